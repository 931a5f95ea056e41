"""Figures and explanations for one step or whole runs (everything but the tree).

Pure functions of traces: no tokenizer (a ``TokenText`` is passed in), no models.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.measure.economics import Economics, Timing, economics, explain, speed_noise
from engine.methods import BASELINE, TREE, Label
from engine.trace import STAGES, TIMING_ONLY, Step, StepBatch, Trace
from viz.tokens import TokenText, shown

ACCEPTED_COLOUR = "#2ca02c"
TARGET_COLOUR = "#d9534f"
# the target's choice in the drafter's top-k: a neutral dark mark, not a red cross, which reads as "rejected" (the
# target's token is what was committed, in or out of the draft)
CHOICE_COLOUR = "#1b1f24"
MAX_NEIGHBOURS = 6  # neighbours a step's batch line names; the rest are counted
DARK_CELL = 0.5  # a heatmap cell at least this probable is dark blue: its token is written in white
CORNER = (0.3, -0.3)  # where in a heatmap cell (depth, rank offsets; rank grows downwards) a corner mark sits
NOISE_ERRORS = 2  # a measured speed-up's noise, drawn and said, is this many standard errors
STAGE_COLOURS = {"draft": "#ff7f0e", "tree_build": "#9467bd", "tree_compile": "#8c564b", "verify": "#1f77b4",
                 "commit": "#2ca02c"}


def timing_title(title: str, traces: list[Trace]) -> str:
    """``title``, marked when a run's weights are random (a model shape timed, nothing decoded)."""
    return f"{title} · {TIMING_ONLY}" if any(trace.config.timing_only for trace in traces) else title


def empty_figure(message: str, height: int = 220) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font=dict(size=14, color="#666"))
    fig.update_layout(template="plotly_white", height=height, xaxis=dict(visible=False), yaxis=dict(visible=False),
                      margin=dict(l=10, r=10, t=30, b=10))
    return fig


def target_path_tokens(step: Step) -> list[int]:
    """The target's token at each depth along the accepted path, depth 1 first; the
    last one is the bonus (what the target wanted where the draft was rejected)."""
    return [step.target_tokens[node] for node in step.accepted]


def draft_rank(step: Step, depth: int, token: int) -> tuple[int, float] | None:
    """(0-based rank, probability) of ``token`` in the drafter's recorded top-k at
    ``depth`` (1-based), or None when it is outside the top-k or past the draft."""
    if not 1 <= depth <= len(step.draft_top_tokens):
        return None
    tokens = step.draft_top_tokens[depth - 1]
    if token not in tokens:
        return None
    rank = tokens.index(token)
    return rank, step.draft_top_probs[depth - 1][rank]


