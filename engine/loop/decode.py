"""AR, DFlash and DDTree decoding: the ``Decoder`` (settings, checks, which step runs) and the
readable step, ``ReadableRun``, on ``engine.loop.run``'s loop.

Every step drafts a tree below the last committed token (AR: no tree; DFlash: a
chain; DDTree: the best-first tree), verifies root + nodes in one target pass with
an ancestors-only mask, walks it with the target's own tokens, keeps the accepted
path's KV and hands the accepted tokens' hidden states to the drafter as new
context. Greedy output therefore equals AR exactly, and sampled output follows the
target's distribution.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

import ddtree
from engine.errors import EngineError
from engine.gpu.profiling import profile_kernels
from engine.loop.budgeting import Budgeting
from engine.loop.draft_pass import EagerDraft, GraphedDraft
from engine.loop.fixed_step import FixedProgram, FixedRun
from engine.loop.race import TURN_S, Race, check_apart, one_after_another, take_turns
from engine.loop.run import Outcome, Run, draft_top, logit_margins
from engine.loop.settings import DecodeSettings
from engine.methods import BASELINE, method
from engine.models.drafter import DFlashDrafter
from engine.models.protocols import FixedKV, TargetModel
from engine.trace import RunConfig, Step, Trace

READABLE_SAMPLING = "sampling runs the readable step: the fixed-shape step walks greedily"
FIXED_CAPACITY_STEP = 512  # fixed-step KV buffers come in multiples of this many rows


@dataclass
class DrafterInfo:
    """How the drafter is presented in traces: its name and whether it was trained."""

    name: str
    trained: bool
    revision: str | None = None  # the weights' fingerprint (``engine.models.drafter.weights_digest``)
    tag: str | None = None  # a second drafter beside the first: what its runs' labels add (``ddtree@16+tag``)


def step_kind(fixed_step: bool, compile_step: bool) -> str:
    return ("compiled fixed" if compile_step else "fixed") if fixed_step else "readable"


class Decoder:
    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None = None,
                 drafter_info: DrafterInfo | None = None,
                 engine: str = "torch", cuda_graphs: bool = False, fixed_step: bool = False,
                 compile_step: bool = False, timing_only: bool = False):
        self.target = target
        self.drafter = drafter
        self.drafter_info = drafter_info or DrafterInfo(name="none", trained=False)
        self.engine = engine
        self.cuda_graphs = cuda_graphs  # replay the draft pass as a CUDA graph where the drafter allows it
        # greedy DFlash / DDTree as fixed-shape device programs (engine.loop.fixed_step) instead of the readable step,
        # where the target's cache can take them (``TargetModel.runs_fixed_step``)
        self.fixed_step = fixed_step and target.runs_fixed_step
        self.compile_step = compile_step  # the fixed step's own stages (draft, tree, walk) through torch.compile
        self.timing_only = timing_only  # random weights at a real shape: traces say so
        self.budgeting = Budgeting()  # how "auto" trees are sized here (``engine.loop.budgeting``); start-up may
        # put this machine's recorded step costs in its place
        self._graphed_drafts: dict[tuple, GraphedDraft] = {}
        self._programs: dict[tuple, FixedProgram] = {}
        # one KV cache for all the fixed-step programs, grown (never shrunk) when a run needs more rows: a budget
        # sweep holds one cache at its longest run's size, not one per budget
        self._fixed_kv: FixedKV | None = None
        self._fixed_capacity = 0
        if drafter is not None:
            check_drafter_fits(drafter.config, target.config)

    def remote_batch(self, budgeting: Budgeting):
        """Where the models live in other processes (the vLLM engine's workers), the batch lives there too: a
        ``engine.loop.remote_batch.RemoteBatch`` on them. None here: the batch runs on these models
        (``engine.loop.remote_batch.open_batch``)."""
        return None

    def remote_step_costs(self, prompts: list[list[int]], requests: tuple[int, ...], nodes: tuple[int, ...]
                          ) -> dict | None:
        """``engine.measure.step_cost.time_step_costs`` where the models live in other processes, as plain data
        (``CostTiming.to_dict``); None here: it times these models."""
        return None

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

    def draft_pass(self, block_size: int, owner: tuple = ()) -> EagerDraft | GraphedDraft:
        """The drafter's pass for a run; a graphed one is kept for the next run of the same ``owner``
        (``DecodeSettings.apart``: the runs of a race never share one)."""
        if not (self.cuda_graphs and self.drafter.graphable):
            return EagerDraft(self.drafter, *self.draft_weights, block_size)
        key = (block_size, *owner)
        if key not in self._graphed_drafts:
            self._graphed_drafts[key] = GraphedDraft(self.drafter, *self.draft_weights, block_size,
                                                     self.target.context_length)
        graphed = self._graphed_drafts[key]
        graphed.reset()
        return graphed

    def prepare(self, settings: DecodeSettings, prompt_length: int) -> tuple[DecodeSettings, list[str]]:
        """Check settings against the models (``DecodeSettings`` checked the values themselves); return them
        adjusted, with notes saying how."""
        notes: list[str] = []
        if prompt_length == 0:
            raise EngineError("the prompt is empty: type a message for the model to answer", field="prompt")
        block_size = 1
        row = method(settings.method)
        if row.drafts:
            if self.drafter is None:
                raise EngineError(f"{settings.method} needs a DFlash drafter; pass one (or 'random')", field="method")
            native = self.drafter.block_size
            block_size = settings.block_size or native
            if not 2 <= block_size <= native:
                raise EngineError(f"block size {block_size} is not supported by this drafter: "
                                  f"choose 2..{native} (it was trained with blocks of {native})", field="block_size")
        if self.fixed_step and settings.temperature > 0:
            notes.append(READABLE_SAMPLING)
        limit = self.target.context_length
        needed = prompt_length + settings.max_new_tokens + block_size
        if needed > limit:
            raise EngineError(f"prompt of {prompt_length} tokens + {settings.max_new_tokens} new tokens exceeds the "
                              f"model's context of {limit} tokens: shorten the prompt or lower max new tokens",
                              field="max_new_tokens")
        return replace(settings, block_size=block_size), notes

    @torch.inference_mode()
    def run(self, prompt: str = "", settings: DecodeSettings = DecodeSettings(BASELINE.name), *,
            prompt_ids: list[int] | None = None,
            on_step: Callable[[Trace, Step], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> Trace:
        prompt_ids, settings, notes = self.checked(prompt, settings, prompt_ids)
        return self.run_prepared(prompt, prompt_ids, settings, notes, on_step=on_step, should_stop=should_stop)

    def start(self, prompt: str = "", settings: DecodeSettings = DecodeSettings(BASELINE.name), *,
              prompt_ids: list[int] | None = None,
              on_step: Callable[[Trace, Step], None] | None = None,
              should_stop: Callable[[], bool] | None = None) -> Run:
        """The run of these settings, checked and ready, not begun: ``run`` takes it through, ``race`` gives it
        turns among others."""
        prompt_ids, settings, notes = self.checked(prompt, settings, prompt_ids)
        return self.start_prepared(prompt, prompt_ids, settings, notes, on_step=on_step, should_stop=should_stop)

    def checked(self, prompt: str, settings: DecodeSettings, prompt_ids: list[int] | None
                ) -> tuple[list[int], DecodeSettings, list[str]]:
        """The prompt's ids (the chat template's, unless given) and the settings ``prepare`` makes of them."""
        if prompt_ids is None:
            if not prompt.strip():
                raise EngineError("the prompt is empty: type a message for the model to answer")
            prompt_ids = self.target.chat_ids(prompt)
        settings, notes = self.prepare(settings, len(prompt_ids))
        return prompt_ids, settings, notes

    @torch.inference_mode()
    def run_prepared(self, prompt: str, prompt_ids: list[int], settings: DecodeSettings, notes: list[str], *,
                     on_step: Callable[[Trace, Step], None] | None = None,
                     should_stop: Callable[[], bool] | None = None) -> Trace:
        """``run`` on settings ``prepare`` already checked against these models for this prompt (with its notes):
        nothing is checked again. The vLLM engine's workers run what its driver prepared, the API what it prepared
        when the request came."""
        return self.start_prepared(prompt, prompt_ids, settings, notes, on_step=on_step,
                                   should_stop=should_stop).execute()

    @torch.inference_mode()
    def start_prepared(self, prompt: str, prompt_ids: list[int], settings: DecodeSettings, notes: list[str], *,
                       on_step: Callable[[Trace, Step], None] | None = None,
                       should_stop: Callable[[], bool] | None = None) -> Run:
        """``start`` on settings ``prepare`` already checked (``run_prepared``)."""
        fixed = self.uses_fixed_step(settings)
        config = self.run_config(prompt, prompt_ids, settings, list(notes), step_kind(fixed, self.compile_step))
        if fixed:
            program = self.fixed_program(settings, len(prompt_ids))
            return FixedRun(self, settings, config, on_step, should_stop, program)
        return ReadableRun(self, settings, config, on_step, should_stop)

    def race(self, prompt: str, settings: list[DecodeSettings], *, prompt_ids: list[int] | None = None,
             on_step: Callable[[Trace, Step], None] | None = None, should_stop: Callable[[], bool] | None = None,
             turn_s: float = TURN_S) -> Race:
        """The runs of ``settings`` on one prompt in turns (``engine.loop.race``), so that a load falls on all
        alike; where they cannot take turns (``takes_turns``), whole, one after another."""
        return race([(self, setting) for setting in settings], prompt, prompt_ids=prompt_ids, on_step=on_step,
                    should_stop=should_stop, turn_s=turn_s)

    def takes_turns(self, settings: list[DecodeSettings]) -> bool:
        """Whether runs of these settings can take turns: not on the fixed step, whose programs share one KV cache
        (``fixed_kv``), each run writing it from the prompt on."""
        return not any(map(self.uses_fixed_step, settings))

    def run_config(self, prompt: str, prompt_ids: list[int], settings: DecodeSettings, notes: list[str],
                   step: str) -> RunConfig:
        """What a run's trace says it ran: the prepared settings, the models, the step kind."""
        drafts = method(settings.method).drafts
        return RunConfig(
            method=settings.method, engine=self.engine, model=self.target.name,
            drafter=self.drafter_info.name if drafts else None, drafter_trained=self.drafter_info.trained and drafts,
            device=str(self.target.device), dtype=str(self.target.dtype).removeprefix("torch."),
            block_size=settings.block_size, tree_budget=recorded_budget(settings),
            temperature=settings.temperature, seed=settings.seed, max_new_tokens=settings.max_new_tokens,
            prompt=prompt, prompt_ids=list(prompt_ids), notes=notes, timing_only=self.timing_only, step=step,
            drafter_tag=self.drafter_info.tag if drafts else None,
        )

    def kernel_profile(self, prompt_ids: list[int], settings: DecodeSettings):
        """Kernels per verify step by stage for one generation, and the slowest (``engine.gpu.profiling``;
        CUDA only)."""
        return profile_kernels(lambda: self.run(prompt_ids=prompt_ids, settings=settings))

    def uses_fixed_step(self, settings: DecodeSettings) -> bool:
        """Greedy decoding on a target that runs the fixed step (``TargetModel.runs_fixed_step``), with a
        drafter a CUDA graph can hold where graphs are on (not a scripted one) if it drafts."""
        if not self.fixed_step or settings.temperature != 0:
            return False
        return not method(settings.method).drafts or self.drafter.graphable or not self.cuda_graphs

    def fixed_program(self, settings: DecodeSettings, prompt_length: int) -> FixedProgram:
        """The fixed-shape program for these settings, made once (buffers, and graphs on CUDA), on the decoder's
        KV cache grown to this run's rows."""
        nodes = method(settings.method).nodes(settings.tree_budget, settings.block_size - 1)
        # the last step may pass max_new_tokens by a block, and its tree's rows sit after that; one scratch row
        needed = prompt_length + settings.max_new_tokens + settings.block_size + nodes + 2
        capacity = -(-needed // FIXED_CAPACITY_STEP) * FIXED_CAPACITY_STEP
        kv = self.fixed_kv(capacity)
        key = (settings.method, nodes, settings.block_size, settings.record_top_k)
        if key not in self._programs:
            self._programs[key] = FixedProgram(self, method(settings.method), nodes, settings.block_size,
                                               settings.record_top_k,
                                               graphs=self.cuda_graphs and self.target.device.type == "cuda",
                                               compile_step=self.compile_step)
        program = self._programs[key]
        program.use(kv, capacity)
        return program

    def fixed_kv(self, capacity: int) -> FixedKV:
        """The fixed step's one KV cache, with room for ``capacity`` rows: where it has fewer, the programs let go
        of it and of their graphs (``FixedProgram.release``) and a cache of ``capacity`` rows takes its place (each
        program takes it up at its next run, ``FixedProgram.use``)."""
        if capacity > self._fixed_capacity:
            for program in self._programs.values():
                program.release()
            self._fixed_kv = None  # the smaller cache goes before the larger one is allocated
            self._fixed_capacity = capacity
            self._fixed_kv = self.target.fixed_kv(capacity, compiled=self.compile_step)
        return self._fixed_kv

    def close(self) -> None:
        """Give back the device memory the step's graphs, programs and KV cache hold before another engine
        (vLLM's own, in the bench) starts; they are rebuilt if this decoder runs again."""
        self._graphed_drafts.clear()
        self._programs.clear()
        self._fixed_kv, self._fixed_capacity = None, 0


def race(entries: list[tuple[Decoder, DecodeSettings]], prompt: str, *, prompt_ids: list[int] | None = None,
         on_step: Callable[[Trace, Step], None] | None = None, should_stop: Callable[[], bool] | None = None,
         turn_s: float = TURN_S) -> Race:
    """Runs of one prompt, each a decoder and its settings (two drafters' decoders on one target among them), in
    turns (``engine.loop.race``); where any cannot take turns (``Decoder.takes_turns``), whole, one after another.
    A decoder keeps its runs' buffers apart by their settings (``DecodeSettings.apart``): no two of its runs share
    them, while two decoders' runs never do."""
    for decoder in {id(decoder): decoder for decoder, _ in entries}.values():
        check_apart([setting for owner, setting in entries if owner is decoder])
    if not all(decoder.takes_turns([setting]) for decoder, setting in entries):
        return one_after_another([decoder.run(prompt, setting, prompt_ids=prompt_ids, on_step=on_step,
                                              should_stop=should_stop) for decoder, setting in entries])
    return take_turns([decoder.start(prompt, setting, prompt_ids=prompt_ids, on_step=on_step, should_stop=should_stop)
                       for decoder, setting in entries], turn_s)


def recorded_budget(settings: DecodeSettings):
    """The budget a trace records: the node count of a method whose budget the user chooses, "auto" where it is
    chosen every step, else None."""
    if settings.auto_budget or method(settings.method).budgeted:
        return settings.tree_budget
    return None


def check_drafter_fits(drafter_config, target_config) -> None:
    """A drafter trained for another model (width, tapped layers) is refused before anything runs."""
    if drafter_config.hidden_size != target_config.hidden_size:
        raise EngineError(f"drafter hidden size {drafter_config.hidden_size} does not match the target's "
                          f"{target_config.hidden_size}: it was trained for another model")
    if max(drafter_config.target_layer_ids) >= target_config.num_hidden_layers:
        raise EngineError(f"drafter taps target layers {drafter_config.target_layer_ids} but the target has "
                          f"{target_config.num_hidden_layers} layers: it was trained for another model")


class ReadableRun(Run):
    """The readable step: each stage a plain call (draft, tree, verify, walk, commit), timed one by one;
    greedy or sampled, on any target."""

    def __init__(self, decoder: Decoder, settings: DecodeSettings, config: RunConfig, on_step, should_stop):
        super().__init__(decoder, settings, config, on_step, should_stop)
        self.draft_pass = decoder.draft_pass(settings.block_size, settings.apart) if self.drafts else None
        self.budgeting = decoder.budgeting

    def steps(self) -> Iterator[Step]:
        for index in itertools.count():
            yield self.step(index)

    def draft(self) -> torch.Tensor:
        """Log-probabilities ``[block-1, vocab]`` for the slots after the root, in one drafter pass."""
        return self.draft_pass(self.root, self.start, self.new_context, self.new_context_positions)

    def build(self, log_probs: torch.Tensor | None) -> ddtree.DraftTree:
        row = method(self.settings.method)
        if log_probs is None:
            return row.readable(None, 0)
        if self.settings.auto_budget:
            return self.budgeting.alone(row, log_probs)
        return row.readable(log_probs, row.nodes(self.settings.tree_budget, log_probs.shape[0]))

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
            self.budgeting.observe([tree], [accepted])
            if self.drafts:
                kept = torch.tensor(accepted, device=self.device)
                self.new_context = self.drafter.context_features(hidden).index_select(1, kept)
                self.new_context_positions = (self.start + torch.arange(len(accepted), device=self.device))[None]
            path_tokens = [int(t) for t in inputs.input_ids[0, accepted[1:]].tolist()]
            committed = self.clip(path_tokens + [bonus])
            margins = logit_margins(logits.index_select(0, torch.tensor(accepted, device=self.device)))
            self.output_ids.extend(committed)
            outcome = Outcome(tree, target_tokens, accepted, bonus, committed,
                               pieces=[self.text.push(token) for token in committed], margins=margins[: len(committed)])
            self.start += len(accepted)
            self.root = bonus
        full = self.settings.trace_detail == "full"
        return self.record(index, t_start, root,
                           draft_top(log_probs, self.settings.record_top_k) if full else ([], []), outcome)
