"""What every view of the page shares: the loaded models (``Studio``, with a second drafter to compare), the page's
columns (``Lane``: a method with the first or the second drafter), a session's traces and Stop switch
(``Session``), a run on the model's queue as the page follows it (``run_live``), the files handed to Gradio, and
how a box's value becomes a setting or a refusal.

The models load once and are shared read-only by every browser session; each session keeps its own traces in
``gr.State``. Every model call is a job on the model's one queue (``engine.serving.model_queue``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import gradio as gr

from engine.errors import EngineError
from engine.loop.decode import Decoder, race
from engine.loop.loading import second_decoder, takes_second_drafter
from engine.loop.race import Race
from engine.loop.settings import DecodeSettings
from engine.measure.calibration import BudgetChoice, StartupTiming, cache_dir
from engine.measure.fairness import disturbance
from engine.methods import AUTO, BASELINE, DFLASH, METHODS, TREE, Budget, Method, method
from engine.serving.model_queue import ModelQueue
from engine.serving.startup import batch_budgeting
from engine.trace import Trace, TraceError, write_trace_file
from viz.tokens import TokenText, traces_token_text
from viz.video import VideoError

log = logging.getLogger("ddtree-studio")

POLL_S = 0.2  # how often a streaming handler refreshes the page while the model works
KEPT_FILES = 64  # trace downloads and videos kept on disk; Gradio serves its own copy of each
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
    # the labels (``ddtree@32``, a second drafter's ``ddtree@32+tag``: what a compiled step is compiled for) run
    # once already
    started: set[str] = field(default_factory=set)
    tree_budget: Budget = AUTO  # what the page's budget box opens at (``--tree-budget``)
    offered_drafters: list[str] = field(default_factory=list)  # the folders the page offers as a second drafter
    second_drafter: str | None = None  # the one it opens with (``--second-drafter``)
    second_decoders: dict[str, Decoder] = field(default_factory=dict)  # the second drafters loaded, by folder

    @property
    def has_model(self) -> bool:
        return self.decoder is not None

    def require_model(self) -> Decoder:
        if self.decoder is None:
            raise EngineError(f"this page loads no model: it opens the traffic of {self.server}; start it without "
                              "--server to run prompts here")
        return self.decoder

    def second_decoder(self, folder: str | None) -> Decoder | None:
        """The decoder of ``folder``'s drafter beside the loaded one (None for none), loaded once, as a job on the
        model's queue. Only a folder the page offers: an API client could name any path (where no second drafter
        can run, loading says why before it reads the folder)."""
        if not folder:
            return None
        if folder not in self.offered_drafters and takes_second_drafter(self.require_model()):
            raise EngineError(f"second drafter {folder!r} is not one this page offers; choose from "
                              f"{', '.join(self.offered_drafters)} (python app.py --second-drafter FOLDER adds one)",
                              field="second_drafter")
        return self.queue.run(self._load_second, folder)

    def _load_second(self, folder: str) -> Decoder:
        if folder not in self.second_decoders:
            decoder = second_decoder(self.decoder, folder)
            batch_budgeting(decoder, time_here=False)  # its "auto" trees: this machine's step costs, its calibration
            self.second_decoders[folder] = decoder
        return self.second_decoders[folder]

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

    def first_use(self, settings: DecodeSettings, decoder: Decoder | None = None) -> str | None:
        """Said while a compiled step's first run of a method and budget compiles it (a minute or more); each
        drafter's decoder compiles its own (``decoder``: a second drafter's, else the loaded one)."""
        decoder = decoder or self.decoder
        if not self.has_model or not decoder.compile_step or compiled_label(settings, decoder) in self.started:
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
                timed = BASELINE.label() if label == BASELINE.name else TREE.label(int(label))
                self.started |= {DFLASH.label(), timed}
                log.info("timed %s: %s", label, self.timing.progress())
            self.budget = self.timing.choice()
            log.info("%s", self.budget.sentence())
        except Exception as exc:  # the page keeps serving at the budget it started with
            log.exception("timing the DDTree budgets failed")
            self.timing_error = f"{type(exc).__name__}: {exc}"

    @functools.cached_property
    def decode_token(self) -> TokenText:
        return functools.lru_cache(maxsize=None)(self.decoder.target.token_text)

    def token_text_for(self, traces: list[Trace]) -> TokenText:
        """The texts the traces carry; for what they lack, the tokenizer where the traces are the loaded model's,
        else the pieces they committed (``viz.tokens.traces_token_text``)."""
        own = self.has_model and traces and all(trace.config.model == self.decoder.target.name for trace in traces)
        return traces_token_text(traces, self.decode_token if own else None)


# ---------------------------------------------------------------- per-session state

@dataclass
class RunControl:
    """The session's Stop switch; decoding polls it between steps. A plain flag, so
    ``gr.State`` can deep-copy it into every new session."""

    stop: bool = False


def request_stop(control: RunControl) -> str:
    control.stop = True
    return "Stopping after the current step…"


# ---------------------------------------------------------------- the page's columns

SECOND_KEY = "_2"  # a second drafter's column: its method's name and this


@dataclass(frozen=True)
class Lane:
    """A column of the page: a method, run with the loaded drafter or (``second``) with the second drafter beside
    it. Its key names it in the session's traces, ``/run``'s outputs and the inspector's picker."""

    method: Method
    second: bool = False

    @property
    def key(self) -> str:
        return f"{self.method.name}{SECOND_KEY}" if self.second else self.method.name

    @property
    def caption(self) -> str:
        return f"{self.method.caption} · second drafter" if self.second else self.method.caption


