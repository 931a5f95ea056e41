"""What a hybrid's Gated DeltaNet layers cost per decoding step, verify and commit, at a target's shape.

    python -m engine.tools.gdn_bench --model assets/shapes/qwen3.6-27b [--trees ar,chain,ddtree@16,ddtree@64] \\
        [--requests 1,4,16] [--also engine.on_vllm.other_fused_module] [--out report.json]
    python -m engine.tools.gdn_bench --table report.json      # its markdown table

A GPU with vLLM: every linear layer of the shape (random weights, its own state slot each), one
step's tree verified and its root committed, all layers as one CUDA graph, replayed. Methods:
``fused`` (``engine.on_vllm.gdn_fused``, what the Studio runs), ``vllm-kernels`` (the readable step,
``engine.on_vllm.gdn_tree`` over vLLM's kernels) and, for one token, ``vllm-decode``: vLLM's own AR
(``causal_conv1d_update`` then the packed decode kernel). ``--also`` times other modules with
``gdn_fused``'s ``verify`` / ``commit`` beside them (a kernel variant under trial). Trees: one token,
a chain of the drafter's block (DFlash), DDTree's at each budget built from peaked random
distributions like a trained drafter's (deep trees: the path walk's worst case), and ``flat@BUDGET``, from
flat ones: the wide trees a random-weight drafter drafts in the shape runs (``gpu_session.sh shape``).
Beside each module's timings: the registers a thread and spills of the programs it compiled for that tree size.
``--requests``: a batch's step, that many requests' trees (each the tree named) in one pass, each request from its own
state slot (``fused``; ``vllm-decode``, vLLM's AR over as many requests; the readable step is one request's).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch

import ddtree
from engine.errors import EngineError, run_command
from engine.gpu.graphs import record
from engine.gpu.triton_support import triton
from engine.methods import BASELINE, TREE
from engine.models.target import shape_config
from engine.on_vllm.gdn_tree import AcceptedPath, GDNParams, GDNTreePlan, commit_layer, verify_layer

BLOCK = 16  # the drafter's block: DFlash's chain, DDTree's depth
SLOT = 3  # the first request's state slot


@dataclass(frozen=True)
class Timing:
    method: str
    tree: str
    nodes: int  # every request's
    step_us: float  # all linear layers, verify + commit
    layer_us: float
    same_bits: bool | None = None  # an --also module: its nodes' outputs equal ``fused``'s bit for bit
    programs: str | None = None  # a Triton module's programs compiled for this tree: registers a thread, spills
    requests: int = 1  # trees verified in the pass, each a request's


@dataclass
class Layer:
    params: GDNParams
    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    mixed_qkv: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor


def linear_layers(model: str) -> tuple[int, dict]:
    config = shape_config(model)
    text = getattr(config, "text_config", config)
    count = sum(kind == "linear_attention" for kind in text.layer_types)
    if not count:
        raise EngineError(f"{model} has no Gated DeltaNet layers")
    return count, dict(key_heads=text.linear_num_key_heads, heads=text.linear_num_value_heads,
                       head_k=text.linear_key_head_dim, head_v=text.linear_value_head_dim,
                       kernel=text.linear_conv_kernel_dim)


def make_layer(shape: dict, q: int, dtype: torch.dtype, device: torch.device, requests: int = 1) -> Layer:
    key_dim, value_dim = shape["key_heads"] * shape["head_k"], shape["heads"] * shape["head_v"]
    channels = 2 * key_dim + value_dim

    def rand(*size, scale=1.0, kind=dtype):
        return (torch.randn(*size, device=device) * scale).to(kind)

    params = GDNParams(conv_weight=rand(channels, shape["kernel"], scale=0.5), conv_bias=None, activation="silu",
                       A_log=rand(shape["heads"], scale=0.5, kind=torch.float32),
                       dt_bias=rand(shape["heads"], scale=0.5, kind=torch.float32), key_dim=key_dim,
                       value_dim=value_dim, head_k_dim=shape["head_k"], head_v_dim=shape["head_v"])
    return Layer(params, rand(SLOT + requests, channels, shape["kernel"] - 1),
                 rand(SLOT + requests, shape["heads"], shape["head_v"], shape["head_k"], scale=0.1, kind=torch.float32),
                 rand(q, channels), rand(q, shape["heads"]), rand(q, shape["heads"]),
                 torch.zeros(q, shape["heads"], shape["head_v"], dtype=dtype, device=device))


@dataclass(frozen=True)
class TreeShape:
    """A tree ``--trees`` names: a shape alone (``chain``), or with a budget (``ddtree@64``)."""

    name: str
    budgeted: bool
    mask: Callable[[int | None, torch.Generator], torch.Tensor]  # (budget, generator) -> ancestors-and-self mask


def drafted_tree(sureness: float, budget: int, generator: torch.Generator) -> torch.Tensor:
    """The best-first tree of ``budget`` nodes from random distributions whose first token's logit is raised by
    ``sureness``."""
    logits = torch.randn(BLOCK - 1, 4096, generator=generator)
    logits[:, 0] += sureness
    return ddtree.ancestor_mask(ddtree.build_tree(torch.log_softmax(logits, dim=-1), budget).parents)


TREE_SHAPES = (
    TreeShape(BASELINE.name, False, lambda budget, generator: torch.ones(1, 1, dtype=torch.bool)),  # the root
    TreeShape("chain", False, lambda budget, generator: torch.ones(BLOCK, BLOCK, dtype=torch.bool).tril()),
    # a drafter sure of ~3 tokens in 4, as a trained one is: trees 15 deep
    TreeShape(TREE.name, True, partial(drafted_tree, 10.0)),
    # a drafter sure of nothing, as random weights are: the root's children, all leaves
    TreeShape("flat", True, partial(drafted_tree, 0.0)),
)


def trees(names: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """Each named tree's ancestors-and-self mask (``TREE_SHAPES``; the random trees drawn in the order named)."""
    generator = torch.Generator().manual_seed(0)
    shapes = {shape.name: shape for shape in TREE_SHAPES}
    masks = {}
    for name in names:
        kind, at, budget = name.partition("@")
        shape = shapes.get(kind)
        if shape is None or shape.budgeted != bool(at) or at and not budget.isdigit():
            known = [shape.name + ("@BUDGET" if shape.budgeted else "") for shape in TREE_SHAPES]
            raise EngineError(f"unknown tree {name!r}: {', '.join(known[:-1])} or {known[-1]}")
        masks[name] = shape.mask(int(budget) if at else None, generator)
    return {name: mask.to(device) for name, mask in masks.items()}


