"""A Gated DeltaNet layer's tree verify in two Triton programs and its commit in one.

``engine.on_vllm.gdn_tree`` verifies a tree with vLLM's own kernels: gathered windows, a convolution
launch, q/k/v splits and gathers, a varlen path replay, then the commit's second replay; about
twenty launches a layer, which at 48 linear layers is most of a hybrid's step. Here the same
arithmetic runs as three programs a layer:

- ``verify``, first every node's convolution: one program per (channel block, node) convolves the
  node's window, the last four inputs on its root-to-node path (``ddtree.forks.path_table``; the
  committed window's columns before the root), and keeps its inputs, convolution output and gates
  for the walk and the commit (vLLM reuses its input buffers layer after layer). The convolution
  needs no recurrence, so it runs once a node, not once a path through it and a value block.
- then the walk: one program per (value block, value head, leaf) walks the leaf's path and scores
  the nodes of the leaf's chain on it (``ddtree.forks.leaf_chains``: each node lies on one chain,
  so it is scored once, and a chain of 16 is one walk of 16 tokens, not 16 walks of 1 to 16),
  applying each token to the recurrent state it holds in registers from the request's committed
  state on; each token's convolved rows are loaded one step ahead. With the convolution out of the
  walk, a program holds no window or taps, so it takes fewer registers a thread and an SM holds more
  walks at once, what a tree of many leaves waits on (``python -m engine.tools.gdn_registers`` prints
  each program's registers; benchmarks/kernels/gpu-gdn-qwen3.6-27b-two-programs.md holds them beside
  the one-program verify's). Nothing in the caches is written.
- ``commit``: one program per (value block, value head) applies the accepted path's kept tokens
  to the committed state (each token's rows loaded one step ahead), stores it, and shifts the
  convolution window along the path.

Every token is the arithmetic of vLLM's one-token decode, op for op: ``causal_conv1d_update``'s
tap order and activation, and ``fused_recurrent_gated_delta_rule_packed_decode`` (its l2 norm,
gates and state update, at its key block and warp count), so a node's output is what AR decoding
its path gives. ``engine.on_vllm.gdn_tree``'s readable step stays the reference the tests hold this to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.forks import depths, leaf_chains, packed_paths, path_table
from engine.gpu.triton_support import tl, triton, triton_runs_on
from engine.on_vllm.gdn_tree import GDNParams

SOFTPLUS_THRESHOLD = 20.0


@dataclass(frozen=True)
class TreePaths:
    """Every node's root-to-node path, what all linear layers of one verify pass share."""

    table: torch.Tensor  # [q, length] int32: node i's ancestor at each depth (``path_table``)
    depth: torch.Tensor  # [q] int32
    chain_start: torch.Tensor  # [q] int32: a leaf's chain's first depth, -1 for other nodes (``leaf_chains``)

    @staticmethod
    def build(visible: torch.Tensor, length: int) -> TreePaths:
        return TreePaths.of(path_table(visible, length), depths(visible))

    @staticmethod
    def packed(local: torch.Tensor, depth: torch.Tensor) -> TreePaths:
        """A batch's pass from its tokens' paths in their own trees' numbering (``ddtree.verify_paths``)."""
        return TreePaths.of(packed_paths(local, depth), depth.long())

    @staticmethod
    def of(table: torch.Tensor, depth: torch.Tensor) -> TreePaths:
        return TreePaths(table.to(torch.int32).contiguous(), depth.to(torch.int32),
                         leaf_chains(table, depth).to(torch.int32))


@dataclass(frozen=True)
class KeptNodes:
    """What a layer's verify keeps for its commit (vLLM reuses its input buffers layer after layer)."""

    inputs: torch.Tensor  # [q, channels]: the convolution's inputs
    convolved: torch.Tensor  # [q, channels]: its outputs, q/k/v packed as vLLM packs them
    a: torch.Tensor  # [q, heads]
    b: torch.Tensor  # [q, heads]

    @staticmethod
    def allocate(q: int, channels: int, heads: int, dtype: torch.dtype, device: torch.device) -> KeptNodes:
        return KeptNodes(*(torch.empty(q, width, dtype=dtype, device=device)
                           for width in (channels, channels, heads, heads)))

    def first(self, q: int) -> KeptNodes:
        """The first ``q`` nodes' rows: a pass of ``q`` nodes keeps its nodes here."""
        return KeptNodes(self.inputs[:q], self.convolved[:q], self.a[:q], self.b[:q])


