"""Many requests in one pass: the batch's caches, and the attention that reads each request's own row.

- ``BatchKV``: a Hugging Face target's keys and values for every request of a batch, one row of per-layer
  buffers ``[rows, kv_heads, capacity, head_dim]`` per request. The batch is always the rows' prefix
  (a request that leaves hands its row to the last one), so a pass reads a view, never a gathered copy.
  A verify pass writes each token's keys and values at its request's row and its column
  (``ddtree.batch.BatchLayout``); the accepted path is then compacted down to the committed rows.
- ``packed_pass``: the target's pass over a ``BatchLayout``: its linear layers see the batch's T tokens
  packed, one sequence; only attention is per request (``packed_attention``): the queries padded to
  the widest tree, each row attending to its own request's cache row through the model's own attention
  function with the layout's mask, then unpadded.
- ``BatchDraftContext``: the drafter's committed context for every request, likewise one row each, so one
  drafter pass drafts every request's block.

A packed pass of a few tokens runs as ``engine.models.rows.run_rows`` tokens, filler tokens added (``filled``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import ddtree
import ddtree.fixed
from ddtree.batch import BatchLayout, layout_bias
from engine.models.drafter import DrafterConfig, narrowed
from engine.models.rows import run_rows

GROWTH = 512  # cache columns come in multiples of this many
# ... and rows (requests) in multiples of this many: every time the buffers move, a recorded pass that reads them
# (``engine.loop.draft_pass.GraphedBatchDraft``) is recorded again
ROW_GROWTH = 8


def filled(layout: BatchLayout, tokens: int) -> BatchLayout:
    """``layout`` run as ``tokens`` tokens: filler tokens after the batch's own, each a copy of the last token
    whose keys and values land past every column the pass reads and whose output rows repeat the last one's
    (the caller keeps the first ``layout.tokens`` rows). Worked example, 3 tokens filled to 4, width 8::

        input_ids  = [r0, a, r1] + [r1]     kv_columns = [5, 6, 2] + [8]     unpadded = [0, 1, 3] + [3]
    """
    extra = tokens - layout.tokens
    if extra <= 0:
        return layout

    def repeat_last(values: torch.Tensor) -> torch.Tensor:
        return torch.cat([values, values[-1:].expand(extra)])

    past_read = torch.arange(layout.width, layout.width + extra, device=layout.kv_columns.device)
    return dataclasses.replace(layout, input_ids=repeat_last(layout.input_ids),
                               position_ids=repeat_last(layout.position_ids), kv_rows=repeat_last(layout.kv_rows),
                               kv_columns=torch.cat([layout.kv_columns, past_read]),
                               unpadded=repeat_last(layout.unpadded))
PACKED = "ddtree_packed"  # the attention implementation a packed pass runs under


def grown(size: int, needed: int, step: int) -> int:
    """``size`` if it holds ``needed``, else the next multiple of ``step`` that does."""
    return size if needed <= size else -(-needed // step) * step


class _Rows:
    """Per-layer key and value buffers ``[rows, heads, capacity, head_dim]`` that grow, and the row moves
    both caches make."""

    def __init__(self, layers: int, heads: int, head_dim: int, rows: int, capacity: int, dtype, device):
        self.shape = (heads, head_dim)
        self.dtype, self.device = dtype, device
        self.keys = [torch.zeros(rows, heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.generation = 0  # how often the buffers moved: a recorded pass reads them where they were

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, rows: int, columns: int) -> None:
        """Room for ``rows`` requests of ``columns`` cache columns each (what is kept stays where it is)."""
        new_rows, new_columns = grown(self.rows, rows, ROW_GROWTH), grown(self.capacity, columns, GROWTH)
        if (new_rows, new_columns) == (self.rows, self.capacity):
            return
        for buffers in (self.keys, self.values):
            for layer, old in enumerate(buffers):
                new = old.new_zeros(new_rows, *self.shape[:1], new_columns, self.shape[1])
                new[: old.shape[0], :, : old.shape[2]] = old
                buffers[layer] = new
        self.generation += 1

    def move_row(self, source: int, target: int, columns: int) -> None:
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer[target, :, :columns] = buffer[source, :, :columns]

    def compact(self, rows: list[int], pasts: list[int], paths: list[list[int]]) -> None:
        """Each request's accepted tree rows (``paths``: node indices, root first) moved down to follow its past
        (request ``rows[i]``, ``pasts[i]`` columns before its root): one gather and one scatter a buffer."""
        row, source, target = ddtree.compaction_moves_of(rows, pasts, paths)
        if not row.numel():
            return
        row, source, target = row.to(self.device), source.to(self.device), target.to(self.device)
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer[row, :, target] = buffer[row, :, source]  # the read is a copy: a source may be a target


class BatchKV(_Rows):
    """A Hugging Face target's KV cache for a batch: one row per request (module docstring)."""

    def __init__(self, config, rows: int, capacity: int, dtype: torch.dtype, device: torch.device):
        text = config.get_text_config()
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        super().__init__(text.num_hidden_layers, heads, head_dim, rows, capacity, dtype, device)

    def release(self, row: int, last: int, columns: int) -> None:
        """Row ``row``'s request leaves and the request in row ``last`` (the last in use) moves into it with its
        ``columns`` cache columns, so the batch stays the rows' prefix."""
        if last != row:
            self.move_row(last, row, columns)

    def packed(self, layout: BatchLayout) -> _PackedWrite:
        """The cache a packed pass over ``layout`` writes into and reads (its requests' rows)."""
        self.reserve(int(layout.rows.max()) + 1, max(layout.width, int(layout.kv_columns.max()) + 1))
        return _PackedWrite(self, layout.kv_rows, layout.kv_columns, rows_read(layout.rows), layout.width)

    def padded(self, layout: BatchLayout) -> _PaddedWrite:
        """The cache a padded pass (``[B, T_max]`` tokens, padding rows and all) writes into and reads."""
        past = layout.kv_columns[layout.query_start_loc[:-1]]  # [B]: each request's root column
        columns = past[:, None] + torch.arange(layout.padded.shape[1], device=past.device)  # [B, T_max]
        width = int(columns.max()) + 1
        self.reserve(int(layout.rows.max()) + 1, width)
        return _PaddedWrite(self, layout.rows, columns, rows_read(layout.rows), width)

    def pass_buffers(self) -> list[torch.Tensor]:
        """What a recorded pass of slots reads by address: the cache's buffers (replaced as they grow)."""
        return [self.keys[0]]

    def hold_slots(self, rows: list[int], ends: list[int], padding: range) -> None:
        """Room for a pass of slots (``slots``) whose row ``rows[s]`` it writes up to column ``ends[s]``, for its
        padding slots' ``padding`` rows, and for the compaction's scratch column past them all."""
        self.reserve(max([*rows, *padding]) + 1, max(ends) + 1)

    def slots(self, rows: torch.Tensor, read: slice | torch.Tensor, past: torch.Tensor, width: int) -> _PaddedWrite:
        """The cache a fixed-shape pass over slots writes into and reads (``slots_pass``): slot s's ``width`` tokens at
        row ``rows[s]``'s columns ``past[s]`` on, the rows read as ``read`` says (a view, or gathered), every column
        of the buffers, so the pass's shapes depend on the buffers alone."""
        columns = past[:, None] + torch.arange(width, device=past.device)  # [b, width]
        return _PaddedWrite(self, rows, columns, read, self.capacity)

    def compact_slots(self, rows: torch.Tensor, past: torch.Tensor, path: torch.Tensor, length: torch.Tensor) -> None:
        """``compact`` for slots as device tensors (``rows``, ``past [b]``, ``path [b, D+1]``, ``length [b]``): the
        accepted rows move down behind each past, the rows past a path's length to the buffers' last column, which
        no pass of slots reads (``ddtree.fixed.compaction_rows``)."""
        sources, targets = ddtree.fixed.compaction_rows(past, path, length, self.capacity - 1)  # [b, D+1] each
        row = rows[:, None].expand_as(sources)
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer[row, :, targets] = buffer[row, :, sources]  # the read is a copy: a source may be a target

    def prompt(self, row: int, start: int, length: int) -> _PackedWrite:
        """The cache a prompt's chunk writes into: ``length`` tokens of request ``row`` from column ``start``."""
        self.reserve(row + 1, start + length)
        columns = torch.arange(start, start + length, device=self.device)
        return _PackedWrite(self, torch.full_like(columns, row), columns, slice(row, row + 1), start + length)


