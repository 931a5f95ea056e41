"""vLLM's own Gated DeltaNet kernels under the tree code, on a machine without a GPU.

    pip install triton==3.6.0      # beside the project's requirements (not one of them)
    TRITON_INTERPRET=1 python -m tests.vllm_kernels_on_cpu SITE   # SITE: a folder holding vllm/ (0.23.0)

Triton's interpreter runs vLLM 0.23's ``causal_conv1d_update``,
``fused_sigmoid_gating_delta_rule_update`` and ``fused_recurrent_gated_delta_rule`` on CPU tensors, loaded straight
from vLLM's source files (``vllm.triton_utils`` stubbed; one interpreter-only edit: the recurrent kernel's
``range(T)`` over a loaded scalar). With them it runs ``tests/test_gdn_tree.py``'s checks
(every tree node, and every commit, against vLLM-style one-token decoding) and drives
``engine.on_vllm.vllm_gdn``'s glue through three tree steps with the stub modules it imports, the
conv state in vLLM's default layout. A GPU runs the same checks with compiled kernels
(``engine/tools/gpu_session.sh hybrid``).
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tempfile
import types
from pathlib import Path

import torch

KERNELS = {"conv": "model_executor/layers/mamba/ops/causal_conv1d.py",
           "gating": "model_executor/layers/fla/ops/fused_sigmoid_gating.py",
           "recurrent": "model_executor/layers/fla/ops/fused_recurrent.py"}


def _module(name: str, **attributes) -> types.ModuleType:
    module = sys.modules.get(name) or types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def load_kernels(site: Path) -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        _module(name)
    _module("vllm.triton_utils", tl=tl, triton=triton)
    _module("vllm.v1.attention.backends.utils", NULL_BLOCK_ID=0, PAD_SLOT_ID=-1)
    loaded, folder = {}, Path(tempfile.mkdtemp(prefix="vllm-kernels-"))
    for key, relative in KERNELS.items():
        source = (site / "vllm" / relative).read_text()
        # the interpreter hands a loaded scalar over as a one-element array, which range() refuses
        # a file of its own, no package around it: op.py's exp is tl.exp (the interpreter patches tl's own names)
        source = re.sub(r"(?<![\w.])exp\(", "tl.exp(", source.replace("from .op import exp\n", ""))
        source = source.replace("for i_t in range(0, T):", "for i_t in range(0, int(T.handle.data.reshape(-1)[0]) "
                                                          "if hasattr(T, 'handle') else T):")
        path = folder / f"vllm_cpu_{key}.py"  # triton reads a kernel's source from its file
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        loaded[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded[key])
    return loaded


class QwenGatedDeltaNetAttention:
    """Stands in for vLLM's layer class: the glue wraps its ``_forward_core``."""

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        raise AssertionError("vLLM's own path runs only for prefills")


