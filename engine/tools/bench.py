"""Benchmark AR, DFlash and DDTree on a prompt set, in one process, one clock.

    python -m engine.tools.bench --prompts PROMPTS.jsonl --methods ar,dflash,ddtree --tree-budget 32 \\
        --max-new-tokens 64 --device cpu --out results.json

Each method runs warm (one untimed warm-up per method first, long enough for a second step, and
every prompt's first step once) and alone, prompt by prompt, or with ``--interleave`` in turns
(``engine.loop.race``), so that a load on the machine falls on every method alike. Speedup is the
method's tokens per second over AR's, measured in this run. The results' ``disturbance`` says when
the timings were not this machine's own (``engine.measure.fairness``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from engine.errors import EngineError, run_command
from engine.gpu.profiling import KernelProfile
from engine.loop.decode import Decoder
from engine.loop.loading import AUTO, DRAFT_DTYPE_HELP, RANDOM, load_decoder, shipped_drafter
from engine.loop.race import TURN_S
from engine.loop.settings import DecodeSettings
from engine.measure.calibration import recorded_choice
from engine.measure.economics import Timing, economics
from engine.measure.fairness import ArReference, slow_ar, uneven_pace
from engine.methods import BASELINE, NAMES, budget_sweep, method
from engine.models.drafter import weights_digest
from engine.models.target import BUNDLED_MODEL
from engine.on_vllm.vllm_engine import (
    NATIVE_DECODERS,
    NATIVE_MAX_SEQS,
    NativeDecoder,
    VllmOptions,
    check_mtp_layers,
    load_vllm_decoder,
)
from engine.trace import (
    NATIVE_AR,
    NEAR_TIE,
    STAGES,
    TOKENS_ONLY,
    Trace,
    divergence,
    write_trace_file,
)

NUMERICS_ENVIRONMENT = ("TRITON_F32_DEFAULT",)  # recorded in front of the command when set


@dataclass(frozen=True)
class Job:
    label: str
    method: str  # a Studio method's name; for one of vLLM's own decoders, what ``--native`` calls it
    tree_budget: int | None
    trace_detail: str = "full"
    native: NativeDecoder | None = None  # vLLM's own decoder this job times, if it is one

    @property
    def drafts(self) -> bool:
        return self.native.drafts if self.native is not None else method(self.method).drafts


def with_reduced_traces(jobs: list[Job]) -> list[Job]:
    """Every job twice: with the full per-step trace (what the app shows), then with a trace of
    the committed tokens only, so the bench shows what recording costs."""
    return [twin for job in jobs
            for twin in (job, replace(job, label=job.label + TOKENS_ONLY, trace_detail="tokens"))]


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
        category = item.get("category") or item.get("source")
        prompts.append({"id": str(item.get("id", number)), "prompt": item["prompt"], "category": category})
    if not prompts:
        raise EngineError(f"prompts file {path!r} holds no prompts")
    return prompts


def plan_jobs(methods: str, budgets: str) -> list[Job]:
    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in NAMES]
    if unknown or not names:
        raise EngineError(f"unknown method(s) {unknown or methods!r}; choose from {', '.join(NAMES)}")
    try:
        budget_values = [int(b) for b in budgets.split(",")]
    except ValueError as exc:
        raise EngineError(f"--tree-budget takes whole numbers separated by commas, got {budgets!r}") from exc
    if any(b < 1 for b in budget_values):
        raise EngineError(f"--tree-budget must be at least 1 (the number of drafted nodes per step), got {budgets!r}")
    rows = [method(name) for name in names]
    return [Job(row.label(budget), row.name, budget) for row in rows
            for budget in (budget_values if row.budgeted else [None])]


def divergence_record(trace: Trace, reference: Trace) -> dict | None:
    """``engine.trace.divergence`` as the results file keeps it."""
    found = divergence(trace, reference)
    return None if found is None else {**asdict(found), "near_tie": found.near_tie}


def run_record(prompt: dict, job: Job, trace: Trace) -> dict:
    summary = trace.summary
    return {
        "prompt_id": prompt["id"], "category": prompt.get("category"), "method": job.method, "label": job.label,
        "tree_budget": job.tree_budget, "prefill_s": summary.time_to_first_token_s,
        "prefill_stage_s": trace.prefill.stage_s,
        "output_ids": trace.output_ids, "text": trace.text, "new_tokens": summary.new_tokens,
        "verify_steps": summary.steps, "acceptance_lengths": summary.acceptance_lengths, "tau": summary.tau,
        "wall_s": summary.wall_s, "tokens_per_s": summary.tokens_per_s, "stage_s": summary.stage_s,
        "step": trace.config.step,
    }


def per_category(prompts: list[dict], count: int | None) -> list[dict]:
    """The first ``count`` prompts of each category, in file order (``None``: all of them)."""
    if count is None:
        return prompts
    taken: dict[str | None, int] = {}
    chosen = []
    for prompt in prompts:
        category = prompt.get("category")
        if taken.get(category, 0) < count:
            taken[category] = taken.get(category, 0) + 1
            chosen.append(prompt)
    return chosen


def summarize_runs(runs: list[dict], jobs: list[Job]) -> dict:
    """Per method: τ, tokens/s, and speed-ups as throughput ratios (outputs of different lengths,
    e.g. bf16 near-ties, would make wall-time ratios lie)."""
    timings = {job.label: run_timing([r for r in runs if r["label"] == job.label]) for job in jobs}
    ar_speed = timings[BASELINE.label()].tokens_per_s if BASELINE.label() in timings else None
    vllm_ar_speed = timings[NATIVE_AR].tokens_per_s if NATIVE_AR in timings else None
    steps = economics({label: timing for label, timing in timings.items()
                       if label not in {native.label for native in NATIVE_DECODERS}})
    summary = {}
    for job in jobs:
        mine = [r for r in runs if r["label"] == job.label]
        speed = timings[job.label].tokens_per_s
        lengths = [n for r in mine for n in r["acceptance_lengths"]]
        entry = {
            "tau": sum(lengths) / len(lengths) if lengths else float(not job.drafts),
            "tokens_per_s": speed or 0.0,
            "speedup_vs_ar": speed / ar_speed if speed is not None and ar_speed else None,
        }
        if job.label in steps:
            entry |= {key: getattr(steps[job.label], key)
                      for key in ("step_ms", "step_cost_vs_ar", "predicted_speedup")}
        categories = sorted({r["category"] for r in mine if r.get("category")})
        if categories:
            entry["tau_by_category"] = {category: _tau([r for r in mine if r.get("category") == category])
                                        for category in categories}
        if "drafts" in mine[0]:  # vLLM's own DFlash reports counters, not per-step lengths
            drafts = sum(r["drafts"] for r in mine)
            entry["tau"] = 1 + sum(r["accepted"] for r in mine) / drafts if drafts else 0.0
        if vllm_ar_speed:
            entry["speedup_vs_vllm_ar"] = speed / vllm_ar_speed if speed is not None else None
        checked = [r for r in mine if "divergence" in r]  # vLLM's own runs are checked against vLLM AR only
        if checked:
            identical = sum(1 for r in checked if r["divergence"] is None)
            entry["identical_to_ar"] = f"{identical}/{len(checked)}"
            entry["near_ties_vs_ar"] = sum(1 for r in checked if r["divergence"] and r["divergence"]["near_tie"])
        for key in ("identical_to_vllm_ar", "identical_to_reference"):
            compared = [r[key] for r in mine if key in r]
            if compared:
                entry[key] = f"{sum(compared)}/{len(compared)}"
        summary[job.label] = entry
    return summary


def run_timing(runs: list[dict]) -> Timing:
    return Timing(sum(r["wall_s"] for r in runs), sum(r.get("prefill_s") or 0.0 for r in runs),
                  sum(r.get("verify_steps") or 0 for r in runs), sum(sum(r["acceptance_lengths"]) for r in runs),
                  sum(r["new_tokens"] for r in runs))


def _tau(runs: list[dict]) -> float:
    lengths = [n for r in runs for n in r["acceptance_lengths"]]
    return sum(lengths) / len(lengths) if lengths else 0.0


def best_budget(summary: dict) -> dict | None:
    """The DDTree budget with the most tokens/s in this run (what the machine favours)."""
    sweep = budget_sweep(summary)
    if not sweep:
        return None
    budget = max(sweep, key=lambda at: summary[sweep[at]]["tokens_per_s"])
    return {"label": sweep[budget], "tree_budget": budget, **summary[sweep[budget]]}


def prompt_tokens(decoder, prompt: dict) -> list[int]:
    """The tokens to decode for ``prompt``: those ``tokenize_prompts`` set, else its chat template's."""
    return prompt.get("ids") or decoder.target.chat_ids(prompt["prompt"])


