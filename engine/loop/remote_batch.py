"""A batch that lives across a process boundary (vLLM's workers hold the models): ``BatchHost`` keeps the
``engine.loop.batch.Batch`` where the models are and answers in plain data; ``RemoteBatch`` gives the server's
``engine.serving.batcher.Batcher`` the ``Batch`` calls it makes (``admit_prepared``, ``advance``, ``idle``) over
any ``call(method, *args)`` that reaches a host, so that a request's steps arrive each round, as they happen
(``open_batch``: the one the server's decoder needs).

A round's report names every request that moved: its trace whole the first time (config and prefill, steps so far),
then only its new steps, and once it is done its summary; and where the round's time went on the host
(``RoundTimes``), to which the driver adds the way there and back and its own part. A request whose client left is
named in the next round's call, and the host stops it at that round, as ``Batch`` stops a request whose
``should_stop`` says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace

from engine.loop.batch import Batch, BatchRequest, RoundTimes
from engine.loop.budgeting import Budgeting
from engine.loop.settings import DecodeSettings
from engine.trace import Step, Summary, Trace

Call = Callable[..., object]  # call(method name, *arguments) on the host, plain data both ways


def open_batch(decoder, budgeting: Budgeting) -> Batch | RemoteBatch:
    """The server's batch: on the decoder's models here, or where they live (``Decoder.remote_batch``)."""
    return decoder.remote_batch(budgeting) or Batch(decoder, budgeting)


class BatchHost:
    """The side with the models: requests by name, and what each round did to them."""

    def __init__(self, batch: Batch):
        self.batch = batch
        self.leaving: set[str] = set()
        self.sent: dict[str, int] = {}  # steps reported so far, by request

    def admit(self, name: str, prompt: str, prompt_ids: list[int], settings: dict, notes: list[str]) -> None:
        self.batch.admit_prepared(prompt, prompt_ids, DecodeSettings(**settings), notes, name=name,
                                  should_stop=lambda: name in self.leaving)

    def advance(self, leaving: list[str]) -> dict:
        """One round (``Batch.advance``) after the requests ``leaving`` are told to stop: ``"requests"``, for each
        request that moved, ``{"trace": ...}`` the first time, then ``{"steps": [...]}``, and ``"summary"`` once done
        (a request that left before its first token: ``{"trace": None, "summary": None}``); ``"times"``, the round's
        ``RoundTimes`` here."""
        self.leaving.update(leaving)
        finished = self.batch.advance()
        reporting = time.perf_counter()
        report = {request.name: self.news(request) for request in [*self.batch.requests, *finished]}
        for request in finished:
            self.leaving.discard(request.name)
            self.sent.pop(request.name, None)
        times = replace(self.batch.last_round, report_s=time.perf_counter() - reporting)
        return {"requests": {name: news for name, news in report.items() if news}, "times": asdict(times)}

    def news(self, request: BatchRequest) -> dict:
        trace = request.trace
        if trace is None:
            return {"trace": None, "summary": None} if request.finished else {}
        seen = self.sent.get(request.name)
        self.sent[request.name] = len(trace.steps)
        news = ({"trace": trace.plain() | {"summary": None, "token_texts": {}}} if seen is None else
                {"steps": [step.plain() for step in trace.steps[seen:]]} if len(trace.steps) > seen else {})
        if trace.summary is not None:
            news |= {"summary": asdict(trace.summary), "token_texts": trace.token_texts}
        return news


class RemoteRequest:
    """A request as the driver sees it: its name, its trace so far, and its client's hooks."""

    def __init__(self, name: str, on_step: Callable[[Trace, Step], None] | None,
                 should_stop: Callable[[], bool] | None):
        self.name, self.on_step, self.should_stop = name, on_step, should_stop
        self.trace: Trace | None = None

    def take(self, news: dict) -> bool:
        """A round's news of it; whether it is done."""
        if "trace" in news:
            self.trace = None if news["trace"] is None else Trace.from_plain(news["trace"])
            fresh = [] if self.trace is None else self.trace.steps
        else:
            fresh = [Step.from_plain(step) for step in news.get("steps", [])]
            self.trace.steps.extend(fresh)
        if self.trace is not None and news.get("summary") is not None:
            self.trace.summary = Summary(**news["summary"])
            self.trace.token_texts = {int(token): text for token, text in news["token_texts"].items()}
        if self.on_step is not None:
            for step in fresh:
                self.on_step(self.trace, step)
        return "summary" in news


class RemoteBatch:
    """``Batch``'s calls for the server's ``Batcher``, on a ``BatchHost`` reached through ``call``."""

    def __init__(self, call: Call):
        self.call = call
        self.requests: dict[str, RemoteRequest] = {}
        self.last_round = RoundTimes()
        self._names = 0

    @property
    def idle(self) -> bool:
        return not self.requests

    def admit_prepared(self, prompt: str, prompt_ids: list[int], settings: DecodeSettings, notes: list[str], *,
                       on_step: Callable[[Trace, Step], None] | None = None,
                       should_stop: Callable[[], bool] | None = None, name: str | None = None) -> RemoteRequest:
        self._names += 1
        name = name or f"request-{self._names}"
        self.call("admit", name, prompt, list(prompt_ids), asdict(settings), list(notes))
        self.requests[name] = request = RemoteRequest(name, on_step, should_stop)
        return request

    def advance(self) -> list[RemoteRequest]:
        """One round on the host; the requests done in it, each with its trace (None: it left before its first
        token), its streamed steps handed to ``on_step`` on the way."""
        leaving = [name for name, request in self.requests.items()
                   if request.should_stop is not None and request.should_stop()]
        called = time.perf_counter()
        answer = self.call("advance", leaving)
        answered = time.perf_counter()
        finished = []
        for name, news in answer["requests"].items():
            request = self.requests[name]
            if request.take(news):
                finished.append(self.requests.pop(name))
        there = RoundTimes(**answer["times"])
        self.last_round = replace(there, hop_s=max(answered - called - there.total_s, 0.0),
                                  streams_s=time.perf_counter() - answered)
        return finished
