"""A draft tree in a paged KV cache (vLLM's layout): attention metadata and compaction moves.

The tree block is written to consecutive cache rows ``past .. past + n`` (row = node index),
while RoPE positions are ``past + depth``. Attention runs causally over rows, so a node
sees the whole past and every earlier node; the query-query bias then hides the nodes
that are not its ancestors. After the walk, the accepted path is moved down to rows
``past .. past + len(path)`` so the cache reads like plain AR decoding again.
"""

from __future__ import annotations

import torch


def query_bias(visible: torch.Tensor) -> torch.Tensor:
    """Additive ``[q, q]`` float32 bias among a verify block's queries: 0 where ``visible``
    (the tree's ancestors-and-self mask), -inf elsewhere."""
    bias = torch.full(visible.shape, float("-inf"), dtype=torch.float32, device=visible.device)
    return bias.masked_fill_(visible, 0.0)


def compaction_moves(past_length: int, accepted: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to copy so the accepted path (node indices, root first) sits right after the past.

    Returns ``(source_rows, target_rows)``, leaving out rows already in place (the root,
    and the prefix of the path that stayed on the tree's first nodes). Copy all sources
    before writing any target: a later source may be an earlier target.
    """
    path = torch.tensor(accepted, dtype=torch.long)
    target = torch.arange(len(accepted), dtype=torch.long)
    moved = path != target
    return past_length + path[moved], past_length + target[moved]


def paged_slots(rows: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block, offset)`` of each cache row when the block table is the identity (row r lives
    in block r // block_size); computed once for all layers of a compaction."""
    return rows // block_size, rows % block_size


def move_rows(cache: torch.Tensor, sources: tuple[torch.Tensor, torch.Tensor],
              targets: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Copy rows (``paged_slots``) of a paged cache laid out ``[blocks, 2 (K, V), block_size, ...]``.
    Gathers before it writes."""
    cache[targets[0], :, targets[1]] = cache[sources[0], :, sources[1]]
