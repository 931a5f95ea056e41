"""AR, DFlash and DDTree steps as fixed-shape programs: the device holds the loop's state and the
host reads one small tensor per step.

A step is two programs over buffers that never change shape:

- ``draft`` (DFlash, DDTree): the drafter's pass over ``StaticDraftContext``, fed the previous
  step's accepted rows (padded to the block) and their count;
- ``advance``: the tree (``ddtree.fixed``: the best-first tree, the chain, or none for AR; on a GPU
  the tree is one Triton program, ``engine.gpu.beam_kernel``, for budgets up to 64), the ancestor
  mask, one verify pass of the target over a KV cache whose write cursor is a device tensor,
  the pointer-jumping walk, the KV compaction of the accepted path and the drafter's next
  context, all in place; it ends by packing what the step decided into one tensor
  (``StepLayout``), so the host reads once.

The KV cache is the target's (``engine.models.protocols.FixedKV``): ``StaticKV`` (a Hugging Face model,
``engine.models.target``) or the vLLM engine's ``PagedKV`` (``engine.on_vllm.vllm_worker``), one a decoder,
shared by all its programs (``engine.loop.decode.Decoder.fixed_kv``).
Nothing in the programs depends on a host value, so on CUDA each is captured once and replayed
as a CUDA graph (``graphs=True``); on the CPU they run as written. ``FixedRun`` is
``engine.loop.run``'s loop with this step (greedy only: a sampled walk needs per-node draws, which
stay in the readable loop), pipelined: the host finishes a step (one read of its record, the
detokenizing, the trace) while the device runs the next. Tests hold its output to the readable
loop's, token for token.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch

import ddtree
import ddtree.fixed
from ddtree.fixed import FixedTree
from engine.gpu.beam_kernel import fused_tree_program
from engine.gpu.graphs import GraphedCall
from engine.gpu.profiling import STAGE_MARK
from engine.loop.draft_pass import DraftBuffers, draft_log_probs
from engine.loop.run import Outcome, Run
from engine.methods import Method
from engine.models.protocols import FixedKV
from engine.trace import Step

SMALLEST_PREFILL = 16


def prefill_bucket(size: int) -> int:
    """The length a prompt's pass is padded to, so that it replays as one of a few CUDA graphs:
    the next power of two, at least 16 (at most twice the tokens, a handful of lengths to capture)."""
    return max(SMALLEST_PREFILL, 1 << (size - 1).bit_length())


def padded_prompt(ids: torch.Tensor, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's ids and positions ``[n]`` padded to ``length``: token 0 at the positions after it."""
    extra = length - ids.numel()
    return (torch.cat([ids, ids.new_zeros(extra)]),
            torch.cat([positions, positions[-1] + 1 + torch.arange(extra, device=positions.device)]))


@dataclass(frozen=True)
class StepLayout:
    """Where each part of a step's packed record sits. The record is float64 (token ids are
    exact in it); the parts a reduced trace needs come first, so it reads a prefix."""

    depth: int  # D: draft depths (0 for AR)
    nodes: int  # n: tree nodes below the root
    top_k: int  # draft top-k kept per depth

    @property
    def parts(self) -> tuple[tuple[str, int], ...]:
        d1, n, dk = self.depth + 1, self.nodes, self.depth * self.top_k
        return (("length", 1), ("committed", d1), ("path", d1), ("margins", d1), ("target_tokens", n + 1),
                ("tree_tokens", n), ("tree_parents", n), ("tree_depths", n), ("tree_ranks", n), ("tree_valid", n),
                ("top_tokens", dk), ("tree_log_probs", n), ("tree_path_log_probs", n), ("top_probs", dk))

    @property
    def size(self) -> int:
        return sum(size for _, size in self.parts)

    @property
    def reduced_size(self) -> int:
        return 1 + 3 * (self.depth + 1)

    @cached_property
    def columns(self) -> dict[str, slice]:
        """Where each part sits in a record's row."""
        out, at = {}, 0
        for name, size in self.parts:
            out[name] = slice(at, at + size)
            at += size
        return out

    def unpack(self, values: list[float]) -> dict[str, list[float]]:
        return {name: values[part] for name, part in self.columns.items()}


