"""AR, DFlash and DDTree decoding on the torch engine, as one loop.

Every step drafts a tree below the last committed token (AR: no tree; DFlash: a
chain; DDTree: the best-first tree), verifies root + nodes in one target pass with
an ancestors-only mask, walks it with the target's own tokens, keeps the accepted
path's KV and hands the accepted tokens' hidden states to the drafter as new
context. Greedy output therefore equals AR exactly, and sampled output follows the
target's distribution.
"""

from __future__ import annotations

import functools
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

import ddtree
from engine.models.drafter import DFlashDrafter
from engine.loop.draft_pass import EagerDraft, GraphedDraft
from engine.errors import EngineError
from engine.gpu.profiling import STAGE_MARK
from engine.models.target import Target
from engine.trace import METHODS, Prefill, RunConfig, Step, Trace, summarize

MAX_TREE_BUDGET = 1024
MAX_NEW_TOKENS = 4096
FIXED_CAPACITY_STEP = 512  # fixed-step KV buffers come in multiples of this many rows
TRACE_DETAILS = ("full", "tokens")


@dataclass(frozen=True)
class DecodeSettings:
    method: str
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    block_size: int | None = None  # None: the drafter's own
    tree_budget: int = 32
    record_top_k: int = 8
    trace_detail: str = "full"  # "tokens": steps keep what they commit, not the tree (timing a lean loop)


@dataclass
class DrafterInfo:
    """How the drafter is presented in traces: its name and whether it was trained."""

    name: str
    trained: bool
    revision: str | None = None  # the weights' fingerprint (``engine.models.drafter.weights_digest``)


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
        marked = torch.autograd.profiler.record_function(STAGE_MARK + name) if torch.autograd._profiler_enabled() else None
        begin = self.now()
        with marked or nullcontext():
            yield
            end = self.now()
        self.times[name] = self.times.get(name, 0.0) + end - begin

    def take(self) -> dict[str, float]:
        times, self.times = self.times, {}
        return times


def step_kind(fixed_step: bool, compile_step: bool) -> str:
    return ("compiled fixed" if compile_step else "fixed") if fixed_step else "readable"