def probability_figure(step: Step, token_text: TokenText, label: str = "") -> go.Figure:
    """Heatmap of the drafter's top-k per depth, with the accepted token (green
    square) and the target's choice (a dark diamond) marked where they are in the top-k."""
    if not step.draft_top_tokens:
        return empty_figure("No draft in this step: AR makes every token with the target.")
    depths = list(range(1, len(step.draft_top_tokens) + 1))
    k = len(step.draft_top_tokens[0])
    ranks = list(range(1, k + 1))
    z = [[step.draft_top_probs[d - 1][r - 1] for d in depths] for r in ranks]
    text = [[shown(token_text, step.draft_top_tokens[d - 1][r - 1]) for d in depths] for r in ranks]
    fig = go.Figure(go.Heatmap(
        x=depths, y=ranks, z=z, customdata=text,
        colorscale="Blues", zmin=0, zmax=1, colorbar=dict(title="prob", thickness=12),
        hovertemplate="depth %{x} · rank %{y}<br>token %{customdata}<br>draft prob %{z:.4f}<extra></extra>",
        name="draft top-k",
    ))
    accepted_tokens = [step.tree_tokens[node - 1] for node in step.accepted[1:]]
    # the accepted token's mark frames its cell and the target's sits in the cell's corner, so neither
    # covers the token written in the middle
    _mark(fig, step, accepted_tokens, "accepted draft token",
          dict(symbol="square-open", size=30, color=ACCEPTED_COLOUR, line=dict(width=3)))
    wanted = target_path_tokens(step)
    _mark(fig, step, wanted, "target's choice", dict(symbol="diamond", size=9, color=CHOICE_COLOUR,
                                                     line=dict(width=1, color="white")), corner=True)
    # the tokens last, over the marks, light on dark cells: a sure rank-1 draft is the darkest cell of all
    cells = [(d, r) for r in ranks for d in depths]
    fig.add_trace(go.Scatter(
        x=[d for d, _ in cells], y=[r for _, r in cells], mode="text", hoverinfo="skip", showlegend=False,
        text=[_clip(text[r - 1][d - 1]) for d, r in cells],
        textfont=dict(size=10, color=["white" if z[r - 1][d - 1] >= DARK_CELL else "#1b1f24" for d, r in cells])))
    stop_depth = len(step.accepted)
    missed = stop_depth <= len(depths) and draft_rank(step, stop_depth, wanted[-1]) is None
    if missed:
        fig.add_annotation(x=1, y=1, xref="paper", yref="paper", showarrow=False, xanchor="right", yanchor="bottom",
                           text=f"depth {stop_depth}: the target chose {shown(token_text, wanted[-1])}, "
                                f"not in the drafter's top-{k}", font=dict(color=CHOICE_COLOUR, size=12))
    fig.update_layout(
        title=dict(text=" · ".join(filter(None, [label, f"Step {step.number}: drafter's top-{k} per depth"])), x=0,
                   font=dict(size=14)),
        template="plotly_white", height=140 + 34 * k, margin=dict(l=10, r=10, t=70, b=40),
        xaxis=dict(title="draft depth", tickvals=depths, side="bottom"),
        yaxis=dict(title="rank", autorange="reversed", tickvals=ranks),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0),
    )
    return fig


def _clip(text: str, width: int = 8) -> str:
    """Cell labels stay inside their cell; the hover has the whole token."""
    return text if len(text) <= width else text[: width - 1] + "…"


def _mark(fig: go.Figure, step: Step, tokens: list[int], name: str, marker: dict, corner: bool = False) -> None:
    """Markers over the heatmap cells holding ``tokens[d-1]`` at depth d (in the cell's top right ``corner``)."""
    dx, dy = CORNER if corner else (0.0, 0.0)
    cells = [(depth + dx, found[0] + 1 + dy) for depth, token in enumerate(tokens, start=1)
             if (found := draft_rank(step, depth, token)) is not None]
    if cells:
        fig.add_trace(go.Scatter(x=[c[0] for c in cells], y=[c[1] for c in cells], mode="markers", name=name,
                                 marker=marker, hoverinfo="skip"))


def explain_stop(step: Step, token_text: TokenText) -> str:
    """Markdown: where and why the acceptance walk stopped in this step, and the batch it ran in."""
    said = _walk(step, token_text)
    return said if step.batch is None else f"{said}\n\n{batch_line(step.batch)}"


def batch_line(batch: StepBatch) -> str:
    """Markdown: the batch a served request's step ran in, its tree's size and why, and its neighbours."""
    neighbours = ", ".join(f"`{name}`" for name in batch.neighbours[:MAX_NEIGHBOURS])
    more = f" and {len(batch.neighbours) - MAX_NEIGHBOURS} more" if len(batch.neighbours) > MAX_NEIGHBOURS else ""
    beside = f" Beside it: {neighbours}{more}." if batch.neighbours else " It ran alone."
    return (f"In a batch of **{batch.size}** request{'s' * (batch.size != 1)} ({batch.nodes} draft nodes verified in "
            f"all), its tree had **{batch.budget}** node{'s' * (batch.budget != 1)}: {batch.reason}.{beside}")


