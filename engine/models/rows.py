"""How many rows a matrix product of a few rows runs as.

On a CPU, MKL's float32 products of 2 or 3 rows past a multiple of 4 (up to about a dozen rows) run slower than
those of the next multiple of 4, so a batched pass of a few tokens is run with filler rows up to it and their
outputs dropped (docs/HISTORY.md, "Serving many requests at once", has the timings).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.batch import grouped_rows

ROW_GROUP, FEW_ROWS = 4, 12  # a CPU product of fewer than FEW_ROWS rows runs as a multiple of ROW_GROUP, or one more


def row_grouping(device: torch.device) -> tuple[int, int]:
    """``(group, few)`` for ``ddtree.batch.grouped_rows`` on this device: ``ROW_GROUP`` and ``FEW_ROWS`` on a
    CPU; elsewhere none (every row count runs as itself)."""
    return (ROW_GROUP, FEW_ROWS) if device.type == "cpu" else (1, 0)


def run_rows(rows: int, device: torch.device) -> int:
    """The rows a product of ``rows`` rows runs as on ``device`` (``row_grouping``)."""
    return grouped_rows(rows, *row_grouping(device))


def linear_rows(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(inputs, weight)`` for ``inputs [..., in]``, its rows run as ``run_rows`` of them (zero rows added,
    their outputs dropped)."""
    rows = inputs.reshape(-1, inputs.shape[-1])  # [M, in]
    extra = run_rows(rows.shape[0], rows.device) - rows.shape[0]
    if extra:
        rows = torch.cat([rows, rows.new_zeros(extra, rows.shape[1])])
    return F.linear(rows, weight)[: rows.shape[0] - extra].reshape(*inputs.shape[:-1], weight.shape[0])
