"""An OpenAI-compatible HTTP API on the Studio's engine (``create_app``), every request's trace kept for the Studio.

``POST /v1/chat/completions`` (messages through the target's chat template) and ``POST /v1/completions`` (a raw
prompt), streamed as server-sent events or not; ``GET /v1/models``. Extensions in the request body: ``method``
(ar, dflash, ddtree) and ``tree_budget`` ("auto" or 1..1024); every answer carries a ``ddtree`` object (method,
budget, seed, τ, steps, tokens/s and the ``trace_id``). ``GET /v1/traces`` lists the last requests, newest first,
and ``GET /v1/traces/{trace_id}`` returns one as the Studio's trace file.

Requests share decoding steps (``engine.serving.batcher``: continuous batching on the model's ``ModelQueue``),
each streaming its own steps; a target that cannot verify a batch in one pass (a hybrid, the vLLM engine) runs
them one at a time, first come first served. A sampled request without a seed is a fresh sample. Bad input gets
OpenAI's error shape with a 4xx status and the field at fault (``param``), in the one sentence the settings
(``engine.loop.settings``) say it; what the server does not do (``n`` > 1, log-probabilities, tools, response
formats, ...) is refused, not ignored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from engine.errors import EngineError
from engine.loop.decode import Decoder
from engine.loop.settings import MAX_NEW_TOKENS, MAX_SEED, DecodeSettings
from engine.methods import AUTO, TREE, Budget, method
from engine.serving.batcher import Batcher
from engine.serving.model_queue import ModelQueue
from engine.trace import Trace, trace_file_data, write_trace_file

log = logging.getLogger("ddtree-serve")

KEPT_TRACES = 200
PROMPT_PREVIEW_CHARS = 200
MAX_STOP_STRINGS = 4  # as OpenAI
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default for /v1/completions; a chat runs until the context is full
DISCONNECT_POLL_S = 0.25  # how often a handler waiting for a run's answer checks that its client is still there
FINISH_REASONS = {"eos": "stop", "max_new_tokens": "length", "cancelled": "cancelled"}  # cancelled: the client left


@dataclass(frozen=True)
class ServeOptions:
    method: str = TREE.name  # what a request that names no method runs
    tree_budget: Budget = AUTO  # likewise for the tree budget: "auto" sizes every request's tree for the batch
    traces_dir: Path | None = None  # also write every request's trace file here
    kept_traces: int = KEPT_TRACES
    batching: bool = True  # requests share steps (``engine.serving.batcher``); False: one at a time, in turn


# ---------------------------------------------------------------- requests

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class Body(BaseModel):
    """What both endpoints take. Fields a client may send at their defaults (``n`` 1, ``top_p`` 1, ...) are
    declared and checked by ``refuse_unsupported``; anything else undeclared is refused by name."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # None: greedy
    seed: int | None = None  # None: a fresh seed, returned in the answer's ``ddtree`` object
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    method: str | None = None
    tree_budget: int | str | None = None
    n: int | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text}


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    max_completion_tokens: int | None = None  # the newer name of max_tokens


class CompletionBody(Body):
    prompt: str
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None