class Decoder:
    def __init__(self, target: Target, drafter: DFlashDrafter | None = None, drafter_info: DrafterInfo | None = None,
                 engine: str = "torch", cuda_graphs: bool = False, fixed_step: bool = False,
                 compile_step: bool = False, timing_only: bool = False):
        self.target = target
        self.drafter = drafter
        self.drafter_info = drafter_info or DrafterInfo(name="none", trained=False)
        self.engine = engine
        self.cuda_graphs = cuda_graphs  # replay the draft pass as a CUDA graph where the drafter allows it
        # greedy DFlash / DDTree as fixed-shape device programs (engine.loop.fixed_step) instead of the readable step,
        # where the target's cache can take them (``Target.runs_fixed_step``)
        self.fixed_step = fixed_step and target.runs_fixed_step
        self.compile_step = compile_step  # the fixed step's own stages (draft, tree, walk) through torch.compile
        self.timing_only = timing_only  # random weights at a real shape: traces say so
        self._graphed_drafts: dict[int, GraphedDraft] = {}
        self._programs: dict[tuple, object] = {}
        if drafter is not None:
            check_drafter_fits(drafter.config, target.config)

    @property
    def step_kind(self) -> str:
        """How greedy steps run: "fixed" (device programs, ``engine.loop.fixed_step``), "compiled fixed"
        (their stages through torch.compile) or "readable"."""
        return step_kind(self.fixed_step, self.compile_step)

    @property
    def draft_dtype(self) -> str | None:
        """The drafter's dtype where it is not the target's (the vLLM engine's workers keep the target's)."""
        if self.engine != "torch" or self.drafter is None or self.drafter.dtype == self.target.dtype:
            return None
        return str(self.drafter.dtype).removeprefix("torch.")

    @functools.cached_property
    def draft_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's embedding and lm_head as the drafter reads them: in the drafter's own dtype
        (a bf16 drafter beside a float32 target drafts at bf16 speed; the target still verifies);
        the same tensors when it is the target's."""
        target = self.target
        dtype = self.drafter.dtype if self.drafter is not None else target.dtype
        if dtype == target.dtype:
            return target.embedding, target.lm_head
        embedding = target.embedding.to(dtype)
        tied = target.lm_head.data_ptr() == target.embedding.data_ptr()
        return embedding, embedding if tied else target.lm_head.to(dtype)

    def draft_pass(self, block_size: int) -> EagerDraft | GraphedDraft:
        if not (self.cuda_graphs and self.drafter.graphable):
            return EagerDraft(self.drafter, *self.draft_weights, block_size)
        if block_size not in self._graphed_drafts:
            self._graphed_drafts[block_size] = GraphedDraft(self.drafter, *self.draft_weights, block_size,
                                                            self.target.context_length)
        graphed = self._graphed_drafts[block_size]
        graphed.reset()
        return graphed

    def prepare(self, settings: DecodeSettings, prompt_length: int) -> tuple[DecodeSettings, list[str]]:
        """Check settings against the models; return them adjusted, with notes saying how."""
        notes: list[str] = []
        if settings.method not in METHODS:
            raise EngineError(f"unknown method {settings.method!r}; choose from {', '.join(METHODS)}")
        if not 1 <= settings.max_new_tokens <= MAX_NEW_TOKENS:
            raise EngineError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS}, got {settings.max_new_tokens}")
        if settings.temperature < 0:
            raise EngineError(f"temperature must be >= 0, got {settings.temperature}")
        if settings.trace_detail not in TRACE_DETAILS:
            raise EngineError(f"trace detail must be one of {', '.join(TRACE_DETAILS)}, got {settings.trace_detail!r}")
        if prompt_length == 0:
            raise EngineError("the prompt is empty: type a message for the model to answer")
        block_size = 1
        if settings.method != "ar":
            if self.drafter is None:
                raise EngineError(f"{settings.method} needs a DFlash drafter; pass one (or 'random')")
            native = self.drafter.block_size
            block_size = settings.block_size or native
            if not 2 <= block_size <= native:
                raise EngineError(f"block size {block_size} is not supported by this drafter: "
                                  f"choose 2..{native} (it was trained with blocks of {native})")
        if settings.method == "ddtree":
            if settings.tree_budget < 1:
                raise EngineError(f"tree budget must be at least 1, got {settings.tree_budget}")
            if settings.tree_budget > MAX_TREE_BUDGET:
                notes.append(f"tree budget {settings.tree_budget} capped to {MAX_TREE_BUDGET}")
                settings = replace(settings, tree_budget=MAX_TREE_BUDGET)
        if self.fixed_step and settings.temperature > 0:
            notes.append("sampling runs the readable step: the fixed-shape step walks greedily")
        limit = self.target.context_length
        needed = prompt_length + settings.max_new_tokens + block_size
        if needed > limit:
            raise EngineError(f"prompt of {prompt_length} tokens + {settings.max_new_tokens} new tokens exceeds the "
                              f"model's context of {limit} tokens: shorten the prompt or lower max new tokens")
        return replace(settings, block_size=block_size), notes

    @torch.inference_mode()
    def run(self, prompt: str = "", settings: DecodeSettings = DecodeSettings("ar"), *, prompt_ids: list[int] | None = None,
            on_step: Callable[[Trace, Step], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> Trace:
        if prompt_ids is None:
            if not prompt.strip():
                raise EngineError("the prompt is empty: type a message for the model to answer")
            prompt_ids = self.target.chat_ids(prompt)
        settings, notes = self.prepare(settings, len(prompt_ids))
        target, device = self.target, self.target.device
        fixed = self.uses_fixed_step(settings)
        config = RunConfig(
            method=settings.method, engine=self.engine, model=target.name,
            drafter=self.drafter_info.name if settings.method != "ar" else None,
            drafter_trained=self.drafter_info.trained if settings.method != "ar" else False,
            device=str(device), dtype=str(target.dtype).removeprefix("torch."),
            block_size=settings.block_size, tree_budget=settings.tree_budget if settings.method == "ddtree" else None,
            temperature=settings.temperature, seed=settings.seed, max_new_tokens=settings.max_new_tokens,
            prompt=prompt, prompt_ids=list(prompt_ids), notes=notes, timing_only=self.timing_only,
            step=step_kind(fixed, self.compile_step),
        )
        if fixed:
            from engine.loop.fixed_step import FixedRun

            program = self.fixed_program(settings, len(prompt_ids))
            return FixedRun(self, settings, config, on_step, should_stop, program).execute()
        return _Run(self, settings, config, on_step, should_stop).execute()

    def kernel_profile(self, prompt_ids: list[int], settings: DecodeSettings):
        """Kernels per verify step by stage for one generation, and the slowest (``engine.gpu.profiling``; CUDA only)."""
        from engine.gpu.profiling import profile_kernels

        return profile_kernels(lambda: self.run(prompt_ids=prompt_ids, settings=settings))

    def uses_fixed_step(self, settings: DecodeSettings) -> bool:
        """Greedy decoding on a target that runs the fixed step (``Target.runs_fixed_step``), with a
        drafter a CUDA graph can hold where graphs are on (not a scripted one) if it drafts."""
        if not self.fixed_step or settings.temperature != 0:
            return False
        return settings.method == "ar" or self.drafter.graphable or not self.cuda_graphs

    def fixed_program(self, settings: DecodeSettings, prompt_length: int):
        """The fixed-shape program for these settings, made once (buffers, and graphs on CUDA)."""
        from engine.loop.fixed_step import FixedProgram

        budget = settings.tree_budget if settings.method == "ddtree" else None
        # the last step may pass max_new_tokens by a block, and its tree's rows sit after that; one scratch row
        nodes = budget if budget is not None else settings.block_size - 1
        needed = prompt_length + settings.max_new_tokens + settings.block_size + nodes + 2
        capacity = -(-needed // FIXED_CAPACITY_STEP) * FIXED_CAPACITY_STEP
        key = (settings.method, budget, settings.block_size, capacity, settings.record_top_k)
        if key not in self._programs:
            self._programs[key] = FixedProgram(self, settings.method, budget, settings.block_size, capacity,
                                               settings.record_top_k,
                                               graphs=self.cuda_graphs and self.target.device.type == "cuda",
                                               compile_step=self.compile_step)
        return self._programs[key]

    def close(self) -> None:
        """Give back the device memory the step's graphs and programs hold before another engine
        (vLLM's own, in the bench) starts; they are rebuilt if this decoder runs again."""
        self._graphed_drafts.clear()
        self._programs.clear()


def check_drafter_fits(drafter_config, target_config) -> None:
    """A drafter trained for another model (width, tapped layers) is refused before anything runs."""
    if drafter_config.hidden_size != target_config.hidden_size:
        raise EngineError(f"drafter hidden size {drafter_config.hidden_size} does not match the target's "
                          f"{target_config.hidden_size}: it was trained for another model")
    if max(drafter_config.target_layer_ids) >= target_config.num_hidden_layers:
        raise EngineError(f"drafter taps target layers {drafter_config.target_layer_ids} but the target has "
                          f"{target_config.num_hidden_layers} layers: it was trained for another model")


@dataclass
class _Outcome:
    """What one verify pass decided."""

    tree: ddtree.DraftTree
    target_tokens: list[int]
    accepted: list[int]
    bonus: int
    committed: list[int]
    pieces: list[str]
    margins: list[float]


class _Run:
    """The state of one generation; ``execute`` is the whole loop."""

    def __init__(self, decoder: Decoder, settings: DecodeSettings, config: RunConfig, on_step, should_stop):
        self.target, self.drafter, self.settings, self.config = decoder.target, decoder.drafter, settings, config
        self.on_step, self.should_stop = on_step, should_stop
        self.device = self.target.device
        self.clock = StageClock(self.device)
        self.generator = torch.Generator(self.device).manual_seed(settings.seed)
        self.drafts = settings.method != "ar"
        self.cache = self.target.new_cache()
        self.draft_pass = decoder.draft_pass(settings.block_size) if self.drafts else None
        self.output_ids: list[int] = []
        self.text = TextStream(self.target.decode)

    def execute(self) -> Trace:
        self.t0 = self.clock.now()
        trace = Trace(config=self.config, prefill=self.prefill())
        stop_reason = self.stop_reason()
        while stop_reason is None:
            step = self.step(len(trace.steps))
            trace.steps.append(step)
            if self.on_step is not None:
                self.on_step(trace, step)
            stop_reason = self.stop_reason()
        trace.summary = summarize(self.config, trace.prefill, trace.steps, self.clock.now() - self.t0, stop_reason)
        return trace

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
            logits, hidden = self.target.forward(prompt, positions, self.cache, hidden_states=self.drafts)
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
                       first_margin=_margins(logits[-1:])[0], stage_s=self.clock.take())

    def prepare_steps(self) -> None:
        """What the steps need once the prompt is in (the readable loop: nothing)."""

    def draft(self) -> torch.Tensor:
        """Log-probabilities ``[block-1, vocab]`` for the slots after the root, in one drafter pass."""
        return self.draft_pass(self.root, self.start, self.new_context, self.new_context_positions)

    def build(self, log_probs: torch.Tensor | None) -> ddtree.DraftTree:
        if log_probs is None:
            return ddtree.DraftTree.empty()
        if self.settings.method == "dflash":
            return ddtree.chain_tree(log_probs)
        return ddtree.build_tree(log_probs, self.settings.tree_budget)

    def step(self, index: int) -> Step:
        t_start = self.elapsed()
        root = self.root
        log_probs = None
        if self.drafts:
            with self.clock.stage("draft"):
                log_probs = self.draft()
        with self.clock.stage("tree_build"):
            tree = self.build(log_probs)
        with self.clock.stage("tree_compile"):
            inputs = ddtree.compile_tree(tree, self.root, self.start)
            bias = self.target.tree_bias(inputs.visible, self.start) if tree.size else None
        with self.clock.stage("verify"):
            logits, hidden = self.target.forward(inputs.input_ids.to(self.device), inputs.position_ids.to(self.device),
                                                 self.cache, bias, hidden_states=self.drafts)
        with self.clock.stage("commit"):
            target_tokens = ddtree.sample_tokens(logits, self.settings.temperature, self.generator).tolist()
            accepted, bonus = ddtree.follow_tree(tree, target_tokens)
            self.target.commit(self.cache, self.start, accepted)
            if self.drafts:
                kept = torch.tensor(accepted, device=self.device)
                self.new_context = self.drafter.context_features(hidden).index_select(1, kept)
                self.new_context_positions = (self.start + torch.arange(len(accepted), device=self.device))[None]
            path_tokens = [int(t) for t in inputs.input_ids[0, accepted[1:]].tolist()]
            committed = self.clip(path_tokens + [bonus])
            margins = _margins(logits.index_select(0, torch.tensor(accepted, device=self.device)))
            self.output_ids.extend(committed)
            outcome = _Outcome(tree, target_tokens, accepted, bonus, committed,
                               pieces=[self.text.push(token) for token in committed], margins=margins[: len(committed)])
            self.start += len(accepted)
            self.root = bonus
        full = self.settings.trace_detail == "full"
        return self.record(index, t_start, root, _draft_top(log_probs, self.settings.record_top_k) if full else ([], []),
                           outcome)

    def clip(self, tokens: list[int]) -> list[int]:
        """Cut at the first stop token (kept) and at the new-token limit."""
        room = self.settings.max_new_tokens - len(self.output_ids)
        tokens = tokens[:room]
        for i, token in enumerate(tokens):
            if token in self.target.stop_ids:
                return tokens[: i + 1]
        return tokens

    def record(self, index: int, t_start: float, root: int, draft_top: tuple[list[list[int]], list[list[float]]],
               outcome: "_Outcome", stage_s: dict[str, float] | None = None) -> Step:
        """The step as the trace keeps it: all of it, or (trace detail "tokens") what it committed.
        ``stage_s``: the stage times, when the stage clock did not take them."""
        full = self.settings.trace_detail == "full"
        tree = outcome.tree if full else ddtree.DraftTree.empty()
        top_tokens, top_probs = draft_top
        return Step(
            index=index, t_start=t_start, t_end=self.elapsed(), stage_s=self.clock.take() if stage_s is None else stage_s,
            root_token=root,
            draft_top_tokens=top_tokens, draft_top_probs=top_probs,
            tree_tokens=tree.tokens.tolist(), tree_parents=tree.parents.tolist(), tree_depths=tree.depths.tolist(),
            tree_node_probs=tree.log_probs.exp().tolist(), tree_path_probs=tree.path_log_probs.exp().tolist(),
            tree_ranks=tree.ranks.tolist(), target_tokens=[int(t) for t in outcome.target_tokens] if full else [],
            accepted=outcome.accepted, bonus_token=int(outcome.bonus), committed_ids=outcome.committed,
            committed_text=outcome.pieces, committed_margins=outcome.margins,
        )


def _draft_top(log_probs: torch.Tensor | None, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The drafter's ``k`` most probable tokens per depth, and their probabilities."""
    if log_probs is None:
        return [], []
    values, tokens = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
    return tokens.tolist(), values.exp().tolist()


def _margins(logits: torch.Tensor) -> list[float]:
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
