"""What the Studio (``app.py``) and the OpenAI-compatible server (``engine.tools.serve``) share to start: the
model flags, loading the decoder they name (torch or vLLM), and the DDTree budget to open at."""

from __future__ import annotations

import argparse
import os

from engine.loop.budgeting import Budgeting, recorded_budgeting
from engine.loop.decode import Decoder
from engine.loop.loading import AUTO, DRAFT_DTYPE_HELP, load_decoder
from engine.measure.calibration import (
    CALIBRATION_PROMPT,
    FALLBACK_BUDGET,
    PROVISIONAL_BUDGET,
    BudgetChoice,
    StartupTiming,
    cache_dir,
    recorded_choice,
)
from engine.measure.step_cost import QUICK_NODES, batch_key, quick_requests, time_step_costs
from engine.models.target import resolve_device


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say which models to load and how (``check_model_arguments`` checks them)."""
    parser.add_argument("--model", default=None, help="target model: folder, GGUF file or hub id (default: bundled)")
    parser.add_argument("--drafter", default=None,
                        help="DFlash drafter folder, or 'random' (default: the shipped drafter, else random)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--dtype", default=None,
                        help="float32 (torch default), bfloat16 (vllm default), float16, float64")
    parser.add_argument("--draft-dtype", default=AUTO, help=DRAFT_DTYPE_HELP)
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"],
                        help="torch (any machine) or vllm (CUDA GPU + requirements-gpu.txt)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm engine: GPUs per model")
    parser.add_argument("--step", choices=["fixed", "readable"], default=None,
                        help="greedy steps as fixed-shape device programs (default on a GPU) or the readable loop")
    parser.add_argument("--compile-step", action=argparse.BooleanOptionalAction, default=None,
                        help="fixed step: its stages (and the vLLM engine's verify pass) through torch.compile: "
                             "the bench's fastest GPU step (default with --engine vllm; --no-compile-step turns it "
                             "off); each method and budget compiles at its first run, cached in "
                             "~/.cache/ddtree-studio (DDTREE_STUDIO_CACHE) for the next start")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="GPU: run the Studio's passes eagerly, not replayed from CUDA graphs (the reference)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="vllm engine: vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT), so a request's "
                             "numbers do not depend on how many share its pass: in float32 a batched request's output "
                             "is its solo run's, at some speed")
    parser.add_argument("--vllm-compile", action=argparse.BooleanOptionalAction, default=None,
                        help="vllm engine: vLLM compiles the target itself (its fused layers), replayed in the "
                             "Studio's CUDA graphs: the default for hybrid targets, whose steps it makes cheaper "
                             "(the step costs with and without it: README, \"Results\"); --no-vllm-compile runs them "
                             "eagerly")


def check_model_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.vllm_compile and args.engine != "vllm":
        parser.error("--vllm-compile has vLLM compile its target: it needs --engine vllm")
    if args.batch_invariant and args.engine != "vllm":
        parser.error("--batch-invariant is vLLM's mode: it needs --engine vllm")


def compile_caches(environ: dict[str, str]) -> dict[str, str]:
    """Where torch.compile and vLLM keep what they compiled, so a restart loads it instead of compiling
    again: under the app's cache unless the environment already says."""
    wanted = {"TORCHINDUCTOR_CACHE_DIR": cache_dir() / "torchinductor", "VLLM_CACHE_ROOT": cache_dir() / "vllm"}
    return {name: str(path) for name, path in wanted.items() if not environ.get(name)}


def compiles_step(args: argparse.Namespace) -> bool:
    """The vLLM engine compiles its fixed step unless told not to: the bench's fastest GPU step, so the app's
    speed-up is the bench's; the torch engine only when asked (``--compile-step``)."""
    if args.compile_step is not None:
        return args.compile_step
    return args.engine == "vllm" and args.step != "readable"


def load_studio_decoder(args: argparse.Namespace, random_weights: bool = False,
                        gpu_memory_utilization: float | None = None) -> Decoder:
    """The decoder ``add_model_arguments``' flags name; on the vLLM engine, ``random_weights`` (config-only folders,
    timing only) and vLLM's share of the GPU's memory where given."""
    compile_step = compiles_step(args)
    if compile_step:  # before torch.compile or vLLM read them
        os.environ.update(compile_caches(os.environ))
    if args.engine == "vllm":  # imported here: the torch engine never needs vLLM
        from engine.on_vllm.vllm_engine import VllmOptions, load_vllm_decoder

        memory = {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
        return load_vllm_decoder(args.model, args.drafter, dtype=args.dtype or "bfloat16",
                                 options=VllmOptions(tensor_parallel_size=args.tensor_parallel_size,
                                                     cuda_graphs=not args.no_cuda_graphs,
                                                     fixed_step=args.step != "readable",
                                                     compile_step=compile_step, vllm_compile=args.vllm_compile,
                                                     batch_invariant=args.batch_invariant,
                                                     random_weights=random_weights, **memory))
    # on a GPU, greedy steps run as CUDA graphs of fixed-shape programs (engine.loop.fixed_step)
    fixed = args.step == "fixed" or args.step is None and resolve_device(args.device).type == "cuda"
    return load_decoder(args.model, args.drafter, args.device, args.dtype or "float32", fixed_step=fixed,
                        cuda_graphs=fixed and not args.no_cuda_graphs, compile_step=fixed and compile_step,
                        draft_dtype=args.draft_dtype)


def opening_budget(decoder: Decoder, tree_budget: int | None = None) -> tuple[BudgetChoice, StartupTiming | None]:
    """The DDTree budget to open at, at once: set by hand, the bench's record for this kind of machine, or what
    earlier starts timed here; where timings are missing, a tree that branches, with the timing of the rest to
    run (``StartupTiming``, None when nothing is left to time)."""
    if tree_budget is not None:
        return BudgetChoice(tree_budget, {}, "set with --tree-budget"), None
    if decoder.drafter is None:
        return BudgetChoice(FALLBACK_BUDGET, {}, "no drafter to time"), None
    recorded = recorded_choice(decoder)
    if recorded is not None:
        return recorded, None
    timing = StartupTiming(decoder, path=cache_dir() / "timings.json")
    if not timing.missing():
        return timing.choice(), None
    return BudgetChoice(PROVISIONAL_BUDGET, {}, "for now, while the timing runs"), timing


def batch_budgeting(decoder: Decoder, time_here: bool) -> Budgeting:
    """How "auto" trees are sized on this machine: the step costs recorded for its kind
    (``assets/batching.json``), else (``time_here``) a short timing of a few batches now, else provisional ones.
    The decoder keeps it (``Decoder.budgeting``)."""
    budgeting = recorded_budgeting(batch_key(decoder), decoder.drafter_info.revision)
    if budgeting is None and time_here and decoder.target.runs_batched:
        prompts = [decoder.target.chat_ids(CALIBRATION_PROMPT)]
        timing = time_step_costs(decoder, prompts, quick_requests(decoder), QUICK_NODES)
        budgeting = Budgeting(timing.cost, timing.calibration,
                              f"step costs timed here at start-up ({len(timing.shapes)} steps)")
    decoder.budgeting = budgeting or decoder.budgeting
    return decoder.budgeting
