"""DDTree Studio: run AR, DFlash and DDTree side by side, replay the race, inspect every step.

    python app.py [--host 127.0.0.1] [--port 7860] [--model smollm2] [--drafter FOLDER|random]
                  [--device cpu] [--dtype float32] [--engine torch|vllm] [--no-compile-step] [--tree-budget N]

The page answers as soon as the models are loaded: its first DDTree budget comes from the bench's
record for this kind of machine (``assets/budgets.json``), or from timings kept by earlier starts;
what is missing is timed in the background (``engine.measure.calibration``).

The models load once at startup and are shared read-only by every browser session;
each session keeps its own traces in ``gr.State``. ``--port`` defaults to Gradio's
``GRADIO_SERVER_PORT`` (then 7860), ``--host`` to ``GRADIO_SERVER_NAME`` (then 127.0.0.1).

Trace files (the download, and what the upload accepts) are JSON:
``{"schema_version": 1, "traces": [<Trace>, ...]}`` with one trace per method, each
as ``engine.trace.Trace.to_dict()`` writes it. The upload also takes a single trace
object (``Trace.save``) or a plain list of traces.

Figures come from ``viz/`` (pure functions of traces); this file only wires them up.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import math
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr

from engine.errors import EngineError
from engine.loop.decode import Decoder
from engine.loop.settings import DecodeSettings
from engine.measure.calibration import FALLBACK_BUDGET, BudgetChoice, StartupTiming, cache_dir
from engine.methods import NAMES
from engine.serving.model_queue import ModelQueue
from engine.serving.startup import add_model_arguments, check_model_arguments, load_studio_decoder, opening_budget
from engine.serving.traffic import DEFAULT_SERVER, ServedRequest, recent_requests, request_traces, server_url
from engine.trace import Trace, TraceError, divergence, read_trace_file, write_trace_file
from viz.figures import (
    acceptance_histogram,
    economics_figure,
    economics_text,
    empty_figure,
    explain_stop,
    probability_figure,
    race_chart,
    stage_figure,
    sweep_figure,
    timing_title,
    trace_economics,
)
from viz.text_view import METHOD_NAMES, column_html, identical_to, legend_html, run_stats
from viz.tokens import TokenText, pieces_token_text
from viz.tree_figure import tree_figure
from viz.video import VideoError, render_video

log = logging.getLogger("ddtree-studio")

EXAMPLE_PROMPTS = [
    "Write a haiku about the sea.",
    "List the first ten prime numbers.",
    "Explain what a hash table is in two sentences.",
    "Write a Python function that reverses a string.",
]
POLL_S = 0.2  # how often a streaming handler refreshes the page while the model works
TIMING_POLL_S = 2.0  # how often the banner follows the background timing of the budgets
REPLAY_FRAME_S = 0.1
# strings, so the API lists exactly the values it accepts
REPLAY_SPEEDS = [("0.25×", "0.25"), ("0.5×", "0.5"), ("1× (real time)", "1")]
DEFAULT_SWEEP = "4, 8, 16, 32, 64, 128"
MAX_SWEEP_POINTS = 8
MAX_SEED = 2**63 - 1
KEPT_FILES = 64  # trace downloads and videos kept on disk; Gradio serves its own copy of each
# Gradio keeps every session's traces and a copy of every output it was shown (a few MB after a run) until this
# many newer sessions evict it; its default, 10000, is unbounded in practice: memory grew with every visitor
MAX_SESSIONS = 128
TRACE_FILE_NAME = "ddtree-traces.json"


# ---------------------------------------------------------------- models (shared)

@dataclass
class Studio:
    """The loaded models, shared by every session. Every call that touches them is a job on ``queue``,
    their one owner (``engine.serving.model_queue``): a torch model with caches is not safe to drive
    from two threads, and no handler takes a lock around the model, so no two can wait on each other."""

    decoder: Decoder | None  # None: the page loads no model and opens a server's traffic (``--server``)
    budget: BudgetChoice  # the DDTree budget the page starts with, and why
    queue: ModelQueue = field(default_factory=ModelQueue)
    server: str | None = None  # the Studio server whose traffic the page opens first
    timing: StartupTiming | None = None  # budgets still being timed in the background, if any
    timing_error: str | None = None
    started: set[tuple[str, int | None]] = field(default_factory=set)  # (method, budget) run once already

    @property
    def has_model(self) -> bool:
        return self.decoder is not None

    def require_model(self) -> Decoder:
        if self.decoder is None:
            raise EngineError(f"this page loads no model: it opens the traffic of {self.server}; start it without "
                              "--server to run prompts here")
        return self.decoder

    @property
    def timing_pending(self) -> bool:
        return self.timing is not None and bool(self.timing.missing()) and self.timing_error is None

    def budget_sentence(self) -> str:
        """Why the page starts at its budget; while the timing runs, how far it got."""
        if self.timing_error is not None:
            return (f"DDTree budget {self.budget.budget}: timing the budgets on this machine failed "
                    f"({self.timing_error}); the page keeps this budget.")
        if self.timing_pending:
            return (f"DDTree budget {self.budget.budget} for now (a tree that branches). No bench record fits this "
                    f"machine, so the budgets are being timed on it in the background, between runs: "
                    f"{self.timing.progress()}. Each timing is kept in {self.timing.path}, so a restart goes on "
                    "where this one stopped.")
        return self.budget.sentence()

    def first_use(self, settings: DecodeSettings) -> str | None:
        """Said while a compiled step's first run of a method and budget compiles it (a minute or more)."""
        if not self.has_model or not self.decoder.compile_step or run_key(settings) in self.started:
            return None
        return (f"compiling the {settings.method} step for this budget (once per method and budget; the compile "
                f"cache in {cache_dir()} keeps it for the next start)")

    def time_budgets(self) -> None:
        """Time what the cache lacks, one label at a time, each between visitors' runs (a timing beside a
        run would slow both and measure neither), then open new pages at the budget it chose."""
        try:
            for label in self.timing.missing():
                self.queue.run(self.timing.time, label)  # one label a job: visitors' runs queue between them
                # what the timing ran (DFlash warms up with the first label) is compiled: the page need not say so
                self.started |= {("dflash", None), ("ar", None) if label == "ar" else ("ddtree", int(label))}
                log.info("timed %s: %s", label, self.timing.progress())
            self.budget = self.timing.choice()
            log.info("%s", self.budget.sentence())
        except Exception as exc:  # the page keeps serving at the budget it started with
            log.exception("timing the DDTree budgets failed")
            self.timing_error = f"{type(exc).__name__}: {exc}"

    @functools.cached_property
    def decode_token(self) -> TokenText:
        tokenizer = self.decoder.target.tokenizer
        return functools.lru_cache(maxsize=None)(lambda token: tokenizer.decode([token], skip_special_tokens=False))

    def token_text_for(self, traces: list[Trace]) -> TokenText:
        """The tokenizer for traces of the loaded model; otherwise (an upload from
        another model) the text pieces the traces themselves carry."""
        if self.has_model and traces and all(trace.config.model == self.decoder.target.name for trace in traces):
            return self.decode_token
        return pieces_token_text(traces)


