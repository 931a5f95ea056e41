"""``engine.on_vllm.vllm_gdn`` over vLLM's hybrid KV-cache layout, on the CPU (stub vLLM modules, the torch kernels).

vLLM puts layers of different types in different KV-cache groups of equal size (the tiny Qwen3.5,
3 linear : 1 full, gets four groups of one layer) and gives layer i of every group the same cache
tensor: groups tell their memory apart by block id only. So every Gated DeltaNet group needs its
own state block; with one block for all, the layers read and overwrite each other's states.
"""

import importlib
import sys
import types

import pytest
import torch

import ddtree
from ddtree.forks import depths, path_table
from engine.models.paged import PagedBatchKV  # imported while Triton's interpreter is on: its row mover runs there
from engine.on_vllm import gdn_fused, gdn_tree
from tests import test_gdn_tree as check

BLOCKS, GROUPS = 6, 3


class QwenGatedDeltaNetAttention:
    """Stands in for vLLM's layer class: the glue wraps its ``_forward_core``."""

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        raise AssertionError("vLLM's own path runs only for prefills")


class ChunkGatedDeltaRule:
    """Stands in for vLLM's chunked prefill op, which refuses float32."""

    def forward(self, q, **rest):
        assert q.dtype != torch.float32, "ChunkGatedDeltaRuleFunction does not support float32"
        return "chunked"


class Builder:
    """A GDN metadata builder that hands back the block table it was given."""

    def build(self, common_prefix_len, common):
        return common.block_table_tensor


@pytest.fixture
def vllm_gdn(monkeypatch):
    stubs = {
        "vllm.model_executor.layers.fla.ops": dict(
            fused_sigmoid_gating_delta_rule_update=gdn_tree.gated_delta_reference,
            fused_recurrent_gated_delta_rule=gdn_tree.recurrent_reference),
        "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn": dict(
            QwenGatedDeltaNetAttention=QwenGatedDeltaNetAttention, ChunkGatedDeltaRule=ChunkGatedDeltaRule),
        "vllm.model_executor.layers.mamba.mamba_utils": dict(is_conv_state_dim_first=lambda: False),
        "vllm.model_executor.layers.mamba.ops.causal_conv1d": dict(causal_conv1d_update=gdn_tree.conv_update_reference),
        "vllm.v1.attention.backend": dict(CommonAttentionMetadata=types.SimpleNamespace),
        "vllm.v1.attention.backends.utils": dict(NULL_BLOCK_ID=0),
    }
    package = types.ModuleType("vllm.model_executor.layers.mamba.gdn")
    monkeypatch.setitem(sys.modules, package.__name__, package)
    for name, attributes in stubs.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
    package.qwen_gdn_linear_attn = sys.modules["vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"]
    previous = sys.modules.pop("engine.on_vllm.vllm_gdn", None)
    try:
        yield importlib.import_module("engine.on_vllm.vllm_gdn")
    finally:
        sys.modules.pop("engine.on_vllm.vllm_gdn", None)
        if previous is not None:
            sys.modules["engine.on_vllm.vllm_gdn"] = previous


def shared_layers(blocks: int = BLOCKS):
    """One Gated DeltaNet layer per group, all on the same two cache tensors (vLLM's default conv layout)."""
    channels = 2 * check.KEY_HEADS * check.HEAD_K + check.HEADS * check.HEAD_V
    conv = torch.zeros(blocks, check.WIDTH, channels)
    ssm = torch.zeros(blocks, check.HEADS, check.HEAD_V, check.HEAD_K)
    layers = []
    for group in range(GROUPS):
        params, _, _ = check.layer(10 + group, "cpu")
        layer = QwenGatedDeltaNetAttention()
        layer.prefix = f"model.layers.{group}.linear_attn"
        layer.params = params
        layer.conv1d = types.SimpleNamespace(weight=params.conv_weight[:, None, :].clone(), bias=params.conv_bias)
        layer.activation, layer.A_log, layer.dt_bias = "silu", params.A_log, params.dt_bias
        layer.key_dim, layer.value_dim, layer.tp_size = params.key_dim, params.value_dim, 1
        layer.head_k_dim, layer.head_v_dim = params.head_k_dim, params.head_v_dim
        layer.kv_cache = [conv, ssm]  # the same memory in every group
        layers.append(layer)
    groups = [types.SimpleNamespace(layer_names=[layer.prefix], metadata_builders=[Builder()]) for layer in layers]
    return layers, groups


def test_each_group_prefills_into_a_block_of_its_own(vllm_gdn):
    layers, groups = shared_layers()
    gdn = vllm_gdn.GDNLayers(groups, {layer.prefix: layer for layer in layers}, device=torch.device("cpu"))
    tables = gdn.prefill_metadata(5, torch.arange(5))
    blocks = {int(tables[layer.prefix].reshape(-1)[0]) for layer in layers}
    assert len(blocks) == GROUPS, blocks
    assert 0 < gdn.slot == min(blocks)  # the attention layers take the blocks before them