def _walk(step: Step, token_text: TokenText) -> str:
    bonus = _code(shown(token_text, step.bonus_token))
    if step.tree_size == 0:
        return f"**Step {step.number}** drafts nothing (AR): the target produced {bonus}."
    drafted = len(step.accepted) - 1
    stop_depth = drafted + 1
    lines = [f"**Step {step.number}**: {drafted} drafted token{'s' * (drafted != 1)} accepted, "
             f"then the target's bonus {bonus}."]
    last = step.accepted[-1]
    offered = [node for node in range(1, step.tree_size + 1) if step.tree_parents[node - 1] == last]
    if not offered:
        reason = ("the draft block ends here" if stop_depth > len(step.draft_top_tokens)
                  else "the tree's budget held nothing deeper on this path")
        lines.append(f"Nothing was rejected: the accepted path reached a leaf ({reason}), so the target "
                     "simply added the next token.")
    else:
        alternatives = ", ".join(f"{_code(shown(token_text, step.tree_tokens[node - 1]))} "
                                 f"(p={step.tree_node_probs[node - 1]:.3f})" for node in offered[:8])
        lines.append(f"First rejected depth: **{stop_depth}**. The tree offered {alternatives}; "
                     f"the target wanted {bonus}.")
        found = draft_rank(step, stop_depth, step.bonus_token)
        k = len(step.draft_top_tokens[stop_depth - 1]) if stop_depth <= len(step.draft_top_tokens) else 0
        if found is None:
            lines.append(f"In the drafter's distribution at depth {stop_depth}, {bonus} is **not in the top-{k}**: "
                         "the drafter did not see it coming.")
        else:
            rank, prob = found
            lines.append(f"In the drafter's distribution at depth {stop_depth}, {bonus} was **rank {rank + 1}** "
                         f"(p={prob:.4f}), but the tree held no branch for it below this path.")
    if len(step.committed_ids) < drafted + 1:
        lines.append("The commit was cut short by a stop token or the new-token limit.")
    return "\n\n".join(lines)


def _code(text: str) -> str:
    """Token text as a Markdown code span, so ``*``, ``_`` or ``<`` in a token stay literal."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def stage_figure(rows: dict[str, dict[str, float]], title: str) -> go.Figure:
    """Stacked horizontal bars of time per stage (ms), one bar per row label."""
    if not rows:
        return empty_figure("No timings yet.")
    labels = list(rows)
    fig = go.Figure()
    for stage in STAGES:
        fig.add_trace(go.Bar(
            y=labels, x=[rows[label].get(stage, 0.0) * 1e3 for label in labels], name=stage, orientation="h",
            marker_color=STAGE_COLOURS[stage], hovertemplate=f"{stage}: %{{x:.2f}} ms<extra>%{{y}}</extra>",
        ))
    fig.update_layout(barmode="stack", title=dict(text=title, x=0, font=dict(size=14)), template="plotly_white",
                      height=150 + 40 * len(labels), margin=dict(l=10, r=10, t=70, b=40),
                      xaxis=dict(title="ms"), yaxis=dict(autorange="reversed"),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0, traceorder="normal"))
    return fig


def acceptance_histogram(traces: list[Trace]) -> go.Figure:
    """How many tokens each drafting run's steps committed (acceptance length, bonus included), as a share of its
    steps: AR commits one a step, its every step one bar that would dwarf the others' shapes, so it is left out;
    shares, not counts, so a run of few long steps reads beside one of many short ones."""
    if not traces:
        return empty_figure("Run or upload traces to see acceptance lengths.")
    drafting = [trace for trace in traces if trace.config.method_row.drafts and trace.steps]
    if not drafting:
        return empty_figure("AR commits one token every step: run DFlash or DDTree to see acceptance lengths.")
    fig = go.Figure()
    longest = max(step.acceptance_length for trace in drafting for step in trace.steps)
    for trace in drafting:
        counts = Counter(step.acceptance_length for step in trace.steps)
        lengths = sorted(counts)
        fig.add_trace(go.Bar(x=lengths, y=[counts[n] / len(trace.steps) for n in lengths], name=trace.config.label,
                             marker_color=trace.config.colour,
                             customdata=[[counts[n], len(trace.steps)] for n in lengths],
                             hovertemplate="length %{x}: %{customdata[0]} of %{customdata[1]} steps"
                                           "<extra>%{fullData.name}</extra>"))
    title = "Acceptance length per step (bonus included; AR's is always 1)"
    fig.update_layout(barmode="group", title=dict(text=timing_title(title, drafting), x=0, font=dict(size=14)),
                      template="plotly_white", height=300, margin=dict(l=10, r=10, t=70, b=40),
                      # a few empty lengths on the right keep one-length runs from drawing slabs
                      xaxis=dict(title="tokens committed in one step", dtick=1, range=[0.5, max(longest, 6) + 0.5]),
                      yaxis=dict(title="share of the run's steps", tickformat=".0%", rangemode="tozero"),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0))
    return fig


def trace_economics(traces: list[Trace], baseline: Trace | None = None) -> dict[str, Economics]:
    """Each finished trace's economics (keyed by label), in AR steps of ``baseline`` (or the AR trace)."""
    runs = [t for t in traces if t.summary is not None]
    reference = baseline or next((t for t in runs if t.config.method_row is BASELINE), None)
    timings = {t.config.label: Timing.of([t.summary]) for t in runs}
    if reference is not None and reference.summary is not None:
        timings[BASELINE.label()] = Timing.of([reference.summary])
    return economics(timings)