def rows_read(rows: torch.Tensor) -> slice | torch.Tensor:
    """How a pass reads its requests' rows: a view where they are consecutive (the usual case), else gathered."""
    first = int(rows[0])
    if torch.equal(rows, torch.arange(first, first + rows.numel(), device=rows.device)):
        return slice(first, first + rows.numel())
    return rows


@dataclass
class _PackedWrite:
    """``update`` as transformers' attention layers call it: the pass's keys and values ``[1, heads, T, dim]``
    written token by token at (``kv_rows``, ``kv_columns``); returns the rows ``read``, ``[B, heads, width, dim]``:
    the batch's requests for a packed pass, one request for a prompt chunk."""

    kv: BatchKV
    kv_rows: torch.Tensor  # [T]
    kv_columns: torch.Tensor  # [T]
    read: slice | torch.Tensor
    width: int

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.kv.keys[layer_idx], self.kv.values[layer_idx]
        keys[self.kv_rows, :, self.kv_columns] = key_states[0].transpose(0, 1)  # [T, heads, dim]
        values[self.kv_rows, :, self.kv_columns] = value_states[0].transpose(0, 1)
        return keys[self.read][:, :, : self.width], values[self.read][:, :, : self.width]


@dataclass
class _PaddedWrite:
    """``update`` for a padded pass: keys ``[B, heads, T_max, dim]``, request b's token i at row ``rows[b]``,
    column ``columns[b, i]``."""

    kv: BatchKV
    rows: torch.Tensor  # [B]
    columns: torch.Tensor  # [B, T_max]
    read: slice | torch.Tensor
    width: int

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.kv.keys[layer_idx], self.kv.values[layer_idx]
        rows = self.rows[:, None].expand_as(self.columns)
        keys[rows, :, self.columns] = key_states.transpose(1, 2)  # [B, T_max, heads, dim]
        values[rows, :, self.columns] = value_states.transpose(1, 2)
        return keys[self.read][:, :, : self.width], values[self.read][:, :, : self.width]


