"""The Gated DeltaNet programs compiled for a Hopper GPU on this machine (``engine.tools.gdn_registers``): what a
program holds in registers bounds how many an SM runs at once. Needs Triton, not its interpreter (the kernels this
session imported are the interpreter's where tests/conftest.py turned it on), so the tool runs in its own process;
no GPU needed."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = re.compile(r"(\w+) (\d+) registers, (\d+) stack bytes")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="compiles with Triton for sm_90")
def test_at_27b_sizes_no_program_spills_registers():
    """The walk holds only its state and a token's rows (the one-program verify held the window and taps too, and
    spilled at 65 nodes)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "engine.tools.gdn_registers", "--model", "assets/shapes/qwen3.6-27b",
                           "--trees", "ar,ddtree@16,flat@64"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "engine.on_vllm.gdn_fused ar (1 nodes)", "engine.on_vllm.gdn_fused ddtree@16 (17 nodes)",
        "engine.on_vllm.gdn_fused flat@64 (65 nodes)"]
    for line in lines:
        programs = PROGRAM.findall(line)
        assert [name for name, _, _ in programs] == ["convolve_kernel", "walk_kernel", "commit_kernel"], line
        assert all(int(stack) == 0 and int(registers) <= 255 for _, registers, stack in programs), line