# ---------------------------------------------------------------- per-session state

@dataclass
class RunControl:
    """The session's Stop switch; decoding polls it between steps. A plain flag, so
    ``gr.State`` can deep-copy it into every new session."""

    stop: bool = False


def ordered(traces: dict[str, Trace]) -> list[Trace]:
    return [traces[method] for method in NAMES if method in traces]


class ScratchFiles:
    """Files the page hands to Gradio, which copies each into its own cache at once: one folder for the app's
    life that keeps the newest ``keep`` of them (a folder per file would fill /tmp over a day of visitors)."""

    def __init__(self, keep: int = KEPT_FILES):
        self.folder = tempfile.TemporaryDirectory(prefix="ddtree-studio-")  # removed when the app exits
        self.keep = keep
        self.made: deque[Path] = deque()
        self.count = itertools.count()
        self.lock = threading.Lock()

    def path(self, name: str) -> Path:
        """A fresh path ending in ``name``, the name a visitor's download gets."""
        with self.lock:
            folder = Path(self.folder.name) / str(next(self.count))
            folder.mkdir()
            self.made.append(folder)
            while len(self.made) > self.keep:
                shutil.rmtree(self.made.popleft(), ignore_errors=True)
        return folder / name


def save_traces(traces: list[Trace], path: Path) -> str:
    return str(write_trace_file(path, traces))


# ---------------------------------------------------------------- running the model

class LiveRun:
    """One decoder run on the model thread; the handler polls ``trace`` as it grows. ``warm_up``: a compiled
    step's first run of its method and budget; a short untimed run builds its programs first, so the run shown
    (and its speed) pays for no compilation."""

    def __init__(self, studio: Studio, prompt: str, prompt_ids: list[int], settings: DecodeSettings,
                 control: RunControl, warm_up: bool = False):
        self.trace: Trace | None = None
        self.error: Exception | None = None
        self.done = threading.Event()
        self.queue = studio.queue
        self.job = studio.queue.submit(self._work, studio.decoder, prompt, prompt_ids, settings, control, warm_up)

    @property
    def waiting_behind(self) -> int:
        """How many jobs (the running one included) this run waits behind in the model's queue; 0 once it runs."""
        return 0 if self.job.running() or self.job.done() else self.queue.ahead_of(self.job) + 1

    def _work(self, decoder: Decoder, prompt: str, prompt_ids: list[int], settings: DecodeSettings,
              control: RunControl, warm_up: bool) -> None:
        try:
            if control.stop:  # stopped (or the page left) while it queued
                return
            if warm_up:
                decoder.run(prompt, settings.warm_up(), prompt_ids=prompt_ids, should_stop=lambda: control.stop)
            self.trace = decoder.run(prompt, settings, prompt_ids=prompt_ids, on_step=self._on_step,
                                     should_stop=lambda: control.stop)
        except Exception as exc:  # handed to the UI thread, which reports it
            self.error = exc
        finally:
            self.done.set()

    def _on_step(self, trace: Trace, step) -> None:
        self.trace = trace


def run_live(studio: Studio, prompt: str, prompt_ids: list[int], settings: DecodeSettings,
             control: RunControl) -> Iterator[LiveRun]:
    """Yield the live run every ``POLL_S`` until it ends (yielding once more at the end); while it waits in
    the model's queue its ``waiting_behind`` says so. Nothing here holds the model: the queue runs one job
    at a time."""
    live = LiveRun(studio, prompt, prompt_ids, settings, control, warm_up=studio.first_use(settings) is not None)
    try:
        while not live.done.wait(POLL_S):
            yield live
        if live.error is not None:
            raise live.error
        studio.started.add(run_key(settings))
        yield live
    finally:
        if not live.done.is_set():
            control.stop = True  # the page went away mid-run: let the run stop at its next step
            if not studio.queue.cancel(live.job):
                live.done.wait()


def run_key(settings: DecodeSettings) -> tuple[str, int | None]:
    """What a compiled step is compiled for."""
    return settings.method, settings.tree_budget if settings.method == "ddtree" else None


def encode_prompt(studio: Studio, prompt: str) -> list[int]:
    studio.require_model()
    if not prompt or not prompt.strip():
        raise EngineError("the prompt is empty: type a message for the model to answer")
    return studio.decoder.target.chat_ids(prompt)


