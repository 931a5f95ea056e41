"""The Run view: the prompt, the settings and a live column a method (and a second drafter's beside the first's),
the runs taking turns on the model (each on its own clock, so that a load falls on all alike), with the step economics
under them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import gradio as gr

from engine.errors import EngineError
from engine.loop.loading import display_name
from engine.loop.race import Race
from engine.loop.settings import DecodeSettings
from engine.methods import AUTO, BASELINE, MAX_TREE_BUDGET, NAMES, TREE, check_budget
from engine.trace import Trace
from viz.figures import economics_figure, economics_text
from viz.page.state import (
    LANES,
    LANE_KEYS,
    LiveRace,
    PlannedRun,
    RunControl,
    Session,
    by_lane,
    checked,
    common_settings,
    disturbed,
    encode_prompt,
    lane_of,
    method_choices,
    ordered,
    problem,
    refusal,
    run_live,
)
from viz.text_view import column_html, legend_html, run_stats

EXAMPLE_PROMPTS = [
    "Write a haiku about the sea.",
    "List the first ten prime numbers.",
    "Explain what a hash table is in two sentences.",
    "Write a Python function that reverses a string.",
]
# /run's outputs by name (/upload's and /open_request's too), in the order the API returns them: the status line, a
# column a method (and the second drafter's, ``dflash_2``), then what the other views show of the traces
RUN_OUTPUTS = ("status", *LANE_KEYS, "summary", "download", "race", "inspect_method", "step", "tree", "probs", "why",
               "step_stages", "run_stages", "histogram", "economics_plot", "economics_text")
NO_SECOND_DRAFTER = ("none", "")  # the second-drafter picker's first choice, and its value


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
                    # text: "auto" sizes every step's tree with this machine's step costs (engine.loop.budgeting)
                    self.budget = gr.Textbox(str(self.studio.tree_budget), max_lines=1, elem_id="budget",
                                             label=f"{TREE.title} budget (\"{AUTO}\" or 1–{MAX_TREE_BUDGET})")
                self.second_drafter = gr.Dropdown(
                    [NO_SECOND_DRAFTER, *((display_name(folder), folder) for folder in self.studio.offered_drafters)],
                    value=self.studio.second_drafter or NO_SECOND_DRAFTER[1], elem_id="second-drafter",
                    visible=bool(self.studio.offered_drafters),
                    label="Second drafter (DFlash and DDTree also run with it, in columns beside the first's)")
                with gr.Row():
                    self.run_button = gr.Button("Run", variant="primary", elem_id="run-button")
                    self.stop_button = gr.Button("Stop", variant="stop", elem_id="stop-button")
        self.session.status.render()
        gr.HTML(legend_html())
        with gr.Row(equal_height=False):
            self.columns = {lane.key: gr.HTML(column_html(lane.caption, None), label=f"{lane.caption} output",
                                              show_label=False, elem_id=f"column-{lane.key}", elem_classes="ddt-output",
                                              visible=not lane.second or self.studio.second_drafter is not None)
                            for lane in LANES}
        with gr.Row(equal_height=False):
            self.economics_plot = gr.Plot(economics_figure([]), label="Step economics", show_label=False,
                                          elem_id="economics-plot", scale=3)
            self.economics_text = gr.Markdown("A method is faster than AR when the tokens it commits per step (τ) "
                                              "exceed what a step costs, counted in AR steps.",
                                              label="Step economics in words", elem_id="economics-text")

    @property
    def status(self) -> gr.Markdown:
        return self.session.status

    @property
    def second_keys(self) -> list[str]:
        """The second drafter's columns."""
        return [lane.key for lane in LANES if lane.second]

    def run(self, prompt, max_new_tokens, temperature, seed, budget, methods, second_drafter, control: RunControl,
            present: Callable[[dict[str, Trace], str], dict]):
        """Run the chosen methods (a drafting one with the second drafter too, where one is picked) in turns on the
        model (``engine.loop.race``), streaming every column, then show everything about the finished traces and
        whether anything disturbed their timings."""
        control.stop = False
        try:
            if not methods:
                raise EngineError("choose at least one method to run")
            prompt_ids = encode_prompt(self.studio, prompt)
            runs = self.planned(common_settings(max_new_tokens, temperature, seed), check_budget(budget), methods,
                                second_drafter)
            checked(prompt_ids, runs)
        except EngineError as exc:
            raise refusal(exc) from None
        planned = {run.lane.key for run in runs}
        yield {self.columns[lane.key]: column_html(lane.caption, None, absent="waiting" if lane.key in planned
                                                   else "not selected") for lane in LANES}
        heading = f"**Running {', '.join(run.lane.caption for run in runs)}**"
        live = None
        try:
            for live in run_live(self.studio, prompt, prompt_ids, runs, control):
                if live.waiting_behind:
                    yield {self.status: f"{heading}: waiting for the model, behind {live.waiting_behind} other "
                                        "run(s) (other visitors', the doctor's or the start-up timing of the "
                                        "budgets)…"}
                else:
                    yield self._live_update(runs, live, heading)
        except Exception as exc:
            ended = [trace for trace in live.traces.values() if trace.summary is not None] if live else []
            yield present(by_lane(ended), problem(exc))
            return
        race = live.race
        finished = by_lane(race.traces if race is not None else [])
        yield present(finished, self._run_status(finished, control.stop, race) + disturbed(self.studio, race))

    def planned(self, common: DecodeSettings, budget, methods: list[str],
                second_drafter: str | None) -> list[PlannedRun]:
        """The click's runs in the columns' order: each chosen method with the loaded drafter, and a drafting one
        with the second drafter too; the box's budget is the tree's (DFlash drafts its whole block)."""
        decoders = {False: self.studio.decoder, True: self.studio.second_decoder(second_drafter)}
        return [PlannedRun(lane, decoders[lane.second],
                           replace(common, method=lane.method.name,
                                   tree_budget=budget if lane.method.budgeted else common.tree_budget))
                for lane in LANES if lane.method.name in methods and decoders[lane.second] is not None]

    def _live_update(self, runs: list[PlannedRun], live: LiveRace, heading: str) -> dict:
        if not live.traces:
            first_use = next(filter(None, (self.studio.first_use(run.settings, run.decoder) for run in runs)), None)
            return {self.status: f"{heading}: {first_use or 'prefill'}…"}
        traces = by_lane(live.traces.values())
        ar = traces.get(BASELINE.name)
        progress = ", ".join(f"{trace.config.heading()} {run_stats(trace).tokens} tokens" for trace in ordered(traces))
        return {self.status: f"{heading}: {progress}",
                **{self.columns[key]: column_html(lane_of(trace).caption, trace, ar) for key, trace in traces.items()}}

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
        ran = ", ".join(lane.caption for lane in LANES if lane.key in traces) or "nothing ran"
        return " · ".join([f"**{done}**: {ran}{how}.", *notes])

    def shown(self, traces: dict[str, Trace]) -> dict:
        ar = traces.get(BASELINE.name)
        runs = ordered(traces)
        return {**{self.columns[lane.key]: column_html(lane.caption, traces.get(lane.key), ar, all_done=True)
                   for lane in LANES},
                self.economics_plot: economics_figure(runs), self.economics_text: economics_text(runs)}

    @property
    def form(self) -> list:
        """The boxes a set of traces fills in (``filled_from``)."""
        return [self.prompt, self.max_new_tokens, self.temperature, self.seed, self.budget, self.methods]

    def filled_from(self, traces: dict[str, Trace]) -> dict:
        """The form as the traces ran (an upload's, a served request's), so that Run or a sweep after it runs their
        prompt and settings, not the ones the boxes held before."""
        runs = ordered(traces)
        if not runs:
            return {}
        config = runs[0].config
        budgets = [trace.config.tree_budget for trace in runs if trace.config.method_row.budgeted]
        return {self.prompt: config.prompt, self.max_new_tokens: config.max_new_tokens,
                self.temperature: config.temperature, self.seed: config.seed,
                self.methods: list(dict.fromkeys(trace.config.method for trace in runs)),
                **({self.budget: str(budgets[0])} if budgets else {})}

    def show_second(self, traces: dict[str, Trace], folder: str | None) -> dict:
        """The second drafter's columns show while one is picked or the traces shown hold its runs (the page's own
        event: ``/run``'s outputs stay the columns' HTML)."""
        shown = bool(folder) or any(key in traces for key in self.second_keys)
        return {self.columns[key]: gr.HTML(visible=shown) for key in self.second_keys}