class FixedProgram:
    """The buffers and the two programs of one (method, budget, block size, top-k) for one decoder. The KV cache
    is the decoder's, shared with its other programs (``use``); the drafter's context buffers are the program's
    own, grown with it when a run needs more rows."""

    def __init__(self, decoder, method: Method, nodes: int, block_size: int, top_k: int, graphs: bool = False,
                 compile_step: bool = False):
        target = decoder.target
        device = target.device
        self.target, self.method, self.nodes, self.graphs = target, method, nodes, graphs
        self.drafter = decoder.drafter if method.drafts else None
        self.depth = block_size - 1
        top_k = min(top_k, target.config.vocab_size) if self.drafter is not None else 0
        self.layout = StepLayout(self.depth, nodes, top_k)
        self.kv: FixedKV | None = None  # the decoder's, from ``use``
        long = dict(dtype=torch.long, device=device)
        self.root = torch.zeros(1, **long)
        self.past = torch.zeros((), **long)
        self.slots = torch.arange(self.depth + 1, **long)
        if self.drafter is not None:
            self.embedding, self.lm_head = decoder.draft_weights
            self.buffers: DraftBuffers | None = None  # from ``use``, for this program's longest run so far
            self.prompt_rows = 0  # the context holds a padded prompt and a block after it
            self.log_probs = torch.zeros(self.depth, self.drafter.config.vocab_size, device=device)  # for advance
            self.prompts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # by bucket
        else:
            self.log_probs = torch.zeros(0, 1, device=device)  # AR drafts nothing: its tree is the root alone
        # the step's own stages have fixed shapes: inductor can fuse their hundreds of small kernels
        compiled = (lambda stage: torch.compile(stage, dynamic=False)) if compile_step else (lambda stage: stage)
        self._draft_pass, self._plan, self._decide = compiled(draft_log_probs), compiled(self._plan_step), \
            compiled(self._decide_step)
        self._tree = fused_tree_program(method.fixed, device, nodes) or compiled(method.fixed)
        self._graphs: dict[str, GraphedCall] = {}

    def use(self, kv: FixedKV, capacity: int) -> None:
        """Before a run of up to ``capacity`` rows: the decoder's KV cache (of at least as many), and the drafter's
        context grown to as many where it holds fewer. A CUDA graph replays the addresses it was captured over:
        where either is new, every graph is dropped and the next calls capture again."""
        if kv is not self.kv:
            self._graphs.clear()
            self.kv = kv
        if self.drafter is not None and self.prompt_rows < capacity:
            self._graphs.clear()
            self.buffers = None  # the shorter context goes before the longer one is allocated
            self.buffers = DraftBuffers.allocate(self.drafter, self.depth + 1, capacity, self.target.device,
                                                 self.drafter.dtype)
            self.prompt_rows = capacity

    def release(self) -> None:
        """Before the decoder's KV cache grows: let go of it and of every graph captured over it, so that its
        memory is free for the larger one (``use`` takes that one)."""
        self._graphs.clear()
        self.kv = None

    def prefill_cache(self):
        """Before a run's prefill: the target cache to write the prompt into; the drafter's emptied."""
        if self.drafter is not None:
            self.buffers.context.length.zero_()
        return self.kv.prefill_cache()

    def start(self, root: int, past: int) -> None:
        """After the prefill: the first committed token and its position."""
        self.root.fill_(root)
        self.past.fill_(past)

    # -- the draft

    def first_draft(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        """After the prefill the new context is the whole prompt, longer than a block. It is padded
        to the prompt's bucket (``prefill_bucket``; rows past the count are masked, as every draft's
        padding is), so that with graphs each bucket is captured once and then replayed."""
        count = features.shape[1]
        bucket = prefill_bucket(count)
        if bucket > self.prompt_rows:  # a prompt near the context's end: its own length, eagerly
            self._draft_from(draft_log_probs, features, positions, count)
            return
        if bucket not in self.prompts:
            # zeros, not empty: masked rows still pass through the attention, and 0 x NaN is NaN
            self.prompts[bucket] = (torch.zeros(1, bucket, features.shape[2], dtype=features.dtype,
                                                device=features.device),
                                    torch.zeros(1, bucket, dtype=torch.long, device=features.device),
                                    torch.zeros((), dtype=torch.long, device=features.device))
        padded, padded_positions, padded_count = self.prompts[bucket]
        padded[:, :count].copy_(features)
        padded_positions[:, :count].copy_(positions)
        padded_count.fill_(count)
        self._run(f"first draft {bucket}",
                  lambda: self._draft_from(draft_log_probs, padded, padded_positions, padded_count))

    def draft(self) -> None:
        buffers = self.buffers
        self._run("draft", lambda: self._draft_from(self._draft_pass, buffers.features, buffers.feature_positions,
                                                    buffers.count))

    def _draft_from(self, draft_pass, features, positions, count) -> torch.Tensor:
        self.buffers.block[0, :1].copy_(self.root)
        torch.add(self.slots, self.past, out=self.buffers.positions[0])
        return self.log_probs.copy_(self.buffers.log_probs(self.drafter, self.embedding, self.lm_head, features,
                                                           positions, count, draft_pass))

    # -- tree, verify, walk, commit

    def advance(self) -> torch.Tensor:
        """The step after its draft (in ``self.log_probs``); returns its packed record."""
        return self._run("advance", self._advance)

    def _advance(self) -> torch.Tensor:
        tree = self._tree(self.log_probs, self.nodes)  # outside the compiled plan: a fused tree build is a Triton
        # program of its own
        ids, positions, visible = self._plan(tree)
        logits, hidden = self.kv.verify(ids, positions, self.past, visible)
        path, length, bonus, record = self._decide(tree, ids, visible, logits)
        if self.drafter is not None or self.kv.forks_states:  # AR's path is its root, already in place in a KV cache
            self.kv.compact(self.past, path, length)
        if self.drafter is not None:
            features = self.drafter.context_features(hidden)[0]
            self.buffers.features[0].copy_(features.index_select(0, path))
            torch.add(self.slots, self.past, out=self.buffers.feature_positions[0])
            self.buffers.count.copy_(length)
        self.past.add_(length)
        self.root.copy_(bonus[None])
        return record

    def _plan_step(self, tree: FixedTree):
        """The verify pass's ids, positions and ancestor mask for the tree below the root."""
        ids = torch.cat([self.root, tree.tokens])
        positions = self.past + torch.cat([torch.zeros_like(self.root), tree.depths])
        return ids, positions, ddtree.fixed.ancestor_mask(tree.parents, self.depth)

    def _decide_step(self, tree: FixedTree, ids, visible, logits):
        """The walk along the target's choices, what it commits, and the step's packed record."""
        target_tokens = logits.argmax(dim=-1)
        path, length, bonus = ddtree.fixed.follow_tree(tree, target_tokens, visible, self.depth)
        along = ids.index_select(0, torch.cat([path[1:], path[-1:]]))
        committed = torch.where(self.slots < length - 1, along, bonus)
        top2 = logits.index_select(0, path).float().topk(2, dim=-1).values
        return path, length, bonus, self._pack(length, committed, path, top2[:, 0] - top2[:, 1], target_tokens, tree)

    def _pack(self, length, committed, path, margins, target_tokens, tree: FixedTree) -> torch.Tensor:
        """The step's record in ``StepLayout`` order, as float64, in a few kernels (integers together,
        reals together): one tensor for the host to read."""
        if self.layout.top_k:
            top_log_probs, top_tokens = self.log_probs.topk(self.layout.top_k, dim=-1)
        else:
            top_log_probs, top_tokens = (torch.empty(0, device=path.device),
                                         torch.empty(0, dtype=torch.long, device=path.device))
        head = torch.cat([length[None], committed, path])
        tail = torch.cat([target_tokens, tree.tokens, tree.parents, tree.depths, tree.ranks, tree.valid.long(),
                          top_tokens.reshape(-1)])
        reals = torch.cat([tree.log_probs, tree.path_log_probs, top_log_probs.exp().reshape(-1)])
        return torch.cat([head.double(), margins.double(), tail.double(), reals.double()])

    def _run(self, name: str, program):
        """``program()`` eagerly, or (``graphs``) replayed from the CUDA graph captured at its first call."""
        if not self.graphs:
            return program()
        if name not in self._graphs:
            self._graphs[name] = GraphedCall(program, capturing=self.kv.capturing, synchronize=True)
        return self._graphs[name]()


class StageMarks:
    """Where a launched step's stages end, without waiting for them: CUDA events on the stream
    (read once the step's record has arrived), or clock readings on the CPU, where work is
    synchronous. Under the profiler each stage is also synchronised and marked, so that
    ``engine.gpu.profiling`` can attribute its kernels."""

    def __init__(self, cuda: bool):
        self.cuda, self.names, self.points = cuda, [], []
        self._mark()

    def _mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())

    @contextlib.contextmanager
    def stage(self, name: str):
        profiled = torch.autograd._profiler_enabled()
        if profiled and self.cuda:
            torch.cuda.synchronize()
        with torch.autograd.profiler.record_function(STAGE_MARK + name) if profiled else contextlib.nullcontext():
            yield
            if profiled and self.cuda:
                torch.cuda.synchronize()
        self.names.append(name)
        self._mark()

    def seconds(self) -> dict[str, float]:
        spans = zip(self.points, self.points[1:])
        if self.cuda:
            return {name: begin.elapsed_time(end) / 1000 for name, (begin, end) in zip(self.names, spans)}
        return {name: end - begin for name, (begin, end) in zip(self.names, spans)}


