"""The record of one decoding run: the only thing ``viz/`` and ``app.py`` read.

A run is a prefill (which yields the first token) followed by verify steps. Every
step, AR included, verifies a tree hanging below the last committed token (the
root, node 0); AR's tree is empty. A step commits the accepted draft nodes' tokens
plus the bonus token, so its acceptance length counts the bonus and AR's is 1.
"""

from __future__ import annotations

import functools
import json
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path

from engine.methods import AUTO, METHODS, NAMES, Method, method

SCHEMA_VERSION = 2
# version 1 lacks ``Step.batch`` and ``Trace.token_texts``, which default to empty: its files read as they are
READ_VERSIONS = (1, 2)
# bench labels of vLLM's own decoding (--native)
NATIVE_AR, NATIVE_DFLASH, NATIVE_MTP = "vllm-ar", "vllm-dflash", "vllm-mtp"
NATIVE_AR_GRAPHLESS = "vllm-ar-graphless"  # vLLM's AR compiled, without its CUDA graphs (--native ar-graphless)
TIMING_ONLY = "random weights: timing only"  # how a run on a config-only model shape is labelled
SCRIPTED = "scripted: proposes known answers"  # how a drafter that knows the answers is labelled
TOKENS_ONLY = ":tokens"  # bench label suffix of a run whose trace keeps only the committed tokens
STAGES = ("draft", "tree_build", "tree_compile", "verify", "commit")
NEAR_TIE = 0.5  # a top-2 logit gap under which rounding (bf16 above all) can swap the target's argmax


class TraceError(ValueError):
    """A trace file that cannot be read back."""


@dataclass
class RunConfig:
    method: str
    engine: str
    model: str
    drafter: str | None
    drafter_trained: bool
    device: str
    dtype: str
    block_size: int
    tree_budget: int | str | None  # the budget of a method that takes one, "auto" where chosen every step, or None
    temperature: float
    seed: int
    max_new_tokens: int
    prompt: str
    prompt_ids: list[int]
    notes: list[str] = field(default_factory=list)  # settings the engine adjusted, said plainly
    timing_only: bool = False  # random weights at a real model's shape: the costs are real, the text is not
    step: str = "readable"  # which step ran: "readable", "fixed" or "compiled fixed" (``engine.loop.decode.step_kind``)
    # a second drafter's run beside the first's (the page's comparison of two drafters): what its label adds
    drafter_tag: str | None = None

    @property
    def method_row(self) -> Method:
        """The method's row of ``engine.methods``: its names, colours, whether it drafts."""
        return method(self.method)

    @property
    def label(self) -> str:
        """Short display name; runs with a budget carry it (``ddtree@32``, ``ddtree@auto``), a second drafter's its
        tag (``ddtree@32+candidate``)."""
        return self.method_row.label(self.tree_budget, self.drafter_tag)

    def heading(self, long: bool = False) -> str:
        """The label as a person reads it (``engine.methods.Method.heading``)."""
        return self.method_row.heading(self.tree_budget, long, self.drafter_tag)

    @property
    def colour(self) -> str:
        """The run's colour in the page's figures: its method's, a second drafter's a lighter shade of it."""
        return self.method_row.run_colour(self.drafter_tag)

    @property
    def model_label(self) -> str:
        """The target's name, marked when its weights are random."""
        return f"{self.model} ({TIMING_ONLY})" if self.timing_only else self.model

    @property
    def title_label(self) -> str:
        """``label`` for figure titles: marked when the weights are random."""
        return f"{self.label} · {TIMING_ONLY}" if self.timing_only else self.label


@dataclass
class StepBatch:
    """The batched step a request's step ran in (``engine.loop.batch``)."""

    size: int  # requests in the step
    nodes: int  # draft nodes the step verified, all requests together
    budget: int  # this request's nodes
    reason: str  # why its tree has that size
    neighbours: list[str]  # the other requests in the step, by name
    alone_s: float = 0.0  # what the step would have taken with its tree alone, by the machine's step costs