def benchmark(decoder: Decoder, prompts: list[dict], jobs: list[Job], base: DecodeSettings,
              traces_dir: Path | None = None, progress: bool = True, interleave: bool = False,
              reference: ArReference | None = None) -> tuple[list[dict], list[str], list[str]]:
    """Run every job on every prompt, each whole one after another or (``interleave``) in turns; returns run
    records, human-readable notes and what disturbed the timings (``engine.measure.fairness``: AR against
    ``reference``, and each run's pace over its stretches)."""
    notes: list[str] = []
    disturbed: list[str] = []
    ar_traces: list[Trace] = []
    for job in tqdm(jobs, desc="warm-up", disable=not progress, leave=False):
        decoder.run(prompts[0]["prompt"], _settings(base, job).warm_up(), prompt_ids=prompt_tokens(decoder, prompts[0]))
    # every prompt's first step once: on a GPU each fixed program captures a graph per padded prompt
    # length, for the target's pass and the drafter's first one (on the CPU nothing is captured)
    first_steps = [Job(BASELINE.label(), BASELINE.name, None)]
    if decoder.target.device.type == "cuda":
        first_steps += list({(job.method, job.tree_budget): job for job in jobs if job.drafts}.values())
    for prompt in prompts[1:]:
        for job in first_steps:
            decoder.run(prompt["prompt"], _settings(base, job, max_new_tokens=1),
                        prompt_ids=prompt_tokens(decoder, prompt))
    runs: list[dict] = []
    bar = tqdm(total=len(prompts) * len(jobs), desc="bench", disable=not progress)
    for prompt in prompts:
        bar.set_postfix_str(prompt["id"])
        # in turns (``--interleave``) or each whole, one after another (a turn that never ends)
        race = decoder.race(prompt["prompt"], [_settings(base, job) for job in jobs],
                            prompt_ids=prompt_tokens(decoder, prompt), turn_s=TURN_S if interleave else math.inf)
        ar_trace = None
        for job, trace, turns in zip(jobs, race.traces, race.turns):
            record = run_record(prompt, job, trace)
            if interleave:
                record["turns"] = turns
            if job.label == BASELINE.label():
                ar_trace = trace
            elif ar_trace is not None:
                record["divergence"] = divergence_record(trace, ar_trace)
                if record["divergence"] and base.temperature == 0:
                    notes.append(_divergence_note(prompt["id"], job.label, record["divergence"]))
            notes += [note for note in (f"{job.label}: {n}" for n in trace.config.notes) if note not in notes]
            runs.append(record)
            if traces_dir is not None:
                trace.save(traces_dir / f"{prompt['id']}.{job.label}.json")
            bar.update()
        disturbed += [f"{prompt['id']}: {finding}" for finding in filter(None, map(uneven_pace, race.traces))]
        ar_traces += [ar_trace] if ar_trace is not None else []
    bar.close()
    slow = slow_ar(ar_traces, reference)
    return runs, notes, ([slow] if slow else []) + disturbed


