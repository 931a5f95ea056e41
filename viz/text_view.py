"""A run's output as HTML: tokens coloured by origin, plus its live statistics.

Both the live run view and the replay race render a trace "as of" a moment: only
the prefill and the steps finished by ``until`` seconds count, so one function
serves streaming (the trace so far, ``until=None``) and the shared-clock replay.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from engine.trace import Trace, divergence
from viz.tokens import committed_origins

ORIGIN_STYLES = {
    "draft": "background:#c9f0c4;",  # accepted draft token
    "target": "background:#d6e4fb;",  # the target's own token: bonus, prefill, every AR token
}


def legend_html() -> str:
    return ("<div style='font-size:0.9em'>"
            f"<span style='{ORIGIN_STYLES['draft']}padding:1px 4px;border-radius:3px'>accepted draft token</span> "
            f"<span style='{ORIGIN_STYLES['target']}padding:1px 4px;border-radius:3px'>target's token "
            "(bonus / AR)</span> · hover a token for its step</div>")


STOPPED = "cancelled"  # a summary's stop reason when the visitor stopped the run


@dataclass(frozen=True)
class RunStats:
    tokens: int
    steps: int
    tau: float
    elapsed_s: float
    done: bool
    stopped: bool = False  # done because the visitor stopped it, not at its end

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def run_stats(trace: Trace, until: float | None = None) -> RunStats:
    """Statistics of the trace as of ``until`` seconds (``None``: everything recorded)."""
    finished = trace.summary is not None and (until is None or until >= trace.summary.wall_s)
    if finished:
        s = trace.summary
        return RunStats(tokens=s.new_tokens, steps=s.steps, tau=s.tau, elapsed_s=s.wall_s, done=True,
                        stopped=s.stop_reason == STOPPED)
    steps = [step for step in trace.steps if until is None or step.t_end <= until]
    started = until is None or trace.prefill.t_end <= until
    lengths = [step.acceptance_length for step in steps]
    elapsed = until if until is not None else (steps[-1].t_end if steps else trace.prefill.t_end)
    return RunStats(tokens=int(started) + sum(lengths), steps=len(steps),
                    tau=sum(lengths) / len(lengths) if lengths else 0.0, elapsed_s=elapsed, done=False)


def tokens_html(trace: Trace, until: float | None = None) -> str:
    """The output so far, one span per token, coloured by where it came from."""
    spans = []
    if until is None or trace.prefill.t_end <= until:
        spans.append(_span(trace.prefill.first_text, "target", "prefill"))
    for step in trace.steps:
        if until is not None and step.t_end > until:
            break
        for piece, origin in zip(step.committed_text, committed_origins(step)):
            spans.append(_span(piece, origin, f"step {step.number}"))
    return "".join(spans)


def _span(piece: str, origin: str, where: str) -> str:
    return (f"<span style='{ORIGIN_STYLES[origin]}' title='{where}: {origin}'>"
            f"{html.escape(piece)}</span>")


def identical_to(trace: Trace, reference: Trace) -> bool:
    return trace.output_ids == reference.output_ids


def column_html(caption: str, trace: Trace | None, ar: Trace | None = None, until: float | None = None,
                all_done: bool = False, absent: str = "not run") -> str:
    """One column: title (``caption``, the budget), drafter badge, stats line, verdict against AR,
    the engine's notes, text. ``absent`` says why there is no trace yet.

    ``all_done`` says every method of the run has finished, which is when comparing
    with AR means something; a run stopped midway is not compared.
    """
    budget = f" · budget {trace.config.tree_budget}" if trace and trace.config.tree_budget is not None else ""
    title = f"<div class='ddt-heading' style='font-weight:600;font-size:1.1em'>{html.escape(caption)}{budget}</div>"
    if trace is None:
        return f"<div class='ddt-column'>{title}<div style='color:#888'>{html.escape(absent)}</div></div>"
    stats = run_stats(trace, until)
    parts = [title, _drafter_badge(trace), _stats_line(stats, trace, ar, until)]
    if stats.stopped:
        parts.append(_badge("#eee", "stopped before its end: not compared with AR"))
    elif all_done and ar is not None and stats.done and not run_stats(ar).stopped:
        parts.append(_verdict(trace, ar))
    parts += [f"<div style='color:#8a4b00;font-size:0.85em'>{html.escape(note)}</div>"
              for note in trace.config.notes]
    parts.append("<div class='ddt-text' style='white-space:pre-wrap;font-family:ui-monospace,monospace;"
                 "font-size:0.92em;line-height:1.5;border:1px solid #ddd;border-radius:6px;padding:8px;"
                 f"min-height:6em;margin-top:6px'>{tokens_html(trace, until)}</div>")
    return f"<div class='ddt-column'>{''.join(parts)}</div>"


def _drafter_badge(trace: Trace) -> str:
    config = trace.config
    if not config.method_row.drafts:
        return "<div style='color:#666;font-size:0.85em'>no drafter</div>"
    warning = ("" if config.drafter_trained else
               " <span style='background:#fde2b8;color:#8a4b00;padding:1px 6px;border-radius:8px;"
               "white-space:nowrap'>untrained drafter: expect τ ≈ 1</span>")
    return f"<div style='color:#666;font-size:0.85em'>drafter {html.escape(str(config.drafter))}{warning}</div>"


def _stats_line(stats: RunStats, trace: Trace, ar: Trace | None, until: float | None) -> str:
    items = [f"{stats.tokens} tokens", f"{stats.steps} steps", f"τ {stats.tau:.2f}",
             f"{stats.tokens_per_s:.1f} tok/s", f"{stats.elapsed_s:.2f} s"]
    if ar is not None and trace is not ar:
        ar_stats = run_stats(ar, until)
        if ar_stats.tokens_per_s > 0 and stats.tokens_per_s > 0:
            items.append(f"{stats.tokens_per_s / ar_stats.tokens_per_s:.2f}× vs AR")
    state = "stopped" if stats.stopped else "done" if stats.done else "running" if until is None else "…"
    return (f"<div class='ddt-stats' style='font-size:0.9em'>{' · '.join(items)} "
            f"<span style='color:#888'>({state})</span></div>")


def _verdict(trace: Trace, ar: Trace) -> str:
    if trace is ar:
        return _badge("#eee", "reference output")
    found = divergence(trace, ar)
    if found is None:
        return _badge("#c9f0c4", "✓ identical to AR")
    if trace.config.temperature > 0:
        return _badge("#f8d0cf", "✗ differs from AR (expected when sampling: temperature > 0)")
    where = f"token {found.index + 1}"
    if found.ar_margin is None:
        return _badge("#f8d0cf", f"✗ differs from AR: AR stopped before {where}")
    if found.near_tie:
        return _badge("#fde7b0", f"≈ leaves AR at {where} on a near-tie: the target's top two were "
                                 f"{found.ar_margin:.3g} logits apart there, and rounding can pick either")
    return _badge("#f8d0cf", f"✗ leaves AR at {where}, where the target's top two were {found.ar_margin:.3g} logits "
                             "apart: not rounding, a bug to report")


def _badge(colour: str, text: str) -> str:
    return (f"<div class='ddt-verdict'><span style='background:{colour};padding:1px 6px;border-radius:8px'>"
            f"{html.escape(text)}</span></div>")