class ApiError(Exception):
    """A request refused with OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload(), status_code=self.status)


def refuse_unsupported(body: Body) -> None:
    """Refuse what this server does not do rather than answer as if it had."""
    refusals = [
        ("n", body.n not in (None, 1), "n must be 1: this server returns one choice per request"),
        ("top_p", body.top_p not in (None, 1), "top_p is not supported: sampling draws from the target's whole "
                                               "distribution (top_p 1)"),
        ("presence_penalty", body.presence_penalty not in (None, 0), "presence_penalty is not supported"),
        ("frequency_penalty", body.frequency_penalty not in (None, 0), "frequency_penalty is not supported"),
        ("logprobs", getattr(body, "logprobs", None) not in (None, False, 0), "logprobs are not supported"),
        ("echo", getattr(body, "echo", None), "echo is not supported"),
        ("best_of", getattr(body, "best_of", None) not in (None, 1), "best_of must be 1"),
    ]
    for param, refused, message in refusals:
        if refused:
            raise ApiError(400, message, param)


# ---------------------------------------------------------------- one request's run

@dataclass(frozen=True)
class Job:
    """What one request asks the engine."""

    trace_id: str
    endpoint: str  # "chat.completions" or "completions"
    prompt: str  # the prompt as the trace keeps it
    prompt_ids: list[int]
    settings: DecodeSettings  # checked against the models when the request came (``Decoder.prepare``)
    notes: tuple[str, ...]  # how that check adjusted them
    stops: tuple[str, ...]
    created: int  # unix seconds, when the request came


@dataclass(frozen=True)
class Completion:
    trace: Trace
    text: str  # cut before the first stop string
    tokens: int  # generated tokens, through the one that completed a stop string
    finish_reason: str

    def ddtree(self, trace_id: str) -> dict:
        summary, config = self.trace.summary, self.trace.config
        return {"method": config.method, "tree_budget": config.tree_budget, "seed": config.seed,
                "tau": round(summary.tau, 4), "steps": summary.steps, "tokens_per_s": round(summary.tokens_per_s, 3),
                "trace_id": trace_id}

    def usage(self) -> dict:
        prompt = len(self.trace.config.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens, "total_tokens": prompt + self.tokens}


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, int | None]:
    """The text before the first stop string, and where that stop string ends (None: no stop string yet)."""
    found = [(index, index + len(stop)) for stop in stops if (index := text.find(stop)) >= 0]
    if not found:
        return text, None
    start, end = min(found)
    return text[:start], end


def tokens_through(pieces: list[str], end: int) -> int:
    """How many tokens' text pieces it takes to reach character ``end``."""
    length = 0
    for count, piece in enumerate(pieces, start=1):
        length += len(piece)
        if length >= end:
            return count
    return len(pieces)


def finish(trace: Trace, stops: tuple[str, ...]) -> Completion:
    text, end = cut_at_stop(trace.text, stops)
    if end is not None:
        return Completion(trace, text, tokens_through(trace.text_pieces, end), "stop")
    return Completion(trace, text, len(trace.output_ids), FINISH_REASONS[trace.summary.stop_reason])


class Generation:
    """One request's run: it ends at a stop string or when the client leaves (``cancelled``), and hands each
    step's text so far (cut at a stop string) to ``on_text``."""

    def __init__(self, job: Job, on_text: Callable[[str], None] | None = None):
        self.job = job
        self.on_text = on_text
        self.cancelled = False
        self.stopped = False  # a stop string is in the text

    def should_stop(self) -> bool:
        return self.cancelled or self.stopped

    def run(self, decoder: Decoder) -> Trace:
        """The request alone, as a job on the model's thread (a server that does not batch)."""
        job = self.job
        return decoder.run_prepared(job.prompt, job.prompt_ids, job.settings, list(job.notes), on_step=self.on_step,
                                    should_stop=self.should_stop)

    def on_step(self, trace: Trace, step) -> None:
        text, end = cut_at_stop(trace.text, self.job.stops)
        self.stopped = end is not None
        if self.on_text is not None:
            self.on_text(text)


class TraceBook:
    """The last requests' traces, newest last, and their listing; written to a folder too when asked. Jobs add
    to it on the model's thread while handlers read it: the lock guards the dict, never a wait on the queue."""

    def __init__(self, keep: int, folder: Path | None = None):
        self.keep, self.folder = keep, folder
        self._kept: OrderedDict[str, tuple[dict, Trace]] = OrderedDict()
        self._lock = threading.Lock()
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)

    def add(self, job: Job, completion: Completion) -> None:
        trace, summary = completion.trace, completion.trace.summary
        entry = {"id": job.trace_id, "created": job.created, "endpoint": job.endpoint,
                 "method": trace.config.method, "tree_budget": trace.config.tree_budget,
                 "prompt": job.prompt[:PROMPT_PREVIEW_CHARS], "tokens": completion.tokens, "steps": summary.steps,
                 "tau": round(summary.tau, 4), "tokens_per_s": round(summary.tokens_per_s, 3),
                 "finish_reason": completion.finish_reason}
        with self._lock:
            self._kept[job.trace_id] = (entry, trace)
            while len(self._kept) > self.keep:
                self._kept.popitem(last=False)
        if self.folder is None:
            return
        try:
            write_trace_file(self.folder / f"{job.trace_id}.json", [trace])
        except OSError as exc:  # the answer and the kept trace stand; only the file is missing
            log.warning("could not write %s's trace file in %s: %s", job.trace_id, self.folder, exc)

    def listing(self) -> list[dict]:
        with self._lock:
            return [entry for entry, _ in reversed(self._kept.values())]

    def get(self, trace_id: str) -> Trace | None:
        with self._lock:
            kept = self._kept.get(trace_id)
        return kept[1] if kept is not None else None