def check_glue(kernels, check) -> None:
    """``engine.on_vllm.vllm_gdn`` over stub vLLM modules: three tree steps, each committed."""
    from ddtree.forks import depths, path_table

    _module("vllm.model_executor.layers.fla.ops", fused_sigmoid_gating_delta_rule_update=kernels.gated_delta_update,
            fused_recurrent_gated_delta_rule=kernels.recurrent)
    _module("vllm.model_executor.layers.mamba.gdn")
    _module("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
            QwenGatedDeltaNetAttention=QwenGatedDeltaNetAttention,
            ChunkGatedDeltaRule=type("ChunkGatedDeltaRule", (), {"forward": None}))
    _module("vllm.model_executor.layers.mamba.mamba_utils", is_conv_state_dim_first=lambda: False)
    _module("vllm.model_executor.layers.mamba.ops.causal_conv1d", causal_conv1d_update=kernels.conv_update)
    _module("vllm.v1.attention.backend", CommonAttentionMetadata=object)
    from engine.on_vllm import vllm_gdn

    params, conv, ssm = check.layer(3, "cpu")
    layer = QwenGatedDeltaNetAttention()
    layer.prefix = "model.layers.0.linear_attn"
    layer.conv1d = types.SimpleNamespace(weight=params.conv_weight[:, None, :].clone(), bias=params.conv_bias)
    layer.activation, layer.A_log, layer.dt_bias = "silu", params.A_log, params.dt_bias
    layer.key_dim, layer.value_dim, layer.tp_size = params.key_dim, params.value_dim, 1
    layer.head_k_dim, layer.head_v_dim = params.head_k_dim, params.head_v_dim
    layer.kv_cache = [conv.transpose(1, 2).contiguous(), ssm.clone()]  # vLLM's default layout: (blocks, W, dim)
    group = types.SimpleNamespace(layer_names=[layer.prefix], metadata_builders=[None])
    gdn = vllm_gdn.GDNLayers([group], {layer.prefix: layer}, device=torch.device("cpu"))
    reference_conv, reference_ssm = conv.clone(), ssm.clone()
    check.SLOT = gdn.slot  # decode_path's slot: the one the glue took (the pool's last block)
    for seed in range(3):
        visible = check.wide_deep_tree(seed)
        q = visible.shape[0]
        mixed_qkv, a, b = check.node_inputs(q, seed, params, "cpu")
        gdn.begin(visible, min(q, 32))
        out = torch.zeros(q, check.HEADS, check.HEAD_V)
        layer._forward_core(mixed_qkv=mixed_qkv.clone(), b=b, a=a, core_attn_out=out)
        gdn.end()
        table, depth = path_table(visible, 8), depths(visible)
        for node, node_depth in enumerate(depth.tolist()):
            expected = check.decode_path(params, vllm_gdn.KERNELS, reference_conv.clone(), reference_ssm.clone(),
                                         mixed_qkv, a, b, table[node, :node_depth + 1].tolist())
            assert torch.equal(out[node], expected[-1]), (seed, node)
        deepest = int(depth.argmax())
        accepted = table[deepest, :int(depth[deepest]) + 1].tolist()
        gdn.commit(accepted)
        check.decode_path(params, vllm_gdn.KERNELS, reference_conv, reference_ssm, mixed_qkv, a, b, accepted)
        assert torch.equal(layer.kv_cache[0].transpose(1, 2), reference_conv), seed
        assert torch.equal(layer.kv_cache[1], reference_ssm), seed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not (Path(argv[0]) / "vllm").is_dir():
        print(__doc__)
        return 2
    if importlib.util.find_spec("triton") is None:
        print("needs triton (pip install triton==3.6.0) and TRITON_INTERPRET=1")
        return 2
    from engine.on_vllm.gdn_tree import REFERENCE_KERNELS, GDNKernels
    from tests import test_gdn_tree as check

    loaded = load_kernels(Path(argv[0]))
    kernels = GDNKernels(loaded["conv"].causal_conv1d_update, loaded["gating"].fused_sigmoid_gating_delta_rule_update,
                         loaded["recurrent"].fused_recurrent_gated_delta_rule)
    for seed in (0, 1, 2):
        check.test_every_node_scores_like_its_path_decoded_alone_and_verify_writes_nothing((kernels, "cpu"), seed)
    for seed in (0, 3):
        check.test_commit_leaves_the_caches_as_decoding_the_accepted_path((kernels, "cpu"), seed)
    check.test_a_chain_and_a_lone_root_are_trees_too((kernels, "cpu"))
    check.test_the_float32_prefill_leaves_each_prompt_as_decoding_it_token_by_token((kernels, "cpu"))
    print("vLLM's kernels: every node and every commit bit-identical to one-token decoding")
    params, conv, ssm = check.layer(7, "cpu")
    visible = check.wide_deep_tree(7)
    mixed_qkv, a, b = check.node_inputs(visible.shape[0], 7, params, "cpu")
    plan = check.GDNTreePlan.build(visible, check.SLOT, check.WIDTH, 8)
    outputs = [check.verify_layer(params, mixed_qkv.clone(), a, b, conv.clone(), ssm.clone(), plan, each)[0]
               for each in (kernels, REFERENCE_KERNELS)]
    print(f"the torch doubles against vLLM's kernels: max |difference| {(outputs[0] - outputs[1]).abs().max():.1e}")
    check_glue(kernels, check)
    print("engine.on_vllm.vllm_gdn's glue: three tree steps and commits bit-identical to one-token decoding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
