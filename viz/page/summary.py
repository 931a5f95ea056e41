"""The API's digest of a run (``/run``'s summary output, the Traces view's JSON): per column (a method, and a second
drafter's beside the first's) its text, headline numbers, step economics and where it left AR's text."""

from __future__ import annotations

from engine.methods import BASELINE
from engine.trace import Trace, divergence
from viz.figures import trace_economics
from viz.page.state import ordered
from viz.text_view import identical_to, run_stats


def run_summary(traces: dict[str, Trace]) -> dict:
    """The API-friendly digest of a run: text, headline numbers and step economics per column, keyed as the columns
    are (``ddtree``, ``ddtree_2``: ``viz.page.state.Lane``), with each run's label (``step_cost_vs_ar`` and
    ``predicted_speedup`` need AR in the run; the prediction leaves the prefill out, the measured ``speedup_vs_ar``
    is tokens per second over AR's, whole wall times)."""
    ar = traces.get(BASELINE.name)
    entries = trace_economics(ordered(traces))
    summary = {}
    for key, trace in traces.items():
        stats = run_stats(trace)
        entry = entries[trace.config.label]
        summary[key] = {
            "label": trace.config.label, "text": trace.text, "tokens": stats.tokens, "steps": stats.steps,
            "tau": round(stats.tau, 4),
            "tokens_per_s": round(stats.tokens_per_s, 3), "wall_s": round(stats.elapsed_s, 4),
            "prefill_s": round(trace.summary.time_to_first_token_s, 4),
            "step_cost_vs_ar": _rounded(entry.step_cost_vs_ar), "predicted_speedup": _rounded(entry.predicted_speedup),
            "speedup_vs_ar": _rounded(entry.speedup_vs_ar),
            "identical_to_ar": identical_to(trace, ar) if ar is not None else None,
            "divergence": _divergence(trace, ar),
            "stop_reason": trace.summary.stop_reason,
            "drafter": trace.config.drafter, "drafter_trained": trace.config.drafter_trained,
            "tree_budget": trace.config.tree_budget, "notes": trace.config.notes,
        }
    return summary


def _divergence(trace: Trace, ar: Trace | None) -> dict | None:
    """Where a method's text first leaves AR's (1-based token), and whether the target was at a near-tie there."""
    found = divergence(trace, ar) if ar is not None and trace is not ar else None
    if found is None:
        return None
    return {"token": found.index + 1, "ar_top2_gap": _rounded(found.ar_margin), "near_tie": found.near_tie}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)

