"""Hybrid targets in the vLLM engine: tree verification through vLLM's Gated DeltaNet layers.

Qwen3-Next and Qwen3.5 / Qwen3.6 mix full-attention layers, which verify a tree with the
query bias like any target (``engine.on_vllm.vllm_worker``), with Gated DeltaNet layers
(``QwenGatedDeltaNetAttention``), whose state must fork at every tree node. Those layers
verify a tree in two Triton programs a layer, every node's convolution and then a walk per leaf, and
commit the accepted path in one more (``engine.on_vllm.gdn_fused``: each token convolved and applied as
vLLM's one-token decode does). With ``DDTREE_GDN=vllm-kernels`` in the environment they run the
readable reference instead, vLLM's own kernels as ``engine.on_vllm.gdn_tree`` lays it out: each node
convolves the window of its own ancestors (``causal_conv1d_update`` over gathered windows),
and each node's path is replayed from the request's committed state in one launch of
``fused_sigmoid_gating_delta_rule_update`` (its varlen, per-sequence state-index mode),
storing no state. After the walk ``commit`` replays the accepted path once more into the
request's state slot, so nothing of the rejected branches is left behind.

Where the states live: vLLM's own per-layer state caches (conv window and recurrent matrix
per block). vLLM splits a hybrid's layers into KV-cache groups of equal size (the tiny Qwen3.5,
3 linear : 1 full, gets four groups of one layer; Qwen3.6-27B four of 16) and layer i of every
group shares one cache tensor: groups tell their memory apart by block id only. So each Gated
DeltaNet group takes a block of its own from the pool's end (the last block for the first group,
the one before it for the next...), and the attention layers get the blocks before those: no two
groups may ever hold the same block id. In a batch (``HybridBatchKV``) each request holds a block a group
of its own from the pool below those; one verify pass forks every request's nodes from its own blocks
(``GDNLayers.begin_batch``: the fused programs read each node's block) and one commit a layer writes
every request's accepted path into them.

vLLM is touched at two more named points: ``QwenGatedDeltaNetAttention._forward_core`` is
wrapped, so that inside a tree pass (``_TreeGDN.current`` set) it runs the tree version; the
prompt's prefill runs vLLM's own path (chunked delta rule) with metadata from vLLM's builder.
And ``ChunkGatedDeltaRule.forward`` runs float32 prefills through vLLM's recurrent kernel
(``gdn_tree.recurrent_prefill``), since 0.23's chunked one refuses float32; other dtypes pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from vllm.model_executor.layers.fla.ops import fused_recurrent_gated_delta_rule, fused_sigmoid_gating_delta_rule_update
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from engine.errors import EngineError
from engine.gpu.copies import to_device
from engine.models.paged import PagedBatchKV
from engine.on_vllm import gdn_fused, gdn_tree

KERNELS = gdn_tree.GDNKernels(causal_conv1d_update, fused_sigmoid_gating_delta_rule_update,
                              fused_recurrent_gated_delta_rule)


FUSED = os.environ.get("DDTREE_GDN", "fused") != "vllm-kernels"


@dataclass
class GDNPass:
    """One verify pass's plan and what each linear layer kept of it (by layer name): the fused
    programs' paths, or the readable step's plans (one per state slot)."""

    slots: dict[str, int]  # by layer name: its group's state block
    paths: gdn_fused.TreePaths | None
    plans: dict[str, gdn_tree.GDNTreePlan] | None
    node_slots: dict[str, torch.Tensor] | None = None  # by layer name, the fused programs': each node's block, [q]
    into: dict[str, gdn_fused.KeptNodes] | None = None  # by layer name, where the fused programs keep the nodes' rows
    kept: dict[str, gdn_tree.KeptInputs | gdn_fused.KeptNodes] = field(default_factory=dict)

    @property
    def tree_plan(self) -> gdn_tree.GDNTreePlan:
        """One of the plans: they differ by state slot only, not by tree."""
        return next(iter(self.plans.values()))

    @property
    def width(self) -> int:
        """The longest path the pass verifies."""
        return self.paths.table.shape[1] if self.paths is not None else self.tree_plan.commit_rows.shape[1]


class _TreeGDN:
    """The pass the next Gated DeltaNet calls verify; ``None`` outside a tree pass (prefill)."""

    current: GDNPass | None = None


def _forward_core_with_tree(self, mixed_qkv, b, a, core_attn_out):
    tree = _TreeGDN.current
    if tree is None:
        return _forward_core(self, mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=core_attn_out)
    conv_state, ssm_state = states(self)
    if tree.paths is not None:
        q = tree.paths.depth.shape[0]
        tree.kept[self.prefix] = gdn_fused.verify(params(self), mixed_qkv[:q], a[:q], b[:q], conv_state, ssm_state,
                                                  tree.node_slots[self.prefix], tree.paths, core_attn_out[:q],
                                                  tree.into[self.prefix] if tree.into is not None else None)
        return
    plan = tree.plans[self.prefix]
    q = plan.before.shape[0]
    out, tree.kept[self.prefix] = gdn_tree.verify_layer(params(self), mixed_qkv[:q], a[:q], b[:q], conv_state,
                                                        ssm_state, plan, KERNELS)
    core_attn_out[:q] = out.to(core_attn_out.dtype)


_forward_core = qwen_gdn_linear_attn.QwenGatedDeltaNetAttention._forward_core
qwen_gdn_linear_attn.QwenGatedDeltaNetAttention._forward_core = _forward_core_with_tree


def _chunked_or_recurrent(self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens=None,
                          use_qk_l2norm_in_kernel=True, core_attn_out=None, **chunk_metadata):
    if q.dtype != torch.float32:
        return _chunked(self, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, core_attn_out=core_attn_out, **chunk_metadata)
    out, final_state = gdn_tree.recurrent_prefill(q, k, v, g, beta, initial_state, cu_seqlens,
                                                  use_qk_l2norm_in_kernel, KERNELS.recurrent)
    if core_attn_out is not None:
        core_attn_out.reshape(-1)[: out.numel()].copy_(out.reshape(-1))
    return out, final_state


# the float32 prefill: vLLM 0.23's chunked delta rule refuses float32, its recurrent kernel takes it
# (in vLLM's own AR too: ``HybridPrefill`` puts this module into its workers)
_chunked = qwen_gdn_linear_attn.ChunkGatedDeltaRule.forward
qwen_gdn_linear_attn.ChunkGatedDeltaRule.forward = _chunked_or_recurrent


class HybridPrefill:
    """A worker extension with nothing in it: naming it (``worker_extension_cls``) imports this module
    into vLLM's workers before the model is built and profiled, so a float32 prefill runs there too
    (the Studio's own: ``engine.on_vllm.hybrid_worker``)."""


def states(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's conv windows ``[blocks, dim, W]`` (a view, whatever vLLM's layout) and recurrent states."""
    conv, ssm = layer.kv_cache[0], layer.kv_cache[1]
    return (conv if is_conv_state_dim_first() else conv.transpose(-1, -2)), ssm


def params(layer) -> gdn_tree.GDNParams:
    weight = layer.conv1d.weight
    return gdn_tree.GDNParams(
        conv_weight=weight.view(weight.size(0), weight.size(2)), conv_bias=layer.conv1d.bias,
        activation=layer.activation, A_log=layer.A_log, dt_bias=layer.dt_bias, key_dim=layer.key_dim // layer.tp_size,
        value_dim=layer.value_dim // layer.tp_size, head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim)


class GDNLayers:
    """A hybrid target's linear layers, the request's state block in each of their KV-cache groups,
    and their tree passes."""

    def __init__(self, groups, forward_layers: dict, device: torch.device):
        self.names = [name for group in groups for name in group.layer_names]
        unsupported = {type(forward_layers[name]).__name__ for name in self.names} - {"QwenGatedDeltaNetAttention"}
        if unsupported:
            raise EngineError(f"the vLLM engine forks Gated DeltaNet states of Qwen3-Next / Qwen3.5 layers; this "
                              f"target has {', '.join(sorted(unsupported))}: use --engine torch")
        self.layers = [forward_layers[name] for name in self.names]
        self.params = [params(layer) for layer in self.layers]
        self.groups = groups
        conv_state = states(self.layers[0])[0]
        last = conv_state.shape[0] - 1  # the pool's last block (block 0 is vLLM's null block)
        # one block per group: groups share their cache tensors, so one block for all would
        # make every linear layer read and overwrite the others' states
        self.group_slots = [last - index for index in range(len(groups))]
        if self.group_slots[-1] <= 0:
            raise EngineError(f"vLLM's cache has {last + 1} blocks, too few for {len(groups)} Gated DeltaNet groups")
        self.slots = {name: slot for group, slot in zip(groups, self.group_slots) for name in group.layer_names}
        self.group_of = {name: index for index, group in enumerate(groups) for name in group.layer_names}
        self.slot = self.group_slots[-1]  # the lowest block the states take: attention rows stay below it
        self.device, self.width = device, conv_state.shape[-1]
        self.fused = FUSED and gdn_fused.fused_fits(device, self.width + 1)
        self.block_tables = [torch.full((1, 1), slot, dtype=torch.int32, device=device) for slot in self.group_slots]
        self.commit_slots = {slot: table[0] for slot, table in zip(self.group_slots, self.block_tables)}  # [1] each
        self.single = torch.tensor(self.group_slots, dtype=torch.int32, device=device)  # [groups]: its blocks
        self.pending: GDNPass | None = None  # the last verify pass, until its commit
        # what a batch's passes keep of their nodes, one buffer for every size: only the last pass is ever committed,
        # so the recorded passes of every size share it (``reserve_batch``)
        self.batch_kept: dict[str, gdn_fused.KeptNodes] | None = None

    def prefill_metadata(self, size: int, slots: torch.Tensor, blocks: list[int] | None = None, past: int = 0) -> dict:
        """vLLM's own prefill metadata for the linear layers: ``size`` prompt tokens after ``past`` ones (from an
        empty state where ``past`` is 0, else from the state they left), each group's (its own builder) in its own
        block: the single request's (``group_slots``), or a batch's request's ``blocks``."""
        query_start = torch.tensor([0, size], dtype=torch.int32)
        seq_lens = torch.tensor([past + size], dtype=torch.int32)
        tables = self.block_tables if blocks is None else [
            torch.full((1, 1), block, dtype=torch.int32, device=self.device) for block in blocks]
        layers = {}
        for group, table in zip(self.groups, tables):
            common = CommonAttentionMetadata(
                query_start_loc=query_start.to(self.device), query_start_loc_cpu=query_start,
                seq_lens=seq_lens.to(self.device), num_reqs=1, num_actual_tokens=size, max_query_len=size,
                max_seq_len=past + size, block_table_tensor=table, slot_mapping=slots,
                is_prefilling=torch.ones(1, dtype=torch.bool), seq_lens_cpu_upper_bound=seq_lens,
            )
            metadata = group.metadata_builders[0].build(0, common)
            layers |= {name: metadata for name in group.layer_names}
        return layers

    def begin(self, visible: torch.Tensor, path_length: int) -> GDNPass:
        """A verify pass of the tree ``visible [q, q]`` (on the device); paths at most ``path_length`` long."""
        if self.fused:
            nodes = {slot: torch.full(visible.shape[:1], slot, dtype=torch.int32, device=self.device)
                     for slot in self.group_slots}
            self.pending = GDNPass(self.slots, gdn_fused.TreePaths.build(visible, path_length), None,
                                   {name: nodes[slot] for name, slot in self.slots.items()})
        else:
            plan = gdn_tree.GDNTreePlan.build(visible, self.group_slots[0], self.width, path_length)
            by_slot = {slot: plan if slot == plan.slot else plan.for_slot(slot) for slot in self.group_slots}
            self.pending = GDNPass(self.slots, None, {name: by_slot[slot] for name, slot in self.slots.items()})
        _TreeGDN.current = self.pending
        return self.pending

    def reserve_batch(self, tokens: int, dtype: torch.dtype) -> None:
        """Room for a batch's passes of up to ``tokens`` tokens to keep their nodes' rows in (outside any recording)."""
        if self.batch_kept is not None and self.batch_kept[self.names[0]].inputs.shape[0] >= tokens:
            return
        self.batch_kept = {name: gdn_fused.KeptNodes.allocate(tokens, 2 * p.key_dim + p.value_dim,
                                                              p.value_dim // p.head_v_dim, dtype, self.device)
                           for name, p in zip(self.names, self.params)}

    def begin_batch(self, local: torch.Tensor, depth: torch.Tensor, blocks: torch.Tensor) -> GDNPass:
        """A batch's verify pass (the fused programs'): each token's path in its own request's tree (``local [T, L]``
        and ``depth [T]``, ``ddtree.verify_paths``') and its request's state block in each group (``blocks [T, G]``);
        its nodes' rows kept where ``reserve_batch`` made room, if it did."""
        self.pending = GDNPass(self.slots, gdn_fused.TreePaths.packed(local, depth), None,
                               {name: blocks[:, group].contiguous() for name, group in self.group_of.items()},
                               self.batch_kept)
        _TreeGDN.current = self.pending
        return self.pending

    @staticmethod
    def end() -> None:
        _TreeGDN.current = None

    def to_commit(self) -> GDNPass:
        if self.pending is None:
            raise EngineError("no tree pass to commit: a hybrid target commits once per verify")
        return self.pending

    def commit(self, accepted: list[int]) -> None:
        """The accepted path (node indices, root first) becomes the request's state in every linear layer."""
        width = self.to_commit().width  # padded: one shape per tree size
        path = torch.tensor(accepted + accepted[-1:] * (width - len(accepted)), device=self.device)
        self.commit_path(path, torch.tensor(len(accepted), device=self.device))

    def commit_path(self, path: torch.Tensor, length: torch.Tensor) -> None:
        """``commit`` from device tensors, no host read (the fixed step's CUDA graph holds it): ``path``
        node indices, root first, padded with the leaf past ``length``."""
        tree = self.to_commit()
        if tree.paths is not None:
            self._commit_fused(tree, {name: self.commit_slots[slot] for name, slot in tree.slots.items()},
                               path.to(torch.int32)[None], length.to(torch.int32).reshape(1))
        else:
            accepted_path = gdn_tree.AcceptedPath.build(tree.tree_plan, path, length)
            for layer, layer_params in zip(self.layers, self.params):
                conv_state, ssm_state = states(layer)
                gdn_tree.commit_layer(layer_params, tree.kept[layer.prefix], tree.plans[layer.prefix], accepted_path,
                                      conv_state, ssm_state, KERNELS)
        self.pending = None

    def commit_batch(self, blocks: torch.Tensor, paths: torch.Tensor, lengths: torch.Tensor) -> None:
        """A batch's pass committed: request r's accepted ``paths[r]`` (the pass's node indices, root first, padded
        past ``lengths[r]``) becomes its state in its blocks, ``blocks [R, G]`` (one launch a layer for them all)."""
        self._commit_fused(self.to_commit(), {name: blocks[:, group].contiguous() for name, group in
                                              self.group_of.items()}, paths.to(torch.int32), lengths.to(torch.int32))
        self.pending = None

    def _commit_fused(self, tree: GDNPass, slots: dict[str, torch.Tensor], paths: torch.Tensor,
                      lengths: torch.Tensor) -> None:
        for layer, layer_params in zip(self.layers, self.params):
            conv_state, ssm_state = states(layer)
            gdn_fused.commit(layer_params, tree.kept[layer.prefix], conv_state, ssm_state, slots[layer.prefix], paths,
                             lengths)


class HybridBatchKV(PagedBatchKV):
    """A batch's cache on a hybrid target: the attention layers' rows paged as any target's (``PagedBatchKV``), in
    the blocks below the single request's state blocks (``GDNLayers.slot``), and each request's Gated DeltaNet states
    in blocks of its own from the same pool, one a group (``states [rows, groups]``): a batch's verify forks every
    node's state from its request's (``GDNLayers.begin_batch``), and ``compact`` commits each request's accepted path
    into them after moving its attention rows. No request holds vLLM's null block: its convolution kernels skip a
    sequence whose state block it is (its output left unwritten)."""

    def __init__(self, caches: list[torch.Tensor], block_size: int, gdn: GDNLayers):
        super().__init__(caches, block_size, grow=False, blocks=gdn.slot, reserved=NULL_BLOCK_ID + 1)
        self.gdn = gdn
        self.state_blocks: list[list[int]] = []  # by row: its request's block in each group ([] while none)
        self.states = torch.zeros(0, len(gdn.groups), dtype=torch.int32, device=self.device)
        self.begins: list[int] = []  # the requests' first tokens in the last pass held (``hold_layout``)

    def hold(self, rows, columns: int) -> None:
        rows = list(rows)
        while len(self.state_blocks) < max(rows, default=-1) + 1:
            self.state_blocks.append([])
        fresh = [row for row in rows if not self.state_blocks[row]]
        groups = len(self.gdn.groups)
        if groups * len(fresh) > len(self.tables.free):
            raise EngineError(f"the KV cache's {self.blocks - 1} blocks are held by the requests in flight; a hybrid "
                              f"request's states take {groups} more: fewer requests at once, or a larger cache")
        for row in fresh:  # a new request's prompt starts from an empty state (vLLM's prefill: no initial state)
            self.state_blocks[row] = [self.tables.free.pop() for _ in range(groups)]
        super().hold(rows, columns)
        if fresh:
            self.publish()

    def release(self, row: int, last: int, columns: int) -> None:
        super().release(row, last, columns)
        self.tables.free.extend(reversed(self.state_blocks[row]))
        self.state_blocks[row], self.state_blocks[last] = self.state_blocks[last], []
        self.publish()

    def publish(self) -> None:
        """The rows' state blocks to the device (a row without a request names the single request's blocks, which
        no pass of the batch writes)."""
        self.states = to_device([blocks or self.gdn.group_slots for blocks in self.state_blocks], self.device,
                                torch.int32).reshape(-1, len(self.gdn.groups))

    def hold_layout(self, layout) -> None:
        super().hold_layout(layout)
        self.begins = layout.query_start_loc[:-1].tolist()

    def compact(self, rows: list[int], pasts: list[int], paths: list[list[int]]) -> None:
        """``PagedBatchKV.compact``, then each request's accepted path (its own tree's node indices) committed into
        its states: the paths in the pass's numbering (``begins``), padded with their leaves to the pass's width."""
        super().compact(rows, pasts, paths)
        width = self.gdn.to_commit().width
        packed = [[begin + node for node in path + path[-1:] * (width - len(path))]
                  for begin, path in zip(self.begins, paths)]
        self.gdn.commit_batch(self.states[torch.tensor(rows, device=self.device)],
                              torch.tensor(packed, device=self.device),
                              torch.tensor([len(path) for path in paths], device=self.device))
