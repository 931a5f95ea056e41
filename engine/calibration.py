"""Pick the DDTree budget that is fastest on this machine, at start-up, in a few seconds.

Speed-up = τ ÷ step cost. τ at each budget is the drafter's: its measured acceptance curve
(``acceptance`` in the drafter's config.json, written from a bench run on prompts it never
saw) or, for drafters without one, what the calibration runs themselves accept. The step
cost is the machine's: a short AR run and a short DDTree run per candidate budget on one
prompt, each after a warm-up, timed per step (prefill excluded). A wide tree is nearly free
on a GPU and costly on two CPU cores, so the best budget differs by machine. The runs also warm every method up,
so the page's first runs do not pay one-time costs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.decode import DecodeSettings, Decoder
from engine.economics import Economics, Timing, economics

CANDIDATE_BUDGETS = (4, 8, 16, 32, 64)
CALIBRATION_PROMPT = "Explain briefly how a refrigerator keeps food cold."
CALIBRATION_TOKENS = 16
FALLBACK_BUDGET = 32  # no drafter to calibrate


@dataclass(frozen=True)
class BudgetChoice:
    budget: int
    table: dict[int, Economics]  # per candidate budget: τ (the curve's), step cost, predicted speed-up
    tau_source: str
    seconds: float

    def sentence(self) -> str:
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
    return BudgetChoice(best, table, source, time.perf_counter() - began)