def economics_figure(traces: list[Trace]) -> go.Figure:
    """Per method, τ beside the step cost in AR steps: speed-up is one over the other."""
    runs = [t for t in traces if t.summary is not None]
    if not any(t.config.method_row is BASELINE for t in runs):
        return empty_figure("Run AR with the others: a step's cost is measured in AR steps.")
    entries = trace_economics(runs)
    labels = [t.config.label for t in runs]
    names = [Label.parse(label).heading for label in labels]
    taus = [entries[label].tau or 0.0 for label in labels]
    costs = [entries[label].step_cost_vs_ar or 0.0 for label in labels]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=names, y=taus, name="τ: tokens per step", marker_color=ACCEPTED_COLOUR,
                         text=[f"{v:.2f}" for v in taus], textposition="outside"))
    fig.add_trace(go.Bar(x=names, y=costs, name="step cost (AR steps)", marker_color=TARGET_COLOUR,
                         text=[f"{v:.2f}" for v in costs], textposition="outside"))
    for name, label in zip(names, labels):
        entry = entries[label]
        if entry.predicted_speedup is not None and entry.speedup_vs_ar is not None:
            # above the bars and their value labels
            fig.add_annotation(x=name, y=max(entry.tau or 0, entry.step_cost_vs_ar or 0), yshift=22, yanchor="bottom",
                               showarrow=False,
                               text=f"τ ÷ cost = <b>{entry.predicted_speedup:.2f}×</b><br>"
                                    f"measured {entry.speedup_vs_ar:.2f}×")
    top = max(taus + costs + [1.0])
    fig.update_layout(template="plotly_white", barmode="group", height=360, yaxis=dict(range=[0, top * 1.6]),
                      title=dict(text=timing_title("Why it is fast or slow: speed-up = τ ÷ step cost", traces),
                                font=dict(size=14)),
                      margin=dict(l=10, r=10, t=50, b=30), legend=dict(orientation="h", y=-0.15))
    return fig


def economics_text(traces: list[Trace]) -> str:
    """One plain sentence per drafting method, and one per run that shared its steps with others (Markdown)."""
    entries = trace_economics(traces)
    labels = [Label.parse(label) for label in entries]
    lines = [explain(label.heading, entries[label.text]) for label in labels if not label.is_baseline]
    lines += [sentence for trace in traces if (sentence := batch_cost(trace)) is not None]
    return "\n".join(f"- {line}" for line in lines)


def batch_cost(trace: Trace) -> str | None:
    """What sharing its steps cost a served request: its steps' time beside what its trees alone would take by the
    machine's step costs, and how many requests advanced with it; None for a run that ran alone."""
    shared = [step for step in trace.steps if step.batch is not None]
    if not shared:
        return None
    sizes = [step.batch.size for step in shared]
    took = sum(step.t_end - step.t_start for step in shared) / len(shared)
    alone = sum(step.batch.alone_s for step in shared) / len(shared)
    nodes = sum(step.batch.budget for step in shared) / len(shared)
    spread = f"{min(sizes)}–{max(sizes)}" if min(sizes) != max(sizes) else f"{sizes[0]}"
    sentence = (f"{trace.config.heading()} shared its {len(shared)} steps with others: batches of "
                f"{sum(sizes) / len(sizes):.1f} requests ({spread}), its own trees {nodes:.1f} nodes. A step took "
                f"{1000 * took:.0f} ms")
    if alone > 0:
        return (sentence + f", where its trees alone would take {1000 * alone:.0f} ms by this machine's step costs: "
                f"sharing made its steps {took / alone:.1f}× longer while {sum(sizes) / len(sizes) - 1:.1f} other "
                "requests advanced in the same passes.")
    return sentence + "."


