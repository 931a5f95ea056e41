"""Benchmark AR, DFlash and DDTree on a prompt set, in one process, one clock.

    python -m engine.bench --prompts PROMPTS.jsonl --methods ar,dflash,ddtree --tree-budget 32 \\
        --max-new-tokens 64 --device cpu --out results.json

Each method runs warm (one untimed warm-up per method first) and alone, prompt by
prompt. Speedup is AR's total wall time over the method's, measured in this run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.decode import DecodeSettings, Decoder
from engine.errors import EngineError
from engine.trace import METHODS, Trace

NEAR_TIE = 0.5  # logit gap under which fp rounding can flip the argmax


@dataclass(frozen=True)
class Job:
    label: str
    method: str
    tree_budget: int | None


def read_prompts(path: str) -> list[dict]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise EngineError(f"cannot read prompts file {path!r}: {exc.strerror or exc}") from exc
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EngineError(f"{path}:{number} is not valid JSON ({exc.msg}); expected one "
                              '{"id": ..., "prompt": ...} object per line') from exc
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise EngineError(f'{path}:{number} has no "prompt" string')
        prompts.append({"id": str(item.get("id", number)), "prompt": item["prompt"]})
    if not prompts:
        raise EngineError(f"prompts file {path!r} holds no prompts")
    return prompts


def plan_jobs(methods: str, budgets: str) -> list[Job]:
    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise EngineError(f"unknown method(s) {unknown or methods!r}; choose from {', '.join(METHODS)}")
    try:
        budget_values = [int(b) for b in budgets.split(",") if b.strip()]
    except ValueError as exc:
        raise EngineError(f"--tree-budget takes integers separated by commas, got {budgets!r}") from exc
    jobs = []
    for name in names:
        if name == "ddtree":
            jobs += [Job(f"ddtree@{b}", "ddtree", b) for b in budget_values]
        else:
            jobs.append(Job(name, name, None))
    return jobs


def margins_of(trace: Trace) -> list[float]:
    margins = [trace.prefill.first_margin]
    for step in trace.steps:
        margins.extend(step.committed_margins)
    return margins


def divergence(trace: Trace, reference: Trace) -> dict | None:
    """Where ``trace`` first leaves the AR output, and how close to a tie the target was there."""
    ours, theirs = trace.output_ids, reference.output_ids
    index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if index is None:
        if len(ours) == len(theirs):
            return None
        index = min(len(ours), len(theirs))
    ar_margin = margins_of(reference)[index] if index < len(theirs) else None
    our_margin = margins_of(trace)[index] if index < len(ours) else None
    return {"index": index, "ar_margin": ar_margin, "method_margin": our_margin,
            "near_tie": ar_margin is not None and ar_margin < NEAR_TIE}


def run_record(prompt: dict, job: Job, trace: Trace) -> dict:
    summary = trace.summary
    return {
        "prompt_id": prompt["id"], "method": job.method, "label": job.label, "tree_budget": job.tree_budget,
        "output_ids": trace.output_ids, "text": trace.text, "new_tokens": summary.new_tokens,
        "verify_steps": summary.steps, "acceptance_lengths": summary.acceptance_lengths, "tau": summary.tau,
        "wall_s": summary.wall_s, "tokens_per_s": summary.tokens_per_s, "stage_s": summary.stage_s,
    }


def summarize_runs(runs: list[dict], jobs: list[Job]) -> dict:
    ar_wall = sum(r["wall_s"] for r in runs if r["label"] == "ar")
    summary = {}
    for job in jobs:
        mine = [r for r in runs if r["label"] == job.label]
        wall = sum(r["wall_s"] for r in mine)
        lengths = [n for r in mine for n in r["acceptance_lengths"]]
        entry = {
            "tau": sum(lengths) / len(lengths) if lengths else 0.0,
            "tokens_per_s": sum(r["new_tokens"] for r in mine) / wall if wall else 0.0,
            "speedup_vs_ar": ar_wall / wall if ar_wall and wall else None,
        }
        if ar_wall and job.label != "ar":
            identical = sum(1 for r in mine if r.get("divergence") is None)
            entry["identical_to_ar"] = f"{identical}/{len(mine)}"
        summary[job.label] = entry
    return summary


def benchmark(decoder: Decoder, prompts: list[dict], jobs: list[Job], base: DecodeSettings,
              traces_dir: Path | None = None, progress: bool = True) -> tuple[list[dict], list[str]]:
    """Run every job on every prompt; returns run records and human-readable notes."""
    notes: list[str] = []
    for job in tqdm(jobs, desc="warm-up", disable=not progress, leave=False):
        decoder.run(prompts[0]["prompt"], _settings(base, job, max_new_tokens=min(8, base.max_new_tokens)))
    runs: list[dict] = []
    bar = tqdm(total=len(prompts) * len(jobs), desc="bench", disable=not progress)
    for prompt in prompts:
        ar_trace = None
        for job in jobs:
            bar.set_postfix_str(f"{prompt['id']} {job.label}")
            trace = decoder.run(prompt["prompt"], _settings(base, job))
            record = run_record(prompt, job, trace)
            if job.label == "ar":
                ar_trace = trace
            elif ar_trace is not None:
                record["divergence"] = divergence(trace, ar_trace)
                if record["divergence"] and base.temperature == 0:
                    notes.append(_divergence_note(prompt["id"], job.label, record["divergence"]))
            notes += [f"{prompt['id']} {job.label}: {n}" for n in trace.config.notes]
            runs.append(record)
            if traces_dir is not None:
                trace.save(traces_dir / f"{prompt['id']}.{job.label}.json")
            bar.update()
    bar.close()
    return runs, notes


def _settings(base: DecodeSettings, job: Job, **overrides) -> DecodeSettings:
    fields = {**base.__dict__, "method": job.method, "tree_budget": job.tree_budget or base.tree_budget, **overrides}
    return DecodeSettings(**fields)


def _divergence_note(prompt_id: str, label: str, div: dict) -> str:
    gap = "n/a" if div["ar_margin"] is None else f"{div['ar_margin']:.4f}"
    verdict = "a numerical near-tie" if div["near_tie"] else "NOT a near-tie: investigate"
    return f"{prompt_id} {label}: diverges from AR at new token {div['index']}; AR top-2 logit gap {gap} ({verdict})"


def format_summary(summary: dict) -> str:
    rows = ["| method | τ | tokens/s | speedup vs AR | identical to AR |", "|---|---|---|---|---|"]
    for label, s in summary.items():
        speedup = "–" if s["speedup_vs_ar"] is None else f"{s['speedup_vs_ar']:.2f}×"
        rows.append(f"| {label} | {s['tau']:.2f} | {s['tokens_per_s']:.1f} | {speedup} | {s.get('identical_to_ar', '–')} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="JSONL file, one {\"id\", \"prompt\"} per line")
    parser.add_argument("--methods", default="ar,dflash,ddtree")
    parser.add_argument("--tree-budget", default="32", help="DDTree node budget; a comma list sweeps")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="HF folder or id, or a .gguf file (default: bundled SmolLM2)")
    parser.add_argument("--drafter", default=None, help="DFlash checkpoint folder, or 'random' (default: shipped)")
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default), float64, bfloat16 (CUDA default)")
    parser.add_argument("--block-size", type=int, default=None, help="draft block size (default: the drafter's)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--traces", default=None, help="folder to write each run's Trace JSON into")
    parser.add_argument("--out", default=None, help="results JSON path")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _main(args)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    from engine.models import load_decoder

    if args.engine != "torch":
        raise EngineError("the vllm engine is not available in this build yet; use --engine torch")
    prompts = read_prompts(args.prompts)[: args.limit]
    jobs = plan_jobs(args.methods, args.tree_budget)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    started = time.perf_counter()
    decoder = load_decoder(args.model, args.drafter, device=args.device, dtype=dtype, seed=args.seed)
    base = DecodeSettings("ar", max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                          block_size=args.block_size, tree_budget=32)
    traces_dir = Path(args.traces) if args.traces else None
    if traces_dir is not None:
        traces_dir.mkdir(parents=True, exist_ok=True)
    runs, notes = benchmark(decoder, prompts, jobs, base, traces_dir, progress=not args.no_progress)
    summary = summarize_runs(runs, jobs)
    config = {
        "command": "python -m engine.bench " + " ".join(sys.argv[1:]),
        "model": decoder.target.name, "drafter": decoder.drafter_info.name, "drafter_trained": decoder.drafter_info.trained,
        "engine": args.engine, "device": str(decoder.target.device), "dtype": dtype,
        "block_size": args.block_size or decoder.drafter.block_size, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "seed": args.seed, "tree_budgets": [j.tree_budget for j in jobs if j.tree_budget],
        "prompts": args.prompts, "num_prompts": len(prompts), "host": _host(), "total_s": time.perf_counter() - started,
    }
    result = {"config": config, "runs": runs, "summary": summary, "notes": notes}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    for note in notes:
        print(note)
    print(format_summary(summary))
    return 0


def _host() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


if __name__ == "__main__":
    sys.exit(main())