CONV_KERNEL = 4  # the convolution width the verify program is written for (Qwen3-Next's, Qwen3.5's)
WARPS = 1  # vLLM's packed decode kernel's: how a sum splits over warps sets its order, hence its bits
CONV_BLOCK = 1024  # channels a convolution program takes (each channel's arithmetic is its own: any block will do)


def fused_fits(device: torch.device, conv_kernel: int = CONV_KERNEL) -> bool:
    return triton_runs_on(device) and conv_kernel == CONV_KERNEL


def _blocks(params: GDNParams, nodes: int) -> tuple[int, int]:
    """Key and value columns a program holds. Every value column's arithmetic is the same at any value
    block (the sums run over keys), so the block sets only how many programs share the work and how many
    registers each takes. One token's walk is fastest at 8 columns, where more programs share its one
    path; past one node, 16 columns halve a walk's registers against 32, so an SM holds twice the walks a
    tree of many leaves waits on. ``engine.tools.gdn_bench`` times each size (BENCHMARKS.md, "Gated
    DeltaNet verify and commit"; benchmarks/kernels/gpu-gdn-qwen3.6-27b-size-rule.md and
    gpu-gdn-qwen3.6-27b-two-programs.md)."""
    value_block = 8 if nodes == 1 else 16
    return triton.next_power_of_2(params.head_k_dim), min(triton.next_power_of_2(params.head_v_dim), value_block)


def verify(
    params: GDNParams,
    mixed_qkv: torch.Tensor,  # [nodes, channels]
    a: torch.Tensor,  # [nodes, heads]
    b: torch.Tensor,  # [nodes, heads]
    conv_state: torch.Tensor,  # [slots, channels, W], any strides, read only
    ssm_state: torch.Tensor,  # [slots, heads, V, K], read only
    slots: torch.Tensor,  # [nodes] int32: each node's request's slot in both caches
    paths: TreePaths,
    out: torch.Tensor,  # [nodes, heads, V]
    into: KeptNodes | None = None,  # where to keep the nodes' rows (at least ``nodes`` of them); by default new
) -> KeptNodes:
    """Every node's core output into ``out [q, heads, V]`` for inputs ``mixed_qkv [q, channels]``,
    ``a``/``b [q, heads]``; ``conv_state [slots, channels, W]`` (any strides) and ``ssm_state`` are read only.
    The pass may hold a batch's trees (``paths`` of a block-diagonal mask), each node starting from its own
    request's committed state in ``slots``."""
    q, channels = mixed_qkv.shape
    heads = params.value_dim // params.head_v_dim
    if into is not None and (into.inputs.shape[0] < q or into.inputs.shape[1] != channels):
        raise ValueError(f"a pass of {q} nodes of {channels} channels does not fit {tuple(into.inputs.shape)}")
    kept = (KeptNodes.allocate(q, channels, heads, mixed_qkv.dtype, mixed_qkv.device) if into is None
            else into.first(q))
    _convolve_kernel[(triton.cdiv(channels, CONV_BLOCK), q)](
        mixed_qkv, mixed_qkv.stride(0), a, a.stride(0), b, b.stride(0), params.conv_weight,
        params.conv_weight.stride(0), params.conv_weight.stride(1), params.conv_bias, conv_state, conv_state.stride(0),
        conv_state.stride(1), conv_state.stride(2), slots, paths.table, paths.depth, kept.inputs, kept.convolved,
        kept.convolved.stride(0), channels, kept.a, kept.b, HV=heads, HEADS=triton.next_power_of_2(heads),
        LENGTH=paths.table.shape[1], BLOCK=CONV_BLOCK, HAS_BIAS=params.conv_bias is not None,
        SILU=params.activation in ("silu", "swish", True))
    block_k, block_v = _blocks(params, q)
    _walk_kernel[(triton.cdiv(params.head_v_dim, block_v), heads, q)](
        kept.convolved, kept.convolved.stride(0), kept.a, kept.b, params.A_log, params.dt_bias, slots, ssm_state,
        ssm_state.stride(0), paths.table, paths.depth, paths.chain_start, out, out.stride(0), params.head_k_dim ** -0.5,
        H=params.key_dim // params.head_k_dim, HV=heads, K=params.head_k_dim, V=params.head_v_dim, BK=block_k,
        BV=block_v, LENGTH=paths.table.shape[1], PATH=triton.next_power_of_2(paths.table.shape[1]),
        SOFTPLUS_THRESHOLD=SOFTPLUS_THRESHOLD, num_warps=WARPS)
    return kept