def filled(value, name: str):
    """A number box's value; an emptied box arrives as None."""
    if value is None:
        raise EngineError(f"{name} is empty: enter a number")
    return value


def is_number(value) -> bool:
    """A finite int or float; not a bool, whose True a box would take as 1."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float)
                                                                          and math.isfinite(value))


def number(value, name: str) -> float:
    """A box's number. An API client can send anything: "hot", true or NaN must be refused here, not fail
    inside the model."""
    value = filled(value, name)
    if not is_number(value):
        raise EngineError(f"{name} must be a number, got {value!r}")
    return value


def whole(value, name: str) -> int:
    """A count's box: an API client can send 2.5, which must not quietly run as 2, or "ten"."""
    value = filled(value, name)
    if not is_number(value) or value != int(value):
        raise EngineError(f"{name} must be a whole number, got {value!r}")
    return int(value)


def common_settings(max_new_tokens, temperature, seed) -> dict:
    seed = whole(seed, "seed")
    if not 0 <= seed <= MAX_SEED:  # torch.manual_seed overflows past 64 bits
        raise EngineError(f"seed must be a whole number between 0 and 2**63-1, got {seed}")
    return dict(max_new_tokens=whole(max_new_tokens, "max new tokens"),
                temperature=number(temperature, "temperature"), seed=seed)


def checked(studio: Studio, prompt_ids: list[int],
            settings: list[DecodeSettings]) -> tuple[list[DecodeSettings], list[str]]:
    """Check every run's settings before any starts, so a bad value fails at once; with the notes on
    what the runs will change (a budget over the cap), each said once."""
    notes = [note for setting in settings for note in studio.decoder.prepare(setting, len(prompt_ids))[1]]
    return settings, list(dict.fromkeys(notes))


def problem(exc: Exception) -> str:
    """Show a failure that ended a run midway: a toast plus the status line's Markdown, beside what
    the run made before it."""
    if isinstance(exc, (EngineError, TraceError, VideoError)):
        message = str(exc)
    else:
        log.exception("unexpected failure")
        message = f"internal error ({type(exc).__name__}: {exc}); the app is still running, try again"
    gr.Warning(message)
    return f"⚠️ **{capitalized(message)}**"


def refusal(exc: Exception) -> gr.Error:
    """Bad input, refused before anything changed: the page shows it as an error toast and keeps
    everything it shows (its events hide their progress, which would mark every output "Error");
    an API client gets the message as its error, not a status line beside unchanged outputs.
    Refusals are expected: the log gets one line, not a traceback."""
    message = capitalized(str(exc))
    log.info("refused: %s", message)
    return gr.Error(message, print_exception=False)


def capitalized(message: str) -> str:
    return message[0].upper() + message[1:]


# ---------------------------------------------------------------- the UI
#
# One small view per part of the page: each builds its components and holds its handlers.
# Handlers return ``{component: value}`` so each updates exactly what it changes; all
# per-user data arrives through ``gr.State``. ``StudioApp`` lays the views out, wires them,
# and shows a set of finished traces in all of them at once (``present``).


@dataclass
class Session:
    """What every view shares: the models, this session's traces and Stop switch, the status line."""

    studio: Studio
    traces: gr.State
    control: gr.State
    status: gr.Markdown
    files: ScratchFiles  # shared by every session: the app's files on disk, bounded


class RunView:
    """The Run controls and the three live columns, with the step economics under them."""

    def __init__(self, session: Session):
        self.session = session
        self.studio = session.studio

    def build(self) -> None:
        with gr.Row(visible=self.studio.has_model):  # a page without a model only opens traces
            with gr.Column(scale=3):
                self.prompt = gr.Textbox(label="Prompt", lines=3, value=EXAMPLE_PROMPTS[0], elem_id="prompt")
                gr.Examples(EXAMPLE_PROMPTS, inputs=self.prompt, label="Example prompts")
            with gr.Column(scale=2):
                self.methods = gr.CheckboxGroup([(METHOD_NAMES[m], m) for m in NAMES], value=list(NAMES),
                                                label="Methods (each runs alone, one after another)", elem_id="methods")
                with gr.Row():
                    # no precision: a rounding box would quietly run 2.5 tokens as 2; ``whole`` refuses it
                    self.max_new_tokens = gr.Number(64, label="Max new tokens", step=1, elem_id="max-new-tokens")
                    self.temperature = gr.Number(0.0, label="Temperature (0 = greedy)")
                with gr.Row():
                    self.seed = gr.Number(0, label="Seed", step=1)
                    # a plain value, not one computed at page load: a load event, queued behind runs, would
                    # overwrite what the visitor typed meanwhile; the timing clock moves an untouched box
                    self.budget = gr.Number(self.studio.budget.budget, label="DDTree budget (nodes, 1–1024)",
                                            step=1, elem_id="budget")
                    self.budget_typed = gr.State(False)
                with gr.Row():
                    self.run_button = gr.Button("Run", variant="primary", elem_id="run-button")
                    self.stop_button = gr.Button("Stop", variant="stop", elem_id="stop-button")
        self.session.status.render()
        gr.HTML(legend_html())
        with gr.Row(equal_height=False):
            self.columns = {method: gr.HTML(column_html(method, None), label=f"{METHOD_NAMES[method]} output",
                                            show_label=False, elem_id=f"column-{method}", elem_classes="ddt-output")
                            for method in NAMES}
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
        """Run the chosen methods one after another, streaming each column, then show
        everything about the finished traces."""
        control.stop = False
        try:
            if not methods:
                raise EngineError("choose at least one method to run")
            prompt_ids = encode_prompt(self.studio, prompt)
            common = common_settings(max_new_tokens, temperature, seed)
            budget = whole(budget, "tree budget")
            settings, _ = checked(self.studio, prompt_ids, [DecodeSettings(method, tree_budget=budget, **common)
                                                         for method in NAMES if method in methods])
        except EngineError as exc:
            raise refusal(exc) from None
        finished: dict[str, Trace] = {}
        yield {column: column_html(method, None, absent="waiting" if method in methods else "not selected")
               for method, column in self.columns.items()}
        for number, setting in enumerate(settings, start=1):
            method = setting.method
            heading = f"**Running {METHOD_NAMES[method]}** ({number} of {len(settings)})"
            live = None
            try:
                for live in run_live(self.studio, prompt, prompt_ids, setting, control):
                    if live.waiting_behind:
                        yield {self.status: f"{heading}: waiting for the model, behind {live.waiting_behind} "
                                            "other run(s) (other visitors', the doctor's or the start-up timing "
                                            "of the budgets)…"}
                    else:
                        yield self._live_update(setting, live, finished, heading)
            except Exception as exc:
                yield present(finished, problem(exc))
                return
            if live is not None and live.trace is not None:
                finished[method] = live.trace
            if control.stop:
                break
        yield present(finished, self._run_status(finished, control.stop))

    def _live_update(self, setting: DecodeSettings, live: LiveRun, finished: dict[str, Trace], heading: str) -> dict:
        method = setting.method
        if live.trace is None:
            return {self.status: f"{heading}: {self.studio.first_use(setting) or 'prefill'}…"}
        stats = run_stats(live.trace)
        return {self.status: f"{heading}: {stats.tokens} tokens, {stats.elapsed_s:.1f} s",
                self.columns[method]: column_html(method, live.trace, finished.get("ar"))}

    @staticmethod
    def _run_status(traces: dict[str, Trace], stopped: bool) -> str:
        # each run keeps the notes on its settings: one temperature warning per method is one warning
        notes = list(dict.fromkeys(note for trace in traces.values() for note in trace.config.notes))
        for note in notes:
            gr.Info(note)
        done = "Stopped" if stopped else "Done"
        return " · ".join([f"**{done}**: {', '.join(METHOD_NAMES[m] for m in traces) or 'nothing ran'}.", *notes])

    def shown(self, traces: dict[str, Trace]) -> dict:
        ar = traces.get("ar")
        runs = ordered(traces)
        return {**{column: column_html(method, traces.get(method), ar, all_done=True)
                   for method, column in self.columns.items()},
                self.economics_plot: economics_figure(runs), self.economics_text: economics_text(runs)}


