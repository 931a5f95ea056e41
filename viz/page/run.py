"""The Run view: the prompt, the settings and a live column a method, the methods taking turns on the model (each on
its own clock, so that a load falls on all alike), with the step economics under them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import gradio as gr

from engine.errors import EngineError
from engine.loop.race import Race
from engine.loop.settings import DecodeSettings
from engine.methods import BASELINE, MAX_TREE_BUDGET, METHODS, NAMES, TREE
from engine.trace import Trace
from viz.figures import economics_figure, economics_text
from viz.page.state import (
    LiveRace,
    RunControl,
    Session,
    checked,
    common_settings,
    disturbed,
    encode_prompt,
    method_choices,
    ordered,
    problem,
    refusal,
    run_live,
    whole,
)
from viz.text_view import column_html, legend_html, run_stats

EXAMPLE_PROMPTS = [
    "Write a haiku about the sea.",
    "List the first ten prime numbers.",
    "Explain what a hash table is in two sentences.",
    "Write a Python function that reverses a string.",
]
# /run's outputs by name (/upload's and /open_request's too), in the order the API returns them: the status line, a
# column a method, then what the other views show of the traces
RUN_OUTPUTS = ("status", *NAMES, "summary", "download", "race", "inspect_method", "step", "tree", "probs", "why",
               "step_stages", "run_stages", "histogram", "economics_plot", "economics_text")


def named_outputs(result) -> dict:
    """A ``gradio_client`` result of ``/run`` (or ``/upload``, ``/open_request``) by the names of ``RUN_OUTPUTS``."""
    return dict(zip(RUN_OUTPUTS, result, strict=True))


class RunView:
    """The Run controls and a live column a method, with the step economics under them."""

    def __init__(self, session: Session):
        self.session = session
        self.studio = session.studio

    def build(self) -> None:
        with gr.Row(visible=self.studio.has_model):  # a page without a model only opens traces
            with gr.Column(scale=3):
                self.prompt = gr.Textbox(label="Prompt", lines=3, value=EXAMPLE_PROMPTS[0], elem_id="prompt")
                gr.Examples(EXAMPLE_PROMPTS, inputs=self.prompt, label="Example prompts")
            with gr.Column(scale=2):
                self.methods = gr.CheckboxGroup(method_choices(NAMES), value=list(NAMES), elem_id="methods",
                                                label="Methods (they take turns, each on its own clock)")
                with gr.Row():
                    # no precision: a rounding box would quietly run 2.5 tokens as 2; ``whole`` refuses it
                    self.max_new_tokens = gr.Number(64, label="Max new tokens", step=1, elem_id="max-new-tokens")
                    self.temperature = gr.Number(0.0, label="Temperature (0 = greedy)")
                with gr.Row():
                    self.seed = gr.Number(0, label="Seed", step=1)
                    # a plain value, not one computed at page load: a load event, queued behind runs, would
                    # overwrite what the visitor typed meanwhile; the timing clock moves an untouched box
                    self.budget = gr.Number(self.studio.budget.budget, step=1, elem_id="budget",
                                            label=f"{TREE.title} budget (nodes, 1–{MAX_TREE_BUDGET})")
                    self.budget_typed = gr.State(False)
                with gr.Row():
                    self.run_button = gr.Button("Run", variant="primary", elem_id="run-button")
                    self.stop_button = gr.Button("Stop", variant="stop", elem_id="stop-button")
        self.session.status.render()
        gr.HTML(legend_html())
        with gr.Row(equal_height=False):
            self.columns = {row.name: gr.HTML(column_html(row.name, None), label=f"{row.caption} output",
                                              show_label=False, elem_id=f"column-{row.name}", elem_classes="ddt-output")
                            for row in METHODS.values()}
        with gr.Row(equal_height=False):
            self.economics_plot = gr.Plot(economics_figure([]), label="Step economics", show_label=False,
                                          elem_id="economics-plot", scale=3)
            self.economics_text = gr.Markdown("A method is faster than AR when the tokens it commits per step (τ) "
                                              "exceed what a step costs, counted in AR steps.",
                                              label="Step economics in words", elem_id="economics-text")

    @property
    def status(self) -> gr.Markdown:
        return self.session.status

    def run(self, prompt, max_new_tokens, temperature, seed, budget, methods, control: RunControl,
            present: Callable[[dict[str, Trace], str], dict]):
        """Run the chosen methods in turns on the model (``engine.loop.race``), streaming every column, then show
        everything about the finished traces and whether anything disturbed their timings."""
        control.stop = False
        try:
            if not methods:
                raise EngineError("choose at least one method to run")
            prompt_ids = encode_prompt(self.studio, prompt)
            common = common_settings(max_new_tokens, temperature, seed)
            budget = whole(budget, "tree budget")  # its range DecodeSettings checks (``engine.methods.check_budget``)
            settings, _ = checked(self.studio, prompt_ids, [replace(common, method=name, tree_budget=budget)
                                                         for name in NAMES if name in methods])
        except EngineError as exc:
            raise refusal(exc) from None
        yield {column: column_html(method, None, absent="waiting" if method in methods else "not selected")
               for method, column in self.columns.items()}
        heading = f"**Running {', '.join(METHODS[setting.method].caption for setting in settings)}**"
        live = None
        try:
            for live in run_live(self.studio, prompt, prompt_ids, settings, control):
                if live.waiting_behind:
                    yield {self.status: f"{heading}: waiting for the model, behind {live.waiting_behind} other "
                                        "run(s) (other visitors', the doctor's or the start-up timing of the "
                                        "budgets)…"}
                else:
                    yield self._live_update(settings, live, heading)
        except Exception as exc:
            ended = [trace for trace in live.traces.values() if trace.summary is not None] if live else []
            yield present(by_method(ended), problem(exc))
            return
        race = live.race
        finished = by_method(race.traces if race is not None else [])
        yield present(finished, self._run_status(finished, control.stop, race) + disturbed(self.studio, race))

    def _live_update(self, settings: list[DecodeSettings], live: LiveRace, heading: str) -> dict:
        if not live.traces:
            first_use = next(filter(None, map(self.studio.first_use, settings)), None)
            return {self.status: f"{heading}: {first_use or 'prefill'}…"}
        traces = by_method(live.traces.values())
        ar = traces.get(BASELINE.name)
        progress = ", ".join(f"{METHODS[method].title} {run_stats(trace).tokens} tokens"
                             for method, trace in traces.items())
        return {self.status: f"{heading}: {progress}",
                **{self.columns[method]: column_html(method, trace, ar) for method, trace in traces.items()}}

    @staticmethod
    def _run_status(traces: dict[str, Trace], stopped: bool, race: Race | None) -> str:
        # each run keeps the notes on its settings: one temperature warning per method is one warning
        notes = list(dict.fromkeys(note for trace in traces.values() for note in trace.config.notes))
        for note in notes:
            gr.Info(note)
        done = "Stopped" if stopped else "Done"
        how = ("" if race is None or len(traces) < 2 else
               " (in turns, each on its own clock: a load falls on all alike)" if race.in_turns else
               " (one after another: the fixed step and the vLLM engine run each generation whole)")
        ran = ', '.join(METHODS[m].caption for m in traces) or 'nothing ran'
        return " · ".join([f"**{done}**: {ran}{how}.", *notes])

    def shown(self, traces: dict[str, Trace]) -> dict:
        ar = traces.get(BASELINE.name)
        runs = ordered(traces)
        return {**{column: column_html(method, traces.get(method), ar, all_done=True)
                   for method, column in self.columns.items()},
                self.economics_plot: economics_figure(runs), self.economics_text: economics_text(runs)}


def by_method(traces) -> dict[str, Trace]:
    """Traces keyed by their method, in the table's order."""
    return {trace.config.method: trace for trace in sorted(traces, key=lambda trace: NAMES.index(trace.config.method))}


def typed() -> bool:
    """The visitor typed in a box: what the page would put there later must not replace it."""
    return True