@pytest.mark.parametrize("commit", ["readable", "fixed"])
def test_groups_sharing_a_cache_tensor_keep_their_own_states(vllm_gdn, commit):
    """``commit``: the readable step's (a list of node indices) or the fixed step's (``commit_path``:
    device tensors, the path padded with its leaf to a block, a width of its own)."""
    layers, groups = shared_layers()
    gdn = vllm_gdn.GDNLayers(groups, {layer.prefix: layer for layer in layers}, device=torch.device("cpu"))
    channels = layers[0].params.conv_weight.shape[0]
    # each layer decoding alone on caches of its own, from the same (empty) state
    references = [(torch.zeros(check.SLOTS, channels, check.WIDTH),
                   torch.zeros(check.SLOTS, check.HEADS, check.HEAD_V, check.HEAD_K)) for _ in layers]
    for seed in range(3):
        visible = check.wide_deep_tree(seed)
        q = visible.shape[0]
        inputs = [check.node_inputs(q, 10 * group + seed, layer.params, "cpu") for group, layer in enumerate(layers)]
        gdn.begin(visible, min(q, 32))
        outs = []
        for layer, (mixed_qkv, a, b) in zip(layers, inputs):
            outs.append(torch.zeros(q, check.HEADS, check.HEAD_V))
            layer._forward_core(mixed_qkv=mixed_qkv.clone(), b=b, a=a, core_attn_out=outs[-1])
        gdn.end()
        table, depth = path_table(visible, 8), depths(visible)
        for group, (layer, (mixed_qkv, a, b), (conv, ssm)) in enumerate(zip(layers, inputs, references)):
            for node, node_depth in enumerate(depth.tolist()):
                expected = check.decode_path(layer.params, gdn_tree.REFERENCE_KERNELS, conv.clone(), ssm.clone(),
                                             mixed_qkv, a, b, table[node, :node_depth + 1].tolist())
                assert torch.equal(outs[group][node], expected[-1]), (seed, group, node)
        deepest = int(depth.argmax())
        accepted = table[deepest, :int(depth[deepest]) + 1].tolist()
        if commit == "readable":
            gdn.commit(accepted)
        else:
            gdn.commit_path(torch.tensor(accepted + accepted[-1:] * (16 - len(accepted))), torch.tensor(len(accepted)))
        for layer, (mixed_qkv, a, b), (conv, ssm) in zip(layers, inputs, references):
            check.decode_path(layer.params, gdn_tree.REFERENCE_KERNELS, conv, ssm, mixed_qkv, a, b, accepted)