def typed() -> bool:
    """The visitor typed in a box: what the page would put there later must not replace it."""
    return True


def request_stop(control: RunControl) -> str:
    control.stop = True
    return "Stopping after the current step…"


class ReplayView:
    """The race replayed in the Run columns on one clock, its chart, and the video of it."""

    def __init__(self, session: Session, columns: dict[str, gr.HTML]):
        self.session = session
        self.columns = columns

    def build(self) -> None:
        with gr.Accordion("Replay race (all methods on one clock, from the recorded step times)", open=True):
            with gr.Row():
                self.speed = gr.Radio(REPLAY_SPEEDS, value="0.5", label="Replay speed", scale=3)
                self.replay_button = gr.Button("Replay race", scale=1, elem_id="replay-button")
            self.race = gr.Plot(race_chart([]), label="Tokens over time", show_label=False, elem_id="race-plot")
            with gr.Row():
                self.video_button = gr.Button("Render comparison video (MP4, 720p)", scale=1, elem_id="video-button")
                self.video = gr.Video(label="Comparison video", interactive=False, scale=3, elem_id="video")

    @property
    def status(self) -> gr.Markdown:
        return self.session.status

    def replay(self, traces: dict[str, Trace], speed: str, control: RunControl):
        """Animate every run on one clock, each token appearing when its step ended: the race chart beside the
        button, and the columns above it."""
        runs = ordered(traces)
        if not runs:
            raise refusal(EngineError("nothing to replay yet: run the methods or upload traces"))
        control.stop = False
        speed = float(speed or 1)
        finish = max(trace.summary.wall_s for trace in runs)
        started = time.perf_counter()
        clock = 0.0
        while clock < finish and not control.stop:
            clock = min(finish, (time.perf_counter() - started) * speed)
            yield self._race_frame(traces, clock, f"Replay at {speed:g}×: t = {clock:.2f} s of {finish:.2f} s")
            time.sleep(REPLAY_FRAME_S)
        yield self._race_frame(traces, None, "Replay finished." if not control.stop else "Replay stopped.")

    @staticmethod
    def filmable(traces: dict[str, Trace]) -> list[Trace]:
        runs = ordered(traces)
        if not runs:
            raise refusal(EngineError("nothing to film yet: run the methods or upload traces"))
        return runs

    @staticmethod
    def check_film(traces: dict[str, Trace]) -> None:
        ReplayView.filmable(traces)

    def render_video(self, traces: dict[str, Trace], speed: str, progress=gr.Progress()) -> dict:
        """The race as an MP4, drawn from the traces (the replay speed sets the slow motion)."""
        runs = self.filmable(traces)
        out = self.session.files.path("ddtree-comparison.mp4")
        try:
            render_video(runs, out, preset="720p", slowdown=1.0 / float(speed or 1),
                         progress=lambda done, total: progress(done / total, desc="rendering video frames"))
        except VideoError as exc:
            raise refusal(exc) from None
        return {self.status: f"Video rendered: {len(runs)} columns, {out.stat().st_size / 1e6:.1f} MB.",
                self.video: str(out)}

    def _race_frame(self, traces: dict[str, Trace], clock: float | None, status: str) -> dict:
        ar = traces.get("ar")
        return {self.status: status, self.race: race_chart(ordered(traces), until=clock), **{
            column: column_html(method, traces.get(method), ar, until=clock, all_done=clock is None)
            for method, column in self.columns.items()}}

    def shown(self, traces: dict[str, Trace]) -> dict:
        return {self.race: race_chart(ordered(traces))}


