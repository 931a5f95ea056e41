"""A Gated DeltaNet layer verifying a tree on vLLM-style state caches (``engine.on_vllm.gdn_tree``).

The reference is the layer decoding one path token by token, as vLLM's decode does: each
token convolves and shifts the request's window and runs the recurrence from the request's
state, storing it back. Every tree node must produce what that decoding gives at its
position, verifying must leave the caches alone, and committing a path must leave them as
decoding it would. With the readable torch kernels on the CPU; with vLLM's own kernels where
vLLM and a GPU are present.
"""

import pytest
import torch

import ddtree
from ddtree.forks import depths, leaf_chains, packed_paths, path_replay, path_table, window_columns
from engine.on_vllm import gdn_tree
from engine.on_vllm.gdn_tree import REFERENCE_KERNELS, AcceptedPath, GDNParams, GDNTreePlan, commit_layer, verify_layer

SLOT, SLOTS, WIDTH = 2, 4, 3  # the request's slot among 4; a window of 3 inputs (kernel 4)
KEY_HEADS, HEADS, HEAD_K, HEAD_V = 2, 4, 8, 8


def same(ours: torch.Tensor, reference: torch.Tensor, device: str) -> bool:
    """Bit for bit with the torch kernels (and with vLLM's under Triton's interpreter); on a GPU the
    tree and the one-token decode run differently specialised compilations of one kernel, which may
    contract multiply-adds differently: the last bits may differ there."""
    if device == "cpu":
        return torch.equal(ours, reference)
    return torch.allclose(ours, reference, rtol=1e-5, atol=1e-6)


def kernel_sets():
    sets = [pytest.param((REFERENCE_KERNELS, "cpu"), id="torch-reference")]
    try:
        from vllm.model_executor.layers.fla.ops import (
            fused_recurrent_gated_delta_rule,
            fused_sigmoid_gating_delta_rule_update,
        )
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    except ImportError:
        return sets
    if torch.cuda.is_available():
        sets.append(pytest.param((gdn_tree.GDNKernels(causal_conv1d_update, fused_sigmoid_gating_delta_rule_update,
                                                      fused_recurrent_gated_delta_rule), "cuda"), id="vllm-kernels"))
    return sets


@pytest.fixture(params=kernel_sets())
def kernels(request):
    return request.param


def layer(seed: int, device: str, key_heads: int = KEY_HEADS, heads: int = HEADS, head_k: int = HEAD_K,
          head_v: int = HEAD_V):
    g = torch.Generator().manual_seed(seed)
    key_dim, value_dim = key_heads * head_k, heads * head_v
    channels = 2 * key_dim + value_dim

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(device)

    params = GDNParams(conv_weight=rand(channels, WIDTH + 1, s=0.5), conv_bias=rand(channels, s=0.1), activation="silu",
                       A_log=rand(heads, s=0.5), dt_bias=rand(heads, s=0.5), key_dim=key_dim, value_dim=value_dim,
                       head_k_dim=head_k, head_v_dim=head_v)
    conv_state = rand(SLOTS, channels, WIDTH)
    ssm_state = rand(SLOTS, heads, head_v, head_k, s=0.3)
    return params, conv_state, ssm_state


def node_inputs(q: int, seed: int, params: GDNParams, device: str):
    g = torch.Generator().manual_seed(100 + seed)
    channels, heads = params.conv_weight.shape[0], params.value_dim // params.head_v_dim
    return (torch.randn(q, channels, generator=g).to(device), torch.randn(q, heads, generator=g).to(device),
            torch.randn(q, heads, generator=g).to(device))


def decode_path(params, kernels, conv_state, ssm_state, mixed_qkv, a, b, path: list[int]) -> torch.Tensor:
    """vLLM's one-token decode along ``path``, in place on the caches: each token's core output.
    (vLLM's convolution kernel writes its output over its input: every call gets a copy.)"""
    device = conv_state.device
    slot = torch.tensor([SLOT], dtype=torch.int32, device=device)
    outputs = []
    for node in path:
        convolved = kernels.conv_update(mixed_qkv[node:node + 1].clone(), conv_state, params.conv_weight,
                                        params.conv_bias, params.activation, conv_state_indices=slot)
        query, key, value = params.split(convolved)
        out, _ = kernels.gated_delta_update(
            A_log=params.A_log, a=a[node:node + 1], b=b[node:node + 1], dt_bias=params.dt_bias, q=query, k=key,
            v=value, initial_state=ssm_state, inplace_final_state=True,
            cu_seqlens=torch.tensor([0, 1], dtype=torch.int32, device=device), ssm_state_indices=slot,
            use_qk_l2norm_in_kernel=True)
        outputs.append(out[0, 0])
    return torch.stack(outputs)