@dataclass(frozen=True)
class SweepPoint:
    """One budget's run of a sweep: its economics against the sweep's AR run, and how noisy its measured speed-up
    is (``noise``: ± that many times AR, ``NOISE_ERRORS`` standard errors; None without enough steps)."""

    trace: Trace
    economics: Economics
    noise: float | None

    @property
    def budget(self) -> int:
        return self.trace.config.tree_budget

    @property
    def measured(self) -> float:
        return self.economics.speedup_vs_ar or 0.0

    def within_noise(self, best: SweepPoint) -> bool:
        """Whether this pass measured as fast as ``best``'s up to both passes' noise."""
        return best.measured - self.measured <= math.hypot(self.noise or 0.0, best.noise or 0.0)


def speedup_noise(trace: Trace, baseline: Trace) -> float | None:
    """How far one pass's measured speed-up over ``baseline`` may stray by chance, relative to it: ``NOISE_ERRORS``
    standard errors of the two passes' speeds together (``engine.measure.economics.speed_noise``)."""
    errors = [speed_noise((step.acceptance_length, step.t_end - step.t_start) for step in run.steps)
              for run in (trace, baseline)]
    return None if None in errors else NOISE_ERRORS * math.hypot(*errors)


def sweep_points(traces: list[Trace], baseline: Trace | None) -> dict[str | None, list[SweepPoint]]:
    """A sweep's finished runs by drafter (the loaded one's under None, a second drafter's under its tag), each by
    budget."""
    runs = sorted((t for t in traces if t.summary is not None), key=lambda t: t.config.tree_budget)
    entries = trace_economics(runs, baseline)
    points: dict[str | None, list[SweepPoint]] = {}
    for trace in runs:
        noise = speedup_noise(trace, baseline) if baseline is not None else None
        entry = entries[trace.config.label]
        measured = entry.speedup_vs_ar
        points.setdefault(trace.config.drafter_tag, []).append(
            SweepPoint(trace, entry, noise * measured if noise is not None and measured is not None else None))
    return points


def best_measured(points: list[SweepPoint]) -> SweepPoint | None:
    """The budget whose pass measured fastest (a prediction is no measurement: it leaves out the prefill)."""
    measured = [point for point in points if point.economics.speedup_vs_ar is not None]
    return max(measured, key=lambda point: point.measured) if measured else None


def sweep_verdict(traces: list[Trace], baseline: Trace | None) -> str:
    """In words (Markdown): each drafter's measured best budget, and the budgets one pass cannot tell from it."""
    lines = []
    for tag, points in sweep_points(traces, baseline).items():
        best = best_measured(points)
        if best is None:
            continue
        noise = f" ± {best.noise:.2f}" if best.noise is not None else ""
        close = [str(point.budget) for point in points if point is not best and point.within_noise(best)]
        tied = (f"; budget{'s' * (len(close) > 1)} {', '.join(close)} measured within one pass's noise of it: one "
                "pass cannot tell them apart" if close else "")
        best_of = f"With {tag}, best measured" if tag else "Best measured"
        lines.append(f"{best_of}: budget **{best.budget}**, {best.measured:.2f}×{noise} AR "
                     f"(predicted {best.economics.predicted_speedup or 0:.2f}×){tied}.")
    return " ".join(lines)


def _tagged(name: str, tag: str | None) -> str:
    """A sweep trace's name; a second drafter's with its tag."""
    return f"{name} · {tag}" if tag else name