# ---------------------------------------------------------------- the packed pass's attention

@dataclass(frozen=True)
class PackedAttention:
    """What each attention layer of a packed pass needs, made once per pass."""

    padded: torch.Tensor  # [B, T_max] index into T
    unpadded: torch.Tensor  # [T] index into B * T_max
    bias: torch.Tensor  # [B, 1, T_max, W]
    attention: object  # the model's own attention function (sdpa, eager, ...)


def packed_attention(module, query, key, value, attention_mask, *, packed: PackedAttention | None = None, **kwargs):
    """Attention for a packed pass: ``query [1, heads, T, dim]`` padded to ``[B, heads, T_max, dim]``, each
    request's rows against its own cache row (``key``/``value [B, kv_heads, W, dim]``, from ``_PackedWrite``)
    with the layout's mask, through the model's own attention function; returns ``[1, T, heads, dim]``."""
    heads, dim = query.shape[1], query.shape[3]
    padded_query = query[0].transpose(0, 1)[packed.padded].transpose(1, 2)  # [B, heads, T_max, dim]
    out, _ = packed.attention(module, padded_query, key, value, packed.bias, is_causal=False, **kwargs)
    return out.reshape(-1, heads, dim)[packed.unpadded][None], None  # out: [B, T_max, heads, dim]