def plan_native_jobs(spec: str) -> list[Job]:
    """``--native ar,ar-graphless,dflash,mtp``: which of vLLM's own decoders to time beside ours."""
    wanted = {m.strip() for m in spec.split(",") if m.strip()}
    options = [native.option for native in NATIVE_DECODERS]
    if wanted - set(options):
        raise EngineError(f"--native takes {', '.join(options[:-1])} and/or {options[-1]}, got {spec!r}")
    return [Job(native.label, native.option, None, native=native) for native in NATIVE_DECODERS
            if native.option in wanted]


def benchmark_native(decoder, prompts: list[dict], jobs: list[Job], args: argparse.Namespace, dtype: str,
                     progress: bool = True) -> tuple[list[dict], list[str]]:
    """vLLM as it ships (CUDA graphs on): its AR and/or its DFlash with our drafter, on the same
    prompts, once the Studio's engine has given the GPU back (at 27B the two do not fit side by side). A
    baseline vLLM refuses to start is reported in the notes; the runs already made stay."""
    from engine.on_vllm.vllm_engine import native_acceptance, native_generate, native_llm

    decoder.close()
    torch.cuda.empty_cache()
    prompt_ids = [prompt_tokens(decoder, p) for p in prompts]
    runs: list[dict] = []
    notes: list[str] = []
    options = getattr(decoder, "options", None) or VllmOptions()  # the torch engine on a GPU has none
    if args.native_max_seqs is not None:
        options = replace(options, native_max_seqs=args.native_max_seqs)
    for job in jobs:
        native = job.native
        drafter = str(_drafter_folder(args)) if native.our_drafter else None
        drafted = decoder.drafter.block_size - 1 if drafter else args.native_mtp_tokens if native.mtp else 0
        try:
            llm = native_llm(args.model, dtype, drafter, drafted, seed=args.seed, options=options, mtp=native.mtp,
                             cuda_graphs=native.cuda_graphs)
        except Exception as exc:  # vLLM's own checks raise pydantic, value and runtime errors alike
            notes.append(f"{job.label} not timed: vLLM did not start it: {' '.join(str(exc).split())}")
            continue
        native_generate(llm, prompt_ids[0], 8, decoder.target.stop_ids)  # warm-up, untimed
        for prompt, ids in tqdm(list(zip(prompts, prompt_ids)), desc=job.label, disable=not progress):
            before = native_acceptance(llm)
            run = native_generate(llm, ids, args.max_new_tokens, decoder.target.stop_ids)
            after = native_acceptance(llm)
            record = {"prompt_id": prompt["id"], "method": job.method, "label": job.label, "tree_budget": None,
                      "output_ids": run.output_ids, "text": decoder.target.decode(run.output_ids),
                      "new_tokens": len(run.output_ids), "verify_steps": None, "acceptance_lengths": [],
                      "wall_s": run.wall_s, "tokens_per_s": len(run.output_ids) / run.wall_s, "stage_s": {}}
            if native.drafts:
                record["drafts"], record["accepted"] = after[0] - before[0], after[1] - before[1]
            if job.label == NATIVE_AR:  # where a run leaves vLLM's output, how close was vLLM to a tie?
                record["margins"] = native_generate(llm, ids, args.max_new_tokens, decoder.target.stop_ids,
                                                    margins=True).margins
            runs.append(record)
        del llm
        torch.cuda.empty_cache()
    return runs, notes