class TrafficView:
    """A Studio server's recent requests (``python -m engine.tools.serve``), any of them opened in every view of
    the page as an upload is: the columns, the economics, the replay and the step inspector."""

    HEADERS = ["time (UTC)", "endpoint", "method", "prompt", "tokens", "steps", "τ", "tokens/s", "finish"]

    def __init__(self, session: Session, present: Callable[[dict[str, Trace], str], dict]):
        self.session = session
        self.studio = session.studio
        self.present = present

    def build(self) -> None:
        server = self.studio.server
        with gr.Accordion("Traffic: the requests a Studio server answered (open one to inspect its trees)",
                          open=server is not None):
            with gr.Row():
                self.url = gr.Textbox(server or DEFAULT_SERVER, label="Server (python -m engine.tools.serve)", scale=3,
                                      elem_id="traffic-url")
                self.refresh_button = gr.Button("Refresh", scale=1, elem_id="traffic-refresh")
            self.table = gr.Dataframe(headers=self.HEADERS, label="Recent requests, newest first (click one to open "
                                      "it)", interactive=False, elem_id="traffic-table")
            with gr.Row():
                self.request = gr.Dropdown([], label="Request", scale=3, elem_id="traffic-request")
                self.open_button = gr.Button("Open in the inspector", scale=1, elem_id="traffic-open")
            self.listed = gr.State([])  # the ids of the table's rows, in its order

    def refresh(self, url: str) -> dict:
        try:
            requests = recent_requests(url)
        except EngineError as exc:
            raise refusal(exc) from None
        rows = [[time.strftime("%H:%M:%S", time.gmtime(r.created)), r.endpoint, _served_label(r), r.prompt[:80],
                 r.tokens, r.steps, round(r.tau, 2), round(r.tokens_per_s, 1), r.finish_reason] for r in requests]
        choices = [(f"{row[0]} · {row[2]} · {request.prompt[:40]!r}", request.id)
                   for row, request in zip(rows, requests)]
        return {self.table: rows, self.listed: [request.id for request in requests],
                self.request: gr.Dropdown(choices=choices, value=choices[0][1] if choices else None),
                self.session.status: f"{len(requests)} request(s) served by {server_url(url)}."}

    def open(self, url: str, trace_id: str | None) -> dict:
        try:
            traces = request_traces(url, trace_id)
        except EngineError as exc:
            raise refusal(exc) from None
        trace = traces[0]
        return self.present({trace.config.method: trace}, f"Opened request {trace_id} from {server_url(url)}: "
                                                     f"{trace.config.label}, {len(trace.steps)} steps.")

    def pick_row(self, ids: list[str], selected: gr.SelectData) -> str:
        """A click on the table picks the request of that row (which ``open`` then opens)."""
        row = selected.index[0] if isinstance(selected.index, (list, tuple)) else selected.index
        if not 0 <= row < len(ids):
            raise refusal(EngineError("that row is not in the list any more: refresh it"))
        return ids[row]


def _served_label(request: ServedRequest) -> str:
    return f"ddtree@{request.tree_budget}" if request.method == "ddtree" else request.method


class TracesView:
    """The session's traces as a file to download, and an upload that shows a file's traces."""

    def __init__(self, session: Session):
        self.session = session

    def build(self) -> None:
        with gr.Accordion("Traces: download or upload (replay and inspect without running a model)", open=False):
            with gr.Row():
                self.download = gr.File(label="Download this run's traces (JSON)", interactive=False)
                self.upload = gr.File(label="Upload traces (JSON)", file_types=[".json"], type="filepath")
            self.summary = gr.JSON(label="Run summary", value={})

    def load_upload(self, path: str | None, present: Callable[[dict[str, Trace], str], dict]) -> dict:
        if not path:
            return {}
        try:
            traces = read_trace_file(path)
        except TraceError as exc:
            raise refusal(exc) from None
        by_method: dict[str, Trace] = {}
        for trace in traces:
            by_method.setdefault(trace.config.method, trace)
        status = f"Loaded {len(by_method)} trace(s) from the upload."
        if len(by_method) < len(traces):
            status += " The file holds several traces of one method; the first of each is shown."
        try:
            return present(by_method, status)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # a value of the wrong kind that the reader let through: refused, not an internal error
            raise refusal(TraceError(f"the file's traces hold a value that cannot be shown ({type(exc).__name__}: "
                                     f"{exc})")) from None

    def shown(self, traces: dict[str, Trace]) -> dict:
        runs = ordered(traces)
        download = save_traces(runs, self.session.files.path(TRACE_FILE_NAME)) if runs else None
        return {self.summary: run_summary(traces), self.download: download}