@dataclass
class Step:
    index: int
    t_start: float  # seconds since the run started (before prefill)
    t_end: float
    stage_s: dict[str, float]
    root_token: int
    # drafter's top-k per draft depth (empty for AR)
    draft_top_tokens: list[list[int]]
    draft_top_probs: list[list[float]]
    # the verified tree, draft nodes 1..n (node 0 is the root)
    tree_tokens: list[int]
    tree_parents: list[int]
    tree_depths: list[int]
    tree_node_probs: list[float]
    tree_path_probs: list[float]
    tree_ranks: list[int]
    target_tokens: list[int]  # target's choice after each node, root first (n+1)
    accepted: list[int]  # accepted node indices, root first
    bonus_token: int
    committed_ids: list[int]  # accepted draft tokens then the bonus, cut at a stop/limit
    committed_text: list[str]  # decoded piece per committed id
    committed_margins: list[float]  # target's top-1 minus top-2 logit behind each committed id
    batch: StepBatch | None = None  # the batch it ran in, when it ran in one

    def plain(self) -> dict:
        """The step as plain data for a hop between the engine's own processes (``engine.loop.remote_batch``): its
        fields as they are, the batch a dict. Unlike ``asdict`` nothing is copied, since a recorded step is never
        changed again."""
        data = {name: getattr(self, name) for name in STEP_FIELDS}
        if self.batch is not None:
            data["batch"] = {name: getattr(self.batch, name) for name in STEP_BATCH_FIELDS}
        return data

    @staticmethod
    def from_plain(data: dict) -> Step:
        """``plain``'s inverse. Trusted: the engine wrote it, so unlike ``Trace.from_dict`` (which reads files a
        person may have edited) it checks no types."""
        batch = data.get("batch")
        return Step(**data | {"batch": None if batch is None else StepBatch(**batch)})

    @property
    def acceptance_length(self) -> int:
        return len(self.committed_ids)

    @property
    def number(self) -> int:
        """The step as the page and the video count it, from 1 (``index`` counts from 0)."""
        return self.index + 1

    @property
    def tree_size(self) -> int:
        return len(self.tree_tokens)


STEP_FIELDS = tuple(f.name for f in fields(Step))
STEP_BATCH_FIELDS = tuple(f.name for f in fields(StepBatch))


@dataclass
class Prefill:
    t_end: float
    first_token: int
    first_text: str
    first_margin: float
    # the prompt pass, the drafter's context features, the fixed program's start: seconds each
    stage_s: dict[str, float] = field(default_factory=dict)


@dataclass
class Summary:
    new_tokens: int
    steps: int
    acceptance_lengths: list[int]
    tau: float
    wall_s: float
    tokens_per_s: float
    time_to_first_token_s: float
    stop_reason: str  # "eos" | "max_new_tokens" | "cancelled"
    stage_s: dict[str, float]


@dataclass
class Trace:
    config: RunConfig
    prefill: Prefill
    steps: list[Step] = field(default_factory=list)
    summary: Summary | None = None
    schema_version: int = SCHEMA_VERSION
    # every token id the trace shows, with the tokenizer's text of it alone: a page without the model shows words
    token_texts: dict[int, str] = field(default_factory=dict)

    @property
    def output_ids(self) -> list[int]:
        """Every generated token id, the prefill's first token included."""
        ids = [self.prefill.first_token]
        for step in self.steps:
            ids.extend(step.committed_ids)
        return ids

    @property
    def margins(self) -> list[float]:
        """The target's top-1 minus top-2 logit behind each generated token, as ``output_ids``."""
        margins = [self.prefill.first_margin]
        for step in self.steps:
            margins.extend(step.committed_margins)
        return margins

    @property
    def text_pieces(self) -> list[str]:
        pieces = [self.prefill.first_text]
        for step in self.steps:
            pieces.extend(step.committed_text)
        return pieces

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)

    @property
    def shown_ids(self) -> set[int]:
        """Every token id a view of the trace can show: the committed tokens, each step's root, tree, target
        choices, bonus and the drafter's top-k."""
        ids = set(self.output_ids)
        for step in self.steps:
            ids.update(step.tree_tokens, step.target_tokens, (step.root_token, step.bonus_token))
            ids.update(token for depth in step.draft_top_tokens for token in depth)
        return ids

    def carry_token_texts(self, token_text: Callable[[int], str]) -> None:
        """Keep the text of every shown id (``token_texts``), so that the trace reads without its tokenizer."""
        self.token_texts = {token: token_text(token) for token in sorted(self.shown_ids)}

    def to_dict(self) -> dict:
        return asdict(self)

    def plain(self) -> dict:
        """The trace as plain data for a hop between the engine's own processes (``engine.loop.remote_batch``), as
        ``Step.plain`` gives its steps: ``to_dict``'s fields, its steps' lists not copied."""
        return {"config": asdict(self.config), "prefill": asdict(self.prefill),
                "steps": [step.plain() for step in self.steps],
                "summary": None if self.summary is None else asdict(self.summary),
                "schema_version": self.schema_version, "token_texts": self.token_texts}

    @staticmethod
    def from_plain(data: dict) -> Trace:
        """``plain``'s inverse. Trusted, as ``Step.from_plain`` is: no field checked (``from_dict`` checks them)."""
        return Trace(config=RunConfig(**data["config"]), prefill=Prefill(**data["prefill"]),
                     steps=[Step.from_plain(step) for step in data["steps"]],
                     summary=None if data["summary"] is None else Summary(**data["summary"]),
                     schema_version=data["schema_version"],
                     token_texts={int(token): text for token, text in data["token_texts"].items()})

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def from_dict(data: dict) -> Trace:
        if not isinstance(data, dict):
            raise TraceError("a trace must be a JSON object")
        _check_version(data.get("schema_version"), "trace")
        try:
            steps = data["steps"]
            if not isinstance(steps, list):
                raise TypeError(f"steps must be a list, got {_shown(steps)}")
            return Trace(
                config=_build(RunConfig, data["config"], "config"),
                prefill=_build(Prefill, data["prefill"], "prefill"),
                steps=[_build(Step, s, f"steps[{i}]") for i, s in enumerate(steps)],
                summary=_build(Summary, data["summary"], "summary") if data.get("summary") is not None else None,
                token_texts=_token_texts(data.get("token_texts", {})),
            )
        except KeyError as exc:
            raise TraceError(f"trace is missing or has malformed field: {exc.args[0]} is missing") from exc
        except TypeError as exc:
            raise TraceError(f"trace is missing or has malformed field: {exc}") from exc

    @staticmethod
    def from_json(text: str) -> Trace:
        return Trace.from_dict(_parse_json(text))

    @staticmethod
    def load(path: str | Path) -> Trace:
        return Trace.from_json(Path(path).read_text())