def wide_deep_tree(seed: int, vocab: int = 24, budget: int = 30, depth: int = 6) -> torch.Tensor:
    """The ancestors-and-self mask of a tree with many siblings at depth 1 and branches several levels deep."""
    g = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(torch.randn(depth, vocab, generator=g) * 4, dim=-1)
    log_probs[0] = torch.log_softmax(torch.randn(vocab, generator=g) * 0.5, dim=-1)
    tree = ddtree.build_tree(log_probs, budget)
    assert int((tree.depths == 1).sum()) >= 5 and int(tree.depths.max()) >= 3
    return ddtree.ancestor_mask(tree.parents)


# --- the plan: pure index arithmetic --------------------------------------------------------------


def test_path_table_lists_each_nodes_ancestors_by_depth():
    parents = torch.tensor([0, 0, 1, 1, 3, 2])  # nodes 1..6
    visible = ddtree.ancestor_mask(parents)
    table = path_table(visible, 5)
    assert depths(visible).tolist() == [0, 1, 1, 2, 2, 3, 2]
    assert table[5].tolist() == [0, 1, 3, 5, 5] and table[6].tolist() == [0, 2, 6, 6, 6]
    assert table[4].tolist() == [0, 1, 4, 4, 4] and table[0].tolist() == [0, 0, 0, 0, 0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_leaf_chains_score_every_node_once(seed):
    visible = wide_deep_tree(seed)
    depth, table = depths(visible), path_table(visible, 8)
    starts = leaf_chains(table, depth)
    scored = [node for leaf in (starts >= 0).nonzero()[:, 0].tolist()
              for node in table[leaf, int(starts[leaf]):int(depth[leaf]) + 1].tolist()]
    assert sorted(scored) == list(range(visible.shape[0]))
    leaves = visible.sum(dim=0) == 1
    assert torch.equal(starts >= 0, leaves) and int(leaves.sum()) < visible.shape[0] - 1  # fewer walks than nodes
    chain = torch.ones(5, 5, dtype=torch.bool).tril()
    assert leaf_chains(path_table(chain, 5), depths(chain)).tolist() == [-1, -1, -1, -1, 0]


def test_a_batch_of_trees_packed_block_diagonally_keeps_each_trees_paths_and_chains():
    """A batch's pass holds several trees, each seeing its own nodes alone: every root starts a chain, and each
    tree's paths and chains are its own, moved to where it sits in the pass (the worked example in
    ``leaf_chains``, then three wide, deep trees and a lone root)."""
    pair = torch.block_diag(ddtree.ancestor_mask(torch.tensor([0, 0])), ddtree.ancestor_mask(torch.tensor([0])))
    assert leaf_chains(path_table(pair, 3), depths(pair)).tolist() == [-1, 0, 1, -1, 0]
    trees = [wide_deep_tree(seed) for seed in (0, 1, 2)] + [torch.ones(1, 1, dtype=torch.bool)]
    packed = torch.block_diag(*trees)
    table, depth = path_table(packed, 8), depths(packed)
    starts = leaf_chains(table, depth)
    begin = 0
    for tree in trees:
        own_table, own_depth = path_table(tree, 8), depths(tree)
        end = begin + tree.shape[0]
        assert torch.equal(table[begin:end], own_table + begin) and torch.equal(depth[begin:end], own_depth)
        assert torch.equal(starts[begin:end], leaf_chains(own_table, own_depth))
        begin = end


def test_a_batch_passs_paths_in_its_own_numbering_match_its_trees_packed():
    """``packed_paths``: the paths path attention reads (``ddtree.verify_paths``, each tree numbered on its own) in
    the pass's numbering are the packed trees' own paths up to each token's depth, and their chains the same."""
    g = torch.Generator().manual_seed(3)
    trees = [ddtree.build_tree(torch.log_softmax(torch.randn(5, 12, generator=g) * 3, dim=-1), budget)
             for budget in (9, 0, 4)]
    layout = ddtree.batch.pack_trees(trees, roots=[1, 2, 3], pasts=[7, 3, 11])
    local, depth = ddtree.verify_paths(layout)
    packed = packed_paths(local, depth)
    visible = torch.block_diag(*[ddtree.ancestor_mask(tree.parents) for tree in trees])
    expected = path_table(visible, local.shape[1])
    within = torch.arange(local.shape[1])[None, :] <= depth[:, None]
    assert torch.equal(torch.where(within, packed, -1), torch.where(within, expected, -1))
    assert torch.equal(leaf_chains(packed, depth.long()), leaf_chains(expected, depths(visible)))
    assert int(packed.max()) < visible.shape[0] and int(packed.min()) >= 0  # columns past a depth stay in the pass


def test_windows_start_in_the_committed_window_and_follow_the_path():
    visible = ddtree.ancestor_mask(torch.tensor([0, 0, 1, 1, 3, 2]))
    table, depth = path_table(visible, 5), depths(visible)
    before = window_columns(table, depth - 1, 3)
    # columns 0..2: the committed window (oldest first); column 3 + i: node i's input
    assert before[0].tolist() == [0, 1, 2]  # the root starts from the committed window
    assert before[1].tolist() == [1, 2, 3] and before[2].tolist() == [1, 2, 3]  # siblings: the same window
    assert before[5].tolist() == [3, 4, 6]  # node 5: root, node 1, node 3
    assert window_columns(table, depth, 3)[5].tolist() == [4, 6, 8]


def test_path_replay_lays_every_path_out_as_one_sequence():
    visible = ddtree.ancestor_mask(torch.tensor([0, 1, 0]))  # 0 -> 1 -> 2, 0 -> 3
    table = path_table(visible, 4)
    replay = path_replay(table, depths(visible))
    assert replay.starts.tolist() == [0, 1, 3, 6, 8, 16]  # paths of 1, 2, 3, 2 tokens; the tail to 16
    assert replay.nodes[:8].tolist() == [0, 0, 1, 0, 1, 2, 0, 3]
    assert replay.last.tolist() == [0, 2, 5, 7]


# --- the layer: tree verify and commit equal token-by-token decoding --------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_node_scores_like_its_path_decoded_alone_and_verify_writes_nothing(kernels, seed):
    kernels, device = kernels
    params, conv_state, ssm_state = layer(seed, device)
    visible = wide_deep_tree(seed).to(device)
    q = visible.shape[0]
    mixed_qkv, a, b = node_inputs(q, seed, params, device)
    plan = GDNTreePlan.build(visible, SLOT, WIDTH, length=8)
    conv_before, ssm_before = conv_state.clone(), ssm_state.clone()

    out, _ = verify_layer(params, mixed_qkv.clone(), a, b, conv_state, ssm_state, plan, kernels)

    assert torch.equal(conv_state, conv_before) and torch.equal(ssm_state, ssm_before)
    table = path_table(visible, 8).cpu()
    for node, depth in enumerate(depths(visible).tolist()):
        path = table[node, :depth + 1].tolist()
        expected = decode_path(params, kernels, conv_before.clone(), ssm_before.clone(), mixed_qkv, a, b, path)
        assert same(out[node], expected[-1], device), node


@pytest.mark.parametrize("seed", [0, 3])
def test_commit_leaves_the_caches_as_decoding_the_accepted_path(kernels, seed):
    kernels, device = kernels
    params, conv_state, ssm_state = layer(seed, device)
    visible = wide_deep_tree(seed).to(device)
    mixed_qkv, a, b = node_inputs(visible.shape[0], seed, params, device)
    plan = GDNTreePlan.build(visible, SLOT, WIDTH, length=8)
    reference_conv, reference_ssm = conv_state.clone(), ssm_state.clone()
    deepest = int(depths(visible).argmax())
    path = path_table(visible, 8)[deepest]
    length = depths(visible)[deepest] + 1

    _, kept = verify_layer(params, mixed_qkv.clone(), a, b, conv_state, ssm_state, plan, kernels)
    commit_layer(params, kept, plan, AcceptedPath.build(plan, path, length), conv_state, ssm_state, kernels)

    decode_path(params, kernels, reference_conv, reference_ssm, mixed_qkv, a, b, path[:int(length)].tolist())
    assert same(conv_state, reference_conv, device)
    assert same(ssm_state, reference_ssm, device)  # other slots untouched too


def test_a_chain_and_a_lone_root_are_trees_too(kernels):
    kernels, device = kernels
    params, conv_state, ssm_state = layer(5, device)
    for q in (1, 6):
        visible = torch.ones(q, q, dtype=torch.bool, device=device).tril()
        mixed_qkv, a, b = node_inputs(q, 5, params, device)
        plan = GDNTreePlan.build(visible, SLOT, WIDTH, length=q)
        out, _ = verify_layer(params, mixed_qkv.clone(), a, b, conv_state, ssm_state, plan, kernels)
        expected = decode_path(params, kernels, conv_state.clone(), ssm_state.clone(), mixed_qkv, a, b, list(range(q)))
        assert same(out, expected, device)


def test_a_node_forked_from_its_sibling_is_caught():
    """The check above can fail: hand node 5 its sibling's path instead of its parent's."""
    params, conv_state, ssm_state = layer(0, "cpu")
    visible = ddtree.ancestor_mask(torch.tensor([0, 0, 1, 1, 3, 2]))  # node 3's sibling is node 4
    mixed_qkv, a, b = node_inputs(7, 0, params, "cpu")
    wrong = visible.clone()
    wrong[5, 3], wrong[5, 4] = False, True  # node 5 (child of 3) now descends from 4
    plan = GDNTreePlan.build(wrong, SLOT, WIDTH, length=5)
    out, _ = verify_layer(params, mixed_qkv.clone(), a, b, conv_state, ssm_state, plan, REFERENCE_KERNELS)
    expected = decode_path(params, REFERENCE_KERNELS, conv_state.clone(), ssm_state.clone(), mixed_qkv, a, b,
                           [0, 1, 3, 5])
    assert not torch.allclose(out[5], expected[-1], atol=1e-3)


def test_the_float32_prefill_leaves_each_prompt_as_decoding_it_token_by_token(kernels):
    """``recurrent_prefill`` (vLLM's recurrent kernel standing in for its chunked one, which refuses
    float32): four prompts of a varlen batch, one empty, one longer than the chunked kernel's chunk of
    64 (where the H200's float32 hybrid strays from float64), each from its own initial state."""
    kernels, device = kernels
    g = torch.Generator().manual_seed(5)
    lengths = [5, 0, 3, 74]
    begins = [sum(lengths[:n]) for n in range(len(lengths))]
    total, starts = sum(lengths), torch.tensor(begins + [sum(lengths)], dtype=torch.int32, device=device)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(device)

    q, k = rand(1, total, KEY_HEADS, HEAD_K), rand(1, total, KEY_HEADS, HEAD_K)
    v, decay, beta = rand(1, total, HEADS, HEAD_V), -rand(1, total, HEADS).abs(), rand(1, total, HEADS).sigmoid()
    initial = rand(len(lengths), HEADS, HEAD_V, HEAD_K, s=0.3)
    before = initial.clone()
    out, final = gdn_tree.recurrent_prefill(q, k, v, decay, beta, initial, starts, True, kernels.recurrent)
    assert out.shape == v.shape and final.shape == initial.shape and torch.equal(initial, before)
    one = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for n, (begin, length) in enumerate(zip(begins, lengths)):
        state = torch.cat([torch.zeros_like(initial[:1]), initial[n:n + 1]])  # slot 1, as vLLM's decode reads it
        for token in range(begin, begin + length):
            step = slice(token, token + 1)
            decoded, _ = kernels.recurrent(q=q[:, step], k=k[:, step], v=v[:, step], g=decay[:, step],
                                           beta=beta[:, step], initial_state=state, inplace_final_state=True,
                                           cu_seqlens=one, ssm_state_indices=one[1:], use_qk_l2norm_in_kernel=True)
            assert same(out[0, token], decoded[0, 0], device), (n, token)
        assert same(final[n], state[1], device), n


def test_the_gdn_bench_trees_are_the_shapes_it_names():
    """``engine.tools.gdn_bench``: DDTree's trees from a sure drafter run deep, ``flat`` ones (what random weights
    draft in the shape runs) are the root and its leaf children; an unknown name is refused."""
    from engine.errors import EngineError
    from engine.tools.gdn_bench import trees

    built = trees(["ar", "chain", "ddtree@64", "flat@64"], torch.device("cpu"))
    assert {name: mask.shape[0] for name, mask in built.items()} == {"ar": 1, "chain": 16, "ddtree@64": 65,
                                                                      "flat@64": 65}
    assert int((built["ddtree@64"].sum(dim=1) - 1).max()) >= 8
    assert (built["flat@64"].sum(dim=1) - 1).tolist() == [0] + [1] * 64
    with pytest.raises(EngineError, match="unknown tree 'flat@x'"):
        trees(["flat@x"], torch.device("cpu"))
