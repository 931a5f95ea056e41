"""Where a batched step's time goes: the server's batch without the server.

    python -m engine.tools.batch_profile [--requests 16] [--methods ar,ddtree] [--tokens 128] [--profile]
        [--kernels] [--waits] [--native ar,mtp]
        [the app's model flags: --engine vllm --model ... --drafter ...] [--random-weights]

For each number of requests and each method ("auto" trees for those that draft), that many prompts join the batch
at once and decode to the end: once to warm up, once timed. One batch serves every run, as a server keeps one
(``engine.loop.remote_batch.open_batch``: on the vLLM engine, in its workers), so the timed run replays what the
warm-up recorded. Prints tokens/s, τ, the rounds and their median, how many nodes the requests' trees got
and how often they grew one, and each stage's median per step as the traces record it (draft, tree_build,
tree_compile, verify, commit). More runs, each after the timed one: ``--kernels`` (GPU) how busy the device was
and its costliest kernels, ``--waits`` (GPU) where the host waited for the device, ``--profile`` the heaviest
functions under cProfile. ``--native ar,mtp`` then times vLLM's own decoders at each number of requests, as that
many clients of its continuous batching: the baseline a batched step is held to, in the same run.
On the vLLM engine the workers run in this process (as they do by default: ``engine_core_here``), so the profile
sees their Python as well; the server's log of its rounds says what a served round adds to this.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial

from engine.errors import EngineError, run_command
from engine.gpu.copies import waits_counted
from engine.gpu.profiling import device_time
from engine.loop.remote_batch import open_batch
from engine.loop.settings import DecodeSettings
from engine.methods import AUTO, Label
from engine.serving.startup import add_model_arguments, batch_budgeting, check_model_arguments, load_studio_decoder
from engine.tools.bench import plan_native_jobs, read_prompts


@dataclass(frozen=True)
class BatchRun:
    """One batch decoded to its end."""

    tokens: int
    steps: int
    seconds: float
    rounds: list[float]  # each round's seconds
    stages: dict[str, float]  # each stage's median seconds a step
    nodes: float  # draft nodes a request verified a step, on average
    grown: float  # the share of its steps in which a request verified a tree (any node past its root)

    def line(self, label: str) -> str:
        stages = ", ".join(f"{stage} {1000 * seconds:.2f}" for stage, seconds in self.stages.items())
        return (f"{label}: {self.tokens / self.seconds:.1f} tokens/s, τ {self.tokens / max(self.steps, 1):.2f}, "
                f"{len(self.rounds)} rounds (median {1000 * statistics.median(self.rounds):.1f} ms, mean "
                f"{1000 * statistics.mean(self.rounds):.1f}); {self.nodes:.1f} nodes a request a step, a tree in "
                f"{100 * self.grown:.0f}% of them; a step's stages (median ms): {stages}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.batch_profile", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--prompts", default="assets/prompts/fresh.jsonl")
    parser.add_argument("--requests", default="16", help="batch sizes, comma-separated")
    parser.add_argument("--methods", default="ar,ddtree",
                        help="methods, comma-separated; a drafting one's budget after @ (ddtree@16), else auto trees")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens a request")
    parser.add_argument("--profile", action="store_true", help="a third run under cProfile, its heaviest functions")
    parser.add_argument("--kernels", action="store_true",
                        help="GPU: a run under the profiler's CUDA activity: the device's busy share, top kernels")
    parser.add_argument("--waits", action="store_true",
                        help="GPU: a run that counts where the host waited for the device (PyTorch's sync debug mode)")
    parser.add_argument("--native", default="", metavar="ar,mtp",
                        help="vllm engine: then vLLM's own decoders (ar, ar-graphless, dflash, mtp) at each number of "
                             "requests, as that many clients of its continuous batching, once the Studio's engine has "
                             "given the GPU back")
    parser.add_argument("--native-mtp-tokens", type=int, default=3, metavar="N", help="--native mtp: tokens it drafts")
    parser.add_argument("--random-weights", action="store_true",
                        help="vllm engine: --model and --drafter are config-only folders (assets/shapes/), timing only")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="vllm engine: its share of the GPU")
    args = parser.parse_args(argv)
    check_model_arguments(parser, args)
    if args.native and args.engine != "vllm":
        parser.error("--native times vLLM's own decoders beside the vLLM engine's: add --engine vllm")
    try:
        args.native_jobs = plan_native_jobs(args.native) if args.native else []
    except EngineError as exc:
        parser.error(str(exc))
    return args


def decode_batch(batch, decoder, prompts: list[list[int]], settings: DecodeSettings) -> BatchRun:
    """Every prompt joins ``batch`` at once and decodes ``settings`` to its end."""
    requests = [batch.admit_prepared("", ids, *decoder.prepare(settings, len(ids))) for ids in prompts]
    rounds, started = [], time.perf_counter()
    while not batch.idle:
        begun = time.perf_counter()
        batch.advance()
        rounds.append(time.perf_counter() - begun)
    seconds = time.perf_counter() - started
    steps = [step for request in requests for step in request.trace.steps]
    stages: dict[str, list[float]] = {}
    for step in steps:
        for stage, spent in step.stage_s.items():
            stages.setdefault(stage, []).append(spent)
    nodes = [len(step.tree_tokens) for step in steps]
    return BatchRun(sum(len(request.trace.output_ids) for request in requests), len(steps), seconds, rounds,
                    {stage: statistics.median(spent) for stage, spent in stages.items()},
                    statistics.mean(nodes) if nodes else 0.0, sum(n > 0 for n in nodes) / max(len(nodes), 1))


def main(args: argparse.Namespace) -> int:
    decoder = load_studio_decoder(args, args.random_weights, args.gpu_memory_utilization)
    budgeting = batch_budgeting(decoder, time_here=True)
    print(f"trees sized by {budgeting.source}: {budgeting.cost}")
    prompts = [decoder.target.chat_ids(row["prompt"]) for row in read_prompts(args.prompts)]
    batch = open_batch(decoder, budgeting)  # one for every run, as a server keeps one: what it recorded, it replays
    for size in (int(size) for size in args.requests.split(",")):
        for name in args.methods.split(","):
            label = Label.parse(name)
            if label.method is None:
                raise SystemExit(f"--methods: {name!r} names no method")
            budget = label.budget if label.budget is not None else AUTO  # a drafting method's bare name: auto trees
            settings = DecodeSettings(label.method.name, max_new_tokens=args.tokens,
                                      **({"tree_budget": budget} if label.method.drafts else {}))
            chosen = [prompts[i % len(prompts)] for i in range(size)]
            decode_batch(batch, decoder, chosen, settings)  # warm-up: first shapes, kernels compiled, graphs recorded
            timed = decode_batch(batch, decoder, chosen, settings)
            print(timed.line(f"{name} x {size}"), flush=True)
            if args.kernels:
                print(device_time(partial(decode_batch, batch, decoder, chosen, settings)).line(len(timed.rounds)))
            if args.waits:
                census: Counter = Counter()
                with waits_counted(census):
                    decode_batch(batch, decoder, chosen, settings)
                print(f"the host waited for the device {sum(census.values()) / len(timed.rounds):.1f} times a round: "
                      + "; ".join(f"{where} ×{count}" for where, count in census.most_common(12)), flush=True)
            if args.profile:
                profile = cProfile.Profile()
                profile.enable()
                decode_batch(batch, decoder, chosen, settings)
                profile.disable()
                for order in ("tottime", "cumulative"):
                    out = io.StringIO()
                    pstats.Stats(profile, stream=out).sort_stats(order).print_stats(40)
                    print(out.getvalue(), flush=True)
    if args.native_jobs:
        time_native(decoder, args, prompts)
    return 0


def time_native(decoder, args: argparse.Namespace, prompts: list[list[int]]) -> None:
    """vLLM's own decoders (``--native``) on the same prompts at each number of requests, as that many clients of its
    continuous batching (``native_clients``), once the Studio's engine has given the GPU back (at 27B the two do not
    fit side by side): a line each, tokens/s and τ (vLLM's counters) beside the Studio's lines above."""
    import torch

    from engine.on_vllm.vllm_engine import native_clients, native_llm, timed_clients

    decoder.close()
    torch.cuda.empty_cache()
    stops = decoder.target.stop_ids
    for job in args.native_jobs:
        native = job.native
        drafted = decoder.drafter.block_size - 1 if native.our_drafter else args.native_mtp_tokens
        llm = native_llm(args.model, args.dtype or "bfloat16", args.drafter if native.our_drafter else None, drafted,
                         options=decoder.options, mtp=native.mtp, cuda_graphs=native.cuda_graphs)
        native_clients(llm, prompts[:1], 1, 8, stops)  # warm-up, untimed
        for size in (int(size) for size in args.requests.split(",")):
            chosen = [prompts[i % len(prompts)] for i in range(size)]
            native_clients(llm, chosen, size, args.tokens, stops)  # this many requests' graphs, untimed
            timed = timed_clients(llm, chosen, size, args.tokens, stops)
            print(f"{job.label} x {size}: {sum(len(a.output_ids) for a in timed.answers) / timed.seconds:.1f} "
                  f"tokens/s, τ {timed.tau:.2f} (vLLM's own, {size} clients)", flush=True)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(run_command(main, parse_args()))
