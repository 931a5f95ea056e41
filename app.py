"""DDTree Studio: run AR, DFlash and DDTree side by side, replay the race, inspect every step.

    python app.py [--host 127.0.0.1] [--port 7860] [--model smollm2] [--drafter FOLDER|random]
                  [--second-drafter FOLDER] [--device cpu] [--dtype float32] [--engine torch|vllm]
                  [--no-compile-step] [--tree-budget auto|N]

The page answers as soon as the models are loaded. Its DDTree budget box opens at "auto": every step sizes its
tree with the step costs recorded for this kind of machine (``assets/batching.json``, else provisional ones). The
fixed budget the banner recommends comes from the bench's record for this kind of machine
(``assets/budgets.json``), or from timings kept by earlier starts; what is missing is timed in the background
(``engine.measure.calibration``). ``--second-drafter``: a drafter to compare with the first on the same prompts,
on the same target (its weights loaded once); the page's picker offers it and every folder in ``assets/drafters/``.

The models load once at startup and are shared read-only by every browser session;
each session keeps its own traces in ``gr.State``. ``--port`` defaults to Gradio's
``GRADIO_SERVER_PORT`` (then 7860), ``--host`` to ``GRADIO_SERVER_NAME`` (then 127.0.0.1).

Trace files (the download, and what the upload accepts) are JSON:
``{"schema_version": 2, "traces": [<Trace>, ...]}`` with one trace per method, each
as ``engine.trace.Trace.to_dict()`` writes it. The upload also takes a single trace
object (``Trace.save``) or a plain list of traces.

The page's views live in ``viz/page/`` (one module a part of the page), its figures in ``viz/`` (pure functions of
traces); this file parses the arguments, loads the models, and lays the views out and wires them.
"""

from __future__ import annotations

import argparse
import functools
import logging
import threading
import time
from collections.abc import Callable

import gradio as gr

from engine.errors import EngineError
from engine.loop.decode import Decoder
from engine.loop.loading import drafter_folders, takes_second_drafter
from engine.measure.calibration import FALLBACK_BUDGET, BudgetChoice, cache_dir
from engine.methods import AUTO, TREE, Budget, check_budget
from engine.serving.model_queue import ModelQueue
from engine.serving.startup import (
    add_model_arguments,
    batch_budgeting,
    check_model_arguments,
    load_studio_decoder,
    opening_budget,
)
from engine.serving.traffic import DEFAULT_SERVER, server_url
from engine.trace import Trace
from viz.page.doctor import DoctorView
from viz.page.inspector import InspectorView
from viz.page.replay import ReplayView
from viz.page.run import RUN_OUTPUTS, RunView
from viz.page.state import RunControl, ScratchFiles, Session, Studio, request_stop
from viz.page.sweep import SweepView
from viz.page.traces import TracesView
from viz.page.traffic import TrafficView

log = logging.getLogger("ddtree-studio")

TIMING_POLL_S = 2.0  # how often the banner follows the background timing of the budgets
# Gradio keeps every session's traces and a copy of every output it was shown (a few MB after a run) until this
# many newer sessions evict it; its default, 10000, is unbounded in practice: memory grew with every visitor
MAX_SESSIONS = 128


