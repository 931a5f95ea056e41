"""Registers a thread and spills of the Gated DeltaNet programs at a target's shape, compiled here for a Hopper GPU.

    python -m engine.tools.gdn_registers --model assets/shapes/qwen3.6-27b [--trees ar,chain,ddtree@16,flat@64] \\
        [--also trial.module_with_verify_and_commit]

No GPU needed: each program ``engine.on_vllm.gdn_fused`` (or an ``--also`` module with its ``verify`` and
``commit``) launches for one verify and commit of each tree is compiled by this machine's Triton for sm_90 (an
H100 or H200), and Triton's own ``cuobjdump`` reads its resource usage. At one warp a program, registers bound
how many programs an SM holds at once (65,536 a multiprocessor), which is what a tree of many leaves waits on;
stack bytes are spilled registers. The GPU's own Triton may compile a few registers either way
(``engine.tools.gdn_bench`` prints what it compiled there).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from unittest import mock

import torch

from engine.errors import EngineError, run_command
from engine.gpu.triton_support import triton
from engine.tools.gdn_bench import SLOT, linear_layers, make_layer, trees

HOPPER = 90
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
                 torch.int64: "*i64"}


@dataclass(frozen=True)
class Program:
    name: str
    registers: int  # a thread's
    stack: int  # bytes a thread: spilled registers


@dataclass(frozen=True)
class Launch:
    kernel: object  # a Triton JITFunction
    args: tuple
    constants: dict  # its constexpr arguments, num_warps among them


def launches(module, tree: torch.Tensor, shape: dict) -> list[Launch]:
    """The launches one verify and one commit of ``tree`` make, on CPU tensors of the shape's sizes, none run."""
    made = []

    def record(kernel, *args, grid, warmup, **constants):
        made.append(Launch(kernel, args, constants))

    q = tree.shape[0]
    layer = make_layer(shape, q, torch.bfloat16, torch.device("cpu"))
    paths = module.TreePaths.build(tree, min(q, 32))
    with mock.patch.object(triton.runtime.JITFunction, "run", record):
        kept = module.verify(layer.params, layer.mixed_qkv, layer.a, layer.b, layer.conv_state, layer.ssm_state,
                             torch.full((q,), SLOT, dtype=torch.int32), paths, layer.out)
        module.commit(layer.params, kept, layer.conv_state, layer.ssm_state, torch.tensor([SLOT], dtype=torch.int32),
                      paths.table[:1].clone(), torch.ones(1, dtype=torch.int32))
    return made


def compile_for_hopper(launch: Launch) -> Program:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, constants = launch.kernel, dict(launch.constants)
    warps = constants.pop("num_warps", 4)
    positional, signature = dict(zip(kernel.arg_names, launch.args)), {}
    for name in kernel.arg_names:
        value = positional.get(name)
        if name in constants:
            signature[name] = "constexpr"
        elif value is None:
            signature[name], constants[name] = "constexpr", None
        elif torch.is_tensor(value):
            signature[name] = POINTER_TYPES[value.dtype]
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants),
                              target=GPUTarget("cuda", HOPPER, 32), options={"num_warps": warps})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "program.cubin")
        with open(cubin, "wb") as handle:
            handle.write(compiled.asm["cubin"])
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
    registers, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    if registers is None or stack is None:
        raise EngineError(f"cuobjdump named no registers for {kernel.__name__}: {usage[-300:]}")
    return Program(kernel.__name__.strip("_"), int(registers.group(1)), int(stack.group(1)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="assets/shapes/qwen3.6-27b")
    parser.add_argument("--trees", default="ar,chain,ddtree@16,ddtree@64,flat@64")
    parser.add_argument("--also", default="", help="modules with gdn_fused's verify/commit, compiled beside it")
    return parser.parse_args(argv)


def _main(args: argparse.Namespace) -> int:
    if triton is None or os.environ.get("TRITON_INTERPRET") == "1":
        raise EngineError("gdn_registers compiles with Triton: install it (pip install triton), "
                          "without TRITON_INTERPRET")
    _, shape = linear_layers(args.model)
    names = ["engine.on_vllm.gdn_fused", *filter(None, args.also.split(","))]
    for name in names:
        module = importlib.import_module(name)
        for tree_name, tree in trees(args.trees.split(","), torch.device("cpu")).items():
            programs = [compile_for_hopper(launch) for launch in launches(module, tree, shape)]
            print(f"{name} {tree_name} ({tree.shape[0]} nodes): " + "; ".join(
                f"{p.name} {p.registers} registers, {p.stack} stack bytes" for p in programs), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