def native_ar_settings(max_seqs: int | None) -> str:
    """How vLLM's own AR ran, for the results (``--native-max-seqs``: None is the baseline's own)."""
    max_seqs = NATIVE_MAX_SEQS if max_seqs is None else max_seqs
    seqs = f"max_num_seqs {max_seqs}" if max_seqs else "vLLM's default max_num_seqs"
    return f"CUDA graphs (vLLM's default mode: full and piecewise), async scheduling, {seqs}"


def compare_outputs(runs: list[dict], reference: dict[str, dict], key: str, name: str) -> list[str]:
    """Mark every run whose prompt ``reference`` answered (prompt id -> run) as identical to that
    output or not (``identical_to_{key}``); where one differs, record the first differing token and
    the reference's top-2 logit gap there (when it kept its margins). Return a note per difference."""
    notes = []
    for run in runs:
        theirs = reference.get(run["prompt_id"])
        if theirs is None or theirs is run:
            continue
        ours, expected = run["output_ids"], theirs["output_ids"]
        run[f"identical_to_{key}"] = ours == expected
        if ours != expected:
            index = next((i for i, (a, b) in enumerate(zip(ours, expected)) if a != b), min(len(ours), len(expected)))
            margins = theirs.get("margins") or []
            gap = margins[index] if index < len(margins) else None
            run[f"{key}_divergence"] = {"index": index, "margin": gap, "near_tie": gap is not None and gap < NEAR_TIE}
            verdict = ("n/a" if gap is None else
                       f"{gap:.4f} ({'a numerical near-tie' if gap < NEAR_TIE else 'NOT a near-tie: investigate'})")
            notes.append(f"{run['prompt_id']} {run['label']}: differs from {name} at new token {index}; "
                         f"{name}'s top-2 logit gap there {verdict}")
    return notes


def read_results(path: str) -> dict:
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineError(f"{path}: not a readable bench result ({exc})") from None
    if not isinstance(results, dict) or not isinstance(results.get("runs"), list):
        raise EngineError(f"{path}: not a readable bench result (no runs)")
    return results


def recorded_runs(path: str, label: str | None = None) -> tuple[str, dict[str, dict]]:
    """A bench result's runs of one label, by prompt id: ``label``, or where none is given vLLM's own
    AR if that run timed it, else the Studio's AR. Returns the label too."""
    runs = read_results(path)["runs"]
    label = label or (NATIVE_AR if any(run.get("label") == NATIVE_AR for run in runs) else BASELINE.label())
    # a run without a label (an older file) is named by its method
    return label, {run["prompt_id"]: run for run in runs if (run.get("label") or run.get("method")) == label}


def reference_outputs(path: str, prompts: list[dict]) -> dict[str, dict]:
    """``--compare-to``: another bench run's AR answer to each of these prompts (vLLM's own AR where
    that run timed it, else the Studio's AR), by prompt id; a clear error when one is missing."""
    label, answers = recorded_runs(path)
    missing = [prompt["id"] for prompt in prompts if prompt["id"] not in answers]
    if missing:
        raise EngineError(f"--compare-to {path}: no {label} run for {len(missing)} of these prompts "
                          f"(first: {missing[0]}); bench it on the same prompts with --methods ar")
    return {prompt["id"]: answers[prompt["id"]] for prompt in prompts}