@dataclass
class _Launched:
    """A step on its way: the device runs it while the host finishes the one before."""

    index: int
    t_start: float
    marks: StageMarks
    record: torch.Tensor  # host memory the step's record is copied into
    arrived: torch.cuda.Event | None  # set once the copy is done (CUDA)


class FixedRun(Run):
    """``engine.loop.run``'s loop with the fixed-shape step, pipelined: the host launches a step
    (the draft and the advance programs, then an asynchronous copy of the step's packed record
    into host memory) and, while the device runs it, finishes the step before: reads that
    record once, detokenizes, records the trace. It stays one step ahead unless the step in
    flight could reach the token limit; a step launched ahead of an end-of-sequence is run and
    dropped. Stage times: ``draft`` and ``verify`` (the tree, the verify pass, the walk and the
    compaction: one program) from the device's own clock, ``commit`` the host's finishing."""

    def __init__(self, decoder, settings, config, on_step, should_stop, program: FixedProgram):
        super().__init__(decoder, settings, config, on_step, should_stop)
        self.program = program
        self.cache = program.prefill_cache()
        self.cuda = self.device.type == "cuda"
        layout = program.layout
        size = layout.size if settings.trace_detail == "full" else layout.reduced_size
        self.slots = [torch.empty(size, dtype=torch.float64, pin_memory=self.cuda) for _ in range(2)]

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0  # no device sync: the device runs ahead of the host

    def prepare_steps(self) -> None:
        with self.clock.stage("start"):
            self.program.start(self.root, self.start)

    def steps(self) -> Iterator[Step]:
        launched = self.launch(0)
        while True:
            ahead = self.launch(launched.index + 1) if self.may_run_ahead() else None
            yield self.finish(launched)
            launched = ahead if ahead is not None else self.launch(launched.index + 1)

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # a step launched ahead of the end is this run's cost, not the next one's

    def may_run_ahead(self) -> bool:
        """Whether the step in flight cannot reach the token limit, so launching the next one is not waste."""
        return len(self.output_ids) + self.program.depth + 1 < self.settings.max_new_tokens

    def launch(self, index: int) -> _Launched:
        t_start = self.elapsed()
        marks = StageMarks(self.cuda)
        if self.drafts:
            with marks.stage("draft"):
                if index == 0:
                    self.program.first_draft(self.new_context, self.new_context_positions)
                else:
                    self.program.draft()
        with marks.stage("verify"):
            record = self.program.advance()
        host = self.slots[index % 2]  # the step before reads the other one meanwhile
        host.copy_(record[: host.numel()], non_blocking=self.cuda)
        arrived = None
        if self.cuda:
            arrived = torch.cuda.Event()
            arrived.record()
        return _Launched(index, t_start, marks, host, arrived)

    def finish(self, launched: _Launched) -> Step:
        if launched.arrived is not None:
            launched.arrived.synchronize()
        began = time.perf_counter()
        root = self.root
        layout, full = self.program.layout, self.settings.trace_detail == "full"
        step = layout.unpack(launched.record.tolist())
        length = int(step["length"][0])
        tokens = [int(t) for t in step["committed"][:length]]
        committed = self.clip(tokens)
        self.output_ids.extend(committed)
        tree = record_tree(step) if full else ddtree.DraftTree.empty()
        outcome = Outcome(tree, [int(t) for t in step["target_tokens"]], [int(i) for i in step["path"][:length]],
                           tokens[-1], committed, pieces=[self.text.push(token) for token in committed],
                           margins=step["margins"][: len(committed)])
        self.start += length
        self.root = tokens[-1]
        stage_s = launched.marks.seconds() | {"commit": time.perf_counter() - began}
        return self.record(launched.index, launched.t_start, root, record_top(step, layout.top_k) if full else ([], []),
                           outcome, stage_s)