def _check_version(version, what: str) -> None:
    if version not in READ_VERSIONS:
        raise TraceError(f"{what} schema version {version!r} is not supported (expected "
                         f"{' or '.join(map(str, READ_VERSIONS))})")


def _token_texts(data) -> dict[int, str]:
    """``token_texts`` as JSON writes it (its keys strings) or as ``to_dict`` makes it (its keys ints)."""
    if not isinstance(data, dict) or not all(_is_token_id(key) and isinstance(text, str) for key, text in data.items()):
        raise TypeError(f"token_texts must be an object of strings keyed by token ids, got {_shown(data)}")
    return {int(key): text for key, text in data.items()}


def _is_token_id(key) -> bool:
    return (isinstance(key, int) and not isinstance(key, bool) and key >= 0) or (isinstance(key, str)
                                                                                and key.isascii() and key.isdigit())


@dataclass(frozen=True)
class Divergence:
    """Where a run's output first leaves a reference run's (AR's), and how close to a tie the target was."""

    index: int  # the first generated token that differs (or where the shorter output ends)
    ar_margin: float | None  # the reference's top-2 logit gap there (None: the reference ended first)
    method_margin: float | None

    @property
    def near_tie(self) -> bool:
        return self.ar_margin is not None and self.ar_margin < NEAR_TIE


def divergence(trace: Trace, reference: Trace) -> Divergence | None:
    """Where ``trace`` first leaves ``reference``'s output; None when they are identical."""
    ours, theirs = trace.output_ids, reference.output_ids
    index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if index is None:
        if len(ours) == len(theirs):
            return None
        index = min(len(ours), len(theirs))
    return Divergence(index, reference.margins[index] if index < len(theirs) else None,
                      trace.margins[index] if index < len(ours) else None)


def _build(cls, data: dict, where: str):
    """``cls`` from its JSON object at ``where`` (``summary``, ``steps[3]``), every field of its annotated type:
    a hand-edited ``"wall_s": "fast"`` is refused here, not met deep inside a figure."""
    if not isinstance(data, dict):
        raise TypeError(f"{where} must be an object, got {_shown(data)}")
    hints = _type_hints(cls)
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    missing = required - data.keys()
    if missing:
        raise KeyError(f"{where}.{sorted(missing)[0]}")
    values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
    for name, value in values.items():
        nested = _dataclass_in(hints[name])
        if nested is not None and isinstance(value, dict):
            values[name] = _build(nested, value, f"{where}.{name}")
        elif not _fits(value, hints[name]):
            raise TypeError(f"{where}.{name} must be {_described(hints[name])}, got {_shown(value)}")
    return cls(**values)


def _dataclass_in(hint):
    """The dataclass a field holds (``StepBatch | None`` holds ``StepBatch``), or None."""
    arms = typing.get_args(hint) if typing.get_origin(hint) in (types.UnionType, typing.Union) else (hint,)
    return next((arm for arm in arms if is_dataclass(arm)), None)


@functools.cache
def _type_hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _fits(value, hint) -> bool:
    """Whether a JSON value has the annotated type (a whole number fits a float field: JSON writes 0.0 as 0)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_fits(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_fits(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _described(hint, plural: bool = False) -> str:
    """A type as a JSON value is said to be: ``a list of integers``, ``an integer or null``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_described(arg, plural) for arg in args)
    if origin is list:
        return f"{'lists' if plural else 'a list'} of {_described(args[0], plural=True)}"
    if origin is dict:
        return f"{'objects' if plural else 'an object'} of {_described(args[1], plural=True)}"
    names = {float: ("a number", "numbers"), int: ("an integer", "integers"), str: ("a string", "strings"),
             bool: ("true or false", "true or false values"), type(None): ("null", "nulls")}
    return names.get(hint, (hint.__name__, hint.__name__))[plural]