@dataclass(frozen=True)
class BatchPass:
    """``requests`` copies of one tree (``visible [q, q]``) in one pass, request r's nodes ``r*q .. r*q + q - 1``
    from its state slot ``SLOT + r``; each commits its root."""

    visible: torch.Tensor  # [requests * q, requests * q], block-diagonal
    node_slots: torch.Tensor  # [requests * q] int32
    slots: torch.Tensor  # [requests] int32
    roots: torch.Tensor  # [requests, path length] int32: each request's root, repeated
    length: int  # the paths' table width

    @staticmethod
    def of(visible: torch.Tensor, requests: int) -> BatchPass:
        q, device = visible.shape[0], visible.device
        slots = SLOT + torch.arange(requests, dtype=torch.int32, device=device)
        length = min(q, 32)
        roots = (torch.arange(requests, dtype=torch.int32, device=device) * q)[:, None].expand(requests, length)
        return BatchPass(torch.block_diag(*[visible] * requests), slots.repeat_interleave(q), slots,
                         roots.contiguous(), length)


def fused_step(module, layers: list[Layer], batch: BatchPass):
    paths = module.TreePaths.build(batch.visible, batch.length)
    one = torch.ones(batch.slots.shape[0], dtype=torch.int32, device=batch.slots.device)

    def step():
        for layer in layers:
            kept = module.verify(layer.params, layer.mixed_qkv, layer.a, layer.b, layer.conv_state, layer.ssm_state,
                                 batch.node_slots, paths, layer.out)
            module.commit(layer.params, kept, layer.conv_state, layer.ssm_state, batch.slots, batch.roots, one)
    return step