# a drafting method's second-drafter column beside its first, so the two drafters stand side by side
LANES = tuple(Lane(row, second) for row in METHODS.values() for second in (False, True)[: 1 + row.drafts])
LANE_KEYS = tuple(lane.key for lane in LANES)


def lane_of(trace: Trace) -> Lane:
    """The column a trace is shown in: a run whose label carries a drafter's tag is the second drafter's."""
    row = trace.config.method_row
    return Lane(row, second=row.drafts and trace.config.drafter_tag is not None)


def by_lane(traces: Iterable[Trace]) -> dict[str, Trace]:
    """Traces by their column's key, the first of each (an upload can hold several runs of one)."""
    shown: dict[str, Trace] = {}
    for trace in traces:
        shown.setdefault(lane_of(trace).key, trace)
    return shown


def ordered(traces: dict[str, Trace]) -> list[Trace]:
    return [traces[key] for key in LANE_KEYS if key in traces]


def method_choices(names: Iterable[str]) -> list[tuple[str, str]]:
    """A box that picks methods: each shown by its caption, its name the value."""
    return [(METHODS[name].caption, name) for name in names]


@dataclass(frozen=True)
class PlannedRun:
    """One run of a click: its column, the decoder of its drafter, its settings."""

    lane: Lane
    decoder: Decoder
    settings: DecodeSettings


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


@dataclass
class Session:
    """What every view shares: the models, this session's traces and Stop switch, the status line."""

    studio: Studio
    traces: gr.State
    control: gr.State
    status: gr.Markdown
    files: ScratchFiles  # shared by every session: the app's files on disk, bounded


# ---------------------------------------------------------------- running the model

