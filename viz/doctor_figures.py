"""The drafter doctor's report (``engine.measure.doctor.DoctorReport``) as figures and Markdown for the app's
Doctor tab: pure functions of the report."""

from __future__ import annotations

import html

import plotly.graph_objects as go

from engine.measure.doctor import CANNOT_JUDGE, FAULTY, HEALTHY, DoctorReport
from engine.measure.doctor_checks import FAULT, WARNING
from engine.methods import DDTREE, DFLASH
from viz.figures import ACCEPTED_COLOUR, TARGET_COLOUR, empty_figure

# glyphs the shipped fonts (DejaVu Sans, ``viz.video.FONT_FILES``) draw: no emoji, which a page without an emoji font
# shows as empty boxes
SEVERITY_MARKS = {"ok": "✓", "note": "ℹ", WARNING: "⚠", FAULT: "✗"}
STATUS_HEADINGS = {HEALTHY: "✓ **Healthy**", FAULTY: "✗ **Fault**", CANNOT_JUDGE: "○ **Not judged yet**"}
ROLE_COLOURS = {"configured": DFLASH.colour, "variant": "#9467bd", "deployment": DDTREE.colour}


def _layout(fig: go.Figure, title: str, **axes) -> go.Figure:
    fig.update_layout(title=dict(text=title, x=0, font=dict(size=14)), template="plotly_white", height=320,
                      margin=dict(l=10, r=10, t=60, b=40), legend=dict(orientation="h", y=-0.25), **axes)
    return fig


def positions_figure(report: DoctorReport) -> go.Figure:
    """Acceptance per draft position given an accepted prefix, beside the plain hit rate."""
    positions = [p.position for p in report.positions]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=positions, y=[p.acceptance for p in report.positions],
                         name="accepted, given the slots before",
                         marker_color=ACCEPTED_COLOUR,
                         hovertemplate="slot %{x}: %{y:.1%} of blocks that got this far<extra></extra>"))
    fig.add_trace(go.Scatter(x=positions, y=[p.hit_rate for p in report.positions], name="right at all",
                             mode="lines+markers", line=dict(color=TARGET_COLOUR),
                             hovertemplate="slot %{x}: %{y:.1%} of blocks<extra></extra>"))
    return _layout(fig, "Acceptance per draft position", xaxis=dict(title="draft slot (1 = after the root)", dtick=1),
                   yaxis=dict(title="rate", range=[0, 1], tickformat=".0%"))


def calibration_figure(report: DoctorReport) -> go.Figure:
    """The drafter's probability of its top token against how often it was right: per position and binned."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="calibrated", line=dict(color="#bbb", dash="dot"),
                             hoverinfo="skip"))
    bins = [b for b in report.calibration if b.count]
    fig.add_trace(go.Scatter(x=[b.mean_probability for b in bins], y=[b.hit_rate for b in bins], mode="lines+markers",
                             name="all drafts, binned", marker=dict(size=[6 + min(b.count, 400) ** 0.5 for b in bins]),
                             line=dict(color=DDTREE.colour), customdata=[b.count for b in bins],
                             hovertemplate="drafter p %{x:.2f}: right %{y:.1%} (%{customdata} drafts)<extra></extra>"))
    # fifteen slots crowd into a corner of the square, so a slot is told by its colour (and hover), not a label
    shown = [p for p in report.positions if p.mean_probability is not None and p.hit_rate is not None]
    fig.add_trace(go.Scatter(x=[p.mean_probability for p in shown], y=[p.hit_rate for p in shown], mode="markers",
                             name="per draft slot", customdata=[p.position for p in shown],
                             marker=dict(size=9, color=[p.position for p in shown], colorscale="Viridis",
                                         line=dict(width=1, color="white"),
                                         colorbar=dict(title=dict(text="draft slot"), thickness=12, len=0.8,
                                                       dtick=max(1, len(shown) // 5))),
                             hovertemplate="slot %{customdata}: drafter p %{x:.2f}, right %{y:.1%}<extra></extra>"))
    return _layout(fig, "Calibration: the drafter's probability against the real hit rate",
                   xaxis=dict(title="drafter probability of its top token", range=[0, 1]),
                   yaxis=dict(title="hit rate", range=[0, 1], tickformat=".0%"))


def confidence_figure(report: DoctorReport) -> go.Figure:
    """First-slot hits by the target's own confidence in its next token."""
    bands = report.confidence_bands
    labels = [f"{b.low:g}–{min(b.high, 1):g}" for b in bands]
    fig = go.Figure(go.Bar(x=labels, y=[b.hit_rate for b in bands], marker_color=DFLASH.colour,
                           customdata=[b.roots for b in bands],
                           hovertemplate="target p %{x}: first slot right %{y:.1%} (%{customdata} roots)"
                                         "<extra></extra>"))
    return _layout(fig, "First-slot hits by the target's own confidence",
                   xaxis=dict(title="the target's probability of its next token"),
                   yaxis=dict(title="first slot right", range=[0, 1], tickformat=".0%"))


