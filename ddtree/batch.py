"""Many requests' trees as one verification pass: the batch's layout.

Each request brings its tree (its root, the last committed token, and the draft nodes below it) and its
past (the KV rows it has committed). The pass packs every request's tokens one after another, as vLLM
lays out a batch (``query_start_loc``), so the target's linear layers see exactly the batch's real tokens;
attention alone is per request, each request's queries padded to the widest tree and reading its own row
of the batched KV cache: its past, then its own tree, ancestors only.

A worked example: request 0 has committed 5 tokens and verifies a root with two children (3 tokens),
request 1 has committed 2 tokens and verifies its root alone (AR, 1 token)::

    query_start_loc = [0, 3, 4]                     T = 4 tokens, B = 2 requests
    input_ids       = [r0, a, b, r1]
    position_ids    = [5, 6, 6, 2]                  past + depth: siblings share a position
    rows            = [0, 1]                        each request's row of the batched cache
    kv_rows         = [0, 0, 0, 1]                  the token's row of the cache
    kv_columns      = [5, 6, 7, 2]                  past + the node's index: the tree lands after the past
    padded          = [[0, 1, 2], [3, 3, 3]]        each request's tokens, its last repeated to the widest
    unpadded        = [0, 1, 2, 3]                  where token t sits in ``padded`` flattened
    visible[0]      = columns 0..4 (the past), then the tree's ancestor mask over columns 5..7
    visible[1]      = columns 0..1, then column 2 (itself), on each of its three (padding) query rows

A padding query row repeats its request's last token and sees what that token sees, so no row of the
attention is empty; its output is dropped (``unpadded`` never points at it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from ddtree.tree import DraftTree
from ddtree.verify import ancestor_masks, compile_tree


@dataclass(frozen=True)
class BatchLayout:
    """B trees as one verify pass: T tokens packed, attention per request over its own cache row."""

    rows: torch.Tensor  # [B] long: each request's row of the batched cache
    query_start_loc: torch.Tensor  # [B+1] long: request r's tokens are T-indices qsl[r]..qsl[r+1]-1
    input_ids: torch.Tensor  # [T] long: each request's root, then its draft nodes
    position_ids: torch.Tensor  # [T] long: past + depth
    kv_rows: torch.Tensor  # [T] long: the cache row (the request) each token's keys and values are written to
    kv_columns: torch.Tensor  # [T] long: ... and the column: past + the node's index in its tree
    padded: torch.Tensor  # [B, T_max] long: index into T, each request's tokens then its last one repeated
    unpadded: torch.Tensor  # [T] long: index into B * T_max, where token t sits in ``padded``
    visible: torch.Tensor  # [B, T_max, W] bool: which cache columns each padded query row attends to

    @property
    def requests(self) -> int:
        return self.padded.shape[0]

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def width(self) -> int:
        """Cache columns the pass reads: up to the end of the longest request's tree."""
        return self.visible.shape[-1]

    def to(self, device: torch.device) -> BatchLayout:
        return BatchLayout(*(getattr(self, name).to(device) for name in self.__dataclass_fields__))

    @staticmethod
    def empty() -> BatchLayout:
        """A pass of no requests: what a recorded pass of padding alone is loaded with (``ddtree.padded_verify``)."""
        none = torch.zeros(0, dtype=torch.long)
        return BatchLayout(none, torch.zeros(1, dtype=torch.long), none, none, none, none,
                           torch.zeros(0, 0, dtype=torch.long), none, torch.zeros(0, 0, 0, dtype=torch.bool))


