"""The DDTree budget the page starts with: from the bench's record for this kind of machine, else timed here.

Where a bench run on this kind of machine (device, engine, dtype, step, drafter weights) has been
recorded in ``assets/budgets.json`` (``python -m engine.measure.calibration record RESULTS.json``), its
speed-up per budget decides and nothing is timed: the app answers as soon as the models are loaded.
Otherwise ``StartupTiming`` times the budgets on this machine, one at a time, in the background
(the page shows its progress), and keeps every timing in a cache (``~/.cache/ddtree-studio``), so a
second start times only what is still missing.

Which budget: a visitor comes to see a tree, and on a CPU the fastest budget drafts little more than a chain
(README, "The first start"). So the page opens at the largest budget within ``NEAR_FASTEST`` of the fastest
one's speed-up.

Speed-up = τ ÷ step cost. τ at each budget is the drafter's: its measured acceptance curve
(``acceptance`` in the drafter's config.json, written from a bench run on prompts it never
saw) or, for drafters without one, what the timing runs themselves accept. The step
cost is the machine's: a short AR run and a short DDTree run per candidate budget on one
prompt, each after a warm-up, timed per step (prefill excluded). A wide tree is nearly free
on a GPU and costly on two CPU cores, so the best budget differs by machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from engine.loop.decode import Decoder, step_kind
from engine.loop.settings import DecodeSettings
from engine.measure.economics import Economics, Timing, economics
from engine.measure.fairness import ArReference
from engine.methods import BASELINE, DFLASH, TREE, budget_sweep

CANDIDATE_BUDGETS = (4, 8, 16, 32, 64)
CALIBRATION_PROMPT = "Explain briefly how a refrigerator keeps food cold."
CALIBRATION_TOKENS = 16
FALLBACK_BUDGET = 32  # no drafter to time
PROVISIONAL_BUDGET = 16  # while the timing runs: a tree that branches, the CPU bench's (README, "The first start")
NEAR_FASTEST = 0.95  # a budget at 95% of the fastest budget's speed-up still counts as fast
MEASURED_BUDGETS = Path(__file__).resolve().parent.parent.parent / "assets" / "budgets.json"


def cache_dir() -> Path:
    """The Studio's one cache folder, read at each call (``DDTREE_STUDIO_CACHE`` moves it): what the app keeps
    between starts (timings, compiled code) and the vLLM engine's converted model folders."""
    return Path(os.environ.get("DDTREE_STUDIO_CACHE") or Path.home() / ".cache" / "ddtree-studio")


def pick_budget(speedups: dict[int, float]) -> int:
    """The largest budget within ``NEAR_FASTEST`` of the fastest: the biggest tree that costs next to nothing."""
    fastest = max(speedups.values())
    return max(budget for budget, speedup in speedups.items() if speedup >= NEAR_FASTEST * fastest)


@dataclass(frozen=True)
class BudgetChoice:
    budget: int
    table: dict[int, Economics]  # per timed budget: τ (the curve's), step cost, predicted speed-up
    tau_source: str
    measured: dict | None = None  # the bench's record for this kind of machine, when it decided
    machine: str = ""
    ar: ArReference | None = None  # AR's speed here, as the record or the timing found it (``engine.measure.fairness``)

    def sentence(self) -> str:
        if self.measured is not None:
            return self._recorded_sentence()
        speedups = {budget: entry.predicted_speedup for budget, entry in self.table.items()
                    if entry.predicted_speedup is not None}
        entry = self.table.get(self.budget)
        if entry is None or entry.predicted_speedup is None:
            return f"DDTree budget {self.budget} ({self.tau_source})."
        fastest = max(speedups, key=speedups.get)
        why = ("the fastest here" if fastest == self.budget else
               f"the largest tree within {1 - NEAR_FASTEST:.0%} of the fastest here (budget {fastest}, "
               f"{speedups[fastest]:.2f}×)")
        return (f"DDTree budget {self.budget} is {why}: τ {entry.tau:.2f} ÷ step cost "
                f"{entry.step_cost_vs_ar:.2f} AR steps = {entry.predicted_speedup:.2f}× predicted "
                f"(τ from {self.tau_source}; step costs timed on this machine).")

    def _recorded_sentence(self) -> str:
        m, budgets = self.measured, self.measured["budgets"]
        at = budgets[str(self.budget)]
        fastest = max(budgets, key=lambda b: budgets[b]["speedup_vs_ar"])
        why = ("the fastest" if int(fastest) == self.budget else
               f"the largest tree within {1 - NEAR_FASTEST:.0%} of the fastest (budget {fastest}, "
               f"{budgets[fastest]['speedup_vs_ar']:.2f}×), so the first page shows a tree that branches")
        return (f"DDTree budget {self.budget} is {why}: the bench measured {at['speedup_vs_ar']:.2f}× AR at it "
                f"(τ {at['tau']:.2f}, {at['tokens_per_s']:.0f} tokens/s on {m['prompts']}) on another machine of "
                f"this kind ({self.machine}), not on this one ({m['results']}).")


