"""KV compaction after a tree verify: keep the accepted path's rows, drop the rest."""

from __future__ import annotations

import torch


def kept_rows(past_length: int, accepted: list[int]) -> torch.Tensor:
    """Absolute cache rows that survive: the tree block starts at ``past_length``."""
    return past_length + torch.tensor(accepted, dtype=torch.long)


def compact_rows(cache: torch.Tensor, past_length: int, accepted: list[int], dim: int = -2) -> torch.Tensor:
    """The past plus the accepted tree rows in path order, compacted in place.

    Returns a view of ``cache`` of length ``past_length + len(accepted)`` along ``dim``;
    the accepted rows are gathered first, so overlapping source and target slots are safe.
    """
    rows = kept_rows(past_length, accepted).to(cache.device)
    kept = cache.index_select(dim, rows)
    cache.narrow(dim, past_length, len(accepted)).copy_(kept)
    return cache.narrow(dim, 0, past_length + len(accepted))
