"""Continuous batching on the model's queue: requests join one ``engine.loop.batch.Batch`` between its
steps and leave it when done, stopped or abandoned, each streaming its own steps. (The vLLM engine's batch lives
in its workers: ``engine.loop.remote_batch.open_batch`` gives a ``RemoteBatch`` there, with the same calls.)

The batch advances in rounds, each round a job on the model's ``ModelQueue`` (prefill what fits of the
joining prompts, then one step for everyone decoding); a round that leaves work queues the next one and
returns, so the app's runs, sweeps and the doctor, which are jobs on the same queue, take their turn
between rounds, and no job ever waits for another (the queue's rules). Requests arrive from any thread
(``submit``) into an inbox the next round admits; each gets a future of its trace.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from engine.errors import EngineError
from engine.loop.batch import Batch, RoundTimes
from engine.loop.budgeting import Budgeting
from engine.loop.decode import Decoder
from engine.loop.remote_batch import RemoteBatch, open_batch
from engine.loop.settings import DecodeSettings
from engine.serving.model_queue import ModelQueue
from engine.trace import Step, Trace

log = logging.getLogger("ddtree-serve")

LOGGED_ROUNDS = 256  # rounds a line of the log says where their time went


class RequestCancelled(Exception):
    """A request whose client left before its prompt was in: it has no trace."""


@dataclass
class Arrival:
    """A request waiting in the inbox for the next round."""

    name: str
    prompt: str
    prompt_ids: list[int]
    settings: DecodeSettings  # as ``Decoder.prepare`` returned them
    notes: list[str]
    on_step: Callable[[Trace, Step], None] | None
    should_stop: Callable[[], bool] | None
    future: Future


class Batcher:
    """The batch of requests in flight on one decoder, advanced round by round on ``queue``."""

    def __init__(self, decoder: Decoder, queue: ModelQueue, budgeting: Budgeting | None = None):
        self.decoder, self.queue = decoder, queue
        self.budgeting = budgeting or decoder.budgeting
        self.batch: Batch | RemoteBatch | None = None  # made on the model's thread, at the first round
        self._inbox: list[Arrival] = []
        self._futures: dict[str, Future] = {}  # by request name, for those admitted
        self._lock = threading.Lock()  # guards the inbox and ``_scheduled``; never held while waiting
        self._scheduled = False
        self.timed: list[tuple[float, float, RoundTimes]] = []  # rounds since the last line of the log: each one's
        # seconds, the seconds it waited on the queue after the one before, and where the batch says they went
        self._last_round_end: float | None = None

    def submit(self, name: str, prompt: str, prompt_ids: list[int], settings: DecodeSettings, notes: list[str], *,
               on_step: Callable[[Trace, Step], None] | None = None,
               should_stop: Callable[[], bool] | None = None) -> Future:
        """A request joins at the next round, its settings as ``Decoder.prepare`` returned them (with their notes);
        its future holds its finished trace (or the ``EngineError`` that refused it alone, or ``RequestCancelled``
        if its client left before its first token)."""
        future: Future = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            self._inbox.append(Arrival(name, prompt, prompt_ids, settings, notes, on_step, should_stop, future))
        self._schedule()
        return future

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished, and those still in the inbox."""
        with self._lock:
            waiting = len(self._inbox)
        return waiting + len(self._futures)

    def _schedule(self) -> None:
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self.queue.submit(self._round)

    def _round(self) -> None:
        """One round on the model's thread: admit the inbox, advance the batch, settle the finished; queue the
        next round while any work is left."""
        begun = time.perf_counter()
        try:
            self._admit()
            if self.batch is not None and not self.batch.idle:
                self._advance()
                self._timed(begun)
        finally:
            with self._lock:
                more = bool(self._inbox) or (self.batch is not None and not self.batch.idle)
                self._scheduled = more
            if more:
                self.queue.submit(self._round)
            self._last_round_end = time.perf_counter() if more else None  # no wait is timed across an idle spell

    def _timed(self, begun: float) -> None:
        """The round just advanced is kept; every ``LOGGED_ROUNDS`` rounds, and when the batch goes idle, a line of
        the log says where the kept rounds' time went."""
        if self.batch is None:  # the step failed and the batch was dropped
            return
        waited = begun - self._last_round_end if self._last_round_end is not None else 0.0
        self.timed.append((time.perf_counter() - begun, waited, self.batch.last_round))
        if len(self.timed) >= LOGGED_ROUNDS or self.batch.idle:
            log.info("%s", round_times_line(self.timed))
            self.timed = []

    def _admit(self) -> None:
        with self._lock:
            arrivals, self._inbox = self._inbox, []
        for arrival in arrivals:
            if arrival.should_stop is not None and arrival.should_stop():
                arrival.future.set_exception(RequestCancelled(arrival.name))
                continue
            try:
                if self.batch is None:
                    self.batch = open_batch(self.decoder, self.budgeting)
                self.batch.admit_prepared(arrival.prompt, arrival.prompt_ids, arrival.settings, arrival.notes,
                                          on_step=arrival.on_step, should_stop=arrival.should_stop, name=arrival.name)
            except EngineError as exc:  # this request alone is refused; the batch goes on
                arrival.future.set_exception(exc)
                continue
            self._futures[arrival.name] = arrival.future

    def _advance(self) -> None:
        batch = self.batch
        try:
            finished = batch.advance()
        except Exception as exc:  # a failure inside a shared step: every request in it gets the error (each
            # request's handler logs it with its traceback)
            log.error("a batched step failed (%s: %s); its %d requests get the error and the batch starts afresh",
                      type(exc).__name__, exc, len(self._futures))
            for future in self._futures.values():
                future.set_exception(exc)
            self._futures.clear()
            self.batch = None
            return
        for request in finished:
            future = self._futures.pop(request.name)
            if request.trace is None:
                future.set_exception(RequestCancelled(request.name))
            else:
                future.set_result(request.trace)


def round_times_line(timed: list[tuple[float, float, RoundTimes]]) -> str:
    """Where rounds' time went, as means in ms that add up to the mean round (the rest: admitting joiners, which
    on a remote batch is a call of its own, and the round's own bookkeeping)."""
    def mean_ms(values) -> float:
        return 1000 * statistics.fmean(values)

    parts = {name: mean_ms([getattr(times, name + "_s") for _, _, times in timed])
             for name in ("prefill", "step", "report", "hop", "streams")}
    rest = mean_ms([seconds - times.total_s for seconds, _, times in timed])
    said = ", ".join(f"{name} {ms:.2f}" for name, ms in parts.items())
    line = (f"the last {len(timed)} rounds, mean ms a round: {mean_ms([s for s, _, _ in timed]):.2f} = {said}, "
            f"admitting and the rest {rest:.2f}; then {mean_ms([w for _, w, _ in timed]):.2f} waiting on the queue "
            f"(median round {1000 * statistics.median(s for s, _, _ in timed):.2f})")
    stepped = [times for _, _, times in timed if times.stage_s]
    if not stepped:
        return line
    stages = {stage: mean_ms([times.stage_s[stage] for times in stepped]) for stage in stepped[0].stage_s}
    stages["records and leaving"] = mean_ms([times.step_s - sum(times.stage_s.values()) for times in stepped])
    return f"{line}; a step's stages, mean ms: " + ", ".join(f"{stage} {ms:.2f}" for stage, ms in stages.items())