TREE_PARTS = ("tree_tokens", "tree_parents", "tree_depths", "tree_ranks", "tree_log_probs", "tree_path_log_probs",
              "tree_valid")


def record_tree(step: dict[str, list[float]]) -> ddtree.DraftTree:
    """The record's real tree nodes as the readable ``DraftTree`` (what a trace records), its columns made as one
    tensor."""
    return record_trees(torch.tensor([[step[name] for name in TREE_PARTS]], dtype=torch.float64))[0]


def record_trees(columns: torch.Tensor) -> list[ddtree.DraftTree]:
    """``columns [count, 7, n]`` (each slot's ``TREE_PARTS``, float64) as each slot's readable tree: the real nodes
    of every slot cut by one mask and split by slot, a few tensors for the whole step."""
    valid = columns[:, 6].bool()  # [count, n]
    kept = columns.transpose(1, 2)[valid]  # [real nodes, 7], slot by slot
    counts = valid.sum(1).tolist()
    tokens, parents, depths, ranks = (kept[:, part].long().split(counts) for part in range(4))
    log_probs, path_log_probs = (kept[:, part].float().split(counts) for part in (4, 5))
    return [ddtree.DraftTree(*fields) for fields in zip(tokens, parents, depths, log_probs, path_log_probs, ranks)]


def record_top(step: dict[str, list[float]], k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The record's draft top tokens per depth and their probabilities, the first ``k`` of each depth's (the record
    keeps as many per depth as ``top_tokens`` holds over the depths of ``tree_depths``' record)."""
    kept = len(step["top_tokens"]) // max(len(step["committed"]) - 1, 1)
    if not kept or not k:
        return [], []
    tokens, probs = [int(t) for t in step["top_tokens"]], step["top_probs"]
    return ([tokens[i: i + min(k, kept)] for i in range(0, len(tokens), kept)],
            [probs[i: i + min(k, kept)] for i in range(0, len(probs), kept)])