AttentionInterface.register(PACKED, packed_attention)


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """The model's attention layers dispatch to ``name`` inside; yields the function they dispatched to before."""
    config = model.config
    original = config._attn_implementation
    config._attn_implementation = name
    try:
        yield ALL_ATTENTION_FUNCTIONS[original]
    finally:
        config._attn_implementation = original


def packed_pass(model, cache_argument: str, kv: BatchKV, layout: BatchLayout, dtype: torch.dtype,
                hidden_states: bool):
    """One pass of ``model`` over ``layout`` (on the model's device), run as ``run_rows`` tokens: logits
    ``[T, vocab]`` and, if asked, the hidden states (HF's tuple, each ``[1, T, hidden]``)."""
    tokens = layout.tokens
    run = filled(layout, run_rows(tokens, layout.input_ids.device))
    with attention_implementation(model, PACKED) as own:
        packed = PackedAttention(run.padded, run.unpadded, layout_bias(run.visible, dtype), own)
        out = model(input_ids=run.input_ids[None], position_ids=run.position_ids[None], use_cache=True,
                    output_hidden_states=hidden_states, packed=packed, **{cache_argument: kv.packed(run)})
    hidden = tuple(states[:, :tokens] for states in out.hidden_states) if hidden_states else None
    return out.logits[0, :tokens], hidden


def padded_pass(model, cache_argument: str, kv: BatchKV, layout: BatchLayout, dtype: torch.dtype,
                hidden_states: bool):
    """The same pass as plain ``[B, T_max]`` batch rows, padding and all, through the model's own attention
    with a 4D mask: the readable reference ``packed_pass`` is tested against. Returns what it returns."""
    cache = kv.padded(layout)
    visible = torch.zeros(*layout.visible.shape[:2], cache.width, dtype=torch.bool, device=layout.visible.device)
    visible[..., : layout.width] = layout.visible
    out = model(input_ids=layout.input_ids[layout.padded], position_ids=layout.position_ids[layout.padded],
                attention_mask=layout_bias(visible, dtype), use_cache=True, output_hidden_states=hidden_states,
                **{cache_argument: cache})
    unpad = lambda rows: rows.reshape(-1, *rows.shape[2:])[layout.unpadded]  # noqa: E731
    hidden = tuple(unpad(h)[None] for h in out.hidden_states) if hidden_states else None
    return unpad(out.logits), hidden


def slots_pass(model, cache_argument: str, kv: BatchKV, rows: torch.Tensor, read: slice | torch.Tensor,
               ids: torch.Tensor, positions: torch.Tensor, past: torch.Tensor, visible: torch.Tensor,
               dtype: torch.dtype, hidden_states: bool):
    """One pass over slots of ``kv`` at shapes fixed by the slots, the tree's width and the cache's capacity, with no
    host read (``engine.loop.fixed_batch``): slot s's ``ids [b, n]`` at ``positions [b, n]`` in row ``rows[s]`` (the
    rows read as ``read`` says) after its ``past[s]`` columns, its queries seeing that past and, among its own
    tokens, ``visible [b, n, n]`` (the tree's ancestor mask); its keys and values written at columns
    ``past[s]..past[s]+n-1``. Returns logits ``[b, n, vocab]`` and, if asked, the hidden states (each
    ``[b, n, hidden]``)."""
    count, width = ids.shape
    cache = kv.slots(rows, read, past, width)
    columns = torch.arange(kv.capacity, device=ids.device)
    seen = (columns[None, None, :] < past[:, None, None]).repeat(1, width, 1)  # [b, n, capacity]: the past
    own = past[:, None, None] + torch.arange(width, device=ids.device)  # [b, 1, n]: its tree's columns
    seen.scatter_(2, own.expand(count, width, width), visible)  # ... then its own tree
    out = model(input_ids=ids, position_ids=positions, attention_mask=layout_bias(seen, dtype), use_cache=True,
                output_hidden_states=hidden_states, **{cache_argument: cache})
    return out.logits, (out.hidden_states if hidden_states else None)


# ---------------------------------------------------------------- the drafter's context