def _shown(value) -> str:
    text = json.dumps(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _parse_json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"not a JSON trace file: {exc}") from exc
    except RecursionError as exc:
        raise TraceError("not a JSON trace file: it nests deeper than any trace (arrays or objects inside each "
                         "other thousands of levels down)") from exc


# ---------------------------------------------------------------- trace files

def trace_file_data(traces: list[Trace]) -> dict:
    """A trace file's JSON: ``{"schema_version": 2, "traces": [<Trace>, ...]}``, one trace per run."""
    return {"schema_version": SCHEMA_VERSION, "traces": [t.to_dict() for t in traces]}


def write_trace_file(path: str | Path, traces: list[Trace]) -> Path:
    """The app's download (``trace_file_data``)."""
    path = Path(path)
    path.write_text(json.dumps(trace_file_data(traces)))
    return path


def read_trace_file(path: str | Path) -> list[Trace]:
    """Every trace in a trace file of any shape the Studio writes: the app's download (``write_trace_file``),
    one trace (``Trace.save``, as ``engine.tools.bench --traces`` writes them) or a plain list of traces;
    each checked by ``check_consistent``. Anything else is a ``TraceError`` that says what the file holds."""
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as exc:
        raise TraceError(f"not a JSON trace file: {exc}") from exc
    return traces_from_data(_parse_json(text))


def traces_from_data(data) -> list[Trace]:
    """``read_trace_file`` on JSON already parsed (a server's answer, say)."""
    if isinstance(data, dict) and not {"traces", "config"} & data.keys():
        raise TraceError(f"not a trace file: it holds {', '.join(map(repr, data)) or 'an empty object'}, where a trace "
                         f"file holds {{\"schema_version\": {SCHEMA_VERSION}, \"traces\": [...]}} (the app's "
                         "download) or one trace with its \"config\" and \"steps\" (Trace.save)")
    if isinstance(data, dict) and "traces" in data:
        _check_version(data.get("schema_version"), "trace file")
        data = data["traces"]
    items = data if isinstance(data, list) else [data]
    traces = [Trace.from_dict(item) for item in items]
    if not traces:
        raise TraceError("the file holds no traces")
    for trace in traces:
        check_consistent(trace)
    return traces


def check_consistent(trace: Trace) -> None:
    """Catch a hand-edited or truncated trace when it is read rather than deep inside a figure."""
    if trace.config.method not in METHODS:
        raise TraceError(f"unknown method {trace.config.method!r} in trace file; expected one of {', '.join(NAMES)}")
    budget = trace.config.tree_budget
    if isinstance(budget, str) and budget != AUTO:
        raise TraceError("trace is missing or has malformed field: config.tree_budget must be an integer, \"auto\" or "
                         f"null, got {_shown(budget)}")
    if trace.summary is None:
        raise TraceError(f"the {trace.config.method} trace has no summary: it was saved before its run finished")
    for step in trace.steps:
        n = len(step.tree_tokens)
        tree_lists = (step.tree_parents, step.tree_depths, step.tree_node_probs, step.tree_path_probs, step.tree_ranks)
        faults = [
            (any(len(values) != n for values in tree_lists), "its tree lists differ in length"),
            (len(step.target_tokens) != n + 1, "it needs one target token per node plus the root"),
            (any(not 0 <= parent < node for node, parent in enumerate(step.tree_parents, start=1)),
             "a node's parent does not come before it"),
            (not step.accepted or step.accepted[0] != 0 or any(not 0 < a <= n for a in step.accepted[1:]),
             "its accepted path is not root-first node indices"),
            (len(step.committed_ids) != len(step.committed_text), "committed ids and texts differ in length"),
            (len(step.draft_top_tokens) != len(step.draft_top_probs), "draft top-k tokens and probs differ"),
        ]
        for failed, why in faults:
            if failed:
                raise TraceError(f"step {step.number} of the {trace.config.method} trace is inconsistent: {why}")


def summarize(config: RunConfig, prefill: Prefill, steps: list[Step], wall_s: float, stop_reason: str) -> Summary:
    lengths = [s.acceptance_length for s in steps]
    new_tokens = 1 + sum(lengths)
    stage_totals = {name: sum(s.stage_s.get(name, 0.0) for s in steps) for name in STAGES}
    return Summary(
        new_tokens=new_tokens,
        steps=len(steps),
        acceptance_lengths=lengths,
        tau=sum(lengths) / len(lengths) if lengths else 0.0,
        wall_s=wall_s,
        tokens_per_s=new_tokens / wall_s if wall_s > 0 else 0.0,
        time_to_first_token_s=prefill.t_end,
        stop_reason=stop_reason,
        stage_s=stage_totals,
    )