class StudioApp:
    """The page: the views laid out and wired to each other."""

    def __init__(self, studio: Studio):
        self.studio = studio
        self.demo = self._build()

    def _build(self) -> gr.Blocks:
        with gr.Blocks(title="DDTree Studio", delete_cache=(3600, 3600)) as demo:
            # method -> Trace, this session's run or upload; and its Stop switch
            status = gr.Markdown("Ready.", label="Status", elem_id="status", render=False)  # the Run view places it
            self.session = Session(self.studio, gr.State({}), gr.State(RunControl()), status, ScratchFiles())
            gr.Markdown("# DDTree Studio\nAR, DFlash and DDTree decoding side by side — same target, same prompt.")
            # while the budgets are timed, the timing clock keeps it current
            self.banner = gr.Markdown(self._model_banner(), elem_id="model-banner")
            with gr.Tabs():
                with gr.Tab("Run & inspect"):
                    self.traffic_view = TrafficView(self.session, self.present)
                    self.traffic_view.build()
                    self.run_view = RunView(self.session)
                    self.run_view.build()
                    self.replay_view = ReplayView(self.session, self.run_view.columns)
                    self.replay_view.build()
                    self.traces_view = TracesView(self.session)
                    self.traces_view.build()
                    self.inspector = InspectorView(self.session)
                    self.inspector.build()
                # both need the model
                with gr.Tab("Budget sweep", visible=self.studio.has_model):
                    self.sweep_view = SweepView(self.session)
                    self.sweep_view.build()
                with gr.Tab("Doctor", visible=self.studio.has_model):
                    self.doctor_view = DoctorView(self.studio)
                    self.doctor_view.build()
            self.timing_clock = gr.Timer(TIMING_POLL_S, active=self.studio.timing_pending)
            self._wire(demo)
        return demo

    def _model_banner(self) -> str:
        decoder = self.studio.decoder
        if decoder is None:
            return (f"No model loaded: this page opens the traffic of the Studio server at **{self.studio.server}** "
                    "(the Traffic panel). Open a request to see its trees, its economics and its replay.")
        target, info = decoder.target, decoder.drafter_info
        drafts = f", {decoder.draft_dtype} drafts" if decoder.draft_dtype else ""
        drafter = (f"**{info.name}** (trained{drafts})" if info.trained else
                   f"**{info.name}** — ⚠️ **untrained**: seeded random weights, so drafts are noise and τ stays "
                   "near 1; the machinery is real, the speed-up is not")
        auto = (f"The {TREE.title} budget \"{AUTO}\" sizes every step's tree with {decoder.budgeting.source}. "
                "A fixed budget: ")
        return (f"Target **{target.name}** on {target.device} ({str(target.dtype).removeprefix('torch.')}, "
                f"{decoder.engine} engine) · drafter {drafter}  \n{auto}{self.studio.budget_sentence()}")

    def _wire(self, demo: gr.Blocks) -> None:
        session, run, replay, traces, inspector, sweep = (self.session, self.run_view, self.replay_view,
                                                          self.traces_view, self.inspector, self.sweep_view)
        # A refusal raises gr.Error: an API client gets its sentence as the error, the page a toast. Gradio marks
        # every output of a failed event "Error" unless the event hides its progress, so events that can refuse
        # hide it (their status line says how they are doing), or check first in an event without outputs.
        run_inputs = [run.prompt, run.max_new_tokens, run.temperature, run.seed, run.budget, run.methods,
                      run.second_drafter, session.control]
        self.while_busy(run.run_button.click, functools.partial(run.run, present=self.present), run_inputs,
                        self.run_outputs, api_name="run", concurrency_id="model", concurrency_limit=4)
        run.stop_button.click(request_stop, session.control, session.status, api_name="stop", queue=False,
                              show_progress="hidden")
        self.while_busy(replay.replay_button.click, replay.replay, [session.traces, replay.speed, session.control],
                        [session.status, *run.columns.values(), replay.race], api_name="replay")
        replay.video_button.click(replay.check_film, session.traces, None, queue=False, api_visibility="private",
                                  show_progress="hidden").success(
            replay.render_video, [session.traces, replay.speed], [session.status, replay.video], api_name="video",
            concurrency_id="video", concurrency_limit=1)
        # an upload (or a served request, below) fills the form with its prompt and settings, and shows the second
        # drafter's columns where it holds that drafter's runs
        private = dict(api_visibility="private", queue=False, show_progress="hidden")
        second_columns = [run.columns[key] for key in run.second_keys]
        show_second = dict(fn=run.show_second, inputs=[session.traces, run.second_drafter], outputs=second_columns,
                           **private)
        fill_form = dict(fn=run.filled_from, inputs=session.traces, outputs=run.form, **private)
        traces.upload.upload(functools.partial(traces.load_upload, present=self.present), traces.upload,
                             self.run_outputs, api_name="upload", show_progress="hidden").success(
            **fill_form).success(**show_second)
        # .input (not .change) so the updates a run or upload makes do not trigger these again
        inspector.method.input(inspector.choose_method, [session.traces, inspector.method],
                               [inspector.step, *inspector.step_views], api_name="select_method",
                               show_progress="hidden")
        # unprocessed, so the handler (not the slider's range check) answers a step of 999, 0 or "x"
        inspector.step.input(inspector.choose_step, [session.traces, inspector.method, inspector.step],
                             [inspector.step, *inspector.step_views], api_name="inspect", trigger_mode="always_last",
                             show_progress="hidden", preprocess=False)
        for button, delta in ((inspector.prev_button, -1), (inspector.next_button, 1)):
            button.click(functools.partial(inspector.show_step, delta=delta),
                         [session.traces, inspector.method, inspector.step], [inspector.step, *inspector.step_views],
                         api_visibility="private", show_progress="hidden", preprocess=False)
        self.while_busy(sweep.sweep_button.click, sweep.sweep,
                        [run.prompt, run.max_new_tokens, run.temperature, run.seed, sweep.budgets, run.second_drafter,
                         session.control],
                        [sweep.status, sweep.plot, sweep.table], api_name="sweep", concurrency_id="model",
                        concurrency_limit=4)
        sweep.stop_button.click(request_stop, session.control, sweep.status, api_visibility="private", queue=False,
                                show_progress="hidden")
        gr.api(self.info, api_name="info", queue=False)
        traffic = self.traffic_view
        listing = [traffic.table, traffic.listed, traffic.request, session.status]
        traffic.refresh_button.click(traffic.refresh, traffic.url, listing, api_name="traffic", show_progress="hidden")
        self.while_busy(traffic.open_button.click, traffic.open, [traffic.url, traffic.request], self.run_outputs,
                        api_name="open_request", then=(fill_form, show_second))
        # the click's row reaches only the event it triggers: pick the request there, then open it
        traffic.table.select(traffic.pick_row, traffic.listed, traffic.request, api_visibility="private",
                             show_progress="hidden").success(traffic.open, [traffic.url, traffic.request],
                                                             self.run_outputs, api_visibility="private",
                                                             show_progress="hidden").success(
            **fill_form).success(**show_second)
        if self.studio.server is not None:  # the page opens on the server's list
            demo.load(traffic.refresh, traffic.url, listing, api_visibility="private", show_progress="hidden")
        traffic.clock.tick(traffic.follow, [traffic.url, traffic.request], [*listing, traffic.clock],
                           api_visibility="private", show_progress="hidden")
        for event, open_ in ((traffic.panel.expand, True), (traffic.panel.collapse, False)):
            event(functools.partial(traffic.watch, open_), None, traffic.clock, api_visibility="private", queue=False,
                  show_progress="hidden")
        run.second_drafter.input(**show_second)
        self.timing_clock.tick(self.follow_timing, None, [self.banner, self.timing_clock], api_visibility="private",
                               queue=False, show_progress="hidden")

    @property
    def busy_buttons(self) -> list[gr.Button]:
        """The buttons that start work in the session's columns or on its Stop switch: one at a time."""
        return [self.run_view.run_button, self.sweep_view.sweep_button, self.replay_view.replay_button]

    def while_busy(self, trigger: Callable, fn: Callable, inputs: list, outputs: list, then: tuple[dict, ...] = (),
                   **event) -> None:
        """``fn`` on ``trigger`` with the busy buttons disabled until it ends, however it ends (done, stopped,
        refused or failed), so a second click cannot start a run the page would not show; ``then``: events after
        it succeeds, in turn. Only ``fn`` is the API's endpoint: the buttons are the page's."""
        buttons, private = self.busy_buttons, dict(queue=False, api_visibility="private", show_progress="hidden")
        work = trigger(lambda: {button: gr.Button(interactive=False) for button in buttons}, None, buttons,
                       **private).then(fn, inputs, outputs, show_progress="hidden", **event)
        for ended in (work.then, work.failure):  # the page runs a .then only after a success
            ended(lambda: {button: gr.Button(interactive=True) for button in buttons}, None, buttons, **private)
        following = work
        for after in then:
            following = following.success(**after)

    def follow_timing(self) -> dict:
        """The banner follows the background timing of the fixed budgets; when it ends, the clock stops (the budget
        box keeps what it holds: "auto", or what the visitor typed)."""
        if self.studio.timing_pending:
            return {self.banner: self._model_banner()}
        return {self.banner: self._model_banner(), self.timing_clock: gr.Timer(active=False)}

    def info(self) -> dict:
        """What the page runs on and the DDTree budget it starts with, and why; and the names of ``/run``'s
        outputs, in their order, so that a client reads them by name."""
        decoder, choice = self.studio.decoder, self.studio.budget
        outputs = {"run_outputs": list(RUN_OUTPUTS)}
        if decoder is None:
            return {"engine": None, "model": None, "server": self.studio.server, "why": self._model_banner(), **outputs}
        return {"engine": decoder.engine, "device": str(decoder.target.device), "model": decoder.target.name,
                "drafter": decoder.drafter_info.name, "draft_dtype": decoder.draft_dtype,
                "tree_budget": self.studio.tree_budget, "auto_budget": decoder.budgeting.source,
                "fixed_budget": choice.budget, "why": self.studio.budget_sentence(),
                "second_drafters": self.studio.offered_drafters, "second_drafter": self.studio.second_drafter,
                "calibration": {str(budget): entry.to_dict() for budget, entry in choice.table.items()}, **outputs}

    @property
    def run_outputs(self) -> list:
        """Everything a set of traces is shown in, in the order of ``RUN_OUTPUTS``, the API's (the traces state,
        last, is not part of the API)."""
        run, traces, inspector = self.run_view, self.traces_view, self.inspector
        shown = {"status": self.session.status, **run.columns, "summary": traces.summary, "download": traces.download,
                 "race": self.replay_view.race, "inspect_method": inspector.method, "step": inspector.step,
                 "tree": inspector.tree, "probs": inspector.probs, "why": inspector.why,
                 "step_stages": inspector.step_stages, "run_stages": inspector.run_stages,
                 "histogram": inspector.histogram, "economics_plot": run.economics_plot,
                 "economics_text": run.economics_text}
        return [shown[name] for name in RUN_OUTPUTS] + [self.session.traces]

    def present(self, traces: dict[str, Trace], status: str) -> dict:
        """Every view of a set of finished traces (after a run or an upload)."""
        return {self.session.status: status, self.session.traces: traces, **self.run_view.shown(traces),
                **self.traces_view.shown(traces), **self.replay_view.shown(traces), **self.inspector.shown(traces)}