class BatchDraftContext(_Rows):
    """The drafter's committed context for every request of the batch, one row each, and how many rows of
    it each request has (``lengths``); the drafter's pass reads it through ``rows``' view, as it reads a
    ``StaticDraftContext``."""

    def __init__(self, config: DrafterConfig, rows: int, capacity: int, device, dtype: torch.dtype):
        super().__init__(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, rows, capacity,
                         dtype, device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)

    def reserve(self, rows: int, columns: int) -> None:
        super().reserve(rows, columns)
        if self.rows > self.lengths.numel():
            self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(self.rows - self.lengths.numel())])

    def move_row(self, source: int, target: int, columns: int) -> None:
        """``columns``: at least the source row's length, as the host bounds it (its length is not read back)."""
        super().move_row(source, target, columns)
        self.lengths[target] = self.lengths[source]

    def rows_view(self, rows: list[int], new: int) -> _DraftRows:
        """The context of requests ``rows`` for a pass that brings ``new`` context rows each (real or padding)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.reserve(max(rows) + 1, 0)
        width = int(self.lengths[index].max()) + new
        self.reserve(0, width)
        return _DraftRows(self, index, rows_read(index), width)

    def fixed_view(self, rows: torch.Tensor, read: slice | torch.Tensor | None = None) -> _DraftRows:
        """The context of requests ``rows`` ([count] long, on the device) read whole: every column of the buffers,
        the rows gathered (so a recorded pass reads whichever rows its ``rows`` name at its next replay) or read
        as ``read`` says. The caller reserves room for the pass's new rows first."""
        return _DraftRows(self, rows, rows if read is None else read, self.capacity)


@dataclass
class _DraftRows:
    """A ``BatchDraftContext``'s rows as the drafter's pass uses a context cache (``extend``, ``visible``,
    ``advance``: ``engine.models.drafter.DFlashDrafter.forward``). The pass brings the same number of new
    context rows for every request; ``added [count]`` says how many of each request's are real, the rest
    are padding, written past its length and masked, and overwritten by its next pass."""

    context: BatchDraftContext
    rows: torch.Tensor  # [count] long: the requests' rows
    read: slice | torch.Tensor  # how the rows are read: a view where they are consecutive, else gathered
    width: int  # context columns the pass reads: the longest row's length plus the new rows

    @property
    def count(self) -> int:
        return self.rows.numel()

    @property
    def lengths(self) -> torch.Tensor:
        return self.context.lengths[self.rows]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        columns = self.lengths[:, None] + torch.arange(k.shape[2], device=k.device)  # [count, new]
        rows = self.rows[:, None].expand_as(columns)
        keys, values = self.context.keys[layer], self.context.values[layer]
        keys[rows, :, columns] = k.transpose(1, 2)  # k: [count, heads, new, dim]
        values[rows, :, columns] = v.transpose(1, 2)
        return keys[self.read][:, :, :self.width], values[self.read][:, :, :self.width]

    def visible(self, block: int, added: torch.Tensor, causal: bool = False, window: int | None = None
                ) -> torch.Tensor:
        """``[count, 1, block, width + block]`` bool: each row's real context columns, then the block (narrowed
        for a causal or sliding layer, as ``StaticDraftContext.visible``)."""
        device = self.rows.device
        count = self.lengths + added  # [count]: real context rows after this pass
        columns = torch.arange(self.width, device=device)
        shown = torch.cat([columns[None, :] < count[:, None],
                           torch.ones(self.count, block, dtype=torch.bool, device=device)], dim=1)
        if not causal and window is None:
            return shown[:, None, None]
        slots = torch.arange(block, device=device)
        queries = count[:, None, None] + slots[None, :, None]  # [count, block, 1]
        keys = torch.cat([columns.expand(self.count, -1), count[:, None] + slots[None, :]], dim=1)[:, None, :]
        return narrowed(shown[:, None, :], queries, keys, causal, window)[:, None]

    def advance(self, added: torch.Tensor) -> None:
        self.context.lengths[self.rows] += added