class InspectorView:
    """One step of one method at a time: its tree, the drafter's top-k, why it stopped, its timing."""

    def __init__(self, session: Session):
        self.session = session
        self.studio = session.studio

    def build(self) -> None:
        gr.Markdown("## Step inspector")
        with gr.Row():
            # every method from the start, so an API call before any run reaches the handler, which says why not
            self.method = gr.Radio([(METHOD_NAMES[m], m) for m in NAMES], label="Method", scale=2)
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
        first = next((m for m in ("ddtree", "dflash", "ar") if m in traces), None)
        return {self.method: gr.Radio(choices=[(METHOD_NAMES[t.config.method], t.config.method) for t in runs],
                                      value=first),
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
            raise refusal(EngineError(f"this session has no {method!r} trace; it has "
                                      f"{', '.join(t.config.method for t in ordered(traces))}"))

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


class SweepView:
    """DDTree at several budgets on the Run tab's prompt and settings, against one AR run."""

    def __init__(self, session: Session):
        self.session = session
        self.studio = session.studio

    def build(self) -> None:
        gr.Markdown("DDTree at several tree budgets on the prompt and settings of the **Run** tab, "
                    "with AR as the tokens/s reference.")
        with gr.Row():
            self.budgets = gr.Textbox(DEFAULT_SWEEP, label=f"Budgets (comma separated, up to {MAX_SWEEP_POINTS})",
                                      scale=3)
            self.sweep_button = gr.Button("Run sweep", variant="primary", scale=1)
            self.stop_button = gr.Button("Stop", variant="stop", scale=0)
        self.status = gr.Markdown("", label="Sweep status")
        self.plot = gr.Plot(sweep_figure([]), label="Budget sweep")
        self.table = gr.Dataframe(headers=SWEEP_HEADERS, label="Sweep results", interactive=False)

    def sweep(self, prompt, max_new_tokens, temperature, seed, budgets_text, control: RunControl):
        """AR once, then DDTree at each budget; the plot and table grow as runs finish."""
        control.stop = False
        try:
            budgets = parse_budgets(budgets_text)
            prompt_ids = encode_prompt(self.studio, prompt)
            common = common_settings(max_new_tokens, temperature, seed)
            settings, notes = checked(self.studio, prompt_ids, [DecodeSettings("ar", **common)] + [
                DecodeSettings("ddtree", tree_budget=budget, **common) for budget in budgets])
        except EngineError as exc:
            raise refusal(exc) from None
        said = "".join(f" · {note}" for note in notes)
        for note in notes:
            gr.Info(note)
        baseline, runs = None, []
        for number, setting in enumerate(settings):
            name = "AR baseline" if setting.method == "ar" else f"DDTree budget {setting.tree_budget}"
            bar = progress_bar(number, len(settings))
            live = None
            try:
                compiling = self.studio.first_use(setting)
                for live in run_live(self.studio, prompt, prompt_ids, setting, control):
                    tokens = run_stats(live.trace).tokens if live.trace else 0
                    doing = (f"waiting for the model, behind {live.waiting_behind} other run(s)" if live.waiting_behind
                             else f"{compiling}…" if compiling and not tokens else f"{tokens} tokens")
                    yield {self.status: f"{bar} run {number + 1} of {len(settings)}: {name}, {doing}{said}"}
            except Exception as exc:
                yield {self.status: problem(exc), **self._results(runs, baseline)}
                return
            if control.stop or live is None or live.trace is None:
                break
            if setting.method == "ar":
                baseline = live.trace
            else:
                runs.append(live.trace)
                yield self._results(runs, baseline)
        done = "Sweep stopped." if control.stop else "Sweep finished."
        # the last message carries everything: API clients only see the final one
        yield {self.status: f"{progress_bar(len(runs) + 1, len(settings))} {done}{said}",
               **self._results(runs, baseline)}

    def _results(self, runs: list[Trace], baseline: Trace | None) -> dict:
        return {self.plot: sweep_figure(runs, baseline), self.table: sweep_rows(runs, baseline)}


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
        return (f"Target **{target.name}** on {target.device} ({str(target.dtype).removeprefix('torch.')}, "
                f"{decoder.engine} engine) · drafter {drafter}  \n{self.studio.budget_sentence()}")

    def _wire(self, demo: gr.Blocks) -> None:
        session, run, replay, traces, inspector, sweep = (self.session, self.run_view, self.replay_view,
                                                          self.traces_view, self.inspector, self.sweep_view)
        # A refusal raises gr.Error: an API client gets its sentence as the error, the page a toast. Gradio marks
        # every output of a failed event "Error" unless the event hides its progress, so events that can refuse
        # hide it (their status line says how they are doing), or check first in an event without outputs.
        run_inputs = [run.prompt, run.max_new_tokens, run.temperature, run.seed, run.budget, run.methods,
                      session.control]
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
        traces.upload.upload(functools.partial(traces.load_upload, present=self.present), traces.upload,
                             self.run_outputs, api_name="upload", show_progress="hidden")
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
                        [run.prompt, run.max_new_tokens, run.temperature, run.seed, sweep.budgets, session.control],
                        [sweep.status, sweep.plot, sweep.table], api_name="sweep", concurrency_id="model",
                        concurrency_limit=4)
        sweep.stop_button.click(request_stop, session.control, sweep.status, api_visibility="private", queue=False,
                                show_progress="hidden")
        gr.api(self.info, api_name="info", queue=False)
        traffic = self.traffic_view
        listing = [traffic.table, traffic.listed, traffic.request, session.status]
        traffic.refresh_button.click(traffic.refresh, traffic.url, listing, api_name="traffic", show_progress="hidden")
        self.while_busy(traffic.open_button.click, traffic.open, [traffic.url, traffic.request], self.run_outputs,
                        api_name="open_request")
        # the click's row reaches only the event it triggers: pick the request there, then open it
        traffic.table.select(traffic.pick_row, traffic.listed, traffic.request, api_visibility="private",
                             show_progress="hidden").success(traffic.open, [traffic.url, traffic.request],
                                                             self.run_outputs, api_visibility="private",
                                                             show_progress="hidden")
        if self.studio.server is not None:  # the page opens on the server's list
            demo.load(traffic.refresh, traffic.url, listing, api_visibility="private", show_progress="hidden")
        run.budget.input(typed, None, run.budget_typed, api_visibility="private", queue=False, show_progress="hidden")
        self.timing_clock.tick(self.follow_timing, run.budget_typed, [self.banner, run.budget, self.timing_clock],
                               api_visibility="private", queue=False, show_progress="hidden")

    @property
    def busy_buttons(self) -> list[gr.Button]:
        """The buttons that start work in the session's columns or on its Stop switch: one at a time."""
        return [self.run_view.run_button, self.sweep_view.sweep_button, self.replay_view.replay_button]

    def while_busy(self, trigger: Callable, fn: Callable, inputs: list, outputs: list, **event) -> None:
        """``fn`` on ``trigger`` with the busy buttons disabled until it ends, however it ends (done, stopped,
        refused or failed), so a second click cannot start a run the page would not show. Only ``fn`` is
        the API's endpoint: the buttons are the page's."""
        buttons, private = self.busy_buttons, dict(queue=False, api_visibility="private", show_progress="hidden")
        work = trigger(lambda: {button: gr.Button(interactive=False) for button in buttons}, None, buttons,
                       **private).then(fn, inputs, outputs, show_progress="hidden", **event)
        for ended in (work.then, work.failure):  # the page runs a .then only after a success
            ended(lambda: {button: gr.Button(interactive=True) for button in buttons}, None, buttons, **private)

    def follow_timing(self, budget_typed: bool) -> dict:
        """The banner follows the background timing; when it ends, the budget box moves to its choice
        (unless the visitor has typed in it) and the clock stops."""
        if self.studio.timing_pending:
            return {self.banner: self._model_banner()}
        moved = {} if budget_typed else {self.run_view.budget: self.studio.budget.budget}
        return {self.banner: self._model_banner(), **moved, self.timing_clock: gr.Timer(active=False)}

    def info(self) -> dict:
        """What the page runs on and the DDTree budget it starts with, and why."""
        decoder, choice = self.studio.decoder, self.studio.budget
        if decoder is None:
            return {"engine": None, "model": None, "server": self.studio.server, "why": self._model_banner()}
        return {"engine": decoder.engine, "device": str(decoder.target.device), "model": decoder.target.name,
                "drafter": decoder.drafter_info.name, "draft_dtype": decoder.draft_dtype, "tree_budget": choice.budget,
                "why": self.studio.budget_sentence(),
                "calibration": {str(budget): entry.to_dict() for budget, entry in choice.table.items()}}

    @property
    def run_outputs(self) -> list:
        """Everything a set of traces is shown in; the API returns them in this order
        (the traces state is not part of the API)."""
        run, inspector = self.run_view, self.inspector
        return [self.session.status, *run.columns.values(), self.traces_view.summary, self.traces_view.download,
                self.replay_view.race, inspector.method, inspector.step, *inspector.step_views, inspector.run_stages,
                inspector.histogram, run.economics_plot, run.economics_text, self.session.traces]

    def present(self, traces: dict[str, Trace], status: str) -> dict:
        """Every view of a set of finished traces (after a run or an upload)."""
        return {self.session.status: status, self.session.traces: traces, **self.run_view.shown(traces),
                **self.traces_view.shown(traces), **self.replay_view.shown(traces), **self.inspector.shown(traces)}


