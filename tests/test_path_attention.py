"""The tree attention that reads each node's keys where AR's step reads them (``engine.on_vllm.path_attention``).

Every node's row must be, bit for bit, the kernel's own one-node pass over the node's path laid out as AR lays it
out (context, then the ancestors, then the node, in consecutive rows), close to float64 attention, and on a GPU
with vLLM, what vLLM's unified attention gives AR's one-token step. On the CPU it runs under Triton's interpreter
(tests/conftest.py turns it on there) in float32; without Triton it is skipped.
"""

from __future__ import annotations

import pytest
import torch

import ddtree
from ddtree.forks import depths, path_table
from engine.gpu.triton_support import triton_runs_on
from engine.on_vllm.path_attention import path_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_runs_on(DEVICE), reason="Triton does not run here")]
BLOCK_SIZE, HEAD_SIZE = 16, 64


def random_tree(nodes: int, seed: int) -> torch.Tensor:
    """``ddtree`` parents (node i + 1's parent) of a random tree: deep chains and wide forks both."""
    generator = torch.Generator().manual_seed(seed)
    return torch.tensor([int(torch.randint(max(0, i - 3), i + 1, (1,), generator=generator)) for i in range(nodes - 1)])


class Pass:
    """A request's paged caches holding ``rows`` (keys and values: the committed context, then the pass's nodes)
    in shuffled blocks, and the pass's queries ``q``."""

    def __init__(self, rows: torch.Tensor, q: torch.Tensor, kv_heads: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.q = q
        used = rows.shape[1]
        blocks = -(-used // BLOCK_SIZE) + 3
        shape = (blocks, BLOCK_SIZE, kv_heads, HEAD_SIZE)
        self.k = torch.randn(shape, generator=generator).to(q.dtype).to(DEVICE)  # noise in every unused row
        self.v = torch.randn(shape, generator=generator).to(q.dtype).to(DEVICE)
        self.block_table = torch.randperm(blocks, generator=generator).to(torch.int32).to(DEVICE)[None]
        for row in range(used):
            block, offset = int(self.block_table[0, row // BLOCK_SIZE]), row % BLOCK_SIZE
            self.k[block, offset], self.v[block, offset] = rows[0, row], rows[1, row]
        self.seq_len = torch.tensor([used], dtype=torch.int32, device=DEVICE)

    def attend(self, visible: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(self.q, float("nan"))
        table = path_table(visible, visible.shape[0]).to(torch.int32).to(DEVICE)
        query_start = torch.tensor([0, self.q.shape[0]], dtype=torch.int32, device=DEVICE)
        path_attention(self.q, self.k, self.v, out, self.block_table, self.seq_len, query_start, table,
                       depths(visible).to(torch.int32).to(DEVICE), HEAD_SIZE ** -0.5)
        return out


def tree_and_ar_steps(dtype: torch.dtype, query_heads: int, kv_heads: int, context: int, nodes: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    visible = ddtree.ancestor_mask(random_tree(nodes, seed))
    kv = torch.randn(2, context + nodes, kv_heads, HEAD_SIZE, generator=generator).to(dtype)  # context, then nodes
    q = torch.randn(nodes, query_heads, HEAD_SIZE, generator=generator).to(dtype).to(DEVICE)
    tree = Pass(kv, q, kv_heads, seed).attend(visible)
    steps = []
    for node in range(nodes):
        path = visible[node].nonzero().flatten()  # root first, the node last
        laid_out = torch.cat([kv[:, :context], kv[:, context + path]], dim=1)
        step = Pass(laid_out, q[node:node + 1], kv_heads, seed + 1 + node)
        steps.append(step.attend(torch.ones(1, 1, dtype=torch.bool))[0])
    return tree, torch.stack(steps), kv, q, visible


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE.type != "cuda", reason="bf16 as a GPU runs it (the interpreter's bf16 loads are not)"))])
# 300: past 16 segments of one 16-key tile, each segment two tiles
@pytest.mark.parametrize("query_heads, kv_heads, context, nodes", [
    (4, 2, 37, 13), pytest.param(16, 2, 70, 33, marks=pytest.mark.slow), (4, 1, 300, 9)])
def test_every_node_attends_as_the_ar_step_of_its_path(dtype, query_heads, kv_heads, context, nodes):
    tree, steps, kv, q, visible = tree_and_ar_steps(dtype, query_heads, kv_heads, context, nodes, seed=nodes)
    assert torch.equal(tree, steps), "a node's row left its AR step's"
    # and it is attention: float64 over the node's context and ancestors
    keys, values = kv.double().repeat_interleave(query_heads // kv_heads, dim=2).to(DEVICE)
    for node in range(nodes):
        seen = torch.cat([torch.arange(context), context + visible[node].nonzero().flatten()]).to(DEVICE)
        scores = torch.einsum("hd,khd->hk", q[node].double(), keys[seen]) * HEAD_SIZE ** -0.5
        expected = torch.einsum("hk,khd->hd", scores.softmax(dim=-1), values[seen])
        tolerance = 1e-5 if dtype == torch.float32 and DEVICE.type == "cpu" else 2e-2
        torch.testing.assert_close(tree[node].double(), expected, atol=tolerance, rtol=tolerance)


def test_requests_packed_in_one_pass_attend_as_each_alone():
    """Three requests' trees in one pass (vLLM's flat layout: each its own block table row, context and tree, their
    blocks interleaved in one cache) give every row the bits of the request's pass alone."""
    generator = torch.Generator().manual_seed(5)
    query_heads, kv_heads = 4, 2
    shapes = [(37, 5), (3, 1), (70, 9)]  # (context, nodes): a tree, AR's root alone, a deeper tree
    passes, visibles = [], []
    for index, (context, nodes) in enumerate(shapes):
        visible = ddtree.ancestor_mask(random_tree(nodes, seed=index)) if nodes > 1 else torch.ones(1, 1, dtype=bool)
        kv = torch.randn(2, context + nodes, kv_heads, HEAD_SIZE, generator=generator)
        q = torch.randn(nodes, query_heads, HEAD_SIZE, generator=generator).to(DEVICE)
        passes.append(Pass(kv, q, kv_heads, seed=index))
        visibles.append(visible)
    alone = [one.attend(visible) for one, visible in zip(passes, visibles)]
    # one cache holding every request's blocks: request r's block b lands at block offset[r] + b
    sizes = [one.k.shape[0] for one in passes]
    offsets = torch.tensor([0, *sizes]).cumsum(0)[:-1].tolist()
    k, v = torch.cat([one.k for one in passes]), torch.cat([one.v for one in passes])
    widest = max(sizes)
    block_table = torch.zeros(len(passes), widest, dtype=torch.int32, device=DEVICE)
    for row, (one, offset) in enumerate(zip(passes, offsets)):
        block_table[row, : one.k.shape[0]] = one.block_table[0] + offset
    length = max(visible.shape[0] for visible in visibles)
    table = torch.cat([torch.nn.functional.pad(path_table(visible, visible.shape[0]), (0, length - visible.shape[0]))
                       for visible in visibles]).to(torch.int32).to(DEVICE)
    depth = torch.cat([depths(visible) for visible in visibles]).to(torch.int32).to(DEVICE)
    query_start = torch.tensor([0, *torch.tensor([n for _, n in shapes]).cumsum(0).tolist()], dtype=torch.int32,
                               device=DEVICE)
    seq_lens = torch.cat([one.seq_len for one in passes])
    q = torch.cat([one.q for one in passes])
    out = torch.full_like(q, float("nan"))
    path_attention(q, k, v, out, block_table, seq_lens, query_start, table, depth, HEAD_SIZE ** -0.5)
    assert torch.equal(out, torch.cat(alone)), "a packed request's row left its row alone"


def test_a_padded_pass_gives_every_real_row_the_bits_of_the_pass_unpadded():
    """``ddtree.padded_verify``: a batch's trees padded to a recorded pass's fixed rows and request slots, the padding
    request reading the scratch block alone (its row of the block table names nothing else), leave every real
    token's row as the packed pass gives it, and the padding rows finite."""
    from ddtree.batch import pack_trees

    generator = torch.Generator().manual_seed(11)
    query_heads, kv_heads = 4, 2
    trees = [ddtree.build_tree(torch.log_softmax(torch.randn(6, 9, generator=generator) * 2, dim=-1), budget)
             for budget in (10, 0, 5)]
    pasts = [37, 3, 70]
    layout = pack_trees(trees, [1, 2, 3], pasts)
    widest = max(past + tree.size + 1 for past, tree in zip(pasts, trees)) // BLOCK_SIZE + 1
    blocks = widest * len(trees) + 1  # every request's blocks, shuffled together, then the scratch block
    scratch = blocks - 1
    k = torch.randn(blocks, BLOCK_SIZE, kv_heads, HEAD_SIZE, generator=generator).to(DEVICE)
    v = torch.randn(blocks, BLOCK_SIZE, kv_heads, HEAD_SIZE, generator=generator).to(DEVICE)
    block_table = torch.randperm(scratch, generator=generator).to(torch.int32).view(len(trees), widest).to(DEVICE)
    q = torch.randn(layout.tokens, query_heads, HEAD_SIZE, generator=generator).to(DEVICE)
    paths, depth = ddtree.verify_paths(layout)
    unpadded = torch.full_like(q, float("nan"))
    path_attention(q, k, v, unpadded, block_table, (layout.kv_columns[layout.query_start_loc[1:] - 1] + 1).to(
        torch.int32).to(DEVICE), layout.query_start_loc.to(torch.int32).to(DEVICE), paths.to(DEVICE),
        depth.to(DEVICE), HEAD_SIZE ** -0.5)
    padded = ddtree.padded_verify(layout, tokens=layout.tokens + 7, requests=len(trees) + 4, width=16)
    table = torch.full((len(trees) + 4, widest), scratch, dtype=torch.int32, device=DEVICE)
    table[:len(trees)] = block_table
    q_padded = torch.cat([q, torch.randn(7, query_heads, HEAD_SIZE, generator=generator).to(DEVICE)])
    out = torch.full_like(q_padded, float("nan"))
    path_attention(q_padded, k, v, out, table, padded.seq_lens.to(DEVICE), padded.query_start.to(DEVICE),
                   padded.paths.to(DEVICE), padded.depth.to(DEVICE), HEAD_SIZE ** -0.5)
    assert torch.equal(out[:layout.tokens], unpadded), "padding moved a real token's row"
    assert torch.isfinite(out[layout.tokens:]).all()
    slots = ddtree.table_slots(table, padded.requests.to(DEVICE), padded.columns.to(DEVICE), BLOCK_SIZE)
    assert torch.equal(slots[:layout.tokens], ddtree.verify_slots(layout.to(DEVICE), block_table, BLOCK_SIZE)[0])
    assert (slots[layout.tokens:] == scratch * BLOCK_SIZE).all(), "a padding token writes outside the scratch block"


def vllm_unified_attention():
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except ImportError:
        return None
    return unified_attention


@pytest.mark.skipif(DEVICE.type != "cuda" or vllm_unified_attention() is None, reason="vLLM's kernel on a GPU")
@pytest.mark.parametrize("context", [37, 300])
def test_a_tree_node_gets_the_bits_vllms_kernel_gives_its_ar_step(context):
    """vLLM's unified attention as AR's decode step runs it (its 3D launch: 16 segments, then their reduction), one
    token at the end of each node's path laid out as AR lays it out."""
    unified_attention = vllm_unified_attention()
    query_heads, kv_heads = 16, 8
    tree, _, kv, q, visible = tree_and_ar_steps(torch.bfloat16, query_heads, kv_heads, context, 17, seed=3)
    segments = 16
    for node in range(visible.shape[0]):
        path = visible[node].nonzero().flatten()
        step = Pass(torch.cat([kv[:, :context], kv[:, context + path]], dim=1), q[node:node + 1], kv_heads, seed=node)
        out = torch.empty_like(step.q)
        unified_attention(q=step.q, k=step.k, v=step.v, out=out,
                          cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), max_seqlen_q=1,
                          seqused_k=step.seq_len, max_seqlen_k=int(step.seq_len), softmax_scale=HEAD_SIZE ** -0.5,
                          causal=True, window_size=(-1, -1), block_table=step.block_table, softcap=0,
                          q_descale=None, k_descale=None, v_descale=None, seq_threshold_3D=16,
                          num_par_softmax_segments=segments,
                          softmax_segm_output=torch.empty(16, query_heads, segments, HEAD_SIZE, device=DEVICE),
                          softmax_segm_max=torch.empty(16, query_heads, segments, device=DEVICE),
                          softmax_segm_expsum=torch.empty(16, query_heads, segments, device=DEVICE))
        assert torch.equal(tree[node], out[0]), node
