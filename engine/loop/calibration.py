"""Pick the DDTree budget that is fastest on this machine: measured by the bench, or timed at start-up.

Where a bench run on this kind of machine (device, engine, dtype, step, drafter weights) has been
recorded in ``assets/budgets.json`` (``python -m engine.loop.calibration record RESULTS.json``), its
best budget is the page's default: the app then starts with what the bench found fastest there.
Otherwise the start-up timing below chooses.

Speed-up = τ ÷ step cost. τ at each budget is the drafter's: its measured acceptance curve
(``acceptance`` in the drafter's config.json, written from a bench run on prompts it never
saw) or, for drafters without one, what the calibration runs themselves accept. The step
cost is the machine's: a short AR run and a short DDTree run per candidate budget on one
prompt, each after a warm-up, timed per step (prefill excluded). A wide tree is nearly free
on a GPU and costly on two CPU cores, so the best budget differs by machine. The runs also warm every method up,
so the page's first runs do not pay one-time costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.loop.decode import DecodeSettings, Decoder, step_kind
from engine.loop.economics import Economics, Timing, economics

CANDIDATE_BUDGETS = (4, 8, 16, 32, 64)
CALIBRATION_PROMPT = "Explain briefly how a refrigerator keeps food cold."
CALIBRATION_TOKENS = 16
FALLBACK_BUDGET = 32  # no drafter to calibrate
MEASURED_BUDGETS = Path(__file__).resolve().parent.parent.parent / "assets" / "budgets.json"


@dataclass(frozen=True)
class BudgetChoice:
    budget: int
    table: dict[int, Economics]  # per candidate budget: τ (the curve's), step cost, predicted speed-up
    tau_source: str
    seconds: float
    measured: dict | None = None  # the bench's record for this machine, when it decided

    def sentence(self) -> str:
        if self.measured is not None:
            m = self.measured
            return (f"DDTree budget {self.budget} is the fastest here: the bench on this machine measured "
                    f"{m['tokens_per_s']:.0f} tokens/s at it, {m['speedup_vs_ar']:.2f}× AR (τ {m['tau']:.2f}; "
                    f"{m['prompts']}, {m['results']}).")
        entry = self.table.get(self.budget)
        if entry is None or entry.predicted_speedup is None:
            return f"DDTree budget {self.budget} ({self.tau_source})."
        return (f"DDTree budget {self.budget} is the fastest here: τ {entry.tau:.2f} ÷ step cost "
                f"{entry.step_cost_vs_ar:.2f} AR steps = {entry.predicted_speedup:.2f}× predicted "
                f"(τ from {self.tau_source}; step costs timed at start-up in {self.seconds:.1f} s).")


def acceptance_curve(decoder: Decoder) -> dict[int, float]:
    """The drafter's measured τ per DDTree budget, if its checkpoint records one."""
    recorded = decoder.drafter.config.acceptance if decoder.drafter is not None else {}
    return {int(budget): float(tau) for budget, tau in recorded.get("ddtree", {}).items()}


