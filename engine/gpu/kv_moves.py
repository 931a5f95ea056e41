"""KV compaction for every layer in one kernel launch.

After a verify, the accepted path's KV rows are moved down to sit right after the past, in
every attention layer (``ddtree.move_rows``, the readable reference: a gather and a scatter
per layer, ~60 kernels a step on a 30-layer model). vLLM allocates each layer's cache on
its own, so no single tensor spans them; ``RowMover`` keeps a table of their addresses and
one Triton program per (layer, K or V, column chunk) copies all the moved rows, loading
every source before it stores any target (a later source may be an earlier target).
Where Triton does not run (the CPU), the reference does the work.
"""

from __future__ import annotations

import torch

import ddtree
from engine.gpu.triton_support import tl, triton, triton_runs_on

MAX_ELEMENTS = 4096  # a program holds moves x columns values: keep it in registers

if triton is not None:

    @triton.jit
    def _move_rows_kernel(
        addresses,  # [layers] int64: each layer's cache's address, every cache [blocks, 2, block_size, ...]
        like,  # the first layer's cache: its pointer type
        sources, targets,  # [MOVES] each: cache row indices, block table the identity
        block_size, block_stride, kv_stride,
        ROW: tl.constexpr,  # values in one cache row (heads x head size)
        MOVES: tl.constexpr, COLUMNS: tl.constexpr,
    ):
        layer, kv, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        base = tl.load(addresses + layer).to(like.dtype, bitcast=True) + kv * kv_stride
        moves = tl.arange(0, MOVES)
        columns = chunk * COLUMNS + tl.arange(0, COLUMNS)
        inside = columns < ROW
        source, target = tl.load(sources + moves), tl.load(targets + moves)
        source_rows = (source // block_size) * block_stride + (source % block_size) * ROW
        target_rows = (target // block_size) * block_stride + (target % block_size) * ROW
        rows = tl.load(base + source_rows[:, None] + columns[None, :], mask=inside[None, :])
        tl.debug_barrier()  # every thread has loaded before any stores: a target may be another move's source
        tl.store(base + target_rows[:, None] + columns[None, :], rows, mask=inside[None, :])


class RowMover:
    """Moves cache rows in every layer of a paged KV cache laid out ``[blocks, 2 (K, V),
    block_size, ...]`` (vLLM's), one launch for all layers where Triton runs."""

    def __init__(self, caches: list[torch.Tensor], block_size: int):
        self.caches, self.block_size = caches, block_size
        first = caches[0]
        self.fused = triton_runs_on(first.device) and all(
            cache.is_contiguous() and cache.shape == first.shape and cache.dtype == first.dtype for cache in caches)
        if self.fused:
            self.addresses = torch.tensor([cache.data_ptr() for cache in caches], dtype=torch.int64,
                                          device=first.device)
            self.row = first[0, 0, 0].numel()

    def __call__(self, sources: torch.Tensor, targets: torch.Tensor) -> None:  # [moves] each
        """Copy rows ``sources[i]`` to ``targets[i]``: cache rows where the block table is the identity, which are
        vLLM's slots (block id * block_size + offset) whatever the block table (``ddtree.compaction_slots``)."""
        if not self.fused:
            paged_sources, paged_targets = (ddtree.paged_slots(sources, self.block_size),
                                            ddtree.paged_slots(targets, self.block_size))
            for cache in self.caches:
                ddtree.move_rows(cache, paged_sources, paged_targets)
            return
        moves = triton.next_power_of_2(sources.numel())
        if moves != sources.numel():  # the kernel takes a power of two: the last move again is a no-op
            extra = moves - sources.numel()
            sources, targets = (torch.cat([sources, sources[-1:].expand(extra)]),
                                torch.cat([targets, targets[-1:].expand(extra)]))
        columns = min(triton.next_power_of_2(self.row), max(16, MAX_ELEMENTS // moves))
        first = self.caches[0]
        grid = (len(self.caches), 2, triton.cdiv(self.row, columns))
        _move_rows_kernel[grid](self.addresses, first, sources, targets, self.block_size, first.stride(0),
                                first.stride(1), ROW=self.row, MOVES=moves, COLUMNS=columns)
