"""vLLM's float32 prefill kernels for a hybrid target, each against a float64 reference, at the
tiny Qwen3.5's shapes and at prompt lengths on both sides of where each kernel switches something
on the prompt's length: the gated RMSNorm takes 2 rows per program past 264 rows (66 tokens of 4
heads, on 132 SMs), the attention reads a third 32-token KV block past 64 tokens, the conv and the
post-conv prep tile tokens by 8 and 16. A float32 kernel that computes what its reference computes
stays within ~1e-5 here. Written when two prompts of 74 and 84 tokens seemed to leave float64 in
vLLM (they had been tokenized apart on the two machines: docs/HISTORY.md, Hybrid targets); all of them pass
on the H200, and they stay as a guard. Needs vLLM and a GPU (``engine/tools/gpu_session.sh hybrid``, the
attention with ``TRITON_F32_DEFAULT=ieee``); the conv's and the norm's logic were checked on the CPU
under Triton's interpreter, which cannot see what the GPU's compiled code does.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
vllm = pytest.importorskip("vllm")

LENGTHS = [52, 66, 67, 74, 84]  # the norm's switch lies between 66 and 67 tokens, the attention's past 64
KEY_HEADS, VALUE_HEADS, HEAD_K, HEAD_V, WIDTH = 2, 4, 64, 64, 4  # the tiny Qwen3.5's Gated DeltaNet
QUERY_HEADS, KV_HEADS, HEAD, BLOCK = 4, 2, 256, 32  # its attention, and vLLM's block for it
TOLERANCE = 2e-5


def draw(generator: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * scale).cuda()


def gap(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.double() - reference).abs().max())


@pytest.mark.parametrize("length", LENGTHS)
def test_the_gated_rms_norm_matches_float64_at_every_prompt_length(length):
    from vllm.model_executor.layers.fla.ops.layernorm_guard import layer_norm_fwd

    generator = torch.Generator().manual_seed(length)
    rows = length * VALUE_HEADS
    x, z = (draw(generator, length, VALUE_HEADS, HEAD_V).view(rows, HEAD_V),
            draw(generator, length, VALUE_HEADS, HEAD_V + 1))
    z = z[..., :HEAD_V].reshape(rows, HEAD_V)  # vLLM's gate is a slice of the projection: rows are strided
    weight = draw(generator, HEAD_V).abs() + 0.5
    out, _, _ = layer_norm_fwd(x, weight, None, 1e-6, z=z, norm_before_gate=True, is_rms_norm=True)
    x64 = x.double()
    reference = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * weight.double() * F.silu(z.double())
    assert gap(out, reference) < TOLERANCE


@pytest.mark.parametrize("length", LENGTHS)
def test_the_prefill_conv_matches_float64_at_every_prompt_length(length):
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn

    generator = torch.Generator().manual_seed(length)
    channels = 2 * KEY_HEADS * HEAD_K + VALUE_HEADS * HEAD_V
    x = draw(generator, length, channels)
    weight, bias = draw(generator, channels, WIDTH, scale=0.3), draw(generator, channels, scale=0.1)
    states = torch.zeros(3, channels, WIDTH - 1, device="cuda")
    out = causal_conv1d_fn(x.t(), weight, bias, conv_states=states, activation="silu",
                           query_start_loc=torch.tensor([0, length], dtype=torch.int32, device="cuda"),
                           cache_indices=torch.tensor([1], dtype=torch.int32, device="cuda"),
                           has_initial_state=torch.tensor([False], device="cuda")).t()
    reference = F.silu(F.conv1d(x.t()[None].double(), weight[:, None].double(), bias.double(), padding=WIDTH - 1,
                                groups=channels)[0, :, :length]).t()
    assert gap(out, reference) < TOLERANCE
    assert torch.equal(states[1], x.t()[:, -(WIDTH - 1):])  # the window decoding goes on from


@pytest.mark.parametrize("length", LENGTHS)
def test_the_post_conv_prep_matches_float64_at_every_prompt_length(length):
    from vllm.model_executor.layers.fla.ops.fused_gdn_prefill_post_conv import fused_post_conv_prep

    generator = torch.Generator().manual_seed(length)
    key_dim = KEY_HEADS * HEAD_K
    mixed = draw(generator, length, 2 * key_dim + VALUE_HEADS * HEAD_V)
    a, b = draw(generator, length, VALUE_HEADS), draw(generator, length, VALUE_HEADS)
    a_log, dt_bias = draw(generator, VALUE_HEADS, scale=0.5), draw(generator, VALUE_HEADS, scale=0.5)
    q, k, v, g, beta = fused_post_conv_prep(mixed, a, b, a_log, dt_bias, KEY_HEADS, HEAD_K, HEAD_V)
    m = mixed.double()
    heads_q, heads_k = (m[:, :key_dim].view(length, KEY_HEADS, HEAD_K),
                        m[:, key_dim:2 * key_dim].view(length, KEY_HEADS, HEAD_K))
    assert gap(q, heads_q / (heads_q.square().sum(-1, keepdim=True) + 1e-6).sqrt()) < TOLERANCE
    assert gap(k, heads_k / (heads_k.square().sum(-1, keepdim=True) + 1e-6).sqrt()) < TOLERANCE
    assert torch.equal(v, mixed[:, 2 * key_dim:].reshape(length, VALUE_HEADS, HEAD_V))
    assert gap(g, -a_log.double().exp() * F.softplus(a.double() + dt_bias.double())) < TOLERANCE
    assert gap(beta, b.double().sigmoid()) < TOLERANCE


@pytest.mark.parametrize("length", LENGTHS)
def test_the_prefill_attention_matches_float64_at_every_prompt_length(length):
    if os.environ.get("TRITON_F32_DEFAULT") != "ieee":  # read at kernel compile time: set it before the process starts
        pytest.skip("Triton's float32 dots default to TF32 on NVIDIA (~1e-3 here): run with TRITON_F32_DEFAULT=ieee")
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    generator = torch.Generator().manual_seed(length)
    q, k, v = (draw(generator, length, QUERY_HEADS, HEAD), draw(generator, length, KV_HEADS, HEAD),
               draw(generator, length, KV_HEADS, HEAD))
    blocks = -(-length // BLOCK)
    # out of order, as a pool hands them
    table = torch.arange(1, blocks + 1, dtype=torch.int32, device="cuda")[None].flip(-1)
    key_cache = torch.zeros(blocks + 2, BLOCK, KV_HEADS, HEAD, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    for position in range(length):
        block, row = table[0, position // BLOCK], position % BLOCK
        key_cache[block, row], value_cache[block, row] = k[position], v[position]
    out = torch.empty_like(q)
    scale = HEAD ** -0.5
    ones = torch.ones(1, KV_HEADS, device="cuda")
    unified_attention(q=q, k=key_cache, v=value_cache, out=out,
                      cu_seqlens_q=torch.tensor([0, length], dtype=torch.int32, device="cuda"), max_seqlen_q=length,
                      seqused_k=torch.tensor([length], dtype=torch.int32, device="cuda"), max_seqlen_k=length,
                      softmax_scale=scale, causal=True, window_size=(-1, -1), block_table=table, softcap=0,
                      q_descale=None, k_descale=ones, v_descale=ones)
    group = QUERY_HEADS // KV_HEADS
    reference = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().repeat_interleave(group, 1).transpose(0, 1),
        v.double().repeat_interleave(group, 1).transpose(0, 1), is_causal=True, scale=scale).transpose(0, 1)
    assert gap(out, reference) < TOLERANCE