def commit(
    params: GDNParams,
    kept: KeptNodes,
    conv_state: torch.Tensor,  # [slots, channels, W]
    ssm_state: torch.Tensor,  # [slots, heads, V, K]
    slots: torch.Tensor,  # [requests] int32
    path: torch.Tensor,  # [requests, max path length] int32
    length: torch.Tensor,  # [requests] int32
) -> None:
    """Each request's accepted ``path`` (node indices of the pass, root first, int32, padded past its ``length``,
    on the device) becomes its state in its slot of ``slots``: the recurrent state and the convolution window."""
    heads = params.value_dim // params.head_v_dim
    block_k, block_v = _blocks(params, kept.convolved.shape[0])
    grid = (triton.cdiv(params.head_v_dim, block_v), heads, slots.shape[0])
    _commit_kernel[grid](
        kept.inputs, kept.convolved, kept.convolved.stride(0), kept.a, kept.b, params.A_log, params.dt_bias,
        conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), slots, ssm_state,
        ssm_state.stride(0), path, path.stride(0), length, params.head_k_dim ** -0.5,
        H=params.key_dim // params.head_k_dim, HV=heads, K=params.head_k_dim, V=params.head_v_dim, BK=block_k,
        BV=block_v, WIDTH=params.conv_weight.shape[1], COLUMNS=triton.next_power_of_2(params.conv_weight.shape[1] - 1),
        SOFTPLUS_THRESHOLD=SOFTPLUS_THRESHOLD, num_warps=WARPS)


