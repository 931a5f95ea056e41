"""The loop every step kind shares: one generation's state, its prefill, the steps until a stop
reason, and the trace they make.

``Run`` is the skeleton; the readable step (``engine.loop.decode.ReadableRun``) and the fixed-shape
step (``engine.loop.fixed_step.FixedRun``) fill in its seam (``steps``, ``prepare_steps``,
``settle``) and record each step through ``Run.record``, so both make the same ``Trace``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

import ddtree
from ddtree.tree import DraftRow, top_drafts
from engine.gpu.profiling import STAGE_MARK
from engine.methods import method
from engine.trace import Prefill, RunConfig, Step, Trace, summarize


class StageClock:
    """Wall time per stage; on CUDA it synchronises so each stage owns its kernels."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.times: dict[str, float] = {}

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def stage(self, name: str):
        marked = (torch.autograd.profiler.record_function(STAGE_MARK + name)
                  if torch.autograd._profiler_enabled() else None)
        begin = self.now()
        with marked or nullcontext():
            yield
            end = self.now()
        self.times[name] = self.times.get(name, 0.0) + end - begin

    def take(self) -> dict[str, float]:
        times, self.times = self.times, {}
        return times


@dataclass
class Outcome:
    """What one verify pass decided."""

    tree: ddtree.DraftTree
    target_tokens: list[int]
    accepted: list[int]
    bonus: int
    committed: list[int]
    pieces: list[str]
    margins: list[float]


class Run:
    """The state of one generation and the loop every step kind shares: ``execute`` prefills, takes
    steps until a stop reason, and summarises. A step kind fills in the seam:

    - ``steps()``: the generation's steps, in order; ``execute`` stops asking once it has a stop reason;
    - ``prepare_steps()``: what the steps need once the prompt is in;
    - ``settle()``: what must finish after the last step is recorded, before the run's clock stops.

    ``decoder`` and ``settings``: ``engine.loop.decode``'s ``Decoder`` and ``DecodeSettings``.
    """

    def __init__(self, decoder, settings, config: RunConfig, on_step, should_stop):
        self.target, self.drafter, self.settings, self.config = decoder.target, decoder.drafter, settings, config
        self.on_step, self.should_stop = on_step, should_stop
        self.device = self.target.device
        self.clock = StageClock(self.device)
        self.generator = torch.Generator(self.device).manual_seed(settings.seed)
        self.drafts = method(settings.method).drafts
        self.cache = self.target.new_cache()
        self.output_ids: list[int] = []
        self.text = TextStream(self.target.decode)
        self.trace: Trace | None = None  # made by the prefill, whole once the run ends
        self.left_at: float | None = None  # when its last turn among others' ended (``turn``)

    def __iter__(self) -> Iterator[Step]:
        """The generation a step at a time: the prefill comes with the first step, and once the last is taken
        ``trace`` is whole. ``execute`` runs it through; ``engine.loop.race`` gives several runs turns."""
        self.t0 = self.clock.now()
        self.trace = Trace(config=self.config, prefill=self.prefill())
        stop_reason = self.stop_reason()
        steps = self.steps()
        while stop_reason is None:
            step = next(steps)
            self.trace.steps.append(step)
            if self.on_step is not None:
                self.on_step(self.trace, step)
            yield step
            stop_reason = self.stop_reason()
        self.settle()
        self.conclude(stop_reason)

    def execute(self) -> Trace:
        for _ in self:
            pass
        return self.trace

    @contextmanager
    def turn(self):
        """One turn of this run among others' (``engine.loop.race``): its clock runs during its own turns only,
        so its trace's times count its own steps alone."""
        if self.left_at is not None:
            self.t0 += self.clock.now() - self.left_at
        try:
            yield
        finally:
            self.settle()  # a step launched ahead is this run's work, not the next run's
            self.left_at = self.clock.now()

    def conclude(self, stop_reason: str) -> Trace:
        """The trace summarized as the clock stops, then given the text of every token it shows."""
        self.trace.summary = summarize(self.config, self.trace.prefill, self.trace.steps, self.elapsed(), stop_reason)
        self.trace.carry_token_texts(self.target.token_text)
        return self.trace

    def steps(self) -> Iterator[Step]:
        """The generation's steps, in order (a step kind's own)."""
        raise NotImplementedError

    def settle(self) -> None:
        """What must finish before the run's clock stops (the readable step: nothing is in flight)."""

    def elapsed(self) -> float:
        """Seconds since the run started (on CUDA, once the work so far is done)."""
        return self.clock.now() - self.t0

    def stop_reason(self) -> str | None:
        if self.output_ids and self.output_ids[-1] in self.target.stop_ids:
            return "eos"
        if len(self.output_ids) >= self.settings.max_new_tokens:
            return "max_new_tokens"
        if self.should_stop is not None and self.should_stop():
            return "cancelled"
        return None

    def prefill(self) -> Prefill:
        prompt = torch.tensor([self.config.prompt_ids], device=self.device)
        positions = torch.arange(prompt.shape[1], device=self.device)[None]
        with self.clock.stage("target"):
            logits, hidden = self.target.forward(prompt, positions, self.cache, hidden_states=self.drafts,
                                                 last_logits=True)
            first = int(ddtree.sample_tokens(logits[-1:], self.settings.temperature, self.generator)[0])
        self.start = prompt.shape[1]  # position of the root: the last committed token, not yet in the KV cache
        self.root = first
        if self.drafts:
            with self.clock.stage("context"):
                self.new_context = self.drafter.context_features(hidden)
            self.new_context_positions = positions
        self.prepare_steps()
        self.output_ids.append(first)
        return Prefill(t_end=self.clock.now() - self.t0, first_token=first, first_text=self.text.push(first),
                       first_margin=logit_margins(logits[-1:])[0], stage_s=self.clock.take())

    def prepare_steps(self) -> None:
        """What the steps need once the prompt is in (the readable loop: nothing)."""

    def clip(self, tokens: list[int]) -> list[int]:
        """Cut at the first stop token (kept) and at the new-token limit."""
        room = self.settings.max_new_tokens - len(self.output_ids)
        tokens = tokens[:room]
        for i, token in enumerate(tokens):
            if token in self.target.stop_ids:
                return tokens[: i + 1]
        return tokens

    def record(self, index: int, t_start: float, root: int, draft_top: tuple[list[list[int]], list[list[float]]],
               outcome: Outcome, stage_s: dict[str, float] | None = None) -> Step:
        """The step as the trace keeps it: all of it, or (trace detail "tokens") what it committed.
        ``stage_s``: the stage times, when the stage clock did not take them."""
        full = self.settings.trace_detail == "full"
        tree = outcome.tree if full else ddtree.DraftTree.empty()
        top_tokens, top_probs = draft_top
        return Step(
            index=index, t_start=t_start, t_end=self.elapsed(),
            stage_s=self.clock.take() if stage_s is None else stage_s,
            root_token=root,
            draft_top_tokens=top_tokens, draft_top_probs=top_probs,
            tree_tokens=tree.tokens.tolist(), tree_parents=tree.parents.tolist(), tree_depths=tree.depths.tolist(),
            tree_node_probs=tree.log_probs.exp().tolist(), tree_path_probs=tree.path_log_probs.exp().tolist(),
            tree_ranks=tree.ranks.tolist(), target_tokens=[int(t) for t in outcome.target_tokens] if full else [],
            accepted=outcome.accepted, bonus_token=int(outcome.bonus), committed_ids=outcome.committed,
            committed_text=outcome.pieces, committed_margins=outcome.margins,
        )



