"""The vLLM engine's pure parts on CPU: tree -> attention metadata, compaction index math, layer taps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ddtree
import ddtree.fixed
from ddtree.batch import BatchLayout, pack_trees
from tests.tiny import tiny_decoder


def random_tree(seed: int, budget: int = 12, depth: int = 5, vocab: int = 7) -> ddtree.DraftTree:
    generator = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(torch.randn(depth, vocab, generator=generator) * 2, dim=-1)
    return ddtree.build_tree(log_probs, budget)


def paged_attention(q, k, v, past: int, bias: torch.Tensor) -> torch.Tensor:
    """What the Triton kernel computes for one sequence: causal over cache rows, plus ``qq_bias``
    on the block's own keys."""
    n = q.shape[0]
    scores = q @ k.T
    causal = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    scores = scores.masked_fill(~causal, float("-inf"))
    scores[:, past:] += bias
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("seed", range(4))
def test_query_bias_plus_row_causality_is_the_tree_mask(seed):
    tree = random_tree(seed)
    visible = ddtree.ancestor_mask(tree.parents)
    bias = ddtree.query_bias(visible)
    assert bias.dtype == torch.float32 and bias.shape == visible.shape
    assert torch.equal(bias == 0, visible) and torch.isneginf(bias[~visible]).all()
    past, n, dim = 5, tree.size + 1, 8
    generator = torch.Generator().manual_seed(100 + seed)
    q, k, v = (torch.randn(rows, dim, generator=generator, dtype=torch.float64) for rows in (n, past + n, past + n))
    dense = torch.softmax(q @ k.T + ddtree.attention_bias(visible, past, torch.float64)[0, 0], dim=-1) @ v
    torch.testing.assert_close(paged_attention(q, k, v, past, bias.double()), dense, rtol=0, atol=1e-12)


def test_a_sibling_is_invisible_through_the_bias():
    tree = ddtree.DraftTree(tokens=torch.tensor([5, 6]), parents=torch.tensor([0, 0]), depths=torch.tensor([1, 1]),
                            log_probs=torch.zeros(2), path_log_probs=torch.zeros(2), ranks=torch.tensor([0, 1]))
    bias = ddtree.query_bias(ddtree.ancestor_mask(tree.parents))
    assert bias[2, 1] == float("-inf") and bias[2, 0] == 0 and bias[1, 0] == 0


@pytest.mark.parametrize("past, accepted, expected", [
    (10, [0], ([], [])),
    (10, [0, 1, 2], ([], [])),
    (10, [0, 2], ([12], [11])),
    (4, [0, 1, 5, 9], ([9, 13], [6, 7])),
])
def test_compaction_moves_only_rows_out_of_place(past, accepted, expected):
    sources, targets = ddtree.compaction_moves(past, accepted)
    assert (sources.tolist(), targets.tolist()) == expected