def wirings_figure(report: DoctorReport) -> go.Figure:
    """First-slot hits as configured and under each miswiring (and each deployment's wiring)."""
    wirings = report.wirings
    fig = go.Figure(go.Bar(y=[w.label for w in wirings], x=[w.first_slot for w in wirings], orientation="h",
                           marker_color=[ROLE_COLOURS[w.role] for w in wirings],
                           text=[f"{w.first_slot:.1%} · {w.mean_accepted:.2f} kept" for w in wirings],
                           textposition="auto",
                           hovertemplate="%{y}: first slot right %{x:.1%}<extra></extra>"))
    fig = _layout(fig, "Wiring probes: first-slot hits (draft tokens a chain keeps)",
                  xaxis=dict(title="first slot right", range=[0, 1], tickformat=".0%"),
                  yaxis=dict(autorange="reversed"))
    fig.update_layout(height=140 + 40 * len(wirings))
    return fig


def doctor_figures(report: DoctorReport) -> dict[str, go.Figure]:
    """Every figure of the tab; placeholders where the probe did not run (static checks only)."""
    if report.first_slot is None:
        placeholder = empty_figure("no acceptance probe: the static checks found a fault it cannot run past")
        return dict.fromkeys(("positions", "calibration", "confidence", "wirings"), placeholder)
    return {"positions": positions_figure(report), "calibration": calibration_figure(report),
            "confidence": confidence_figure(report), "wirings": wirings_figure(report)}


def plain(text: str) -> str:
    """Report text as Markdown shows it literally: a tokenizer's ``<|im_start|>`` is no HTML tag to drop, nor
    ``*`` or ``_`` emphasis, nor a backtick a code span."""
    escaped = text.translate(str.maketrans({c: "\\" + c for c in "\\`*_[]#|"}))
    return html.escape(escaped, quote=False)  # after the backslashes: an entity's "#" stays unescaped


def report_markdown(report: DoctorReport) -> str:
    # a healthy verdict starts with the word its heading already says
    said = report.verdict.removeprefix("healthy").removeprefix(":").strip() if report.healthy else report.verdict
    lines = [f"{STATUS_HEADINGS[report.status]}: {plain(said)}" if said else STATUS_HEADINGS[report.status], "",
             f"Target {plain(report.model)} · drafter {plain(report.drafter)} · {report.engine} engine", ""]
    lines += [f"- {SEVERITY_MARKS.get(f.severity, '')} **{f.check}**: {plain(f.line)}" for f in report.findings]
    if report.first_slot is not None:
        taus = ", ".join(f"{name} **{value:.2f}**" for name, value in report.tau.items())
        lines += ["", f"Probe: {report.prompts} prompts, {report.roots} roots; first-slot hits "
                      f"**{report.first_slot:.1%}**; τ replayed along the target's greedy output: {taus}. "
                      + "Time: " + ", ".join(f"{name} {value:.1f} s" for name, value in report.seconds.items())]
    return "\n".join(lines)
