"""How many rows a matrix product of a few rows runs as.

On a CPU, MKL's float32 products of 2 or 3 rows past a multiple of 4 (up to about a dozen rows) run slower than
those of the next multiple of 4, so a batched pass of a few tokens is run with filler rows up to it and their
outputs dropped (docs/HISTORY.md, "Lab notes moved out of the code", has the timings).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_GROUP, FEW_ROWS = 4, 12  # a CPU product of fewer than FEW_ROWS rows runs as a multiple of ROW_GROUP, or one more


def run_rows(rows: int, device: torch.device) -> int:
    """The rows a product of ``rows`` rows runs as: on a CPU, 2 or 3 past a multiple of ``ROW_GROUP`` (under
    ``FEW_ROWS``) become the next multiple; elsewhere, and 0 or 1 past one, the rows themselves."""
    if device.type != "cpu" or rows >= FEW_ROWS or rows % ROW_GROUP < 2:
        return rows
    return rows + ROW_GROUP - rows % ROW_GROUP


def linear_rows(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(inputs, weight)`` for ``inputs [..., in]``, its rows run as ``run_rows`` of them (zero rows added,
    their outputs dropped)."""
    rows = inputs.reshape(-1, inputs.shape[-1])  # [M, in]
    extra = run_rows(rows.shape[0], rows.device) - rows.shape[0]
    if extra:
        rows = torch.cat([rows, rows.new_zeros(extra, rows.shape[1])])
    return F.linear(rows, weight)[: rows.shape[0] - extra].reshape(*inputs.shape[:-1], weight.shape[0])