class LiveRace:
    """The runs of one click, a job on the model thread: in turns where the engine can (``engine.loop.race``), so
    that what else the machine does lands on every run alike. The handler polls ``traces`` (by label) as they grow;
    ``race`` is whole once the job ends. A compiled step's first run of its method and budget is warmed up first by
    a short untimed run, so the run shown (and its speed) pays for no compilation."""

    def __init__(self, studio: Studio, prompt: str, prompt_ids: list[int], runs: list[PlannedRun],
                 control: RunControl):
        self.traces: dict[str, Trace] = {}
        self.race: Race | None = None
        self.error: Exception | None = None
        self.done = threading.Event()
        self.queue = studio.queue
        warm_ups = [replace(run, settings=run.settings.warm_up()) for run in runs
                    if studio.first_use(run.settings, run.decoder) is not None]
        self.job = studio.queue.submit(self._work, prompt, prompt_ids, runs, warm_ups, control)

    @property
    def waiting_behind(self) -> int:
        """How many jobs (the running one included) this race waits behind in the model's queue; 0 once it runs."""
        return 0 if self.job.running() or self.job.done() else self.queue.ahead_of(self.job) + 1

    def _work(self, prompt: str, prompt_ids: list[int], runs: list[PlannedRun], warm_ups: list[PlannedRun],
              control: RunControl) -> None:
        try:
            if control.stop:  # stopped (or the page left) while it queued
                return
            if warm_ups:
                race([(run.decoder, run.settings) for run in warm_ups], prompt, prompt_ids=prompt_ids,
                     should_stop=lambda: control.stop)
            self.race = race([(run.decoder, run.settings) for run in runs], prompt, prompt_ids=prompt_ids,
                             on_step=self._on_step, should_stop=lambda: control.stop)
        except Exception as exc:  # handed to the UI thread, which reports it
            self.error = exc
        finally:
            self.done.set()

    def _on_step(self, trace: Trace, step) -> None:
        self.traces[trace.config.label] = trace


def run_live(studio: Studio, prompt: str, prompt_ids: list[int], runs: list[PlannedRun],
             control: RunControl) -> Iterator[LiveRace]:
    """Yield the live race every ``POLL_S`` until it ends (yielding once more at the end); while it waits in
    the model's queue its ``waiting_behind`` says so. Nothing here holds the model: the queue runs one job
    at a time."""
    live = LiveRace(studio, prompt, prompt_ids, runs, control)
    try:
        while not live.done.wait(POLL_S):
            yield live
        if live.error is not None:
            raise live.error
        studio.started.update(compiled_label(run.settings, run.decoder) for run in runs)
        yield live
    finally:
        if not live.done.is_set():
            control.stop = True  # the page went away mid-run: let the runs stop at their next step
            if not studio.queue.cancel(live.job):
                live.done.wait()


def compiled_label(settings: DecodeSettings, decoder: Decoder) -> str:
    """What a compiled step is compiled for: the run's label, with its drafter's tag where it is a second one."""
    return method(settings.method).label(settings.tree_budget, decoder.drafter_info.tag)


def disturbed(studio: Studio, race: Race | None) -> str:
    """What disturbed a race's timings (``engine.measure.fairness``), as the status line says it; "" if nothing."""
    findings = disturbance(race.traces, studio.budget.ar) if race is not None else []
    if not findings:
        return ""
    for finding in findings:
        gr.Warning(f"The timings were disturbed: {finding}.")
    return " ⚠️ **The timings were disturbed**: " + "; ".join(findings) + "."


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


def common_settings(max_new_tokens, temperature, seed) -> DecodeSettings:
    """What every run of one click shares, as AR's settings (each run replaces the method and the budget). The
    page reads what a box holds (an emptied box is None; an API client can send text, true or NaN);
    ``DecodeSettings`` checks the values, with the sentence every entry point says."""
    return DecodeSettings(BASELINE.name, max_new_tokens=whole(max_new_tokens, "max new tokens"),
                          temperature=number(temperature, "temperature"), seed=whole(seed, "seed"))


def checked(prompt_ids: list[int], runs: list[PlannedRun]) -> list[str]:
    """Check every run's settings against its models before any starts, so a bad value fails at once; return the
    notes on how the runs will run (sampling on the readable step), each said once."""
    notes = [note for run in runs for note in run.decoder.prepare(run.settings, len(prompt_ids))[1]]
    return list(dict.fromkeys(notes))


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