CSS = """
.ddt-column { min-height: 8em; }
#status { min-height: 1.5em; }
/* a row wraps what it cannot fit: on a phone each output column takes a line of its own rather than a word; on a
   laptop two drafters' five columns share one row */
.ddt-output { min-width: min(220px, 100%) !important; }
"""
# Gradio's own semibold faces hold a few dozen glyphs: its semibold "A" beside a fallback font's "R" split a bold "AR"
# in two. Bold text takes the full bold faces it also ships.
THEME = gr.themes.Default(font=(gr.themes.LocalFont("Source Sans Pro", weights=(400, 700)), "ui-sans-serif",
                                "system-ui", "sans-serif"),
                          font_mono=(gr.themes.LocalFont("IBM Plex Mono", weights=(400, 700)), "ui-monospace",
                                     "Consolas", "monospace"))


def startup_studio(decoder: Decoder, queue: ModelQueue, tree_budget: Budget = AUTO,
                   second_drafter: str | None = None) -> Studio:
    """The page's budgets, at once: "auto" trees sized with the step costs recorded for this kind of machine
    (``batch_budgeting``, nothing timed at start-up), and the fixed budget it recommends (``opening_budget``; where
    timings are missing, ``Studio.time_budgets`` times the rest in the background). The drafters the page offers
    to compare: the torch engine's (a second decoder on the same target)."""
    queue.run(batch_budgeting, decoder, False)
    budget, timing = opening_budget(decoder, tree_budget if tree_budget != AUTO else None)
    offered = drafter_folders(second_drafter) if takes_second_drafter(decoder) else []
    return Studio(decoder, budget, queue=queue, timing=timing, tree_budget=tree_budget, offered_drafters=offered,
                  second_drafter=second_drafter)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=None, help="address to serve on (default: GRADIO_SERVER_NAME or 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: GRADIO_SERVER_PORT or 7860)")
    parser.add_argument("--server", default=None,
                        help="open the traffic of a Studio server (python -m engine.tools.serve), e.g. "
                             f"{DEFAULT_SERVER}: the page loads no model, it lists the server's requests and opens "
                             "any of them in the inspector")
    add_model_arguments(parser)
    parser.add_argument("--second-drafter", default=None, metavar="FOLDER",
                        help="a second DFlash drafter to compare with the first on the same prompts and target "
                             "(torch engine): DFlash and DDTree run with both, side by side")
    parser.add_argument("--tree-budget", default=AUTO,
                        help='the DDTree budget the page starts with: "auto" (the default: every step sizes its tree '
                             "with this machine's step costs) or 1..1024 nodes")
    args = parser.parse_args(argv)
    try:
        args.tree_budget = check_budget(args.tree_budget)
        if args.server is not None:
            server_url(args.server)
    except EngineError as exc:
        parser.error(str(exc))
    check_model_arguments(parser, args)
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    if args.server is not None:
        studio = Studio(None, BudgetChoice(FALLBACK_BUDGET, {}, "no model loaded"), server=server_url(args.server))
        log.info("no model: opening the traffic of %s", studio.server)
        launch(studio, args)
        return
    log.info("loading models (the bundled SmolLM2 takes ~20 s on CPU)…")
    started = time.perf_counter()
    queue = ModelQueue()
    try:
        decoder = queue.run(load_studio_decoder, args)
    except EngineError as exc:
        raise SystemExit(f"error: {exc}") from None
    log.info("loaded %s with drafter %s in %.1f s", decoder.target.name, decoder.drafter_info.name,
             time.perf_counter() - started)
    studio = startup_studio(decoder, queue, args.tree_budget, args.second_drafter)
    try:
        second = studio.second_decoder(args.second_drafter)  # a bad folder fails here, not at the first run
    except EngineError as exc:
        raise SystemExit(f"error: --second-drafter: {exc}") from None
    if second is not None:
        log.info("second drafter %s (its runs labelled +%s)", second.drafter_info.name, second.drafter_info.tag)
    log.info("%s", studio.budget_sentence())
    if decoder.compile_step:
        log.info("the step is compiled: each method and budget compiles at its first run (the page says so while "
                 "it does), cached in %s for the next start", cache_dir())
    if studio.timing_pending:
        threading.Thread(target=studio.time_budgets, name="budget-timing", daemon=True).start()
    launch(studio, args)


def launch(studio: Studio, args: argparse.Namespace) -> None:
    StudioApp(studio).demo.queue(default_concurrency_limit=4).launch(
        server_name=args.host, server_port=args.port, css=CSS, theme=THEME, state_session_capacity=MAX_SESSIONS)


if __name__ == "__main__":
    main()
