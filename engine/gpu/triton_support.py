"""Triton where it runs: on a GPU, or on the CPU under its interpreter (``TRITON_INTERPRET=1``,
how the tests check the kernels here; the CPU install has Triton for them). Without Triton (a platform
it has no wheel for) every path stays on torch."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def triton_runs_on(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
