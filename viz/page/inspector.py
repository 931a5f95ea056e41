"""The step inspector: one step of one method at a time, its draft tree, the drafter's top-k, why the walk
stopped and what the step cost."""

from __future__ import annotations

import gradio as gr

from engine.errors import EngineError
from engine.methods import NAMES
from engine.trace import Trace
from viz.figures import (
    acceptance_histogram,
    empty_figure,
    explain_stop,
    probability_figure,
    stage_figure,
    timing_title,
)
from viz.page.state import Session, lane_of, method_choices, ordered, refusal, whole
from viz.tree_figure import tree_figure


class InspectorView:
    """One step of one method at a time: its tree, the drafter's top-k, why it stopped, its timing."""

    def __init__(self, session: Session):
        self.session = session
        self.studio = session.studio

    def build(self) -> None:
        gr.Markdown("## Step inspector")
        with gr.Row():
            # every method from the start, so an API call before any run reaches the handler, which says why not
            self.method = gr.Radio(method_choices(NAMES), label="Method", scale=2)
            self.prev_button = gr.Button("◀ Prev", scale=0, min_width=80)
            self.step = gr.Slider(1, 2, value=1, step=1, label="Step (focus it and use ← →)", scale=4,
                                  elem_id="step-slider", interactive=False)
            self.next_button = gr.Button("Next ▶", scale=0, min_width=80)
        self.tree = gr.Plot(empty_figure("Run or upload traces to inspect the draft trees."), label="Draft tree",
                            elem_id="tree-plot")
        with gr.Row(equal_height=False):
            with gr.Column():
                gr.Markdown("### Why it stopped")
                self.why = gr.Markdown("", label="Why it stopped", elem_id="why-stopped")
            self.step_stages = gr.Plot(empty_figure("Stage timings for the step."), label="Step timing")
        self.probs = gr.Plot(empty_figure("Per-depth draft probabilities appear here."), label="Draft top-k",
                             elem_id="probs-plot")
        with gr.Row():
            self.run_stages = gr.Plot(empty_figure("Stage timings for the run."), label="Run timing")
            self.histogram = gr.Plot(acceptance_histogram([]), label="Acceptance lengths")

    @property
    def step_views(self) -> list:
        """What showing one step updates."""
        return [self.tree, self.probs, self.why, self.step_stages]

    def shown(self, traces: dict[str, Trace]) -> dict:
        runs = ordered(traces)
        # a column each, by its run's heading (a second drafter's with its tag); the last: a tree, when there is one
        choices = [(trace.config.heading(), lane_of(trace).key) for trace in runs]
        first = choices[-1][1] if choices else None
        return {self.method: gr.Radio(choices=choices, value=first),
                self.run_stages: stage_figure({t.config.label: t.summary.stage_s for t in runs},
                                              timing_title("Time per stage, whole run", runs)),
                self.histogram: acceptance_histogram(runs),
                **self.select_method(traces, first)}

    def select_method(self, traces: dict[str, Trace], method: str | None) -> dict:
        count = step_count(traces, method)
        # steps count from 1, as the video counts them; a slider needs maximum > minimum, so a one-step
        # run still gets 1..2 (inspect clamps)
        return {self.step: gr.Slider(minimum=1, maximum=max(count, 2), value=1, step=1, interactive=count > 1),
                **self.inspect(traces, method, 1)}

    def requested(self, traces: dict[str, Trace], method: str | None) -> None:
        """A visitor's (or an API client's) choice of method must name one of this session's traces."""
        if not traces:
            raise refusal(EngineError("nothing to inspect yet: run the methods or upload traces"))
        if not isinstance(method, str) or method not in traces:  # unprocessed (``inspect``): it may be anything
            raise refusal(EngineError(f"this session has no {method!r} trace; it has {', '.join(traces)}"))

    def choose_method(self, traces: dict[str, Trace], method: str | None) -> dict:
        self.requested(traces, method)
        return self.select_method(traces, method)

    def choose_step(self, traces: dict[str, Trace], method: str | None, step) -> dict:
        self.requested(traces, method)
        return self.show_step(traces, method, step)

    def show_step(self, traces: dict[str, Trace], method: str | None, step, delta: int = 0) -> dict:
        """The step asked for, moved by ``delta`` and kept within the trace; the step box shows the step drawn
        (its number box takes 999 or 0 as typed)."""
        try:
            shown = min(max(whole(step, "step") + delta, 1), max(step_count(traces, method), 1))
        except EngineError as exc:
            raise refusal(exc) from None
        return {self.step: shown, **self.inspect(traces, method, shown)}

    def inspect(self, traces: dict[str, Trace], method: str | None, number: int) -> dict:
        """Step ``number`` (from 1, within the trace) of the method's trace."""
        trace = traces.get(method) if method else None
        if trace is None or not trace.steps:
            message = "No steps to inspect." if trace is not None else "Run or upload traces to inspect steps."
            return {self.tree: empty_figure(message), self.probs: empty_figure(message), self.why: "",
                    self.step_stages: empty_figure(message)}
        step = trace.steps[number - 1]
        token_text = self.studio.token_text_for(ordered(traces))
        label = trace.config.label
        return {
            self.tree: tree_figure(step, token_text, trace.config.title_label),
            self.probs: probability_figure(step, token_text, trace.config.title_label),
            self.why: explain_stop(step, token_text),
            self.step_stages: stage_figure({label: step.stage_s},
                                           timing_title(f"Time per stage, step {step.number}", [trace])),
        }


def step_count(traces: dict[str, Trace], method: str | None) -> int:
    trace = traces.get(method) if method else None
    return len(trace.steps) if trace else 0