def readable_step(kernels, layers: list[Layer], visible: torch.Tensor):
    length = min(visible.shape[0], 32)
    plan = GDNTreePlan.build(visible, SLOT, layers[0].conv_state.shape[-1], length)
    accepted = AcceptedPath.build(plan, torch.zeros(length, dtype=torch.long, device=visible.device),
                                  torch.tensor(1, device=visible.device))

    def step():
        for layer in layers:
            out, kept = verify_layer(layer.params, layer.mixed_qkv, layer.a, layer.b, layer.conv_state, layer.ssm_state,
                                     plan, kernels)
            commit_layer(layer.params, kept, plan, accepted, layer.conv_state, layer.ssm_state, kernels)
    return step


def vllm_decode_step(layers: list[Layer], slot: torch.Tensor):
    """vLLM's AR step of the requests in ``slot [requests]``, one token each."""
    from vllm.model_executor.layers.fla.ops import fused_recurrent_gated_delta_rule_packed_decode
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update


    def step():
        for layer in layers:
            p = layer.params
            convolved = causal_conv1d_update(layer.mixed_qkv, layer.conv_state, p.conv_weight, p.conv_bias,
                                             p.activation, conv_state_indices=slot)
            fused_recurrent_gated_delta_rule_packed_decode(
                mixed_qkv=convolved, a=layer.a, b=layer.b, A_log=p.A_log, dt_bias=p.dt_bias, scale=p.head_k_dim ** -0.5,
                initial_state=layer.ssm_state, out=layer.out[:, None], ssm_state_indices=slot,
                use_qk_l2norm_in_kernel=True)
    return step


def outputs(module, layer: Layer, batch: BatchPass) -> torch.Tensor:
    """Every node's output of one verify on the layer's caches as they are (read only)."""
    out = torch.zeros_like(layer.out)
    module.verify(layer.params, layer.mixed_qkv, layer.a, layer.b, layer.conv_state, layer.ssm_state, batch.node_slots,
                  module.TreePaths.build(batch.visible, batch.length), out)
    return out


def compiled_programs(module) -> dict[int, object]:
    """The Triton programs ``module``'s kernels have compiled so far, by identity (read from Triton's per-device
    caches, whose layout is Triton's own: none where it differs from 3.x's)."""
    programs = {}
    for kernel in (value for value in vars(module).values() if isinstance(value, triton.runtime.JITFunction)):
        for cache in getattr(kernel, "device_caches", {}).values():
            if isinstance(cache, tuple) and isinstance(cache[0], dict):
                programs |= {id(program): program for program in cache[0].values()}
    return programs


def resources(programs) -> str:
    """Each program's registers a thread and spilled ones: at one warp a program, registers bound how many
    programs an SM holds at once, which is what a tree of many leaves waits on."""
    return "; ".join(f"{program.name.strip('_')} {getattr(program, 'n_regs', '?')} registers, "
                     f"{getattr(program, 'n_spills', '?')} spills" for program in programs)