# ---------------------------------------------------------------- the app

class Server:
    """The handlers' shared state: the decoder, its queue (and the batch on it), the options and the kept traces."""

    def __init__(self, decoder: Decoder, options: ServeOptions, queue: ModelQueue):
        self.decoder, self.options, self.queue = decoder, options, queue
        self.book = TraceBook(options.kept_traces, options.traces_dir)
        batches = options.batching and decoder.target.runs_batched
        self.batcher = Batcher(decoder, queue) if batches else None

    def job(self, body: ChatBody | CompletionBody) -> Job:
        """Check a request against the models and say what to run; every refusal names its field."""
        refuse_unsupported(body)
        target = self.decoder.target
        if body.model != target.name:
            raise ApiError(404, f"The model `{body.model}` does not exist: this server runs `{target.name}`", "model",
                           code="model_not_found")
        if any(not stop for stop in body.stops) or len(body.stops) > MAX_STOP_STRINGS:
            raise ApiError(400, f"stop takes 1 to {MAX_STOP_STRINGS} non-empty strings", "stop")
        if isinstance(body, ChatBody):
            endpoint, prompt_param = "chat.completions", "messages"
            texts = [message.text for message in body.messages] + list(body.stops)
            prompt = "\n".join(f"{message.role}: {message.text}" for message in body.messages)
        else:
            endpoint, prompt_param, prompt = "completions", "prompt", body.prompt
            texts = [body.prompt] + list(body.stops)
        refuse_unencodable(texts, prompt_param)
        try:
            prompt_ids = (target.conversation_ids([message.for_template() for message in body.messages])
                          if isinstance(body, ChatBody) else target.text_ids(body.prompt))
            if not prompt_ids:
                raise EngineError("the prompt is empty: give the model some text to continue", field="prompt")
            settings = DecodeSettings(body.method or self.options.method,
                                      max_new_tokens=self.max_tokens(body, len(prompt_ids), prompt_param),
                                      temperature=body.temperature or 0.0,
                                      seed=fresh_seed() if body.seed is None else body.seed,
                                      tree_budget=self.options.tree_budget if body.tree_budget is None else
                                      body.tree_budget)
            settings, notes = self.decoder.prepare(settings, len(prompt_ids))
        except EngineError as exc:
            raise ApiError(400, str(exc), request_param(exc.field, body, prompt_param)) from None
        return Job(f"trace-{uuid.uuid4().hex}", endpoint, prompt, prompt_ids, settings, tuple(notes), body.stops,
                   int(time.time()))

    def max_tokens(self, body: Body, prompt_length: int, prompt_param: str) -> int:
        """The request's token limit, within what the context leaves; unset, all of that (a chat, as OpenAI)
        or 16 (a completion, as OpenAI). Past the context: refused, with the most that fits."""
        context = self.decoder.target.context_length
        drafts = method(body.method or self.options.method).drafts and self.decoder.drafter is not None
        room = context - prompt_length - (self.decoder.drafter.block_size if drafts else 1)  # a step may verify a
        # block past the last token
        if room < 1:
            raise ApiError(400, f"the prompt's {prompt_length} tokens fill the model's context of {context} tokens: "
                                "shorten it", prompt_param)
        asked = [(name, value) for name in ("max_tokens", "max_completion_tokens")
                 if (value := getattr(body, name, None)) is not None]
        if not asked:
            return min(room, COMPLETION_DEFAULT_TOKENS if isinstance(body, CompletionBody) else MAX_NEW_TOKENS)
        name, value = asked[0]
        if 1 <= value <= MAX_NEW_TOKENS and value > room:
            raise ApiError(400, f"{name} {value} and the prompt's {prompt_length} tokens exceed the model's context "
                                f"of {context} tokens: at most {room} new tokens fit after this prompt", name)
        return value

    def start(self, generation: Generation) -> Future:
        """The request's run, batched with the others or queued alone: a future of its trace, kept in the book
        once it ends, whether its client waited for it or left."""
        job = generation.job
        if self.batcher is None:
            future = self.queue.submit(generation.run, self.decoder)
        else:
            future = self.batcher.submit(job.trace_id, job.prompt, job.prompt_ids, job.settings, list(job.notes),
                                         on_step=generation.on_step, should_stop=generation.should_stop)
        future.add_done_callback(lambda done: self.keep(job, done))
        return future

    def keep(self, job: Job, done: Future) -> None:
        if not done.cancelled() and done.exception() is None:
            self.book.add(job, finish(done.result(), job.stops))

    async def complete(self, job: Job, request: Request) -> Completion:
        """The run's answer, once it is done; a client that leaves first stops it at its next step."""
        generation = Generation(job)
        future = self.start(generation)
        answer = asyncio.wrap_future(future)
        while not future.done():
            await asyncio.wait([answer], timeout=DISCONNECT_POLL_S)
            if not future.done() and await request.is_disconnected():
                self.leave(generation, future)
                raise ApiError(400, "the client left before its answer")  # said to no one: the connection is gone
        return finish(await answer, job.stops)

    def leave(self, generation: Generation, future: Future) -> None:
        """The client left: stop its run at the next step, or drop it from the queue if it has not started."""
        generation.cancelled = True
        if self.batcher is None:
            self.queue.cancel(future)

    async def stream(self, job: Job, chunk: Callable[..., dict], include_usage: bool) -> AsyncIterator[str]:
        """The run's text as server-sent events, step by step, holding back a tail as long as the longest stop
        string minus one (it might begin one); a client that leaves stops the run at its next step."""
        loop = asyncio.get_running_loop()
        texts: asyncio.Queue[str | None] = asyncio.Queue()
        generation = Generation(job, on_text=lambda text: loop.call_soon_threadsafe(texts.put_nowait, text))
        future = self.start(generation)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(texts.put_nowait, None))
        held = max(map(len, job.stops), default=1) - 1
        sent = 0
        try:
            yield event(chunk(None, role=True))
            while (text := await texts.get()) is not None:
                shown = text[:max(len(text) - held, 0)]
                if len(shown) > sent:
                    yield event(chunk(shown[sent:]))
                    sent = len(shown)
            completion = finish(future.result(), job.stops)
            if len(completion.text) > sent:
                yield event(chunk(completion.text[sent:]))
            ddtree = completion.ddtree(job.trace_id)
            yield event(chunk(None, finish_reason=completion.finish_reason) | {"ddtree": ddtree})
            if include_usage:
                yield event(chunk(None, usage=completion.usage()) | {"ddtree": ddtree})
            yield "data: [DONE]\n\n"
        except EngineError as exc:
            yield event(ApiError(400, str(exc)).payload())
        except Exception as exc:  # the response has started: the error goes in the stream
            log.exception("a streamed run failed")
            yield event(unexpected(exc).payload())
        finally:
            if not future.done():
                self.leave(generation, future)