def test_a_float32_prefill_runs_through_the_recurrent_kernel_and_other_dtypes_pass(vllm_gdn):
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 6, 2, 8, generator=g), torch.randn(1, 6, 2, 8, generator=g)
    v, decay = torch.randn(1, 6, 4, 8, generator=g), -torch.rand(1, 6, 4, generator=g)
    beta, initial = torch.rand(1, 6, 4, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    starts = torch.tensor([0, 4, 6], dtype=torch.int32)
    core = torch.zeros(6, 4, 8)
    arguments = dict(k=k, v=v, g=decay, beta=beta, initial_state=initial, output_final_state=True, cu_seqlens=starts,
                     chunk_indices=None, chunk_offsets=None, use_qk_l2norm_in_kernel=False)
    out, final = ChunkGatedDeltaRule().forward(q=q, core_attn_out=core, **arguments)
    expected = gdn_tree.recurrent_prefill(q, k, v, decay, beta, initial, starts, False, gdn_tree.recurrent_reference)
    assert torch.equal(out, expected[0]) and torch.equal(final, expected[1]) and torch.equal(core, out[0])
    assert ChunkGatedDeltaRule().forward(q=q.bfloat16(), **arguments) == "chunked"


@pytest.mark.triton
@pytest.mark.skipif(not gdn_fused.fused_fits(torch.device("cpu")), reason="the fused programs need Triton")
def test_a_batch_keeps_each_requests_states_in_blocks_of_its_own_and_commits_them_in_one_pass(vllm_gdn):
    """``HybridBatchKV``: each request of a batch holds a state block in every group, apart from the attention rows'
    blocks and the single request's; one verify of three requests' trees (``GDNLayers.begin_batch``) scores every
    node as decoding its path from its own request's state, ``compact`` commits each accepted path into that
    request's blocks alone, and a request leaving hands its blocks back while the last row's request keeps its own."""
    layers, groups = shared_layers(blocks=40)
    gdn = vllm_gdn.GDNLayers(groups, {layer.prefix: layer for layer in layers}, device=torch.device("cpu"))
    kv = vllm_gdn.HybridBatchKV([torch.zeros(40, 2, 4, 1, 2)], 4, gdn)
    assert isinstance(kv, PagedBatchKV) and kv.blocks == gdn.slot  # the single request's state blocks stay out
    kv.reserve(3, 6)
    held = [block for row in range(3) for block in kv.tables.held[row]]
    states = [block for row in range(3) for block in kv.state_blocks[row]]
    assert len(set(states)) == 3 * GROUPS and not set(states) & (set(held) | set(gdn.group_slots))
    assert 0 not in states + held  # vLLM's null block: its convolution kernels skip a sequence whose state it names
    assert kv.states.tolist() == [kv.state_blocks[row] for row in range(3)]
    g = torch.Generator().manual_seed(4)
    for layer in layers:  # a committed state of its own in every block
        conv, ssm = vllm_gdn.states(layer)
        conv.copy_(torch.randn(conv.shape, generator=g))
        ssm.copy_(torch.randn(ssm.shape, generator=g) * 0.3)
    before = [tuple(state.clone() for state in vllm_gdn.states(layer)) for layer in layers]
    trees = [ddtree.build_tree(torch.log_softmax(torch.randn(4, 10, generator=g) * 3, dim=-1), budget)
             for budget in (6, 0, 3)]
    layout = ddtree.batch.pack_trees(trees, roots=[1, 2, 3], pasts=[5, 2, 4], rows=[2, 0, 1])
    kv.hold_layout(layout)
    local, depth = ddtree.verify_paths(layout)
    sizes = layout.query_start_loc.diff()
    owner = torch.repeat_interleave(torch.arange(3), sizes)
    gdn.reserve_batch(64, torch.float32)  # what every recorded size's pass keeps its nodes in
    gdn.begin_batch(local, depth, kv.states[layout.rows][owner])
    inputs = [check.node_inputs(layout.tokens, group, layer.params, "cpu") for group, layer in enumerate(layers)]
    outs = []
    for layer, (mixed_qkv, a, b) in zip(layers, inputs):
        outs.append(torch.zeros(layout.tokens, check.HEADS, check.HEAD_V))
        layer._forward_core(mixed_qkv=mixed_qkv.clone(), b=b, a=a, core_attn_out=outs[-1])
    gdn.end()
    assert all(gdn.pending.kept[name].convolved.data_ptr() == gdn.batch_kept[name].convolved.data_ptr()
               for name in gdn.names)

    def alone(group: int, request: int, path: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decoding ``path`` (the request's own node indices) from the request's committed state in the group's
        block, on caches of its own: each token's output, and the state it leaves."""
        block = kv.state_blocks[int(layout.rows[request])][group]
        conv, ssm = (state[block:block + 1].expand(check.SLOTS, *state.shape[1:]).clone() for state in before[group])
        begin = int(layout.query_start_loc[request])
        mixed_qkv, a, b = (values[begin:begin + int(sizes[request])] for values in inputs[group])
        out = check.decode_path(layers[group].params, gdn_tree.REFERENCE_KERNELS, conv, ssm, mixed_qkv, a, b, path)
        return out, conv[check.SLOT], ssm[check.SLOT]

    close = dict(rtol=2e-6, atol=2e-6)  # the fused programs against the torch kernels
    for token in range(layout.tokens):
        request, own = int(owner[token]), local[token, :int(depth[token]) + 1].tolist()
        for group in range(GROUPS):
            out, _, _ = alone(group, request, own)
            assert torch.allclose(outs[group][token], out[-1], **close), (token, group)
    paths = [local[int(layout.query_start_loc[request]) + int(sizes[request]) - 1, :].tolist() for request in range(3)]
    paths = [path[:int(depth[int(layout.query_start_loc[r]) + int(sizes[r]) - 1]) + 1] for r, path in enumerate(paths)]
    kv.compact(layout.rows.tolist(), [5, 2, 4], paths)  # each request accepts its last node's path
    for group, layer in enumerate(layers):
        conv, ssm = vllm_gdn.states(layer)
        for request in range(3):
            block = kv.state_blocks[int(layout.rows[request])][group]
            _, expected_conv, expected_ssm = alone(group, request, paths[request])
            assert torch.equal(conv[block], expected_conv) and torch.allclose(ssm[block], expected_ssm, **close)
        untouched = [block for block in range(40) if block not in states]
        assert torch.equal(ssm[untouched], before[group][1][untouched])
    moved = kv.state_blocks[2]
    kv.release(1, 2, 0)
    assert kv.state_blocks[1] == moved and kv.state_blocks[2] == [] and kv.states[1].tolist() == moved
    assert set(states) - set(moved) - set(kv.state_blocks[0]) <= set(kv.tables.free)