def acceptance_curve(decoder: Decoder) -> dict[int, float]:
    """The drafter's measured τ per DDTree budget, if its checkpoint records one."""
    recorded = decoder.drafter.config.acceptance if decoder.drafter is not None else {}
    return {int(budget): float(tau) for budget, tau in recorded.get(TREE.name, {}).items()}


def recorded_choice(decoder: Decoder) -> BudgetChoice | None:
    """The bench's record for this kind of machine and these drafter weights, if there is one."""
    key = machine_key(decoder)
    entry = measured_budgets().get(key)
    if entry is None or entry.get("drafter_revision") != decoder.drafter_info.revision or "budgets" not in entry:
        return None
    speedups = {int(budget): row["speedup_vs_ar"] for budget, row in entry["budgets"].items()}
    ar = entry.get("ar_decode_tokens_per_s")
    reference = ArReference(ar, "the bench recorded", f"on this kind of machine ({key})") if ar else None
    return BudgetChoice(pick_budget(speedups), {}, "the bench", entry, key, reference)


@dataclass
class StartupTiming:
    """Step costs timed on this machine, label by label (AR's run label, then each DDTree budget as a number),
    each kept in ``path`` as soon as it is measured: a start that is cut short loses nothing it had timed."""

    decoder: Decoder
    budgets: tuple[int, ...] = CANDIDATE_BUDGETS
    prompt: str = CALIBRATION_PROMPT
    tokens: int = CALIBRATION_TOKENS
    path: Path | None = None  # the cache file; None keeps the timings in memory only
    timings: dict[str, Timing] = field(default_factory=dict)

    def __post_init__(self):
        kept = self._cache().get(self.key, {})
        self.timings = {label: Timing(**kept[label]) for label in self.labels if label in kept}

    @property
    def key(self) -> str:
        return (f"{machine_key(self.decoder)} | drafter {self.decoder.drafter_info.revision} | "
                f"{self.tokens} tokens of {self.prompt!r}")

    @property
    def labels(self) -> list[str]:
        return [BASELINE.label(), *map(str, self.budgets)]

    def missing(self) -> list[str]:
        return [label for label in self.labels if label not in self.timings]

    def progress(self) -> str:
        done = len(self.labels) - len(self.missing())
        return f"{done} of {len(self.labels)} timed"

    def time(self, label: str) -> None:
        """One label's warm-up and timed run; the first of a start also warms DFlash up, so the page's
        first runs do not pay one-time costs (allocation; on a GPU, CUDA graph capture)."""
        ids = self.decoder.target.chat_ids(self.prompt)
        setting = (DecodeSettings(BASELINE.name, max_new_tokens=self.tokens) if label == BASELINE.label() else
                   DecodeSettings(TREE.name, max_new_tokens=self.tokens, tree_budget=int(label)))
        warm_tokens = self.tokens if self.decoder.target.device.type == "cuda" else 4
        if label == self.missing()[0]:
            self.decoder.run(prompt_ids=ids, settings=DecodeSettings(DFLASH.name, max_new_tokens=warm_tokens))
        self.decoder.run(prompt_ids=ids, settings=replace(setting, max_new_tokens=warm_tokens))
        self.timings[label] = Timing.of([self.decoder.run(prompt_ids=ids, settings=setting).summary])
        self._save()

    def choice(self) -> BudgetChoice:
        curve = acceptance_curve(self.decoder)
        measured = economics(self.timings)
        table = {}
        for budget in self.budgets:
            entry = measured[str(budget)]
            tau, cost = curve.get(budget, entry.tau), entry.step_cost_vs_ar
            table[budget] = Economics(tau, entry.step_ms, cost, tau / cost if tau and cost else None,
                                      entry.speedup_vs_ar)
        source = "the drafter's acceptance curve" if all(b in curve for b in self.budgets) else "the timing runs"
        best = pick_budget({budget: entry.predicted_speedup or 0.0 for budget, entry in table.items()})
        ar_step_s = self.timings[BASELINE.label()].step_s
        reference = ArReference(1 / ar_step_s, "the start-up timing measured", "on this machine") if ar_step_s else None
        return BudgetChoice(best, table, source, machine=machine_key(self.decoder), ar=reference)

    def _cache(self) -> dict:
        try:
            return json.loads(self.path.read_text()) if self.path is not None and self.path.is_file() else {}
        except (OSError, ValueError):
            return {}  # an unreadable cache is timed again, and rewritten

    def _save(self) -> None:
        if self.path is None:
            return
        kept = self._cache() | {self.key: {label: asdict(timing) for label, timing in self.timings.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(kept, indent=1) + "\n")


def machine_key(decoder: Decoder, step: str | None = None) -> str:
    """What a measurement holds for: the device (GPU model, or CPU and its threads), engine, dtype (and the
    drafter's, where it differs) and step (the decoder's own, or ``step``: "batched" for a batch's step costs)."""
    return _key(torch.cuda.get_device_name(0) if decoder.target.device.type == "cuda" else None,
                torch.get_num_threads(), decoder.engine, str(decoder.target.dtype).removeprefix("torch."),
                step or decoder.step_kind, decoder.draft_dtype)


def _key(gpu: str | None, threads: int, engine: str, dtype: str, step: str, draft_dtype: str | None = None) -> str:
    drafts = f" ({draft_dtype} drafts)" if draft_dtype else ""
    return f"{gpu or f'CPU, {threads} threads'} | {engine} | {dtype}{drafts} | {step} step"


def measured_budgets(path: Path = MEASURED_BUDGETS) -> dict[str, dict]:
    return json.loads(path.read_text()) if path.is_file() else {}


def record_best(results_path: str, path: Path = MEASURED_BUDGETS) -> tuple[str, dict]:
    """Add a bench run's speed-up per DDTree budget to the table, keyed by the machine it ran on; the page
    opens at ``pick_budget`` of them."""
    results = json.loads(Path(results_path).read_text())
    config, summary = results["config"], results.get("summary") or {}
    budgets = {budget: summary[label] for budget, label in budget_sweep(summary).items()}
    if not budgets:
        raise ValueError(f"{results_path} has no best DDTree budget: bench DDTree at one budget or more")
    gpu = config["host"].get("gpu") if str(config["device"]).startswith("cuda") else None
    # results from before --step ran the readable loop
    step = step_kind(config.get("step") == "fixed", bool(config.get("compile_step")))
    key = _key(gpu, config["host"]["threads"], config["engine"], config["dtype"], step, config.get("draft_dtype"))
    ar = [run for run in results["runs"] if run["label"] == BASELINE.label()]
    ar_decoding_s = sum(run["wall_s"] - run["prefill_s"] for run in ar)
    entry = {"budgets": {str(budget): {"tokens_per_s": round(row["tokens_per_s"], 1),
                                       "speedup_vs_ar": round(row["speedup_vs_ar"], 3), "tau": round(row["tau"], 3)}
                         for budget, row in sorted(budgets.items())},
             # the yardstick of a disturbed page (``engine.measure.fairness``): AR's tokens a second, no prompt pass
             "ar_decode_tokens_per_s": round(sum(run["verify_steps"] for run in ar) / ar_decoding_s, 1),
             "drafter_revision": config["drafter_revision"], "prompts": config["prompts"],
             "results": str(results_path)}
    table = measured_budgets(path) | {key: entry}
    path.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    return key, entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.measure.calibration",
                                     description="record a bench run's speed-up per DDTree budget for its machine")
    parser.add_argument("command", choices=["record"])
    parser.add_argument("results", help="results JSON written by engine.tools.bench (--out)")
    args = parser.parse_args(argv)
    try:
        key, entry = record_best(args.results)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    budget = pick_budget({int(b): row["speedup_vs_ar"] for b, row in entry["budgets"].items()})
    at = entry["budgets"][str(budget)]
    print(f"{key}: the page opens at budget {budget} ({at['tokens_per_s']} tokens/s, {at['speedup_vs_ar']}× AR)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