def fresh_seed() -> int:
    """A seed of its own for a sampled request that names none: each such request is a fresh sample (OpenAI's
    meaning), and the answer says the seed, so the run can be repeated."""
    return secrets.randbelow(MAX_SEED + 1)


SETTING_PARAMS = {"prompt": None, "block_size": None}  # settings the request does not name itself: its prompt's


def request_param(field: str | None, body: Body, prompt_param: str) -> str | None:
    """The request's name for a setting at fault: ``max_new_tokens`` is the ``max_tokens`` (or
    ``max_completion_tokens``) the request sent, the prompt its ``messages`` or ``prompt``."""
    if field == "max_new_tokens":
        return next((name for name in ("max_tokens", "max_completion_tokens") if getattr(body, name, None) is not None),
                    "max_tokens")
    if field in SETTING_PARAMS:
        return SETTING_PARAMS[field] or prompt_param
    return field


def refuse_unencodable(texts: list[str], param: str) -> None:
    """JSON may carry a lone UTF-16 surrogate (``"\\ud800"``), which is no text: refused before the tokenizer
    meets it."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"{param} holds a lone surrogate ({text[exc.start:exc.end]!a} at character "
                                f"{exc.start}), which is not text: send valid Unicode", param) from None


def event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def unexpected(exc: Exception) -> ApiError:
    return ApiError(500, f"internal error ({type(exc).__name__}: {exc}); the server is still running, try again",
                    type="server_error")


def chat_chunk(base: dict) -> Callable[..., dict]:
    def chunk(text: str | None, role: bool = False, finish_reason: str | None = None, usage: dict | None = None):
        if usage is not None:
            return base | {"choices": [], "usage": usage}
        delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
        return base | {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    return chunk


def completion_chunk(base: dict) -> Callable[..., dict]:
    def chunk(text: str | None, role: bool = False, finish_reason: str | None = None, usage: dict | None = None):
        if usage is not None:
            return base | {"choices": [], "usage": usage}
        return base | {"choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]}
    return chunk


def create_app(decoder: Decoder, options: ServeOptions = ServeOptions(), queue: ModelQueue | None = None) -> FastAPI:
    """The API on ``decoder``; ``queue``: the model's owner, where the caller already has one (it loaded there)."""
    server = Server(decoder, options, queue or ModelQueue())
    app = FastAPI(title="DDTree Studio: OpenAI-compatible API")
    app.add_middleware(UnexpectedErrors)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()[0]).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code)).response()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": decoder.target.name, "object": "model", "created": 0,
                                            "owned_by": "ddtree-studio"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        job = server.job(body)
        base = {"id": f"chatcmpl-{job.trace_id.removeprefix('trace-')}", "created": job.created,
                "model": decoder.target.name}
        if body.stream:
            return event_stream(server.stream(job, chat_chunk(base | {"object": "chat.completion.chunk"}),
                                              include_usage(body)))
        done = await run_or_refuse(server, job, request)
        return base | {"object": "chat.completion", "usage": done.usage(), "ddtree": done.ddtree(job.trace_id),
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                                    "logprobs": None, "finish_reason": done.finish_reason}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        job = server.job(body)
        base = {"id": f"cmpl-{job.trace_id.removeprefix('trace-')}", "object": "text_completion",
                "created": job.created, "model": decoder.target.name}
        if body.stream:
            return event_stream(server.stream(job, completion_chunk(base), include_usage(body)))
        done = await run_or_refuse(server, job, request)
        return base | {"usage": done.usage(), "ddtree": done.ddtree(job.trace_id),
                       "choices": [{"index": 0, "text": done.text, "logprobs": None,
                                    "finish_reason": done.finish_reason}]}

    @app.get("/v1/traces")
    async def traces() -> dict:
        return {"object": "list", "data": server.book.listing()}

    @app.get("/v1/traces/{trace_id}")
    async def trace(trace_id: str) -> dict:
        found = server.book.get(trace_id)
        if found is None:
            raise ApiError(404, f"no trace {trace_id!r}: the server keeps the last {options.kept_traces} requests' "
                                "traces (GET /v1/traces lists them)", "trace_id", code="trace_not_found")
        return trace_file_data([found])

    app.state.server = server
    return app


def include_usage(body: Body) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def run_or_refuse(server: Server, job: Job, request: Request) -> Completion:
    try:
        return await server.complete(job, request)
    except EngineError as exc:  # the engine's own check, past the request's: still the request's fault
        raise ApiError(400, str(exc)) from None


def validation_error(error: dict) -> ApiError:
    """FastAPI's first complaint about a body, as OpenAI says it: 400, and the field at fault."""
    location = [str(part) for part in error["loc"][1:]]
    param = location[0] if location else None  # the request's field (the rest: where inside it, or a union's arm)
    if error["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {error['msg']}")
    if error["type"] == "extra_forbidden":
        return ApiError(400, f"{param} is not supported by this server", param)
    if error["type"] == "missing" and len(location) == 0:
        return ApiError(400, "the body is missing: send a JSON object")
    return ApiError(400, f"{'.'.join(location) or 'the body'}: {error['msg']}", param)


class UnexpectedErrors:
    """A failure no handler expected: logged once, answered with OpenAI's error shape and a 500; the server keeps
    serving. (Starlette's own last-resort handler would answer, then raise again for uvicorn to log twice.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            log.exception("unexpected failure")
            if not started and scope["type"] == "http":
                await unexpected(exc).response()(scope, receive, send)