def choose_budget(decoder: Decoder, budgets: tuple[int, ...] = CANDIDATE_BUDGETS,
                  prompt: str = CALIBRATION_PROMPT, tokens: int = CALIBRATION_TOKENS) -> BudgetChoice:
    began = time.perf_counter()
    if decoder.drafter is None:
        return BudgetChoice(FALLBACK_BUDGET, {}, "no drafter to calibrate", 0.0)
    ids = decoder.target.chat_ids(prompt)
    settings = [DecodeSettings("ar", max_new_tokens=tokens)]
    settings += [DecodeSettings("ddtree", max_new_tokens=tokens, tree_budget=budget) for budget in budgets]
    # the first run of a method or shape pays one-time costs (allocation; on a GPU, CUDA graph
    # capture, which a step's draft meets only from the second step on): run each once untimed,
    # DFlash too, so the page's first runs are warm as well; on the CPU a few tokens do
    warm_tokens = tokens if decoder.target.device.type == "cuda" else 4
    decoder.run(prompt_ids=ids, settings=DecodeSettings("dflash", max_new_tokens=warm_tokens))
    timings = {}
    for setting in settings:
        decoder.run(prompt_ids=ids, settings=DecodeSettings(**{**setting.__dict__, "max_new_tokens": warm_tokens}))
        summary = decoder.run(prompt_ids=ids, settings=setting).summary
        timings[setting.tree_budget if setting.method == "ddtree" else "ar"] = Timing.of([summary])
    curve = acceptance_curve(decoder)
    measured = economics(timings)
    table = {}
    for budget in budgets:
        entry = measured[budget]
        tau = curve.get(budget, entry.tau)
        cost = entry.step_cost_vs_ar
        table[budget] = Economics(tau, entry.step_ms, cost, tau / cost if tau and cost else None, entry.speedup_vs_ar)
    source = "the drafter's acceptance curve" if all(b in curve for b in budgets) else "the calibration runs"
    best = max(budgets, key=lambda b: table[b].predicted_speedup or 0.0)
    measured = measured_budgets().get(machine_key(decoder))
    if measured is not None and measured["drafter_revision"] == decoder.drafter_info.revision:
        return BudgetChoice(measured["tree_budget"], table, source, time.perf_counter() - began, measured)
    return BudgetChoice(best, table, source, time.perf_counter() - began)


def machine_key(decoder: Decoder) -> str:
    """What a measured budget holds for: the device (GPU model, or CPU and its threads), engine,
    dtype (and the drafter's, where it differs) and step."""
    return _key(torch.cuda.get_device_name(0) if decoder.target.device.type == "cuda" else None,
                torch.get_num_threads(), decoder.engine, str(decoder.target.dtype).removeprefix("torch."),
                decoder.step_kind, decoder.draft_dtype)


def _key(gpu: str | None, threads: int, engine: str, dtype: str, step: str, draft_dtype: str | None = None) -> str:
    drafts = f" ({draft_dtype} drafts)" if draft_dtype else ""
    return f"{gpu or f'CPU, {threads} threads'} | {engine} | {dtype}{drafts} | {step} step"


def measured_budgets(path: Path = MEASURED_BUDGETS) -> dict[str, dict]:
    return json.loads(path.read_text()) if path.is_file() else {}


def record_best(results_path: str, path: Path = MEASURED_BUDGETS) -> tuple[str, dict]:
    """Add a bench run's best DDTree budget to the table, keyed by the machine it ran on."""
    results = json.loads(Path(results_path).read_text())
    config, best = results["config"], results.get("best")
    if not best:
        raise ValueError(f"{results_path} has no best DDTree budget: bench DDTree at one budget or more")
    gpu = config["host"].get("gpu") if str(config["device"]).startswith("cuda") else None
    # results from before --step ran the readable loop
    step = step_kind(config.get("step") == "fixed", bool(config.get("compile_step")))
    key = _key(gpu, config["host"]["threads"], config["engine"], config["dtype"], step, config.get("draft_dtype"))
    entry = {"tree_budget": best["tree_budget"], "tokens_per_s": round(best["tokens_per_s"], 1),
             "speedup_vs_ar": round(best["speedup_vs_ar"], 3), "tau": round(best["tau"], 3),
             "drafter_revision": config["drafter_revision"], "prompts": config["prompts"],
             "results": str(results_path)}
    table = measured_budgets(path) | {key: entry}
    path.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    return key, entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.loop.calibration",
                                     description="record a bench run's best DDTree budget as its machine's default")
    parser.add_argument("command", choices=["record"])
    parser.add_argument("results", help="results JSON written by engine.tools.bench (--out)")
    args = parser.parse_args(argv)
    try:
        key, entry = record_best(args.results)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{key}: budget {entry['tree_budget']} ({entry['tokens_per_s']} tokens/s, {entry['speedup_vs_ar']}× AR)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
