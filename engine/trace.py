"""The record of one decoding run: the only thing ``viz/`` and ``app.py`` read.

A run is a prefill (which yields the first token) followed by verify steps. Every
step, AR included, verifies a tree hanging below the last committed token (the
root, node 0); AR's tree is empty. A step commits the accepted draft nodes' tokens
plus the bonus token, so its acceptance length counts the bonus and AR's is 1.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

SCHEMA_VERSION = 1
METHODS = ("ar", "dflash", "ddtree")
NATIVE_AR, NATIVE_DFLASH, NATIVE_MTP = "vllm-ar", "vllm-dflash", "vllm-mtp"  # bench labels of vLLM's own decoding (--native)
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
    tree_budget: int | None
    temperature: float
    seed: int
    max_new_tokens: int
    prompt: str
    prompt_ids: list[int]
    notes: list[str] = field(default_factory=list)  # settings the engine adjusted, said plainly
    timing_only: bool = False  # random weights at a real model's shape: the costs are real, the text is not
    step: str = "readable"  # the step that ran: "readable", "fixed" or "compiled fixed" (``engine.loop.decode.step_kind``)

    @property
    def label(self) -> str:
        """Short display name; DDTree runs carry their budget (``ddtree@32``)."""
        return f"ddtree@{self.tree_budget}" if self.method == "ddtree" else self.method

    @property
    def model_label(self) -> str:
        """The target's name, marked when its weights are random."""
        return f"{self.model} ({TIMING_ONLY})" if self.timing_only else self.model

    @property
    def title_label(self) -> str:
        """``label`` for figure titles: marked when the weights are random."""
        return f"{self.label} · {TIMING_ONLY}" if self.timing_only else self.label


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

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def from_dict(data: dict) -> "Trace":
        if not isinstance(data, dict):
            raise TraceError("a trace must be a JSON object")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise TraceError(f"trace schema version {version!r} is not supported (expected {SCHEMA_VERSION})")
        try:
            return Trace(
                config=_build(RunConfig, data["config"]),
                prefill=_build(Prefill, data["prefill"]),
                steps=[_build(Step, s) for s in data["steps"]],
                summary=_build(Summary, data["summary"]) if data.get("summary") is not None else None,
            )
        except (KeyError, TypeError) as exc:
            raise TraceError(f"trace is missing or has malformed field: {exc}") from exc

    @staticmethod
    def from_json(text: str) -> "Trace":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"not valid JSON: {exc}") from exc
        return Trace.from_dict(data)

    @staticmethod
    def load(path: str | Path) -> "Trace":
        return Trace.from_json(Path(path).read_text())


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


def _build(cls, data: dict):
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__} must be an object")
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    missing = required - data.keys()
    if missing:
        raise KeyError(f"{cls.__name__}.{sorted(missing)[0]}")
    return cls(**{k: data[k] for k in names if k in data})


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