def tokenize_prompts(target, prompts: list[dict], reference: str | None) -> list[str]:
    """Each prompt's token ids (``prompt["ids"]``): those the ``reference`` run (``--compare-to``, a
    replay's ``--ar-outputs``) recorded, else this target's chat template. Two machines can tokenize
    one text apart (transformers 5.24 loads a Qwen3.5 folder's tokenizer with Qwen's own split, which
    makes a blank line one token where 5.17 kept two): a comparison must decode the same tokens.
    Returns a note per prompt that differs."""
    recorded = read_results(reference).get("config", {}).get("prompt_ids", {}) if reference else {}
    notes = []
    for prompt in prompts:
        prompt["ids"] = ours = target.chat_ids(prompt["prompt"])
        theirs = recorded.get(prompt["id"])
        if theirs is not None and theirs != ours:
            prompt["ids"] = theirs
            notes.append(f"{prompt['id']}: tokenized here as {len(ours)} tokens, by {Path(reference).name}'s run as "
                         f"{len(theirs)}: decoding that run's tokens")
    return notes


def _settings(base: DecodeSettings, job: Job, **overrides) -> DecodeSettings:
    budget = job.tree_budget if job.tree_budget is not None else base.tree_budget
    fields = {**base.__dict__, "method": job.method, "tree_budget": budget, "trace_detail": job.trace_detail,
              **overrides}
    return DecodeSettings(**fields)


def _divergence_note(prompt_id: str, label: str, div: dict) -> str:
    gap = "n/a" if div["ar_margin"] is None else f"{div['ar_margin']:.4f}"
    verdict = "a numerical near-tie" if div["near_tie"] else "NOT a near-tie: investigate"
    return f"{prompt_id} {label}: diverges from AR at new token {div['index']}; AR top-2 logit gap {gap} ({verdict})"


def _identical_cell(entry: dict) -> str:
    """"9/24", with how many of the others left AR at a near-tie: "9/24 (15 at near-ties)"."""
    identical, ties = entry.get("identical_to_ar", "–"), entry.get("near_ties_vs_ar")
    return f"{identical} ({ties} at near-ties)" if ties else identical


def format_summary(summary: dict, best: dict | None = None) -> str:
    native = any("speedup_vs_vllm_ar" in s for s in summary.values())
    compared = any("identical_to_reference" in s for s in summary.values())
    head = ("| method | τ | step cost (AR steps) | predicted τ ÷ cost | tokens/s | speedup vs AR |"
            + (" vs vLLM AR | identical to vLLM AR |" if native else "")
            + (" identical to --compare-to |" if compared else ""))
    rows = [head + " identical to AR |",
            "|---|---|---|---|---|---|" + ("---|---|" if native else "") + ("---|" if compared else "") + "---|"]
    shown = list(summary.items()) + ([(f"best: {best['label']}", best)] if best else [])
    for label, s in shown:
        cost = s.get("step_cost_vs_ar")
        cells = [label, f"{s['tau']:.2f}", "–" if cost is None else f"{cost:.2f}", _times(s.get("predicted_speedup")),
                 f"{s['tokens_per_s']:.1f}", _times(s["speedup_vs_ar"])]
        if native:
            cells += [_times(s.get("speedup_vs_vllm_ar")), s.get("identical_to_vllm_ar", "–")]
        if compared:
            cells.append(s.get("identical_to_reference", "–"))
        rows.append("| " + " | ".join(cells + [_identical_cell(s)]) + " |")
    return "\n".join(rows)


