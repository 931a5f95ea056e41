"""A batch's keys and values in a paged cache: vLLM's layout, each request's rows through its own blocks.

Every attention layer's cache is ``[blocks, 2 (K, V), block_size, kv_heads, head_dim]``; a cache row of a request
lives at slot ``block * block_size + offset`` of the block its table names (``ddtree.table_slots``). A request
holds the blocks its rows reach, a leaving request hands its blocks back to the pool, and the request that takes
its row keeps its own blocks: only its table row moves, never its keys. The pool's last block is scratch: no
request owns it, so a table entry past a request's blocks names it, and a pass that reads that far reads
something harmless there (its mask hides it).

``PagedBatchKV`` is ``engine.models.batched.BatchKV``'s twin for this layout (the same calls from
``engine.loop.batch.Batch``): on a Hugging Face target its passes write by slot and read each request's rows
gathered through its table, the readable reference the vLLM engine's batched step (whose pool vLLM allocated, and
whose kernels read the tables themselves) is held to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import ddtree
from ddtree.batch import BatchLayout
from engine.errors import EngineError
from engine.gpu.copies import to_device
from engine.gpu.kv_moves import RowMover


class BlockTables:
    """Which blocks of a pool of ``blocks`` each request row holds (``table [rows, max blocks]`` int32, vLLM's
    ``block_table``; entries past a row's own blocks name the scratch block), and the pool's free blocks."""

    def __init__(self, blocks: int, block_size: int, device: torch.device, width: int = 1, reserved: int = 0):
        """``width``: the table's columns to start with (it widens as a row needs more blocks); ``reserved``: the
        pool's first blocks, which no request ever holds."""
        self.block_size, self.device = block_size, device
        self.scratch = blocks - 1
        self.free = list(range(blocks - 2, reserved - 1, -1))  # popped from the end: the lowest first
        self.held: list[list[int]] = []
        self.table = torch.full((0, width), self.scratch, dtype=torch.int32, device=device)

    def rows_for(self, rows: int) -> None:
        """Room in the table for ``rows`` request rows."""
        while len(self.held) < rows:
            self.held.append([])
        if self.table.shape[0] < rows:
            extra = torch.full((rows - self.table.shape[0], self.table.shape[1]), self.scratch, dtype=torch.int32,
                               device=self.device)
            self.table = torch.cat([self.table, extra])

    def missing(self, row: int, columns: int) -> int:
        """Blocks row ``row`` lacks to hold ``columns`` cache rows."""
        return max(0, -(-columns // self.block_size) - len(self.held[row]))

    def hold(self, row: int, columns: int) -> None:
        """Blocks from the pool for row ``row`` until it holds ``columns`` cache rows; the caller made sure
        the pool has them (``missing``, ``add_blocks``)."""
        needed = self.missing(row, columns)
        if not needed:
            return
        held = self.held[row]
        held.extend(self.free.pop() for _ in range(needed))
        if len(held) > self.table.shape[1]:
            extra = torch.full((self.table.shape[0], len(held) - self.table.shape[1]), self.scratch,
                               dtype=torch.int32, device=self.device)
            self.table = torch.cat([self.table, extra], dim=1)
        self.table[row, : len(held)] = to_device(held, self.device, torch.int32)  # in stream order: no wait

    def release(self, row: int, last: int) -> None:
        """Row ``row``'s request leaves: its blocks go back to the pool, and the request in row ``last`` (the
        table's last in use) takes its row with its own blocks."""
        self.free.extend(reversed(self.held[row]))
        self.held[row] = []
        self.table[row] = self.scratch
        if last != row:
            self.held[row], self.held[last] = self.held[last], []
            self.table[row] = self.table[last]
            self.table[last] = self.scratch

    def add_blocks(self, blocks: int, total: int) -> None:
        """The pool grew from ``total`` blocks to ``total + blocks``: the old scratch block is free now, the new
        last block is scratch, and every table entry that named the old scratch names the new one."""
        old = self.scratch
        self.scratch = total + blocks - 1
        self.free[:0] = list(range(self.scratch - 1, old - 1, -1))  # handed out after the blocks freed already
        self.table[self.table == old] = self.scratch

    def slots(self, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """The slots of cache rows ``columns`` of request rows ``rows`` (the same shape)."""
        return ddtree.table_slots(self.table, rows, columns, self.block_size)

    def read_slots(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """``[R, width]``: the slots of columns ``0 .. width - 1`` of each of request rows ``rows [R]``; a column
        past a row's blocks reads the scratch block (the pass's mask hides it)."""
        columns = torch.arange(width, device=rows.device)
        blocks = columns // self.block_size
        inside = blocks < self.table.shape[1]
        ids = torch.where(inside, self.table[rows][:, blocks.clamp(max=self.table.shape[1] - 1)], self.scratch)
        return ids.long() * self.block_size + columns % self.block_size


class PagedBatchKV:
    """A batch's keys and values, paged (module docstring), in ``caches`` (one per attention layer), their rows
    moved in every layer at once (``engine.gpu.kv_moves.RowMover``). A pool that may not ``grow`` (vLLM's, which
    vLLM allocated) refuses a request it has no blocks for."""

    def __init__(self, caches: list[torch.Tensor], block_size: int, grow: bool = True, blocks: int | None = None,
                 width: int = 1, reserved: int = 0):
        """``blocks``: the pool's first blocks alone (the rest are someone else's); by default all of them. ``width``:
        the block table's columns to start with. ``reserved``: the first blocks no request holds (vLLM's null
        block)."""
        self.caches, self.can_grow = caches, grow
        self.device = caches[0].device
        self.tables = BlockTables(caches[0].shape[0] if blocks is None else blocks, block_size, self.device, width,
                                  reserved)
        self.move_rows = RowMover(caches, block_size)

    @staticmethod
    def for_model(config, blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> PagedBatchKV:
        """A pool of ``blocks`` blocks for a Hugging Face model of ``config``, grown as requests need it."""
        text = config.get_text_config()
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return PagedBatchKV([torch.zeros(blocks, 2, block_size, heads, head_dim, dtype=dtype, device=device)
                             for _ in range(text.num_hidden_layers)], block_size)

    @property
    def blocks(self) -> int:
        return self.tables.scratch + 1  # the pool's last block is its scratch

    def reserve(self, rows: int, columns: int) -> None:
        """Room for ``rows`` requests, each holding ``columns`` cache rows; the pool grows where it must."""
        self.tables.rows_for(rows)
        self.hold(range(rows), columns)

    def hold(self, rows, columns: int) -> None:
        """Blocks for each of request ``rows`` to hold ``columns`` cache rows."""
        rows = list(rows)
        needed = sum(self.tables.missing(row, columns) for row in rows)
        if needed > len(self.tables.free):
            if not self.can_grow:
                raise EngineError(f"the KV cache's {self.blocks - 1} blocks of {self.tables.block_size} tokens are "
                                  f"held by the requests in flight, {needed} more needed: fewer requests at "
                                  "once, or a larger cache (vLLM's gpu_memory_utilization)")
            self._grow(needed - len(self.tables.free))
        for row in rows:
            self.tables.hold(row, columns)

    def _grow(self, blocks: int) -> None:
        total = self.blocks
        blocks = max(blocks, total)  # doubling, so that a growing batch copies its cache a few times only
        self.caches = [torch.cat([cache, cache.new_zeros(blocks, *cache.shape[1:])]) for cache in self.caches]
        self.tables.add_blocks(blocks, total)
        self.move_rows = RowMover(self.caches, self.tables.block_size)

    def release(self, row: int, last: int, columns: int) -> None:
        """Row ``row``'s request leaves and the request in row ``last`` takes its row (``columns``: the rows it
        has, which a paged cache need not copy)."""
        self.tables.release(row, last)

    def compact(self, rows: list[int], pasts: list[int], paths: list[list[int]]) -> None:
        """Each request's accepted tree rows (``paths``: node indices, root first) moved down to follow its past
        (request ``rows[i]``, ``pasts[i]`` columns before its root), every request's moves in one call."""
        row, source, target = ddtree.compaction_moves_of(rows, pasts, paths)
        if row.numel():
            row, source, target = row.to(self.device), source.to(self.device), target.to(self.device)
            self.move_rows(self.tables.slots(row, source), self.tables.slots(row, target))

    def pass_buffers(self) -> list[torch.Tensor]:
        """What a recorded pass of slots reads by address: the block table and the caches (replaced as they grow)."""
        return [self.tables.table, self.caches[0]]

    @property
    def capacity(self) -> int:
        """The cache columns a pass of slots reads of each row: as many as the widest row's blocks hold."""
        return self.tables.table.shape[1] * self.tables.block_size

    def hold_slots(self, rows: list[int], ends: list[int], padding: range) -> None:
        """Blocks for a pass of slots (``slots``) whose row ``rows[s]`` it writes up to column ``ends[s]``; its padding
        slots' ``padding`` rows hold none, so their table rows name the scratch block, where they write."""
        self.tables.rows_for(max([*rows, *padding]) + 1)
        for row, end in zip(rows, ends):
            self.hold([row], end)

    def slots(self, rows: torch.Tensor, read: slice | torch.Tensor, past: torch.Tensor, width: int) -> PagedRows:
        """The cache a fixed-shape pass over slots writes into (slot s's ``width`` tokens at row ``rows[s]``'s columns
        ``past[s]`` on) and reads (each row's every column, ``capacity``, through its table: ``read`` is the rows
        cache's view, which a paged cache has no use for)."""
        columns = past[:, None] + torch.arange(width, device=past.device)  # [b, width]
        return PagedRows(self, rows, self.tables.slots(rows[:, None].expand_as(columns), columns),
                         self.tables.read_slots(rows, self.capacity))

    def compact_slots(self, rows: torch.Tensor, past: torch.Tensor, path: torch.Tensor, length: torch.Tensor) -> None:
        """``compact`` for slots as device tensors (``ddtree.compaction_slots``): the rows past a path's length move
        into the scratch block."""
        size = self.tables.block_size
        self.move_rows(*ddtree.compaction_slots(self.tables.table[rows], past, path, length, size,
                                                self.tables.scratch * size))

    def hold_layout(self, layout: BatchLayout) -> None:
        """Blocks for every cache row a pass over ``layout`` writes (filler tokens' too)."""
        ends = torch.zeros(self.tables.table.shape[0], dtype=torch.long, device=layout.kv_rows.device)
        ends.scatter_reduce_(0, layout.kv_rows, layout.kv_columns + 1, reduce="amax")  # [rows]
        held = ends.tolist()  # one read, not one a request
        for row in sorted(set(layout.rows.tolist())):  # once a row: a prompt's chunk is many requests of one row
            self.hold([row], held[row])

    def packed(self, layout: BatchLayout) -> PagedRows:
        """The cache a packed pass over ``layout`` writes into (slot by token) and reads (its requests' rows)."""
        self.hold_layout(layout)
        return PagedRows(self, layout.rows, self.tables.slots(layout.kv_rows, layout.kv_columns),
                         self.tables.read_slots(layout.rows, layout.width))

    def padded(self, layout: BatchLayout) -> PagedRows:
        """The cache a padded pass (``[B, T_max]`` tokens, padding rows and all) writes into and reads."""
        past = layout.kv_columns[layout.query_start_loc[:-1]]  # [B]: each request's root column
        columns = past[:, None] + torch.arange(layout.padded.shape[1], device=past.device)  # [B, T_max]
        for row, end in zip(layout.rows.tolist(), (columns[:, -1] + 1).tolist()):
            self.hold([row], end)
        return PagedRows(self, layout.rows, self.tables.slots(layout.rows[:, None].expand_as(columns), columns),
                         self.tables.read_slots(layout.rows, int(columns.max()) + 1))

    def prompt(self, row: int, start: int, length: int) -> PagedRows:
        """The cache a prompt's chunk writes into: ``length`` tokens of request ``row`` from column ``start``."""
        self.hold([row], start + length)
        columns = torch.arange(start, start + length, device=self.device)
        rows = torch.tensor([row], device=self.device)
        return PagedRows(self, rows, self.tables.slots(rows.expand_as(columns), columns),
                         self.tables.read_slots(rows, start + length))


@dataclass
class PagedRows:
    """What a pass writes and reads (vLLM's passes take ``rows``' block table and ``slots``), and ``update`` as
    transformers' attention layers call it: the pass's keys and values (``[1, heads, T, dim]``
    packed, ``[B, heads, T_max, dim]`` padded) written at ``slots`` (``[T]`` or ``[B, T_max]``); returns each
    request's rows read through its table, ``[B, heads, width, dim]``."""

    kv: PagedBatchKV
    rows: torch.Tensor  # [B]: the requests' rows of the block table
    slots: torch.Tensor  # [T] or [B, T_max]
    read: torch.Tensor  # [B, width]

    @property
    def width(self) -> int:
        return self.read.shape[1]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        cache = self.kv.caches[layer_idx]
        size = self.kv.tables.block_size
        written = (key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)) if self.slots.dim() == 1 else (
            key_states.transpose(1, 2), value_states.transpose(1, 2))  # [..., heads, dim] per slot
        blocks, offsets = ddtree.paged_slots(self.slots, size)
        cache[blocks, 0, offsets] = written[0]
        cache[blocks, 1, offsets] = written[1]
        blocks, offsets = ddtree.paged_slots(self.read, size)
        return cache[blocks, 0, offsets].transpose(1, 2), cache[blocks, 1, offsets].transpose(1, 2)