def step_count(traces: dict[str, Trace], method: str | None) -> int:
    trace = traces.get(method) if method else None
    return len(trace.steps) if trace else 0


def run_summary(traces: dict[str, Trace]) -> dict:
    """The API-friendly digest of a run: text, headline numbers and step economics per method
    (``step_cost_vs_ar`` and ``predicted_speedup`` need AR in the run; the prediction leaves the
    prefill out, the measured ``speedup_vs_ar`` is tokens per second over AR's, whole wall times)."""
    ar = traces.get("ar")
    entries = trace_economics(ordered(traces))
    summary = {}
    for method, trace in traces.items():
        stats = run_stats(trace)
        entry = entries[trace.config.label]
        summary[method] = {
            "text": trace.text, "tokens": stats.tokens, "steps": stats.steps, "tau": round(stats.tau, 4),
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


def parse_budgets(text: str) -> list[int]:
    parts = [part.strip() for part in (text or "").replace(";", ",").split(",") if part.strip()]
    try:
        budgets = sorted({int(part) for part in parts})
    except ValueError:
        raise EngineError(f"budgets must be whole numbers separated by commas, e.g. {DEFAULT_SWEEP}") from None
    if not budgets:
        raise EngineError(f"enter at least one budget, e.g. {DEFAULT_SWEEP}")
    if len(budgets) > MAX_SWEEP_POINTS:
        raise EngineError(f"at most {MAX_SWEEP_POINTS} budgets per sweep, got {len(budgets)}")
    return budgets


SWEEP_HEADERS = ["budget", "τ", "step cost (AR steps)", "predicted τ ÷ cost", "measured speed-up", "tokens/s",
                 "tokens", "steps"]


def sweep_rows(runs: list[Trace], baseline: Trace | None) -> list[list]:
    entries = trace_economics(runs, baseline)
    rows = []
    for trace in sorted(runs, key=lambda t: t.config.tree_budget):
        stats, entry = run_stats(trace), entries[trace.config.label]
        rows.append([trace.config.tree_budget, round(stats.tau, 3), _shown(entry.step_cost_vs_ar, ""),
                     _shown(entry.predicted_speedup, "×"), _shown(entry.speedup_vs_ar, "×"),
                     round(stats.tokens_per_s, 2), stats.tokens, stats.steps])
    return rows


def _shown(value: float | None, unit: str) -> str:
    return "–" if value is None else f"{value:.2f}{unit}"


def progress_bar(done: int, total: int, width: int = 20) -> str:
    bar = round(width * done / total) if total else width
    return f"`[{'█' * bar}{'·' * (width - bar)}]`"


CSS = """
.ddt-column { min-height: 8em; }
#status { min-height: 1.5em; }
/* a row wraps what it cannot fit: on a phone each output column takes a line of its own rather than a word */
.ddt-output { min-width: min(280px, 100%) !important; }
"""


class DoctorView:
    """The Doctor tab: why the loaded pair's acceptance is what it is, and what to fix (``engine.measure.doctor``,
    the same report as ``python -m engine.tools.doctor``), drawn by ``viz.doctor_figures``."""

    PLOTS = ("positions", "calibration", "confidence", "wirings")

    def __init__(self, studio: Studio):
        self.studio = studio

    def build(self) -> None:
        from engine.measure.doctor import DEFAULT_PROMPTS, ProbeSettings

        gr.Markdown("Checks the loaded target + drafter pair: the configs, acceptance per draft position on the "
                    "target's own greedy output, calibration, and the same blocks fed as a miswired engine would "
                    "feed them (layer ids ±1, sliding windows, the final norm). About a minute on the CPU.")
        with gr.Row():
            self.prompts = gr.Textbox("\n".join(DEFAULT_PROMPTS), lines=4, label="Prompts (one a line)", scale=3,
                                      elem_id="doctor-prompts")
            with gr.Column(scale=1):
                self.tokens = gr.Number(ProbeSettings.max_new_tokens, label="Greedy tokens per prompt", step=1,
                                        elem_id="doctor-tokens")  # no precision: ``whole`` refuses 2.5, never rounds
                self.vllm = gr.Checkbox(False, label="Also probe the wiring vLLM 0.23 gives this drafter")
                self.button = gr.Button("Run the doctor", variant="primary", elem_id="doctor-button")
        self.verdict = gr.Markdown("Not run yet.", label="Verdict", elem_id="doctor-verdict")
        with gr.Row():
            self.plots = [gr.Plot(empty_figure("run the doctor"), label=name, show_label=False,
                                  elem_id=f"doctor-{name}") for name in self.PLOTS[:2]]
        with gr.Row():
            self.plots += [gr.Plot(empty_figure("run the doctor"), label=name, show_label=False,
                                   elem_id=f"doctor-{name}") for name in self.PLOTS[2:]]
        # the page checks the settings first, in an event without outputs, so a refusal marks none of them "Error"
        # while the probe itself keeps its progress; an API client calls /examine, which checks them too
        self.button.click(self.check, [self.tokens, self.vllm], None, queue=False, api_visibility="private",
                          show_progress="hidden").success(
            self.examine, [self.prompts, self.tokens, self.vllm], [self.verdict, *self.plots], api_name="examine")

    def probe_settings(self, max_new_tokens, check_vllm: bool):
        from engine.measure.doctor import ProbeSettings

        try:
            if self.studio.require_model().engine != "torch":
                raise EngineError("the Doctor tab probes on the torch engine: run python -m engine.tools.doctor "
                                  "--engine vllm for vLLM's wiring")
            return ProbeSettings(max_new_tokens=whole(max_new_tokens, "greedy tokens per prompt"),
                                 engine="vllm" if check_vllm else "torch")
        except EngineError as exc:
            raise refusal(exc) from None

    def check(self, max_new_tokens, check_vllm: bool) -> None:
        self.probe_settings(max_new_tokens, check_vllm)

    def examine(self, prompt_text: str, max_new_tokens, check_vllm: bool) -> dict:
        """The doctor's report on the prompts, as one job on the model's queue."""
        from engine.measure.doctor import diagnose
        from viz.doctor_figures import doctor_figures, report_markdown

        settings = self.probe_settings(max_new_tokens, check_vllm)
        lines = [line.strip() for line in (prompt_text or "").splitlines() if line.strip()]
        try:
            report = self.studio.queue.run(diagnose, self.studio.decoder, lines, settings)
        except Exception as exc:  # shown in the tab; the app keeps running
            return {self.verdict: problem(exc)}
        figures = doctor_figures(report)
        return {self.verdict: report_markdown(report)} | {plot: figures[name]
                                                          for plot, name in zip(self.plots, self.PLOTS)}


def startup_studio(decoder: Decoder, queue: ModelQueue, tree_budget: int | None) -> Studio:
    """The page's first budget, at once (``opening_budget``); where timings are missing the page starts at a
    tree that branches and ``Studio.time_budgets`` times the rest in the background."""
    budget, timing = opening_budget(decoder, tree_budget)
    return Studio(decoder, budget, queue=queue, timing=timing)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=None, help="address to serve on (default: GRADIO_SERVER_NAME or 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: GRADIO_SERVER_PORT or 7860)")
    parser.add_argument("--server", default=None,
                        help="open the traffic of a Studio server (python -m engine.tools.serve), e.g. "
                             f"{DEFAULT_SERVER}: the page loads no model, it lists the server's requests and opens "
                             "any of them in the inspector")
    add_model_arguments(parser)
    parser.add_argument("--tree-budget", type=int, default=None,
                        help="the DDTree budget the page starts with (default: the largest tree within 5%% of the "
                             "fastest budget: the bench's record for this kind of machine in assets/budgets.json, "
                             "else timed here in the background)")
    args = parser.parse_args(argv)
    if args.tree_budget is not None and args.tree_budget < 1:
        parser.error(f"--tree-budget must be at least 1, got {args.tree_budget}")
    if args.server is not None:
        try:
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
    studio = startup_studio(decoder, queue, args.tree_budget)
    log.info("%s", studio.budget_sentence())
    if decoder.compile_step:
        log.info("the step is compiled: each method and budget compiles at its first run (the page says so while "
                 "it does), cached in %s for the next start", cache_dir())
    if studio.timing_pending:
        threading.Thread(target=studio.time_budgets, name="budget-timing", daemon=True).start()
    launch(studio, args)


def launch(studio: Studio, args: argparse.Namespace) -> None:
    StudioApp(studio).demo.queue(default_concurrency_limit=4).launch(
        server_name=args.host, server_port=args.port, css=CSS, state_session_capacity=MAX_SESSIONS)


if __name__ == "__main__":
    main()