def _times(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}×"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="JSONL file, one {\"id\", \"prompt\"} per line")
    parser.add_argument("--methods", default=",".join(NAMES))
    parser.add_argument("--tree-budget", default="32", help="DDTree node budget; a comma list sweeps")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="HF folder or id, or a .gguf file (default: bundled SmolLM2)")
    parser.add_argument("--drafter", default=None, help="DFlash checkpoint folder, or 'random' (default: shipped)")
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default), float64, bfloat16 (CUDA default)")
    parser.add_argument("--draft-dtype", default=AUTO, help=DRAFT_DTYPE_HELP)
    parser.add_argument("--block-size", type=int, default=None, help="draft block size (default: the drafter's)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--per-category", type=int, default=None,
                        help="only the first N prompts of each category (a short run that still spans them all)")
    parser.add_argument("--traces", default=None, help="folder to write each run's Trace JSON into")
    parser.add_argument("--trace-file", default=None, metavar="FILE.json",
                        help="one prompt's runs in one file, as the app's download: what the app's upload and "
                             "python -m viz.video read (assets/traces/)")
    parser.add_argument("--out", default=None, help="results JSON path")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm engine: GPUs per model")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="GPU: run the Studio's passes eagerly")
    parser.add_argument("--step", choices=["fixed", "readable"], default=None,
                        help="greedy steps as fixed-shape device programs (default on a GPU; CUDA graphs unless "
                             "--no-cuda-graphs) or the readable loop (default on the CPU)")
    parser.add_argument("--compile-step", action="store_true",
                        help="fixed step: its draft pass, tree and walk through torch.compile, and on the vLLM "
                             "engine the target's verify pass too (fused kernels; compiles at first use)")
    parser.add_argument("--vllm-compile", action=argparse.BooleanOptionalAction, default=None,
                        help="vllm engine: vLLM compiles the target itself (its inductor graph, one for every pass "
                             "size) instead of running it eagerly; the Studio's CUDA graphs replay it as before "
                             "(default for hybrid targets; --no-vllm-compile runs them eagerly)")
    parser.add_argument("--interleave", action="store_true",
                        help=f"give each prompt's runs turns of {TURN_S:g} s, round after round, each on its own "
                             "clock, instead of running each whole one after another: a load on the machine falls on "
                             "every method alike (the results' disturbance says when AR ran far below this machine "
                             "kind's record, or a run's pace changed)")
    parser.add_argument("--reduced-traces", action="store_true",
                        help="also time every method with traces kept to the committed tokens (label suffix :tokens)")
    parser.add_argument("--count-kernels", action="store_true",
                        help="CUDA: count kernels per step by stage (profiler, one run of the first prompt per method)")
    parser.add_argument("--random-weights", action="store_true",
                        help="--model and --drafter are config-only folders (assets/shapes/): random weights, "
                             "timing only (runs ignore end-of-sequence and decode their full length)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="vllm engine: share of GPU memory vLLM may take (large shapes need more)")
    parser.add_argument("--compare-to", default=None, metavar="RESULTS.json",
                        help="another bench run on the same prompts (another engine, machine or dtype): count this "
                             "run's outputs identical to its AR (vLLM's own AR where it ran)")
    parser.add_argument("--native", default="", metavar="ar,dflash,mtp",
                        help="vllm engine: also time vLLM's own AR, DFlash and/or MTP (the target's own multi-token "
                             "prediction layers, e.g. Qwen3.5 / 3.6; CUDA graphs on) on the same prompts; "
                             "ar-graphless: its AR compiled without its CUDA graphs, as --vllm-compile runs the "
                             "Studio's (whether vLLM's graphs change its own numbers)")
    parser.add_argument("--native-mtp-tokens", type=int, default=3, metavar="N",
                        help="--native mtp: tokens its MTP layers draft per step (default 3, the vLLM and SGLang "
                             "recipes' setting for Qwen3-Next / Qwen3.5)")
    parser.add_argument("--native-max-seqs", type=int, default=None, metavar="N",
                        help="--native: vLLM's max_num_seqs for its own runs (default: "
                             f"{NATIVE_MAX_SEQS}, its fastest measured for one request; 0: vLLM's shipped default)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, parse_args(argv))


def on_gpu(args: argparse.Namespace) -> bool:
    return args.engine == "vllm" or args.device.startswith("cuda")


def _main(args: argparse.Namespace) -> int:
    prompts = per_category(read_prompts(args.prompts), args.per_category)[: args.limit]
    jobs = plan_jobs(args.methods, args.tree_budget)
    if args.trace_file and len(prompts) != 1:
        raise EngineError(f"--trace-file holds one prompt's runs, as the app's download; the prompts give "
                          f"{len(prompts)}: pick one with --limit 1 or a one-prompt file")
    if args.reduced_traces:
        jobs = with_reduced_traces(jobs)
    gpu = on_gpu(args)
    if args.native and not gpu:
        raise EngineError("--native times vLLM's own decoding: it needs --engine vllm (or --device cuda)")
    if args.vllm_compile and args.engine != "vllm":
        raise EngineError("--vllm-compile has vLLM compile the target it serves: it needs --engine vllm")
    if args.native_max_seqs is not None and (not args.native or args.native_max_seqs < 0):
        raise EngineError(f"--native-max-seqs sets vLLM's own runs: it needs --native and a count (0: vLLM's "
                          f"default), got {args.native_max_seqs}" + ("" if args.native else " without --native"))
    if args.interleave and args.engine == "vllm":
        raise EngineError("--interleave gives the methods turns on one thread; the vLLM engine runs each generation "
                          "whole in its workers: bench it without --interleave")
    if args.count_kernels and not gpu:
        raise EngineError("--count-kernels counts CUDA kernels: it needs --engine vllm or --device cuda")
    native_jobs = plan_native_jobs(args.native)  # a typo fails here, not after the whole bench
    if any(job.native.mtp for job in native_jobs):
        check_mtp_layers(args.model)
    reference = reference_outputs(args.compare_to, prompts) if args.compare_to else {}
    args.step = args.step or ("fixed" if gpu else "readable")
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    started = time.perf_counter()
    decoder = _load(args, dtype)
    if any(job.native.our_drafter for job in native_jobs) and decoder.drafter is None:
        raise EngineError("--native dflash needs a drafter: pass --drafter")
    tokenized = tokenize_prompts(decoder.target, prompts, args.compare_to)
    base = DecodeSettings(BASELINE.name, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          seed=args.seed, block_size=args.block_size, tree_budget=32)
    traces_dir = Path(args.traces) if args.traces else Path(tempfile.mkdtemp()) if args.trace_file else None
    if traces_dir is not None:
        traces_dir.mkdir(parents=True, exist_ok=True)
    recorded = recorded_choice(decoder)
    runs, notes, disturbance = benchmark(decoder, prompts, jobs, base, traces_dir, progress=not args.no_progress,
                                         interleave=args.interleave, reference=recorded.ar if recorded else None)
    if args.trace_file:
        write_trace_file(args.trace_file, [Trace.load(traces_dir / f"{prompts[0]['id']}.{job.label}.json")
                                           for job in jobs])
    notes = tokenized + notes
    measured = Measured(jobs, runs, notes, {}, disturbance)
    config = run_config(args, decoder, dtype, prompts, jobs, runs)
    # What follows can take minutes at real shapes (kernel counts profile every method once more; vLLM's own
    # decoding starts a second engine and compiles its graphs): whatever stops the run there (a device call's
    # time limit), the Studio's numbers are already on disk.
    pending = (("kernels",) if args.count_kernels else ()) + (("native",) if native_jobs else ())
    if args.count_kernels:
        report(args.out, config, started, measured, pending)
        measured.kernels = count_kernels(decoder, prompts[0], jobs, base)
    if native_jobs:
        report(args.out, config, started, measured, ("native",))
        native_runs, native_notes = benchmark_native(decoder, prompts, native_jobs, args, dtype,
                                                     progress=not args.no_progress)
        runs += native_runs
        jobs += [job for job in native_jobs if any(run["label"] == job.label for run in native_runs)]
        notes += native_notes + compare_outputs(runs, {r["prompt_id"]: r for r in runs if r["label"] == NATIVE_AR},
                                                "vllm_ar", "vLLM AR")
    if reference:
        notes += compare_outputs(runs, reference, "reference", f"{Path(args.compare_to).name}'s AR")
    report(args.out, config, started, measured)
    return 0


@dataclass
class Measured:
    """What a bench run has measured so far (its lists grow as vLLM's own decoding adds to them)."""

    jobs: list[Job]
    runs: list[dict]
    notes: list[str]
    kernels: dict[str, KernelProfile]
    disturbance: list[str] = field(default_factory=list)  # what disturbed the timings (``engine.measure.fairness``)


def run_config(args: argparse.Namespace, decoder, dtype: str, prompts: list[dict], jobs: list[Job],
               runs: list[dict]) -> dict:
    """How the run was made: the results file's ``config``."""
    gpu = on_gpu(args)
    # the step the drafting methods ran (AR's may differ: a scripted drafter's never runs as a graph)
    steps = (Counter(run["step"] for run in runs if method(run["method"]).drafts)
             or Counter(run["step"] for run in runs))
    step = steps.most_common(1)[0][0]
    return {
        "command": _command(),
        "model": decoder.target.name, "drafter": decoder.drafter_info.name,
        "drafter_trained": decoder.drafter_info.trained,
        "drafter_revision": None if args.random_weights else _drafter_revision(args),
        "timing_only": args.random_weights,
        "engine": args.engine, "device": str(decoder.target.device), "dtype": dtype, "draft_dtype": decoder.draft_dtype,
        "tensor_parallel_size": args.tensor_parallel_size if args.engine == "vllm" else None,
        "cuda_graphs": not args.no_cuda_graphs if gpu else None,
        "step": "readable" if step == "readable" else "fixed", "compile_step": step == "compiled fixed",
        "vllm_compile": decoder.options.vllm_compile if args.engine == "vllm" else None,
        "vllm_ar_settings": native_ar_settings(args.native_max_seqs) if args.native else None,
        "vllm_mtp_tokens": args.native_mtp_tokens if any(job.native.mtp for job in plan_native_jobs(args.native))
        else None,
        "block_size": args.block_size or decoder.drafter.block_size, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "seed": args.seed, "interleave": args.interleave,
        "tree_budgets": sorted({j.tree_budget for j in jobs if j.tree_budget}),
        "prompts": args.prompts, "num_prompts": len(prompts), "compared_to": args.compare_to, "host": _host(),
        "prompt_ids": {prompt["id"]: prompt_tokens(decoder, prompt) for prompt in prompts},  # for --compare-to
    }


def report(out: str | None, config: dict, started: float, measured: Measured, pending: tuple[str, ...] = ()) -> None:
    """The results file (when ``out`` names one) with everything measured so far; the tables on stdout once
    nothing is ``pending`` ("kernels": the kernel counts, "native": vLLM's own decoding; gpu_session.sh's
    `tables` stops at the first kernel table)."""
    summary = summarize_runs(measured.runs, measured.jobs)
    for label, profile in measured.kernels.items():
        summary[label]["kernels_per_step"] = profile.counts
        summary[label]["slowest_kernels"] = profile.slowest
    best = best_budget(summary)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        config = config | {"native_pending": "native" in pending, "kernels_pending": "kernels" in pending,
                           "total_s": time.perf_counter() - started}
        Path(out).write_text(json.dumps({"config": config, "runs": measured.runs, "summary": summary, "best": best,
                                         "notes": measured.notes, "disturbance": measured.disturbance}, indent=1))
    if pending:
        follows = " and ".join({"kernels": "the kernel counts", "native": "vLLM's own decoding"}[p] for p in pending)
        print(f"the Studio's runs are in {out or '(no --out)'}; {follows} follow", flush=True)
        return
    for note in measured.notes:
        print(note)
    for finding in measured.disturbance:
        print(f"the timings were disturbed: {finding}")
    print(format_summary(summary, best))
    if measured.kernels:
        print(format_kernels(measured.kernels))


def count_kernels(decoder, prompt: dict, jobs: list[Job], base: DecodeSettings) -> dict[str, KernelProfile]:
    """Kernels per step by stage, and the slowest, for every full-trace job, on one run of ``prompt`` each."""
    return {job.label: decoder.kernel_profile(prompt_tokens(decoder, prompt), _settings(base, job)) for job in jobs
            if job.trace_detail == "full"}


def format_kernels(kernels: dict[str, KernelProfile]) -> str:
    stages = [stage for stage in STAGES if any(stage in profile.counts for profile in kernels.values())]
    rows = ["| method | " + " | ".join(stages) + " | step |", "|---|" + "---|" * (len(stages) + 1)]
    for label, profile in kernels.items():
        cells = [f"{profile.counts[stage]:.0f}" if stage in profile.counts else "–" for stage in stages]
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {sum(profile.counts.values()):.0f} |")
    slowest = ["| method | stage | kernel | µs per step |", "|---|---|---|---|"]
    slowest += [f"| {label} | {stage} | `{name}` | {micros:.1f} |" for label, profile in kernels.items()
                for stage in stages for name, micros in profile.slowest.get(stage, [])]
    return ("kernels per step, by stage\n" + "\n".join(rows) + "\n\nslowest kernels per step, by stage\n"
            + "\n".join(slowest))


def _load(args: argparse.Namespace, dtype: str):
    if args.engine == "vllm":
        options = VllmOptions(tensor_parallel_size=args.tensor_parallel_size, cuda_graphs=not args.no_cuda_graphs,
                              fixed_step=args.step == "fixed", compile_step=args.compile_step,
                              random_weights=args.random_weights, gpu_memory_utilization=args.gpu_memory_utilization,
                              vllm_compile=args.vllm_compile)
        return load_vllm_decoder(args.model, args.drafter, dtype=dtype, seed=args.seed, options=options)
    return load_decoder(args.model, args.drafter, device=args.device, dtype=dtype, seed=args.seed,
                        fixed_step=args.step == "fixed",
                        cuda_graphs=args.step == "fixed" and not args.no_cuda_graphs and on_gpu(args),
                        compile_step=args.compile_step, random_weights=args.random_weights,
                        draft_dtype=args.draft_dtype)


def _drafter_folder(args: argparse.Namespace):
    """The drafter folder the run uses: ``--drafter``, or the shipped one for the bundled model."""
    if args.drafter == RANDOM:
        return None
    return args.drafter or (shipped_drafter() if args.model in (None, BUNDLED_MODEL) else None)


def _drafter_revision(args: argparse.Namespace) -> str | None:
    """The weights' fingerprint of the drafter folder the run used (none for a random drafter)."""
    folder = _drafter_folder(args)
    return weights_digest(folder) if folder else None


def _command() -> str:
    """The command line, behind the settings of the environment that change the numbers (Triton's
    float32 dots: TF32 unless ``TRITON_F32_DEFAULT`` says otherwise)."""
    settings = [f"{name}={os.environ[name]}" for name in NUMERICS_ENVIRONMENT if name in os.environ]
    return " ".join([*settings, "python -m engine.tools.bench", *sys.argv[1:]])


def _host() -> dict:
    import transformers  # its version decides how some tokenizers split a prompt

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


if __name__ == "__main__":
    sys.exit(main())