@pytest.mark.parametrize("accepted", [[0, 1, 3, 4, 7], [0, 2, 3, 5], [0, 6], [0, 1, 2]])
def test_paged_compaction_equals_dense_compaction(accepted):
    block_size, blocks, heads, dim, past, nodes = 4, 6, 2, 3, 5, 9
    generator = torch.Generator().manual_seed(len(accepted))
    dense = torch.randn(2, past + nodes, heads, dim, generator=generator)  # [K/V, rows, ...]
    paged = torch.zeros(blocks, 2, block_size, heads, dim)
    rows = torch.arange(past + nodes)
    paged[rows // block_size, :, rows % block_size] = dense.transpose(0, 1)
    sources, targets = ddtree.compaction_moves(past, accepted)
    ddtree.move_rows(paged, ddtree.paged_slots(sources, block_size), ddtree.paged_slots(targets, block_size))
    expected = ddtree.compact_rows(dense.clone(), past, accepted, dim=1)
    kept = torch.arange(past + len(accepted))
    assert torch.equal(paged[kept // block_size, :, kept % block_size].transpose(0, 1), expected)


def batch_of_requests(seed: int, block_size: int = 4):
    """Three requests whose blocks are interleaved in one cache of 12 (block 0 kept as scratch), each with a past,
    a walk's accepted path (root first, padded with 0) and its length."""
    generator = torch.Generator().manual_seed(seed)
    owners = torch.randperm(11, generator=generator)[:9] + 1
    block_table = owners.view(3, 3).int()  # [R, max blocks]
    past = torch.tensor([2, 5, 0])
    accepted = [[0, 2, 3, 6], [0, 1], [0, 4, 5, 7, 8]]
    path = torch.zeros(3, 5, dtype=torch.long)
    for r, nodes in enumerate(accepted):
        path[r, : len(nodes)] = torch.tensor(nodes)
    cache = torch.randn(12, 2, block_size, 2, 3, generator=generator)  # [blocks, K/V, block_size, heads, dim]
    return block_table, past, path, torch.tensor([len(nodes) for nodes in accepted]), accepted, cache


def compact_each_alone(cache: torch.Tensor, block_table: torch.Tensor, past: torch.Tensor, accepted: list[list[int]],
                       block_size: int = 4) -> None:
    """The readable reference: each request's own compaction (``compaction_moves``), through its own block table."""
    for r, nodes in enumerate(accepted):
        rows = ddtree.compaction_moves(int(past[r]), nodes)
        slots = [block_table[r, moved // block_size].long() * block_size + moved % block_size for moved in rows]
        ddtree.move_rows(cache, *(ddtree.paged_slots(s, block_size) for s in slots))


def test_compaction_slots_follow_each_request_s_own_block_table():
    slots = ddtree.compaction_slots(torch.tensor([[7, 2]]), torch.tensor([3]), torch.tensor([[0, 2, 0]]),
                                    torch.tensor([2]), block_size=4, scratch_slot=0)
    assert [t.tolist() for t in slots] == [[31, 9, 31], [31, 8, 0]]  # the worked example, one padding move


@pytest.mark.parametrize("seed", range(3))
def test_one_batched_compaction_moves_every_request_s_rows_as_its_own_compaction_does(seed):
    block_table, past, path, length, accepted, cache = batch_of_requests(seed)
    expected = cache.clone()
    compact_each_alone(expected, block_table, past, accepted)
    sources, targets = ddtree.compaction_slots(block_table, past, path, length, block_size=4, scratch_slot=0)
    ddtree.move_rows(cache, ddtree.paged_slots(sources, 4), ddtree.paged_slots(targets, 4))
    assert torch.equal(cache[1:], expected[1:]) and not torch.equal(cache[1:], batch_of_requests(seed)[-1][1:])


def test_verify_slots_of_the_worked_example():
    layout = pack_trees([random_tree(0, budget=2)], roots=[3], pasts=[3])
    slots, seq_lens = ddtree.verify_slots(layout, torch.tensor([[7, 2]]), block_size=4)
    assert slots.tolist() == [31, 8, 9] and seq_lens.tolist() == [6]


@pytest.mark.parametrize("seed", range(3))
def test_a_packed_verify_writes_each_request_s_tree_where_its_own_block_table_says(seed):
    generator = torch.Generator().manual_seed(seed)
    trees = [random_tree(seed, budget=12), random_tree(seed + 10, budget=0), random_tree(seed + 20, budget=7)]
    pasts = [5, 0, 9]
    block_table = torch.randperm(24, generator=generator)[:18].view(3, 6).int()  # interleaved, 6 blocks each
    layout = pack_trees(trees, roots=[1, 2, 3], pasts=pasts)
    slots, seq_lens = ddtree.verify_slots(layout, block_table, block_size=4)
    for r, (tree, past) in enumerate(zip(trees, pasts)):
        alone = pack_trees([tree], roots=[r + 1], pasts=[past])
        own, own_length = ddtree.verify_slots(alone, block_table[r : r + 1], block_size=4)
        assert torch.equal(slots[layout.query_start_loc[r] : layout.query_start_loc[r + 1]], own)
        assert int(seq_lens[r]) == int(own_length[0]) == past + tree.size + 1
        assert set((own // 4).tolist()) <= set(block_table[r].tolist())  # its own blocks only
    assert slots.unique().numel() == slots.numel()  # no two tokens share a slot


def test_tapped_hidden_state_indices_are_the_tapped_layers_outputs():
    """z-lab's target_layer_ids name decoder layers; the drafter must read those layers' outputs
    (an off-by-one here is the "~1% acceptance" deployment bug), on either engine."""
    decoder = tiny_decoder()
    model, layer_ids = decoder.target.model, decoder.drafter.config.target_layer_ids
    outputs = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda module, args, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in layer_ids]
    try:
        with torch.no_grad():
            hidden = model(torch.tensor([[1, 2, 3, 4]]), output_hidden_states=True).hidden_states
    finally:
        for hook in hooks:
            hook.remove()
    for layer, index in zip(layer_ids, decoder.drafter.hidden_state_indices):
        torch.testing.assert_close(hidden[index], outputs[layer], rtol=0, atol=0)


@pytest.mark.parametrize("tensor_parallel_size, heads, kv_heads", [(2, 12, 6), (4, 12, 12), (3, 9, 3)])
def test_tensor_parallel_copy_splits_the_heads_and_keeps_every_logit(tmp_path, tensor_parallel_size, heads, kv_heads):
    """SmolLM2's 9 query / 3 KV heads do not split over 2 GPUs; the rewritten copy does, and is the same model."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.models.convert import tensor_parallel_copy
    from engine.models.target import bundled_gguf

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=8, initializer_range=0.3)
    model = LlamaForCausalLM(config).double().eval()
    model.save_pretrained(tmp_path / "source")
    gguf = bundled_gguf()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp_path / "source")
    tensor_parallel_copy(tmp_path / "source", tmp_path / "split", tensor_parallel_size)
    split = LlamaForCausalLM.from_pretrained(tmp_path / "split").double().eval()
    assert (split.config.num_attention_heads, split.config.num_key_value_heads) == (heads, kv_heads)
    assert heads % tensor_parallel_size == 0 and kv_heads % tensor_parallel_size == 0
    ids = torch.tensor([[5, 900, 31, 7, 2048, 11]])
    with torch.no_grad():
        torch.testing.assert_close(split(ids).logits, model(ids).logits, rtol=0, atol=1e-10)


def test_a_split_heads_drafter_drafts_the_same_block(tmp_path, monkeypatch):
    """vLLM's own DFlash shards its drafter too: at tensor parallel 2 it loads the split copy of
    our 9-head drafter, which must compute the same hidden states; a folder that splits already
    is used as it is."""
    import engine.on_vllm.vllm_engine as vllm_engine
    from engine.models.drafter import DFlashDrafter, DrafterConfig, load_drafter, save_drafter

    monkeypatch.setenv("DDTREE_STUDIO_CACHE", str(tmp_path / "cache"))
    config = DrafterConfig(hidden_size=72, intermediate_size=96, num_hidden_layers=2, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=8, vocab_size=64, num_target_layers=4,
                           target_layer_ids=[0, 2], mask_token_id=1, block_size=4)
    save_drafter(DFlashDrafter(config).initialize(0), tmp_path / "drafter")
    assert vllm_engine.split_heads_folder(tmp_path / "drafter", 3) == str(tmp_path / "drafter")
    split_folder = vllm_engine.split_heads_folder(tmp_path / "drafter", 2)
    assert vllm_engine.split_heads_folder(tmp_path / "drafter", 2) == split_folder  # made once, then reused
    drafter, split = (load_drafter(folder).double().eval() for folder in (tmp_path / "drafter", split_folder))
    assert (split.config.num_attention_heads, split.config.num_key_value_heads) == (12, 6)
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.randn(1, 4, 72, generator=generator, dtype=torch.float64)
    features = torch.randn(1, 6, 2 * 72, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        expected, got = (model(embeddings, features, torch.arange(6, 10)[None], torch.arange(6)[None])
                         for model in (drafter, split))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_a_packed_pass_names_each_tokens_ancestors_inside_its_own_requests_tree():
    """``verify_paths``: column k of a token's row is its ancestor at depth k (node index in its own request's tree,
    the root 0), found here by walking parent pointers; columns past its depth repeat it, out to the longest tree."""
    trees = [random_tree(seed, budget) for seed, budget in ((1, 12), (2, 0), (3, 30), (4, 1))]
    layout = pack_trees(trees, [5, 6, 7, 8], [40, 3, 17, 9])
    table, depth = ddtree.verify_paths(layout)
    longest = max(tree.size for tree in trees) + 1
    assert table.shape == (layout.tokens, longest) and table.dtype == depth.dtype == torch.int32
    token = 0
    for tree in trees:
        parents = [0, *tree.parents.tolist()]  # node i's parent (the root's: itself)
        for node in range(tree.size + 1):
            path = [node]
            while path[-1] != 0:
                path.append(parents[path[-1]])
            path = path[::-1]  # the root first
            assert int(depth[token]) == len(path) - 1
            assert table[token].tolist() == path + [node] * (longest - len(path))
            token += 1


@pytest.mark.parametrize("budgets", [(12, 0, 30, 1), (0,), (0, 0, 0), (7, 40, 3)])
def test_every_requests_paths_at_once_are_each_requests_paths_alone(budgets):
    trees = [random_tree(seed, budget) for seed, budget in enumerate(budgets)]
    layout = pack_trees(trees, list(range(5, 5 + len(trees))), [40 - 3 * i for i in range(len(trees))])
    fast, readable = ddtree.verify_paths(layout), ddtree.paged.verify_paths_readable(layout)
    assert torch.equal(fast[0], readable[0]) and torch.equal(fast[1], readable[1])


def test_a_padded_verify_keeps_every_real_token_and_gives_the_padding_a_request_of_its_own():
    """``padded_verify``: the real tokens' inputs, paths, columns and request slots as the packed pass has them; the
    padding tokens one request's roots at depth 0 in its column 0; the request slots after it empty."""
    trees = [random_tree(1, 12), random_tree(2, 0), random_tree(3, 4)]
    layout = pack_trees(trees, [5, 6, 7], [40, 3, 17])
    count, real = layout.tokens, layout.requests
    padded = ddtree.padded_verify(layout, tokens=count + 5, requests=real + 3, width=8)
    paths, depth = ddtree.verify_paths(layout)
    assert torch.equal(padded.input_ids[:count], layout.input_ids) and not padded.input_ids[count:].any()
    assert torch.equal(padded.position_ids[:count], layout.position_ids)
    assert torch.equal(padded.columns[:count], layout.kv_columns) and not padded.columns[count:].any()
    assert torch.equal(padded.depth[:count], depth) and not padded.depth[count:].any()
    assert torch.equal(padded.paths[:count, :paths.shape[1]], paths[:, :8]) and not padded.paths[count:].any()
    assert padded.query_start.tolist() == [*layout.query_start_loc.tolist(), count + 5, count + 5, count + 5]
    sizes = layout.query_start_loc.diff().tolist()
    assert padded.seq_lens.tolist() == [40 + sizes[0], 3 + sizes[1], 17 + sizes[2], 5, 0, 0]
    assert padded.requests.tolist() == [0] * sizes[0] + [1] * sizes[1] + [2] * sizes[2] + [3] * 5


def test_a_pass_of_no_requests_pads_to_the_padding_request_alone():
    """What a recorded verify is first loaded with, before any request: every token the padding's, in slot 0."""
    padded = ddtree.padded_verify(BatchLayout.empty(), tokens=16, requests=4, width=8)
    assert padded.query_start.tolist() == [0, 16, 16, 16, 16] and padded.seq_lens.tolist() == [16, 0, 0, 0]
    assert not padded.requests.any() and not padded.input_ids.any() and not padded.columns.any()
    assert padded.paths.shape == (16, 8) and not padded.paths.any() and not padded.depth.any()


def test_a_verify_that_does_not_fit_its_padding_says_why():
    layout = pack_trees([random_tree(1, 12), random_tree(3, 4)], [5, 7], [40, 17])
    with pytest.raises(ValueError, match=f"a pass of {layout.tokens} tokens for 2 requests does not fit"):
        ddtree.padded_verify(layout, tokens=layout.tokens - 1, requests=8, width=16)
    with pytest.raises(ValueError, match="for 2 requests does not fit .* and 1 requests"):
        ddtree.padded_verify(layout, tokens=layout.tokens, requests=2, width=16)
    with pytest.raises(ValueError, match="deep does not fit 1 columns"):
        ddtree.padded_verify(layout, tokens=layout.tokens, requests=3, width=1)


@pytest.mark.parametrize("budgets", [(12, 0, 7, 3), (0, 0), (5,), (20, 1, 20)])
def test_every_tree_packed_at_once_lays_out_as_each_tree_compiled_alone(budgets):
    from ddtree.batch import pack_trees_readable

    trees = [random_tree(seed, budget=budget) for seed, budget in enumerate(budgets)]
    roots, pasts = [3 + r for r in range(len(trees))], [7 * r + 1 for r in range(len(trees))]
    for rows in (None, list(reversed(range(len(trees))))):
        together, apart = pack_trees(trees, roots, pasts, rows), pack_trees_readable(trees, roots, pasts, rows)
        for field in dataclasses.fields(apart):
            assert torch.equal(getattr(together, field.name), getattr(apart, field.name)), field.name


@pytest.mark.parametrize("width", [8, 24])
def test_a_pass_of_slots_pads_as_the_same_trees_packed_do(width):
    """``slots_verify``: every slot's tree of the same size, laid out on the device from the fixed step's tensors (its
    ids, positions, pasts and ancestor masks), gives what ``padded_verify`` gives those trees packed."""
    trees = [random_tree(seed, 12) for seed in (1, 4, 5)]  # 12 nodes each (7 tokens a depth: room for them)
    roots, pasts = [5, 6, 7], [40, 3, 17]
    layout = pack_trees(trees, roots, pasts)
    ids = torch.stack([torch.cat([torch.tensor([root]), tree.tokens]) for root, tree in zip(roots, trees)])
    past = torch.tensor(pasts)
    positions = past[:, None] + torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])
                                             for tree in trees])
    visible = ddtree.fixed.ancestor_mask(torch.stack([tree.parents for tree in trees]), 5)
    fixed = ddtree.slots_verify(ids, positions, past, visible, tokens=layout.tokens + 6, requests=6, width=width)
    packed = ddtree.padded_verify(layout, tokens=layout.tokens + 6, requests=6, width=width)
    for name in ddtree.paged.PaddedVerify.__dataclass_fields__:
        mine, theirs = getattr(fixed, name), getattr(packed, name)
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name