def time_graph(step, replays: int) -> float:
    """µs per replay of ``step`` recorded as one CUDA graph."""
    step()
    torch.cuda.synchronize()
    graph, _ = record(step)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def table(report: dict) -> str:
    """A report as markdown: µs a layer per tree and batch (columns) and method (rows)."""

    def column(timing: dict) -> tuple[str, int]:
        return timing["tree"], timing.get("requests", 1)

    columns = list(dict.fromkeys(map(column, report["timings"])))
    methods = list(dict.fromkeys(t["method"] for t in report["timings"]))
    cells = {(t["method"], column(t)): t for t in report["timings"]}
    nodes = {column(t): t["nodes"] for t in report["timings"]}
    lines = [f"## Gated DeltaNet verify and commit: {report['model']}", "",
             f"µs a layer, verify and commit ({report['linear_layers']} linear layers, {report['dtype']}, one step's "
             "trees, all layers replayed as one CUDA graph; `engine.tools.gdn_bench`). `same bits`: every node's "
             "output equals `fused`'s.", "", f"Command: `{report.get('command', 'python -m engine.tools.gdn_bench')}`",
             *[f"- {note}" for note in report.get("notes", [])], "",
             "| method | " + " | ".join(f"{tree} ({nodes[tree, requests]} nodes)" + (f" x{requests}" if requests > 1
                                                                                      else "")
                                     for tree, requests in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for method in methods:
        row = []
        for key in columns:
            timing = cells.get((method, key))
            same = "" if timing is None or timing["same_bits"] is None else (
                ", same bits" if timing["same_bits"] else ", OTHER BITS")
            row.append("–" if timing is None else f"{timing['layer_us']:.1f}{same}")
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    programs = {(t["method"], t["nodes"]): t["programs"] for t in report["timings"] if t.get("programs")}
    if programs:
        lines += ["", "Registers a thread and spills of each program compiled (at one warp a program, registers bound "
                  "how many programs an SM holds at once):", ""]
        lines += [f"- {method}, {nodes} nodes: {text}" for (method, nodes), text in programs.items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="assets/shapes/qwen3.6-27b")
    parser.add_argument("--trees", default="ar,chain,ddtree@16,ddtree@64,flat@64")
    parser.add_argument("--requests", default="1", help="requests a pass verifies, each its own tree: e.g. 1,4,16")
    parser.add_argument("--also", default="", help="modules with gdn_fused's verify/commit, timed beside it")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out")
    parser.add_argument("--table", metavar="REPORT", help="print a report's markdown table and stop")
    return parser.parse_args(argv)


def _main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if args.table:
        with open(args.table) as handle:
            print(table(json.load(handle)))
        return 0
    if not torch.cuda.is_available():
        raise EngineError("gdn_bench times CUDA kernels: it needs a GPU")
    from engine.on_vllm import vllm_gdn

    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    count, shape = linear_layers(args.model)
    modules = {"fused": importlib.import_module("engine.on_vllm.gdn_fused")}
    modules |= {name: importlib.import_module(name) for name in filter(None, args.also.split(","))}
    timings = []
    seen = {name: set() for name in modules}  # each module's programs compiled before the tree at hand
    programs: dict[tuple[str, int], str] = {}
    batches = [(tree, visible, requests) for tree, visible in trees(args.trees.split(","), device).items()
               for requests in map(int, args.requests.split(","))]
    for tree, visible, requests in batches:
        q, batch = visible.shape[0], BatchPass.of(visible, requests)
        layers = [make_layer(shape, q * requests, dtype, device, requests) for _ in range(count)]
        steps = {name: fused_step(module, layers, batch) for name, module in modules.items()}
        if requests == 1:
            steps["vllm-kernels"] = readable_step(vllm_gdn.KERNELS, layers, visible)
        if q == 1:
            steps["vllm-decode"] = vllm_decode_step(layers, batch.slots)
        # before any timing commits into the states: every module verifies the same caches (a verify writes none)
        reference = outputs(modules["fused"], layers[0], batch)
        same_bits = {name: torch.equal(outputs(module, layers[0], batch), reference)
                     for name, module in modules.items() if name != "fused"}
        for method, step in steps.items():
            us = time_graph(step, args.replays)
            same = same_bits.get(method)
            if method in modules:  # a program's constants follow the node count: trees of one size share programs
                compiled = compiled_programs(modules[method])
                found = resources(p for key, p in compiled.items() if key not in seen[method])
                if found:
                    programs.setdefault((method, q), found)
                seen[method] = set(compiled)
            timings.append(Timing(method, tree, q, round(us, 1), round(us / count, 2), same, programs.get((method, q)),
                                  requests))
            print(f"{tree:>10} ({q:>3} nodes) x{requests:<3} {method:<34} {us:9.1f} µs a step  "
                  f"{us / count:7.2f} µs a layer"
                  + ("" if same is None else f"  same bits as fused: {'yes' if same else 'NO'}")
                  + (f"  ({programs[method, q]})" if programs.get((method, q)) else ""), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            command = "python -m engine.tools.gdn_bench " + " ".join(sys.argv[1:] if argv is None else argv)
            json.dump({"command": command, "model": args.model, "linear_layers": count, "dtype": args.dtype,
                       "timings": [asdict(t) for t in timings]}, handle, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(partial(_main, argv=argv), parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
