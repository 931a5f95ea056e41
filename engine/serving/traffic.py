"""A Studio server's traffic as the Studio reads it: the recent requests it answered, and each one's Trace
(``engine.serving.openai_api``: ``GET /v1/traces`` and ``GET /v1/traces/{id}``). No model is needed."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from engine.errors import EngineError
from engine.trace import Trace, TraceError, traces_from_data

DEFAULT_SERVER = "http://127.0.0.1:8000"
TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServedRequest:
    """One answered request, as the server lists it (newest first)."""

    id: str
    created: float  # unix seconds
    endpoint: str  # "chat.completions" or "completions"
    method: str
    tree_budget: int | None
    prompt: str  # its start
    tokens: int
    steps: int
    tau: float
    tokens_per_s: float
    finish_reason: str


def recent_requests(server: str) -> list[ServedRequest]:
    listing = _get_json(server, "/v1/traces")
    try:
        return [ServedRequest(**{name: entry[name] for name in ServedRequest.__dataclass_fields__})
                for entry in listing["data"]]
    except (KeyError, TypeError) as exc:
        raise EngineError(f"{server} answered /v1/traces with something other than a Studio server's list of "
                          f"requests ({type(exc).__name__}: {exc})") from None


def request_traces(server: str, trace_id: str) -> list[Trace]:
    """The traces of one request (one: a request runs one method)."""
    if not trace_id or not isinstance(trace_id, str):
        raise EngineError("choose a request to open: refresh the list, then pick one")
    data = _get_json(server, f"/v1/traces/{urllib.parse.quote(trace_id, safe='')}")
    try:
        return traces_from_data(data)  # the checks an uploaded file gets
    except TraceError as exc:
        raise EngineError(f"request {trace_id}'s trace cannot be read: {exc}") from None


def server_url(server: str | None) -> str:
    """``server`` checked and without a trailing slash or a ``/v1`` the user may have copied from a client."""
    url = (server or "").strip().rstrip("/")
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise EngineError(f"{server!r} is not a server address: give one like {DEFAULT_SERVER}")
    return url.removesuffix("/v1")


def _get_json(server: str, path: str):
    url = server_url(server) + path
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise EngineError(f"{url} answered {exc.code}: {_error_message(exc)}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", exc)
        raise EngineError(f"no Studio server answers at {server_url(server)} ({reason}): start one with "
                          "python -m engine.tools.serve") from None
    except json.JSONDecodeError:
        raise EngineError(f"{url} did not answer with JSON: is it a Studio server?") from None


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The message of an OpenAI-shaped error body, else the HTTP reason."""
    try:
        return json.loads(exc.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return str(exc.reason)