if triton is not None:

    @triton.jit
    def _delta_step(b_h, b_q, b_k, b_v, a_raw, b_raw, A_log_val, dt_bias_val, scale, SOFTPLUS_THRESHOLD: tl.constexpr):
        """One token of the packed decode kernel: l2-normed q and k, the gates, the state update, the
        output (computed where that kernel computes it, so that it compiles to the same arithmetic)."""
        b_q = b_q.to(tl.float32)
        b_k = b_k.to(tl.float32)
        b_v = b_v.to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale
        x = a_raw.to(tl.float32) + dt_bias_val
        softplus_x = tl.where(x <= SOFTPLUS_THRESHOLD, tl.log(1.0 + tl.exp(x)), x)
        g_val = -tl.exp(A_log_val) * softplus_x
        beta_val = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)
        b_h *= tl.exp(g_val)
        b_v -= tl.sum(b_h * b_k[None, :], 1)
        b_v *= beta_val
        b_h += b_v[:, None] * b_k[None, :]
        b_o = tl.sum(b_h * b_q[None, :], 1)
        return b_h, b_o

    @triton.jit
    def _conv4(bias, weight, stride_w_dim, stride_w_tap, channels, mask, oldest, older, newer, newest,
               HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
        """``causal_conv1d_update``'s output on ``channels`` (kernel 4): the bias, the taps oldest first, the
        activation, rounded to the inputs' dtype as its output buffer is."""
        if HAS_BIAS:
            acc = tl.load(bias + channels, mask=mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros(channels.shape, dtype=tl.float32)
        acc += oldest * tl.load(weight + channels * stride_w_dim, mask=mask, other=0.0)
        acc += older * tl.load(weight + channels * stride_w_dim + stride_w_tap, mask=mask, other=0.0)
        acc += newer * tl.load(weight + channels * stride_w_dim + 2 * stride_w_tap, mask=mask, other=0.0)
        acc += newest * tl.load(weight + channels * stride_w_dim + 3 * stride_w_tap, mask=mask, other=0.0)
        if SILU:
            acc = acc / (1 + tl.exp(-acc))
        return acc.to(newest.dtype)

    @triton.jit
    def _inputs(x, stride_x, a, stride_a, b, stride_b, token, i_hv, q_channels, k_channels, v_channels, mask_k, mask_v):
        """A token's q, k and v rows of ``x`` on this program's channels, and its gate inputs."""
        return (tl.load(x + token * stride_x + q_channels, mask=mask_k, other=0.0),
                tl.load(x + token * stride_x + k_channels, mask=mask_k, other=0.0),
                tl.load(x + token * stride_x + v_channels, mask=mask_v, other=0.0),
                tl.load(a + token * stride_a + i_hv), tl.load(b + token * stride_b + i_hv))

    @triton.jit
    def _window_input(x, stride_x, window, stride_cs_dim, stride_cs_tok, table, node, at_depth, channels, mask,
                      LENGTH: tl.constexpr):
        """The convolution input at ``at_depth`` on a node's path: a path node's input, or before the root the
        committed window's column (its three columns hold the last inputs, kernel 4's, in its own dtype)."""
        on_path = tl.full(channels.shape, at_depth, tl.int32) >= 0
        token = tl.load(table + node * LENGTH + tl.maximum(at_depth, 0))
        from_path = tl.load(x + token * stride_x + channels, mask=mask & on_path, other=0.0)
        from_window = tl.load(window + channels * stride_cs_dim + tl.maximum(3 + at_depth, 0) * stride_cs_tok,
                              mask=mask & ~on_path, other=0.0)
        return tl.where(on_path, from_path, from_window.to(from_path.dtype))

    @triton.jit
    def _convolve_kernel(
        x, stride_x,  # [nodes, channels]: the layer's inputs, q/k/v packed as vLLM packs them
        a, stride_a, b, stride_b,  # [nodes, HV] each: the gates' inputs
        weight, stride_w_dim, stride_w_tap,  # [channels, W]: the convolution's taps
        bias,  # [channels], or None
        conv_state, stride_cs_slot, stride_cs_dim, stride_cs_tok,  # [slots, channels, W], read only
        slots,  # [nodes] int32: each node's request's slot in both state caches
        table,  # [nodes, LENGTH] int32: each node's ancestor at each depth (``ddtree.forks.path_table``)
        depth,  # [nodes] int32
        kept_x, kept_conv, stride_kept,  # [nodes, channels] each: what the walk and the commit read
        channel_count,
        kept_a, kept_b,  # [nodes, HV] each, contiguous
        HV: tl.constexpr, HEADS: tl.constexpr, LENGTH: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,
    ):
        """One node's convolution on a block of channels, over its path's last four inputs, into what the walk and
        the commit read (the node's inputs, convolution output and gates, kept apart from vLLM's reused buffers)."""
        block, node = tl.program_id(0), tl.program_id(1)
        channels = block * BLOCK + tl.arange(0, BLOCK)
        mask = channels < channel_count
        window = conv_state + tl.load(slots + node).to(tl.int64) * stride_cs_slot
        at = tl.load(depth + node)
        oldest = _window_input(x, stride_x, window, stride_cs_dim, stride_cs_tok, table, node, at - 3, channels, mask,
                               LENGTH)
        older = _window_input(x, stride_x, window, stride_cs_dim, stride_cs_tok, table, node, at - 2, channels, mask,
                              LENGTH)
        newer = _window_input(x, stride_x, window, stride_cs_dim, stride_cs_tok, table, node, at - 1, channels, mask,
                              LENGTH)
        newest = tl.load(x + node * stride_x + channels, mask=mask, other=0.0)
        tl.store(kept_x + node * stride_kept + channels, newest, mask=mask)
        convolved = _conv4(bias, weight, stride_w_dim, stride_w_tap, channels, mask, oldest, older, newer, newest,
                           HAS_BIAS, SILU)
        tl.store(kept_conv + node * stride_kept + channels, convolved, mask=mask)
        if block == 0:
            heads = tl.arange(0, HEADS)
            tl.store(kept_a + node * HV + heads, tl.load(a + node * stride_a + heads, mask=heads < HV), mask=heads < HV)
            tl.store(kept_b + node * HV + heads, tl.load(b + node * stride_b + heads, mask=heads < HV), mask=heads < HV)

    @triton.jit
    def _walk_kernel(
        kept_conv, stride_kept,  # [nodes, channels]: every node's convolved q/k/v (``_convolve_kernel``)
        kept_a, kept_b,  # [nodes, HV] each, contiguous
        A_log, dt_bias,  # [HV] each
        slots,  # [nodes] int32: each node's request's slot
        ssm_state, stride_state_slot,  # [slots, HV, V, K], read only
        table,  # [nodes, LENGTH] int32, contiguous: each node's ancestor at each depth
        depth,  # [nodes] int32
        chain_start,  # [nodes] int32: a leaf's chain's first depth, -1 for other nodes
        out, stride_out,  # [nodes, HV, V]: every node's core output
        scale,  # K ** -0.5
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        LENGTH: tl.constexpr, PATH: tl.constexpr, SOFTPLUS_THRESHOLD: tl.constexpr,
    ):
        i_v, i_hv, node = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_h = i_hv // (HV // H)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        mask_k = o_k < K
        mask_v = o_v < V
        q_channels = i_h * K + o_k
        k_channels = H * K + i_h * K + o_k
        v_channels = 2 * H * K + i_hv * V + o_v
        # a leaf walks its path and scores its chain (``leaf_chains``); every other node's program has nothing to do
        start = tl.load(chain_start + node)
        if start >= 0:
            steps_to_walk = tl.load(depth + node) + 1
            # the whole path at once: each step then picks its next token without waiting on memory
            steps = tl.arange(0, PATH)
            path = tl.load(table + node * LENGTH + steps, mask=steps < LENGTH, other=0)
            A_log_val = tl.load(A_log + i_hv).to(tl.float32)
            dt_bias_val = tl.load(dt_bias + i_hv).to(tl.float32)
            slot = tl.load(slots + node).to(tl.int64)
            p_h = ssm_state + slot * stride_state_slot + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
            b_h = tl.load(p_h, mask=mask_v[:, None] & mask_k[None, :], other=0).to(tl.float32)
            # each step's rows are loaded one step ahead, so their latency hides behind the step before; the first
            # step's token is the path's root (node 0 of a lone tree)
            next_token = tl.sum(tl.where(steps == 0, path, 0))
            next_q, next_k, next_v, next_a, next_b = _inputs(kept_conv, stride_kept, kept_a, HV, kept_b, HV, next_token,
                                                             i_hv, q_channels, k_channels, v_channels, mask_k, mask_v)
            for t in range(0, steps_to_walk):
                token, b_q, b_k, b_v, a_t, b_t = next_token, next_q, next_k, next_v, next_a, next_b
                next_token = tl.sum(tl.where(steps == t + 1, path, 0))  # past the path's end: node 0's, never used
                next_q, next_k, next_v, next_a, next_b = _inputs(kept_conv, stride_kept, kept_a, HV, kept_b, HV,
                                                                 next_token, i_hv, q_channels, k_channels, v_channels,
                                                                 mask_k, mask_v)
                b_h, b_o = _delta_step(b_h, b_q, b_k, b_v, a_t, b_t, A_log_val, dt_bias_val, scale,
                                       SOFTPLUS_THRESHOLD)
                if t >= start:  # a node of this leaf's chain
                    tl.store(out + token * stride_out + i_hv * V + o_v, b_o.to(out.dtype.element_ty), mask=mask_v)

    @triton.jit
    def _shift_window(kept_x, stride_x, window, stride_cs_dim, stride_cs_tok, path, length, channels, mask,
                      WIDTH: tl.constexpr, COLUMNS: tl.constexpr):
        """The committed window after the accepted path, on ``channels``: its last WIDTH - 1 inputs,
        older columns of the window where the path is shorter. All reads come before any write."""
        columns = tl.arange(0, COLUMNS)  # the window's WIDTH - 1 columns, padded to a power of two
        position = length - (WIDTH - 1) + columns
        node = tl.load(path + tl.maximum(position, 0), mask=columns < WIDTH - 1, other=0)
        in_path = (position >= 0) & (columns < WIDTH - 1)
        from_path = tl.load(kept_x + node[:, None] * stride_x + channels[None, :],
                            mask=in_path[:, None] & mask[None, :], other=0.0)
        old = tl.maximum(WIDTH - 1 + position, 0)
        from_window = tl.load(window + channels[None, :] * stride_cs_dim + old[:, None] * stride_cs_tok,
                              mask=((position < 0) & (columns < WIDTH - 1))[:, None] & mask[None, :], other=0.0)
        shifted = tl.where(in_path[:, None], from_path.to(from_window.dtype), from_window)
        tl.debug_barrier()
        tl.store(window + channels[None, :] * stride_cs_dim + columns[:, None] * stride_cs_tok, shifted,
                 mask=(columns < WIDTH - 1)[:, None] & mask[None, :])

    @triton.jit
    def _commit_kernel(
        kept_x, kept_conv, stride_x,  # [nodes, channels] each: the verify's inputs and convolved q/k/v
        kept_a, kept_b,  # [nodes, HV] each, contiguous
        A_log, dt_bias,  # [HV] each
        conv_state, stride_cs_slot, stride_cs_dim, stride_cs_tok,  # [slots, channels, W]: the window is shifted
        slots,  # [requests] int32: each request's slot
        ssm_state, stride_state_slot,  # [slots, HV, V, K]: the state is stored
        paths, stride_path,  # [requests, max path length] int32: the accepted nodes, root first, padded past a length
        lengths,  # [requests] int32: each accepted path's length, on the device
        scale,  # K ** -0.5
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        WIDTH: tl.constexpr, COLUMNS: tl.constexpr, SOFTPLUS_THRESHOLD: tl.constexpr,
    ):
        i_v, i_hv, request = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_h = i_hv // (HV // H)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        mask_k = o_k < K
        mask_v = o_v < V
        mask_h = mask_v[:, None] & mask_k[None, :]
        q_channels = i_h * K + o_k
        k_channels = H * K + i_h * K + o_k
        v_channels = 2 * H * K + i_hv * V + o_v
        path = paths + request * stride_path
        length = tl.load(lengths + request)
        slot = tl.load(slots + request).to(tl.int64)
        A_log_val = tl.load(A_log + i_hv).to(tl.float32)
        dt_bias_val = tl.load(dt_bias + i_hv).to(tl.float32)
        p_h = ssm_state + slot * stride_state_slot + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
        b_h = tl.load(p_h, mask=mask_h, other=0).to(tl.float32)
        # each token's rows are loaded one step ahead, as in the verify, starting at the root (past the path's end:
        # the root's again)
        next_q, next_k, next_v, next_a, next_b = _inputs(kept_conv, stride_x, kept_a, HV, kept_b, HV, tl.load(path),
                                                         i_hv, q_channels, k_channels, v_channels, mask_k, mask_v)
        for t in range(0, length):
            b_q, b_k, b_v, a_t, b_t = next_q, next_k, next_v, next_a, next_b
            following = tl.load(path + tl.where(t + 1 < length, t + 1, 0))
            next_q, next_k, next_v, next_a, next_b = _inputs(kept_conv, stride_x, kept_a, HV, kept_b, HV, following,
                                                             i_hv, q_channels, k_channels, v_channels, mask_k, mask_v)
            b_h, _ = _delta_step(b_h, b_q, b_k, b_v, a_t, b_t, A_log_val, dt_bias_val, scale, SOFTPLUS_THRESHOLD)
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=mask_h)
        window = conv_state + slot * stride_cs_slot
        _shift_window(kept_x, stride_x, window, stride_cs_dim, stride_cs_tok, path, length, v_channels, mask_v,
                      WIDTH, COLUMNS)
        if i_v == 0 and i_hv % (HV // H) == 0:
            _shift_window(kept_x, stride_x, window, stride_cs_dim, stride_cs_tok, path, length, q_channels, mask_k,
                          WIDTH, COLUMNS)
            _shift_window(kept_x, stride_x, window, stride_cs_dim, stride_cs_tok, path, length, k_channels, mask_k,
                          WIDTH, COLUMNS)