def pack_trees(trees: list[DraftTree], roots: list[int], pasts: list[int], rows: list[int] | None = None
               ) -> BatchLayout:
    """The layout of one verify pass over ``trees``, request r's tree below ``roots[r]`` after its
    ``pasts[r]`` committed rows (so its root sits at position ``pasts[r]``), in row ``rows[r]`` of the
    batched cache (default: row r). Every tree at once, padded to the widest (``ancestor_masks``):
    ``pack_trees_readable`` is the same layout tree by tree."""
    requests = len(trees)
    sizes = torch.tensor([tree.size + 1 for tree in trees])  # [B]: root and nodes
    widest = int(sizes.max())
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    past = torch.tensor(pasts, dtype=torch.long)
    width = int((past + sizes).max())
    slot = torch.arange(widest)
    real = slot[None, :] < sizes[:, None]  # [B, T_max]: the request's own tokens, root first
    nodes = [tree.tokens for tree in trees]
    tokens = torch.cat([torch.tensor(roots, dtype=torch.long)[:, None],
                        pad_sequence(nodes, batch_first=True).reshape(requests, widest - 1)], dim=1)
    depth = torch.cat([torch.zeros(requests, 1, dtype=torch.long),
                       pad_sequence([tree.depths for tree in trees], batch_first=True).reshape(requests, widest - 1)],
                      dim=1)
    parents = pad_sequence([tree.parents for tree in trees], batch_first=True).reshape(requests, widest - 1)

    last = torch.minimum(slot[None, :], sizes[:, None] - 1)  # [B, T_max]: a padding row repeats the last token
    own = ancestor_masks(parents).gather(1, last[:, :, None].expand(requests, widest, widest))  # [B, T_max, T_max]
    wide = (torch.arange(width + widest)[None, :] < past[:, None])[:, None, :].repeat(1, widest, 1)  # the past
    wide.scatter_(2, (past[:, None] + slot)[:, None, :].expand(requests, widest, widest), own)  # after its past

    rows_t = torch.arange(requests) if rows is None else torch.tensor(rows, dtype=torch.long)
    return BatchLayout(
        rows=rows_t,
        query_start_loc=query_start_loc,
        input_ids=tokens[real],
        position_ids=(past[:, None] + depth)[real],
        kv_rows=torch.repeat_interleave(rows_t, sizes),
        kv_columns=(past[:, None] + slot)[real],
        padded=query_start_loc[:-1, None] + last,
        unpadded=torch.arange(requests * widest).view(requests, widest)[real],
        visible=wide[..., :width].contiguous(),
    )


def pack_trees_readable(trees: list[DraftTree], roots: list[int], pasts: list[int], rows: list[int] | None = None
                        ) -> BatchLayout:
    """``pack_trees``' reference: each tree compiled on its own (``compile_tree``), then laid side by side."""
    compiled = [compile_tree(tree, root, past) for tree, root, past in zip(trees, roots, pasts)]
    sizes = torch.tensor([inputs.input_ids.shape[1] for inputs in compiled])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    requests, widest = len(trees), int(sizes.max())
    past = torch.tensor(pasts, dtype=torch.long)
    width = int((past + sizes).max())

    slot = torch.arange(widest)
    last = torch.minimum(slot[None, :], sizes[:, None] - 1)  # [B, T_max]: a padding row repeats the last token
    padded = query_start_loc[:-1, None] + last
    unpadded = torch.cat([r * widest + torch.arange(int(size)) for r, size in enumerate(sizes)])

    columns = torch.arange(width)
    visible = (columns[None, None, :] < past[:, None, None]).expand(requests, widest, width).clone()
    for r, inputs in enumerate(compiled):
        size, start = int(sizes[r]), pasts[r]
        visible[r, :, start:start + size] = inputs.visible[last[r]]

    rows_t = torch.arange(requests) if rows is None else torch.tensor(rows, dtype=torch.long)
    return BatchLayout(
        rows=rows_t,
        query_start_loc=query_start_loc,
        input_ids=torch.cat([inputs.input_ids[0] for inputs in compiled]),
        position_ids=torch.cat([inputs.position_ids[0] for inputs in compiled]),
        kv_rows=torch.repeat_interleave(rows_t, sizes),
        kv_columns=torch.cat([start + torch.arange(int(size)) for start, size in zip(pasts, sizes)]),
        padded=padded,
        unpadded=unpadded,
        visible=visible,
    )


def layout_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[B, 1, T_max, W]`` for ``visible [B, T_max, W]``: 0 where seen, the dtype's lowest
    elsewhere (as ``attention_bias``)."""
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return bias.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


def grouped_rows(rows: int | torch.Tensor, group: int, few: int) -> int | torch.Tensor:
    """The rows a pass of ``rows`` rows runs as (an int, or a tensor of counts), where a machine runs fewer than
    ``few`` rows as a multiple of ``group``: 2 or 3 (and so on, up to ``group - 1``) past a multiple become the
    next one; 0 or 1 past it stay. E.g. group 4, few 12: 1, 2, 3, 5, 6, 10, 12 rows run as 1, 4, 4, 5, 8, 12, 12.
    An int stays an int (no device sync: a CUDA graph's program may ask)."""
    short = rows % group
    if isinstance(rows, torch.Tensor):
        return torch.where((rows < few) & (short >= 2), rows + group - short, rows)
    return rows + group - short if rows < few and short >= 2 else rows
