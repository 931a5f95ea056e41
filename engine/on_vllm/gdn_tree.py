"""A Gated DeltaNet layer verifying a draft tree on vLLM-style state caches.

vLLM keeps one request's linear-attention state in a slot of two per-layer caches: the
convolution window ``conv_state [slots, dim, W]`` (the last W inputs, oldest first) and the
recurrent matrix ``ssm_state [slots, heads, V, K]``; slot 0 is its null block, which kernels
skip. Its decode kernels take per-sequence slot indices:

- ``causal_conv1d_update``: a batch of one-token sequences, each convolving its own window
  (``conv_state_indices``) and shifting it in place;
- ``fused_sigmoid_gating_delta_rule_update``: a batch of varlen sequences (``cu_seqlens``);
  with 2D ``ssm_state_indices`` and ``num_accepted_tokens`` (its speculative-decoding mode)
  sequence n starts from slot ``indices[n, accepted[n] - 1]`` and after its token t stores the
  state in slot ``indices[n, t]``, or nowhere if that is 0.

A tree verify uses both without a new kernel (``verify_layer``): every node convolves the
window gathered from its own ancestors (``ddtree.forks.window_columns``), and every node's
root-to-node path is replayed from the committed state as one sequence of a batch
(``ddtree.forks.path_replay``), reading the request's slot and storing nothing; the node's
output is its sequence's last. The committed state is untouched until ``commit_layer``:
the accepted leaf's window becomes the committed one and the accepted path is replayed once
more, storing into the request's slot. Replaying a path token by token is exactly what
decoding it one token at a time computes, so greedy outputs match AR.

``conv_update_reference`` and ``gated_delta_reference`` are readable torch versions of the
two kernels, with the same indexing conventions; CPU tests run the tree code through them,
and the GPU tests hold the real kernels to the same checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ddtree.forks import PathReplay, depths, path_replay, path_table, window_columns


@dataclass(frozen=True)
class GDNKernels:
    conv_update: Callable  # causal_conv1d_update's signature
    gated_delta_update: Callable  # fused_sigmoid_gating_delta_rule_update's signature
    recurrent: Callable  # fused_recurrent_gated_delta_rule's (the float32 prefill, ``recurrent_prefill``)


@dataclass(frozen=True)
class GDNParams:
    """One layer's weights, as this tensor-parallel rank holds them."""

    conv_weight: torch.Tensor  # [dim, W + 1]
    conv_bias: torch.Tensor | None
    activation: str | None
    A_log: torch.Tensor  # [heads]
    dt_bias: torch.Tensor  # [heads]
    key_dim: int  # q and k channels (all key heads of this rank)
    value_dim: int
    head_k_dim: int
    head_v_dim: int

    def split(self, convolved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key, value ``[1, T, heads, dim]`` from the packed convolution output ``[T, channels]``."""
        query, key, value = torch.split(convolved, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (query.reshape(1, -1, self.key_dim // self.head_k_dim, self.head_k_dim).contiguous(),
                key.reshape(1, -1, self.key_dim // self.head_k_dim, self.head_k_dim).contiguous(),
                value.reshape(1, -1, self.value_dim // self.head_v_dim, self.head_v_dim).contiguous())


@dataclass(frozen=True)
class GDNTreePlan:
    """What every linear layer of one verify pass shares: where each node's inputs come from."""

    slot: int  # the request's state slot (> 0)
    before: torch.Tensor  # [q, W] window columns each node starts from
    after: torch.Tensor  # [q, W] window columns each node leaves behind
    replay: PathReplay
    read_rows: torch.Tensor  # [q + 1, L + 1] int32: every path reads the slot (last column), stores nowhere
    read_column: torch.Tensor  # [q + 1] int32: L + 1, the column read
    conv_rows: torch.Tensor  # [q] int32: the scratch windows 1..q (row 0 is the null row)
    commit_rows: torch.Tensor  # [1, L] int32: the accepted path stores every step into the slot
    one: torch.Tensor  # [1] int32

    @staticmethod
    def build(visible: torch.Tensor, slot: int, width: int, length: int) -> GDNTreePlan:
        """From the ancestors-and-self mask ``[q, q]``; ``length`` bounds a path (the block size)."""
        q = visible.shape[0]
        device = visible.device
        depth = depths(visible)
        table = path_table(visible, length)
        read_rows, commit_rows = _slot_rows(q, length, slot, device)
        return GDNTreePlan(
            slot=slot, before=window_columns(table, depth - 1, width), after=window_columns(table, depth, width),
            replay=path_replay(table, depth), read_rows=read_rows,
            read_column=torch.full((q + 1,), length + 1, dtype=torch.int32, device=device),
            conv_rows=torch.arange(1, q + 1, dtype=torch.int32, device=device), commit_rows=commit_rows,
            one=torch.ones(1, dtype=torch.int32, device=device))

    def for_slot(self, slot: int) -> GDNTreePlan:
        """The same tree over another state slot (another KV-cache group's block)."""
        q, length = self.read_rows.shape[0] - 1, self.commit_rows.shape[1]
        read_rows, commit_rows = _slot_rows(q, length, slot, self.read_rows.device)
        return replace(self, slot=slot, read_rows=read_rows, commit_rows=commit_rows)


def _slot_rows(q: int, length: int, slot: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """State rows of a plan over ``slot``: every path reads it (last column) and stores nowhere; the
    accepted path stores every step into it."""
    read_rows = torch.zeros(q + 1, length + 1, dtype=torch.int32, device=device)
    read_rows[:q, length] = slot
    return read_rows, torch.full((1, length), slot, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class KeptInputs:
    """What a layer keeps from a verify pass until the commit: its inputs, not per-node states
    (a state is heads x K x V floats, 3 MB a layer at 27B sizes; a path replay costs one launch)."""

    inputs: torch.Tensor  # [dim, W + q]: the committed window, then every node's convolution input
    convolved: torch.Tensor  # [q, channels]
    a: torch.Tensor  # [q, heads]
    b: torch.Tensor  # [q, heads]


def verify_layer(params: GDNParams, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 conv_state: torch.Tensor, ssm_state: torch.Tensor, plan: GDNTreePlan, kernels: GDNKernels
                 ) -> tuple[torch.Tensor, KeptInputs]:
    """Every node's core output ``[q, heads, V]`` for inputs ``mixed_qkv [q, channels]``,
    ``a``/``b [q, heads]``; the caches are read, never written. Like vLLM's own layer, the
    convolution overwrites ``mixed_qkv`` with its output (vLLM's kernel works in place)."""
    inputs = torch.cat([conv_state[plan.slot], mixed_qkv.T.to(conv_state.dtype)], dim=1)
    windows = inputs[:, plan.before].permute(1, 0, 2)
    scratch = torch.cat([windows[:1], windows]).contiguous()  # row 0 stands for the null block
    convolved = kernels.conv_update(mixed_qkv, scratch, params.conv_weight, params.conv_bias, params.activation,
                                    conv_state_indices=plan.conv_rows)
    query, key, value = params.split(convolved)
    nodes = plan.replay.nodes
    out, _ = kernels.gated_delta_update(
        A_log=params.A_log, a=a[nodes], b=b[nodes], dt_bias=params.dt_bias, q=query[:, nodes], k=key[:, nodes],
        v=value[:, nodes], initial_state=ssm_state, inplace_final_state=True, cu_seqlens=plan.replay.starts,
        ssm_state_indices=plan.read_rows, num_accepted_tokens=plan.read_column, use_qk_l2norm_in_kernel=True)
    return out[0, plan.replay.last], KeptInputs(inputs, convolved, a, b)


@dataclass(frozen=True)
class AcceptedPath:
    """What every linear layer's commit shares, made once per verify pass (a hybrid has dozens of
    linear layers, and each op made per layer is a launch per layer)."""

    nodes: torch.Tensor  # [L] node indices, root first, padded past the path's length
    bounds: torch.Tensor  # [2] int32: the path as the delta rule's one sequence (0, its length)
    window: torch.Tensor  # [W] columns of a layer's kept inputs: the window the leaf leaves behind

    @staticmethod
    def build(plan: GDNTreePlan, path: torch.Tensor, length: torch.Tensor) -> AcceptedPath:
        """From ``path [L]`` (padded past ``length``, a device scalar), all on the device."""
        leaf = path.gather(0, (length - 1).reshape(1))
        bounds = torch.cat([torch.zeros_like(plan.one), length.reshape(1).to(torch.int32)])
        return AcceptedPath(nodes=path, bounds=bounds, window=plan.after.index_select(0, leaf)[0])


def commit_layer(params: GDNParams, kept: KeptInputs, plan: GDNTreePlan, accepted: AcceptedPath,
                 conv_state: torch.Tensor, ssm_state: torch.Tensor, kernels: GDNKernels) -> None:
    """Make the accepted path's state the request's."""
    conv_state[plan.slot].copy_(kept.inputs[:, accepted.window])
    query, key, value = params.split(kept.convolved[accepted.nodes])
    kernels.gated_delta_update(
        A_log=params.A_log, a=kept.a[accepted.nodes], b=kept.b[accepted.nodes], dt_bias=params.dt_bias, q=query, k=key,
        v=value, initial_state=ssm_state, inplace_final_state=True, cu_seqlens=accepted.bounds,
        ssm_state_indices=plan.commit_rows, num_accepted_tokens=plan.one, use_qk_l2norm_in_kernel=True)


# ---------------------------------------------------------------------------------------------
# Readable references of the vLLM kernels (their indexing conventions, plain torch)
# ---------------------------------------------------------------------------------------------


def conv_update_reference(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None):
    """``causal_conv1d_update`` for a batch of one-token sequences ``x [batch, dim]``."""
    rows = conv_state_indices.long()
    windows = torch.cat([conv_state[rows], x.to(conv_state.dtype)[:, :, None]], dim=-1)  # [batch, dim, W + 1]
    out = (windows * weight[None]).sum(-1)
    if bias is not None:
        out = out + bias
    conv_state[rows] = windows[:, :, 1:]
    return (F.silu(out) if activation in ("silu", "swish", True) else out).to(x.dtype)


def recurrent_reference(q, k, v, g, beta, scale=None, initial_state=None, inplace_final_state=True, cu_seqlens=None,
                        ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False):
    """``fused_recurrent_gated_delta_rule`` over varlen sequences ``q/k [1, T, H, K]``, ``v [1, T, HV, V]``,
    log decays ``g`` and ``beta [1, T, HV]``, with per-sequence state slots (``ssm_state_indices``:
    sequence n starts from slot ``indices[n, accepted[n] - 1]``, stores after token t into slot
    ``indices[n, t]`` unless it is 0); returns ``(out, state)``."""
    heads, key_heads = v.shape[2], q.shape[2]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros_like(v)
    bounds = cu_seqlens.tolist()
    flat = ssm_state_indices.reshape(-1)
    row_stride = ssm_state_indices.stride(0) if ssm_state_indices.dim() == 2 else 1
    for n in range(len(bounds) - 1):
        begin, end = bounds[n], bounds[n + 1]
        read = int(num_accepted_tokens[n]) - 1 if num_accepted_tokens is not None else 0
        slot = int(flat[n * row_stride + read])
        if end == begin or slot <= 0:
            continue
        state = initial_state[slot].float()  # [HV, V, K]
        for t in range(end - begin):
            token = begin + t
            query = q[0, token].float().repeat_interleave(heads // key_heads, dim=0)  # [HV, K]
            key = k[0, token].float().repeat_interleave(heads // key_heads, dim=0)
            value = v[0, token].float()  # [HV, V]
            if use_qk_l2norm_in_kernel:
                query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
                key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
            query = query * scale
            state = state * g[0, token].float().exp()[:, None, None]
            value = (value - (state * key[:, None, :]).sum(-1)) * beta[0, token].float()[:, None]
            state = state + value[:, :, None] * key[:, None, :]
            out[0, token] = (state * query[:, None, :]).sum(-1).to(out.dtype)
            store = int(flat[n * row_stride + t])
            if inplace_final_state and store > 0:
                initial_state[store] = state.to(initial_state.dtype)
    return out, initial_state


def gated_delta_reference(A_log, a, b, dt_bias, q, k, v, initial_state, inplace_final_state=True, cu_seqlens=None,
                          ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                          scale=None):
    """``fused_sigmoid_gating_delta_rule_update``: the gates from ``a/b [T, HV]`` (softplus decay,
    sigmoid beta), then the recurrence as ``recurrent_reference``."""
    def decay(row):  # token by token: the same bits however many tokens come along (vectorised exp is not)
        x = row.float() + dt_bias.float()
        return -A_log.float().exp() * torch.where(x <= 20.0, torch.log(1 + torch.exp(x)), x)

    g = torch.stack([decay(row) for row in a]) if len(a) else a.float()
    beta = torch.stack([torch.sigmoid(row.float()) for row in b]) if len(b) else b.float()
    return recurrent_reference(q, k, v, g[None], beta[None], scale, initial_state,
                               inplace_final_state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                               use_qk_l2norm_in_kernel)


def recurrent_prefill(q, k, v, g, beta, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                      use_qk_l2norm_in_kernel: bool, recurrent: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_gated_delta_rule``'s prefill (outputs ``[1, T, HV, V]``, each sequence's final state
    ``[N, HV, V, K]``) through the recurrent kernel ``recurrent`` (``fused_recurrent_gated_delta_rule``'s
    signature): vLLM 0.23's chunked kernel refuses float32. Sequence n starts from row n + 1 of a
    scratch copy of ``initial_state`` (row 0 is the null row the kernel skips) and stores every
    step's state back into that row, so the row ends as the sequence's final state."""
    sequences = cu_seqlens.numel() - 1
    longest = max(1, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
    states = torch.cat([initial_state.new_zeros(1, *initial_state.shape[1:]), initial_state])
    rows = torch.arange(1, sequences + 1, dtype=torch.int32, device=q.device)[:, None].repeat(1, longest)
    out, _ = recurrent(q=q, k=k, v=v, g=g, beta=beta, initial_state=states, inplace_final_state=True,
                       cu_seqlens=cu_seqlens, ssm_state_indices=rows, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out, states[1:]


REFERENCE_KERNELS = GDNKernels(conv_update_reference, gated_delta_reference, recurrent_reference)
