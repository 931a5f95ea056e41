"""The fused tree verify and commit (``engine.on_vllm.gdn_fused``) against one-token decoding.

Every node's output must be what decoding its root-to-node path token by token gives, verifying
must leave the caches alone, and a commit must leave them as decoding the accepted path would.
On a GPU the reference is vLLM's own decode kernels (``causal_conv1d_update``, then
``fused_recurrent_gated_delta_rule_packed_decode``, what vLLM's AR runs), and the fused programs
must match them bit for bit. On the CPU, under Triton's interpreter (tests/conftest.py turns it on
there), the reference is ``engine.on_vllm.gdn_tree``'s readable torch kernels, to float32 rounding (their l2 norm
multiplies by a reciprocal square root where the packed kernel divides). Without Triton it is skipped.
"""

from __future__ import annotations

import pytest
import torch

import ddtree
from ddtree.forks import depths, path_table
from engine.on_vllm import gdn_fused
from engine.on_vllm.gdn_tree import REFERENCE_KERNELS
from tests.test_gdn_tree import SLOT, decode_path, layer, node_inputs, wide_deep_tree

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(not gdn_fused.fused_fits(DEVICE), reason="Triton does not run here")]


def vllm_decode():
    """vLLM's AR decode of one token, or None without vLLM."""
    try:
        from vllm.model_executor.layers.fla.ops import fused_recurrent_gated_delta_rule_packed_decode
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    except ImportError:
        return None

    def decode(params, conv_state, ssm_state, mixed_qkv, a, b, path):
        slot = torch.tensor([SLOT], dtype=torch.int32, device=conv_state.device)
        outputs = []
        for node in path:
            convolved = causal_conv1d_update(mixed_qkv[node:node + 1].clone(), conv_state, params.conv_weight,
                                             params.conv_bias, params.activation, conv_state_indices=slot)
            heads = params.value_dim // params.head_v_dim
            out = torch.empty(1, 1, heads, params.head_v_dim, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
            fused_recurrent_gated_delta_rule_packed_decode(
                mixed_qkv=convolved, a=a[node:node + 1], b=b[node:node + 1], A_log=params.A_log,
                dt_bias=params.dt_bias, scale=params.head_k_dim ** -0.5, initial_state=ssm_state, out=out,
                ssm_state_indices=slot, use_qk_l2norm_in_kernel=True)
            outputs.append(out[0, 0])
        return torch.stack(outputs)

    return decode


def decoded(params, conv_state, ssm_state, mixed_qkv, a, b, path: list[int]) -> torch.Tensor:
    """Each token's output along ``path``, decoding in place on the caches given."""
    if DEVICE.type == "cuda":
        return vllm_decode()(params, conv_state, ssm_state, mixed_qkv, a, b, path)
    return decode_path(params, REFERENCE_KERNELS, conv_state, ssm_state, mixed_qkv, a, b, path)


def same(ours: torch.Tensor, reference: torch.Tensor) -> bool:
    if DEVICE.type == "cuda":
        return torch.equal(ours, reference)
    return torch.allclose(ours, reference, rtol=2e-6, atol=2e-6)


needs_reference = pytest.mark.skipif(DEVICE.type == "cuda" and vllm_decode() is None,
                                     reason="on a GPU the reference is vLLM's decode kernels")


def run_verify(params, conv_state, ssm_state, visible, mixed_qkv, a, b, length: int = 8):
    heads = params.value_dim // params.head_v_dim
    out = torch.zeros(visible.shape[0], heads, params.head_v_dim, dtype=mixed_qkv.dtype, device=DEVICE)
    kept = gdn_fused.verify(params, mixed_qkv, a, b, conv_state, ssm_state, slots_of([SLOT], [visible.shape[0]]),
                            gdn_fused.TreePaths.build(visible, length), out)
    return out, kept


def slots_of(slots: list[int], counts: list[int]) -> torch.Tensor:
    """Each node's slot, ``counts[r]`` nodes of request r in ``slots[r]``: int32, as the programs read them."""
    return torch.tensor(slots, dtype=torch.int32, device=DEVICE).repeat_interleave(torch.tensor(counts, device=DEVICE))


def commit_one(params, kept, conv_state, ssm_state, path: torch.Tensor, length: torch.Tensor) -> None:
    """One request's commit in ``SLOT``: its ``path [L]`` and ``length``."""
    gdn_fused.commit(params, kept, conv_state, ssm_state, slots_of([SLOT], [1]), path.to(torch.int32)[None],
                     length.to(torch.int32).reshape(1))


@needs_reference
@pytest.mark.parametrize("seed, budget", [(0, 30), (1, 30), (2, 40)])  # 40: past 32 nodes, wider value blocks
def test_every_node_scores_like_its_path_decoded_alone_and_verify_writes_nothing(seed, budget):
    params, conv_state, ssm_state = layer(seed, DEVICE.type)
    visible = wide_deep_tree(seed, budget=budget).to(DEVICE)
    mixed_qkv, a, b = node_inputs(visible.shape[0], seed, params, DEVICE.type)
    # vLLM's inputs are a view into the projection's output, rows wider than the channels
    mixed_qkv = torch.cat([mixed_qkv, torch.full_like(mixed_qkv[:, :5], 7.0)], dim=1)[:, :mixed_qkv.shape[1]]
    inputs_before, conv_before, ssm_before = mixed_qkv.clone(), conv_state.clone(), ssm_state.clone()

    out, _ = run_verify(params, conv_state, ssm_state, visible, mixed_qkv, a, b)

    assert torch.equal(conv_state, conv_before) and torch.equal(ssm_state, ssm_before)
    assert torch.equal(mixed_qkv, inputs_before)
    table = path_table(visible, 8).cpu()
    for node, depth in enumerate(depths(visible).tolist()):
        path = table[node, :depth + 1].tolist()
        expected = decoded(params, conv_before.clone(), ssm_before.clone(), mixed_qkv, a, b, path)
        assert same(out[node], expected[-1]), node


@needs_reference
@pytest.mark.parametrize("seed, pick", [(0, "deepest"), (3, "deepest"), (4, "root"), (5, "shallow")])
def test_commit_leaves_the_caches_as_decoding_the_accepted_path(seed, pick):
    """Paths shorter than the window too: the window keeps columns of the committed one."""
    params, conv_state, ssm_state = layer(seed, DEVICE.type)
    visible = wide_deep_tree(seed).to(DEVICE)
    mixed_qkv, a, b = node_inputs(visible.shape[0], seed, params, DEVICE.type)
    reference_conv, reference_ssm = conv_state.clone(), ssm_state.clone()
    depth = depths(visible)
    node = {"deepest": int(depth.argmax()), "root": 0, "shallow": int((depth == 1).nonzero()[0])}[pick]
    length = depth[node] + 1
    path = path_table(visible, 8)[node].to(torch.int32)

    _, kept = run_verify(params, conv_state, ssm_state, visible, mixed_qkv, a, b)
    commit_one(params, kept, conv_state, ssm_state, path, length)

    decoded(params, reference_conv, reference_ssm, mixed_qkv, a, b, path[:int(length)].tolist())
    assert torch.equal(conv_state, reference_conv)  # a window is inputs moved, never computed
    assert same(ssm_state, reference_ssm)  # other slots untouched too


@needs_reference
def test_a_lone_root_and_a_chain_are_trees_too():
    params, conv_state, ssm_state = layer(5, DEVICE.type)
    for q in (1, 6):
        visible = torch.ones(q, q, dtype=torch.bool, device=DEVICE).tril()
        mixed_qkv, a, b = node_inputs(q, 5, params, DEVICE.type)
        out, _ = run_verify(params, conv_state, ssm_state, visible, mixed_qkv, a, b, length=q)
        expected = decoded(params, conv_state.clone(), ssm_state.clone(), mixed_qkv, a, b, list(range(q)))
        assert same(out, expected)


@needs_reference
def test_every_leaf_of_a_wide_tree_scores_like_its_path_and_commits_like_it():
    """All leaves under the root (what random weights draft): each scored from the root's state, none from a
    sibling's; and the commit of the last leaf."""
    params, conv_state, ssm_state = layer(9, DEVICE.type)
    visible = ddtree.ancestor_mask(torch.zeros(20, dtype=torch.long)).to(DEVICE)
    mixed_qkv, a, b = node_inputs(visible.shape[0], 9, params, DEVICE.type)
    reference_conv, reference_ssm = conv_state.clone(), ssm_state.clone()
    out, kept = run_verify(params, conv_state, ssm_state, visible, mixed_qkv, a, b)
    for node in range(visible.shape[0]):
        path = [0] if node == 0 else [0, node]
        assert same(out[node], decoded(params, reference_conv.clone(), reference_ssm.clone(), mixed_qkv, a, b,
                                       path)[-1]), node
    path = torch.tensor([0, 20, 0, 0, 0, 0, 0, 0], dtype=torch.int32, device=DEVICE)
    accepted = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    commit_one(params, kept, conv_state, ssm_state, path, accepted)
    decoded(params, reference_conv, reference_ssm, mixed_qkv, a, b, [0, 20])
    assert torch.equal(conv_state, reference_conv) and same(ssm_state, reference_ssm)


@needs_reference
# one token, a small tree, past 32 nodes: each value block
@pytest.mark.parametrize("budget", [0, 12, pytest.param(40, marks=pytest.mark.slow)])
def test_real_head_sizes_score_like_decoding(budget):
    """At a real model's head sizes (128), where the value block a program holds depends on the tree's size."""
    params, conv_state, ssm_state = layer(7, DEVICE.type, key_heads=1, heads=2, head_k=128, head_v=128)
    visible = wide_deep_tree(7, budget=budget).to(DEVICE) if budget else torch.ones(1, 1, dtype=torch.bool,
                                                                                    device=DEVICE)
    mixed_qkv, a, b = node_inputs(visible.shape[0], 7, params, DEVICE.type)
    out, _ = run_verify(params, conv_state, ssm_state, visible, mixed_qkv, a, b)
    table = path_table(visible, 8).cpu()
    for node, depth in enumerate(depths(visible).tolist()):
        expected = decoded(params, conv_state.clone(), ssm_state.clone(), mixed_qkv, a, b,
                           table[node, :depth + 1].tolist())
        assert same(out[node], expected[-1]), node


def test_a_batchs_trees_in_one_pass_score_and_commit_as_each_alone():
    """A batch's pass: three requests' trees packed block-diagonally (a wide, deep tree, a chain, a lone root), each
    from its own slot (slot 1 among them: a slot is read, never compiled in). Every node's output is what its
    request's tree alone gives, bit for bit, and one commit of the three accepted paths leaves every slot as three
    commits of one would."""
    params, conv_state, ssm_state = layer(8, DEVICE.type)
    trees = [tree.to(DEVICE) for tree in (wide_deep_tree(8, budget=12), torch.ones(5, 5, dtype=torch.bool).tril(),
                                          torch.ones(1, 1, dtype=torch.bool))]
    slots, counts = [SLOT, 1, 3], [tree.shape[0] for tree in trees]
    begins = [sum(counts[:index]) for index in range(len(trees))]
    mixed_qkv, a, b = node_inputs(sum(counts), 8, params, DEVICE.type)
    heads = params.value_dim // params.head_v_dim
    out = torch.zeros(sum(counts), heads, params.head_v_dim, dtype=mixed_qkv.dtype, device=DEVICE)
    committed_conv, committed_ssm = conv_state.clone(), ssm_state.clone()
    kept = gdn_fused.verify(params, mixed_qkv, a, b, committed_conv, committed_ssm, slots_of(slots, counts),
                            gdn_fused.TreePaths.build(torch.block_diag(*trees), 8), out)
    accepted = [path_table(trees[0], 8)[int(depths(trees[0]).argmax())], torch.arange(8).clamp(max=3),
                torch.zeros(8, dtype=torch.long)]
    lengths = [int(depths(trees[0]).max()) + 1, 3, 1]
    gdn_fused.commit(params, kept, committed_conv, committed_ssm, torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                     torch.stack([path.to(DEVICE) + begin for path, begin in zip(accepted, begins)]).to(torch.int32),
                     torch.tensor(lengths, dtype=torch.int32, device=DEVICE))

    alone_conv, alone_ssm = conv_state.clone(), ssm_state.clone()
    for tree, slot, begin, path, length in zip(trees, slots, begins, accepted, lengths):
        nodes = slice(begin, begin + tree.shape[0])
        own = torch.zeros_like(out[nodes])
        own_kept = gdn_fused.verify(params, mixed_qkv[nodes], a[nodes], b[nodes], conv_state, ssm_state,
                                    slots_of([slot], [tree.shape[0]]), gdn_fused.TreePaths.build(tree, 8), own)
        assert torch.equal(out[nodes], own), f"the request in slot {slot}"
        gdn_fused.commit(params, own_kept, alone_conv, alone_ssm, slots_of([slot], [1]),
                         path.to(DEVICE, torch.int32)[None], torch.tensor([length], dtype=torch.int32, device=DEVICE))
    assert torch.equal(committed_conv, alone_conv) and torch.equal(committed_ssm, alone_ssm)
    assert not torch.equal(committed_ssm[1], ssm_state[1]) and torch.equal(committed_ssm[0], ssm_state[0])


def test_a_node_forked_from_its_sibling_is_caught():
    """The checks above can fail: hand node 5 its sibling's path instead of its parent's."""
    params, conv_state, ssm_state = layer(0, DEVICE.type)
    visible = ddtree.ancestor_mask(torch.tensor([0, 0, 1, 1, 3, 2])).to(DEVICE)  # node 3's sibling is node 4
    mixed_qkv, a, b = node_inputs(7, 0, params, DEVICE.type)
    wrong = visible.clone()
    wrong[5, 3], wrong[5, 4] = False, True
    right_out, _ = run_verify(params, conv_state, ssm_state, visible, mixed_qkv, a, b, length=5)
    wrong_out, _ = run_verify(params, conv_state, ssm_state, wrong, mixed_qkv, a, b, length=5)
    assert torch.equal(right_out[:5], wrong_out[:5]) and not torch.allclose(right_out[5], wrong_out[5], atol=1e-3)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 as a GPU runs it")
@needs_reference
def test_bf16_nodes_are_vllm_decode_bit_for_bit():
    params, conv_state, ssm_state = layer(6, "cuda")
    params = type(params)(**{name: (value.bfloat16() if torch.is_tensor(value) and name.startswith("conv") else value)
                             for name, value in vars(params).items()})
    conv_state = conv_state.bfloat16()
    visible = wide_deep_tree(6).to(DEVICE)
    mixed_qkv, a, b = (t.bfloat16() for t in node_inputs(visible.shape[0], 6, params, "cuda"))
    out, _ = run_verify(params, conv_state, ssm_state, visible, mixed_qkv, a, b)
    table = path_table(visible, 8).cpu()
    for node, depth in enumerate(depths(visible).tolist()):
        expected = decoded(params, conv_state.clone(), ssm_state.clone(), mixed_qkv, a, b,
                           table[node, :depth + 1].tolist())
        assert torch.equal(out[node], expected[-1]), node