def draft_top(log_probs: torch.Tensor | DraftRow | None, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The drafter's ``k`` most probable tokens per depth, and their probabilities (what a step records)."""
    if log_probs is None:
        return [], []
    values, tokens = top_drafts(log_probs, min(k, log_probs.shape[-1]))
    return tokens.tolist(), values.exp().tolist()


def logit_margins(logits: torch.Tensor) -> list[float]:
    """Top-1 minus top-2 logit per row: how close the target's choice was to a tie."""
    if logits.shape[-1] < 2:
        return [float("inf")] * logits.shape[0]
    top2 = logits.float().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


@dataclass
class TextStream:
    """Incremental detokenization: one piece per token, and the pieces join to the full decode.

    Decoding only a short window keeps each token O(1). A character split across tokens
    decodes to U+FFFD until its last byte arrives, so its piece is held back until then.
    The window restarts on the last token, decoded alone, so tokenizers that drop a
    leading space at the start of a decode still give the next token its space.
    """

    decode: Callable[[list[int]], str]
    ids: list[int] = field(default_factory=list)
    start: int = 0  # the window: decode(ids[start:]) begins with ``emitted``
    emitted: str = ""

    WINDOW = 16

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.decode(self.ids[self.start:])
        if text.endswith("\ufffd"):
            return ""
        shared = len(os.path.commonprefix([text, self.emitted]))
        piece, self.emitted = text[shared:], text
        if len(self.ids) - self.start > self.WINDOW:
            self.start = len(self.ids) - 1
            self.emitted = self.decode(self.ids[self.start:])
        return piece
