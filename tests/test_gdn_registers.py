"""The Gated DeltaNet programs compiled for a Hopper GPU on this machine (``engine.tools.gdn_registers``): what a
program holds in registers bounds how many an SM runs at once. Needs Triton (not its interpreter), no GPU."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from engine.on_vllm import gdn_fused


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or importlib.util.find_spec("triton") is None,
                    reason="compiles with Triton for sm_90")
def test_at_27b_sizes_no_program_spills_registers():
    """``engine.tools.gdn_registers``: the walk holds only its state and a token's rows (the one-program verify
    held the window and taps too, and spilled at 65 nodes); compiled here, no GPU needed."""
    from engine.tools.gdn_bench import linear_layers, trees
    from engine.tools.gdn_registers import compile_for_hopper, launches

    _, shape = linear_layers("assets/shapes/qwen3.6-27b")
    for name, tree in trees(["ar", "ddtree@16", "flat@64"], torch.device("cpu")).items():
        programs = [compile_for_hopper(launch) for launch in launches(gdn_fused, tree, shape)]
        assert [p.name for p in programs] == ["convolve_kernel", "walk_kernel", "commit_kernel"], name
        assert all(p.stack == 0 and p.registers <= 255 for p in programs), (name, programs)