def sweep_figure(traces: list[Trace], baseline: Trace | None = None) -> go.Figure:
    """Against the DDTree budget: τ and the step cost (in AR steps) rising together, and the
    speed-up τ ÷ cost (predicted) beside the measured one with its noise, the measured best marked; AR is 1×.
    A second drafter's runs are drawn beside the first's, dotted, in its shade."""
    groups = sweep_points(traces, baseline)
    if not groups:
        return empty_figure("Run a sweep to compare budgets.")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("τ and step cost", "speed-up vs AR"))
    for tag, points in groups.items():
        budgets, rows = [point.budget for point in points], [point.economics for point in points]
        line = dict(dash="dot" if tag else None)
        fig.add_trace(go.Scatter(x=budgets, y=[e.tau for e in rows], mode="lines+markers",
                                 name=_tagged("τ (tokens per step)", tag), marker_color=ACCEPTED_COLOUR, line=line),
                      row=1, col=1)
        if baseline is None:
            continue
        colour = TREE.run_colour(tag)
        fig.add_trace(go.Scatter(x=budgets, y=[e.step_cost_vs_ar for e in rows], mode="lines+markers",
                                 name=_tagged("step cost (AR steps)", tag), marker_color=TARGET_COLOUR, line=line),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=budgets, y=[e.predicted_speedup for e in rows], mode="lines+markers",
                                 name=_tagged("predicted τ ÷ cost", tag), marker_color=colour, line=line), row=1, col=2)
        fig.add_trace(go.Scatter(x=budgets, y=[e.speedup_vs_ar for e in rows], mode="markers",
                                 name=_tagged("measured", tag), marker=dict(color=colour, symbol="x", size=10),
                                 error_y=dict(type="data", array=[point.noise or 0.0 for point in points],
                                              color=colour, thickness=1)), row=1, col=2)
        best = best_measured(points)
        if best is not None:
            # on a log axis an annotation's x is the exponent: 16 sits at log10(16), not at 10^16
            fig.add_annotation(x=math.log10(best.budget), y=best.measured, text=_tagged(f"best: {best.budget}", tag),
                               showarrow=True, arrowhead=2, row=1, col=2)
    if baseline is not None:
        fig.add_hline(y=1.0, line=dict(dash="dash", color=BASELINE.colour), annotation_text=BASELINE.title,
                      row=1, col=2)
    budgets = sorted({point.budget for points in groups.values() for point in points})
    noises = [point.noise / point.measured for points in groups.values() for point in points
              if point.noise is not None and point.measured]
    noise = (f"measured: one pass, ± {100 * statistics.median(noises):.0f}% noise ({NOISE_ERRORS} standard errors, "
             "from its steps' times)") if noises else ""
    runs = [point.trace for points in groups.values() for point in points]
    fig.update_xaxes(type="log", title="tree budget (nodes)", tickvals=budgets)
    fig.update_layout(template="plotly_white", height=380, margin=dict(l=10, r=10, t=60, b=40),
                      legend=dict(orientation="h", y=-0.25),
                      title=dict(text=timing_title(noise, runs), x=0, font=dict(size=13)))
    return fig


def race_chart(traces: list[Trace], until: float | None = None) -> go.Figure:
    """Tokens committed against wall time for each run: the race. ``until``: the race as of that many seconds,
    a frame of the replay, with its clock drawn and the axes of the whole race, so frames do not jump."""
    if not traces:
        return empty_figure("Run or upload traces to see the race.")
    fig = go.Figure()
    for trace in traces:
        times, counts = race_line(trace, until)
        fig.add_trace(go.Scatter(x=times, y=counts, mode="lines", line_shape="hv", name=trace.config.label,
                                 line=dict(color=trace.config.colour, width=2)))
    fig.update_layout(title=dict(text=timing_title("Tokens over time (each method ran alone)", traces), x=0,
                                 font=dict(size=14)),
                      template="plotly_white", height=300, margin=dict(l=10, r=10, t=70, b=40),
                      xaxis=dict(title="seconds since start"), yaxis=dict(title="tokens"),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0))
    if until is not None:
        finish = max(trace.steps[-1].t_end if trace.steps else trace.prefill.t_end for trace in traces)
        most = max(race_line(trace)[1][-1] for trace in traces)
        fig.add_vline(x=until, line=dict(color="#888", dash="dot", width=1),
                      annotation=dict(text=f"t = {until:.2f} s", font=dict(size=11, color="#666")))
        fig.update_layout(xaxis_range=[0, finish * 1.02], yaxis_range=[0, most * 1.05 + 1])
    return fig


def race_line(trace: Trace, until: float | None = None) -> tuple[list[float], list[int]]:
    """The run's (seconds, tokens committed) corners, as of ``until`` seconds (``None``: the whole run); a line
    cut by the clock runs flat up to it."""
    times, counts = [0.0, trace.prefill.t_end], [0, 1]
    for step in trace.steps:
        times.append(step.t_end)
        counts.append(counts[-1] + step.acceptance_length)
    if until is None:
        return times, counts
    shown = sum(t <= until for t in times)
    return times[:shown] + [until], counts[:shown] + [counts[shown - 1]]
