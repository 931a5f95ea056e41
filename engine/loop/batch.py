"""Many generations advanced together: one drafter pass drafts every request's block, one target pass
verifies every request's tree, and each request walks and commits its own.

Every method is a tree with a budget, so requests of any method share a step: AR verifies its root alone,
DFlash a chain, DDTree the best-first tree. A request with a fixed budget verifies that many nodes; one
with ``tree_budget`` "auto" gets the nodes the batch can afford (``ddtree.allocate``): its tree's nodes
in heap order, worth their calibrated path probabilities, against the step's cost model on this machine and what
a round costs here beyond its step (``Batch.round_cost``).

``Batch.advance`` is one round of continuous batching: it prefills the prompts of requests that joined
(a bounded number of prompt tokens a round, so a long prompt cannot stall the running requests), then
takes one step for every request that is decoding, and lets go of those that finished. ``Batch.step``
is the batched step as a stage per line, in the house style of ``ReadableRun.step``; its target pass is
``packed`` (the batch's tokens packed, attention per request: ``engine.models.batched.packed_pass``) or
``padded`` (plain batch rows, the readable reference the packed pass is tested against).

Each request is a ``Run`` (``engine.loop.run``): its own settings, generator, output, text stream and
trace, recorded step by step as a single run records them, plus what the batch did with it
(``engine.trace.StepBatch``).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch.nn.utils.rnn import pad_sequence

import ddtree
from ddtree.allocate import Allocation, Offer, StepCost, allocate, measured_scales, plan_drafts, shared_budget
from ddtree.batch import BatchLayout, pack_trees
from ddtree.fixed import FixedTree
from ddtree.tree import DraftRow, Drafts
from engine.errors import EngineError
from engine.gpu.copies import to_device
from engine.loop.budgeting import AUTO_NODES, Budgeting, expected_worth, first_nodes
from engine.loop.decode import READABLE_SAMPLING
from engine.loop.draft_pass import GraphedBatchDraft, count_bucket, draft_log_probs
from engine.loop.fixed_batch import AcceptedRows, FixedBatchProgram, RowState, SlotInputs, node_bucket, slot_kind
from engine.loop.fixed_step import StageMarks, record_top
from engine.loop.run import Outcome, Run, StageClock, draft_top, logit_margins
from engine.loop.settings import DecodeSettings
from engine.methods import METHODS, method
from engine.models.batched import BatchDraftContext, packed_pass, padded_pass
from engine.trace import Prefill, RunConfig, Step, StepBatch, Trace

PREFILL_TOKENS = 128  # prompt tokens a round prefills at most, so the running requests wait at most that long
DEPTH_MARGIN = 2  # depths an "auto" request drafts past the nodes it is expected to get
INITIAL_ROWS = 4
# ... where the drafter's pass replays from CUDA graphs, which go whenever its context's buffers move: room for
# a busy server's requests (and the padding's scratch row) from the start
GRAPHED_CONTEXT_ROWS = 40
KEPT_SHAPES = 256
KEPT_GAPS = 32  # the last gaps between consecutive steps, whose median is what a round costs beyond its step
# the budgets a fixed step's "auto" requests share, its programs' node buckets up to an "auto" tree's candidates
SHARED_BUDGETS = (0, *(1 << power for power in range(AUTO_NODES.bit_length())))  # 0, 1, 2, 4, ... AUTO_NODES
REFIT_STEPS = 16  # steps between two measurings of how the steps' time compares with the cost model's
INITIAL_COLUMNS = 512


@dataclass
class RoundTimes:
    """Where a round's seconds went: ``Batch.advance`` times its prompts' chunks and the rest of its round, a host
    across a process boundary its report, and its driver the way there and back and what it then streams
    (``engine.loop.remote_batch``). What the server logs, so that a served round's time beyond its step has names."""

    prefill_s: float = 0.0  # the joining prompts' chunks
    step_s: float = 0.0  # the rest of the round: the step (here also its records and streams) and the leaving
    report_s: float = 0.0  # the round's news as plain data, on the host
    hop_s: float = 0.0  # to the host and back, beyond what it did there
    streams_s: float = 0.0  # the news taken and streamed on the driver's side
    stage_s: dict[str, float] = field(default_factory=dict)  # the step's stages (``Batch.step``), where it took one

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.step_s + self.report_s + self.hop_s + self.streams_s


class BatchRequest(Run):
    """One generation in a batch: ``Run``'s state and record without a loop of its own. The batch prefills
    it chunk by chunk, then takes its steps with the others'."""

    def __init__(self, decoder, settings: DecodeSettings, config: RunConfig, on_step, should_stop, name: str):
        super().__init__(decoder, settings, config, on_step, should_stop)
        self.name = name
        self.row = -1
        self.prefilled = 0  # prompt tokens in the cache so far
        self.start = 0  # the root's position, once the prompt is in
        self.finished: str | None = None  # the stop reason, once it has one
        self.pending_context: list[torch.Tensor] = []  # committed rows' features the drafter has not read yet
        self.pending_positions: list[range] = []  # ... and their positions
        self.expected: torch.Tensor | None = None  # what its next draft is expected to be worth, node by node
        self.reach: torch.Tensor | None = None  # [n]: at k, the depth its last candidate tree's first k + 1 nodes reach
        self.row_method = method(settings.method)
        self.t0 = self.clock.now()

    @property
    def prompt_ids(self) -> list[int]:
        return self.config.prompt_ids

    def context_rows(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The features ``[c, width]`` (``width``: taps * hidden) and positions ``[c]`` of every committed row the
        drafter has not read (none just after the prompt, which it read at once)."""
        if not self.pending_context:
            return torch.zeros(0, width, device=self.device), torch.zeros(0, dtype=torch.long)
        return torch.cat(self.pending_context), torch.tensor([p for span in self.pending_positions for p in span])

    def depth_for(self, nodes: int) -> int:
        """How deep a tree of its next ``nodes`` nodes is expected to reach: as deep as its last candidate tree's first
        ``nodes`` did (a chain's n nodes reach depth n, a best-first tree's fewer), at most ``nodes``."""
        if nodes == 0 or self.reach is None or nodes > self.reach.numel():
            return nodes
        return int(self.reach[nodes - 1])

    def read_context(self) -> None:
        self.pending_context, self.pending_positions = [], []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0  # no device sync: a fixed step may be running ahead of its record

    def finish(self) -> Trace | None:
        """Its trace, summarized (None: it left before its first token)."""
        return None if self.trace is None else self.conclude(self.finished)


@dataclass(frozen=True)
class StepShape:
    """A step's size and its time: what ``StepCost`` is fitted to (``engine.measure.step_cost``)."""

    requests: int
    nodes: int
    drafts: int
    draft_rows: int  # slots the drafter pass drafted: each drafted request's block, as deep as the pass went
    seconds: float
    draft_seconds: float = 0.0  # of which planning and drafting


@dataclass
class Planned:
    """One request's part of a step before the verify: its tree and why it is that size."""

    request: BatchRequest
    root: int  # the token its tree hangs below
    tree: ddtree.DraftTree
    log_probs: DraftRow | None  # [D, V] its draft, or None (not drafted)
    reason: str


@dataclass
class LaunchedStep:
    """A fixed step on its way (``Batch.launch_fixed``): the device runs it while the host finishes the one before."""

    active: list[BatchRequest]  # its slots' requests, in slot order
    program: FixedBatchProgram
    marks: StageMarks
    record: torch.Tensor  # [requests, size]: in host memory once ``arrived`` (on the CPU, at once)
    arrived: torch.cuda.Event | None
    t_start: float


class Batch:
    """The requests advancing together on one decoder (its target and drafter), and their caches."""

    @torch.inference_mode()
    def __init__(self, decoder, budgeting: Budgeting, verify: str = "packed", cache: str = "rows"):
        if not decoder.target.runs_batched:
            raise EngineError(f"{decoder.target.name} cannot verify a batch of trees in one pass on this engine (a "
                              "hybrid's linear attention layers fork their state per node): serve it one request at "
                              "a time")
        if verify not in ("packed", "padded"):
            raise EngineError(f"verify must be packed or padded, got {verify!r}")
        if cache not in ("rows", "paged"):  # a target whose cache is paged (vLLM's) pages it either way
            raise EngineError(f"cache must be rows or paged, got {cache!r}")
        self.decoder, self.budgeting, self.verify_kind = decoder, budgeting, verify
        if not budgeting.prior and decoder.drafter is not None:
            config = decoder.drafter.config
            budgeting.prior = {row.name: worth for row in METHODS.values() if row.drafts
                               if (worth := expected_worth(config.acceptance, row, config.block_size - 1)) is not None}
        target = decoder.target
        self.target, self.drafter = target, decoder.drafter
        self.clock = StageClock(target.device)
        self.kv = target.batch_kv(INITIAL_ROWS, INITIAL_COLUMNS, paged=cache == "paged")
        self.context = (BatchDraftContext(self.drafter.config, INITIAL_ROWS, INITIAL_COLUMNS, target.device,
                                          self.drafter.dtype) if self.drafter is not None else None)
        # on a GPU the drafter's pass replays from CUDA graphs at fixed shapes (the eager pass is its reference)
        self.graphed_draft = (GraphedBatchDraft(self.drafter, *decoder.draft_weights, self.context)
                              if self.drafter is not None and self.drafter.graphable and decoder.cuda_graphs
                              and target.device.type == "cuda" else None)
        if self.graphed_draft is not None:
            self.context.reserve(GRAPHED_CONTEXT_ROWS, 0)
        # greedy requests step as fixed-shape programs (``engine.loop.fixed_batch``) where the decoder runs the fixed
        # step and the target verifies slots
        self.fixed = decoder.fixed_step and target.verifies_slots
        # ... each program's advance replayed from CUDA graphs where a GPU records them (``FixedBatchProgram.graphs``)
        self.fixed_graphs = decoder.cuda_graphs and target.device.type == "cuda"
        self.programs: dict[tuple, FixedBatchProgram] = {}  # by (nodes, candidates, block, top-k, learns)
        self.accepted: AcceptedRows | None = None  # what the fixed steps' requests accepted last, for their drafts
        self.row_state = RowState(target.device)  # ... and their roots and pasts, for the next step
        self.on_device: set[BatchRequest] = set()  # the requests whose root and past ``row_state`` holds
        self.in_flight: LaunchedStep | None = None  # the fixed step launched and not yet finished
        self.waiting: list[BatchRequest] = []  # joined, prompt not yet all in the cache
        self.requests: list[BatchRequest] = []  # in rows 0..n-1, in row order
        self.steps_taken = 0
        self.shapes: deque[StepShape] = deque(maxlen=KEPT_SHAPES)  # the last steps' sizes and times
        self.gaps: deque[float] = deque(maxlen=KEPT_GAPS)  # seconds from a step's end to the next one's start
        self.last_step_end: float | None = None  # while requests are decoding
        self.scales = (1.0, 1.0)  # the measured steps against the cost model's parts (``ddtree.measured_scales``)
        self.cost = self.round_cost  # what the step under way sizes its trees by
        self.last_round = RoundTimes()
        self._names = 0

    # -- joining and leaving

    def admit(self, prompt_ids: list[int], settings: DecodeSettings, prompt: str = "", *,
              on_step: Callable[[Trace, Step], None] | None = None,
              should_stop: Callable[[], bool] | None = None, name: str | None = None) -> BatchRequest:
        """A request joins: checked against the models now (an ``EngineError`` refuses it alone), prefilled
        over the next rounds, then stepped with the others."""
        settings, notes = self.decoder.prepare(settings, len(prompt_ids))
        return self.admit_prepared(prompt, prompt_ids, settings, notes, on_step=on_step, should_stop=should_stop,
                                   name=name)

    @torch.inference_mode()
    def admit_prepared(self, prompt: str, prompt_ids: list[int], settings: DecodeSettings, notes: list[str], *,
                       on_step: Callable[[Trace, Step], None] | None = None,
                       should_stop: Callable[[], bool] | None = None, name: str | None = None) -> BatchRequest:
        """``admit`` for settings ``Decoder.prepare`` already checked for this prompt (with its notes)."""
        notes = [note for note in notes if note != READABLE_SAMPLING]  # every batched step samples as it must
        # the step it asks for: the fixed one takes it while its neighbours are greedy too
        step = "fixed" if self.fixed and steps_greedily(settings) else self.verify_kind
        config = self.decoder.run_config(prompt, prompt_ids, settings, notes, step="batched " + step)
        self._names += 1
        request = BatchRequest(self.decoder, settings, config, on_step, should_stop,
                               name or f"request-{self._names}")
        request.row = len(self.requests) + len(self.waiting)
        self.kv.reserve(request.row + 1, 0)
        if self.context is not None:
            self.context.reserve(request.row + 1, 0)
            self.context.lengths[request.row] = 0  # the row's last request's context is no longer read
        if self.accepted is not None:
            self.accepted.take(request.row)  # ... nor what its last fixed step accepted
        self.waiting.append(request)
        return request

    def release(self, request: BatchRequest) -> None:
        """A finished (or abandoned) request leaves: the request in the last row moves into its row, so the
        batch stays the rows' prefix."""
        everyone = self.requests + self.waiting
        last = max(everyone, key=lambda r: r.row)
        lag = last.settings.block_size if self.in_flight is not None else 0  # the host's past lags the step in flight
        columns = max(last.start + lag, last.prefilled)  # the rows the last request's caches may hold
        self.kv.release(request.row, last.row, columns)
        self.on_device.discard(request)
        if last is not request:
            if self.context is not None:
                self.context.move_row(last.row, request.row, columns)
            if self.accepted is not None:
                self.accepted.move_row(last.row, request.row)
            self.row_state.move_row(last.row, request.row)
            last.row = request.row
        for rows in (self.requests, self.waiting):
            if request in rows:
                rows.remove(request)
            rows.sort(key=lambda r: r.row)

    @property
    def idle(self) -> bool:
        return not self.requests and not self.waiting

    # -- a round

    @torch.inference_mode()
    def advance(self) -> list[BatchRequest]:
        """One round: prefill what fits of the joining prompts, one step for the decoding requests; returns the
        requests that finished in it (each with its summarized trace), already released."""
        begun = time.perf_counter()
        finished: list[BatchRequest] = []
        for request in list(self.waiting):
            if request.should_stop is not None and request.should_stop():  # its client left before its first token
                request.finished = "cancelled"
                finished.append(request)
                self.release(request)
        budget = PREFILL_TOKENS
        for request in sorted(self.waiting, key=lambda r: len(r.prompt_ids) - r.prefilled):  # the shortest first:
            if budget <= 0:  # the most requests start soonest
                break
            budget -= self.prefill(request, budget)
            if request.trace is not None:
                self.waiting.remove(request)
                self.requests.append(request)
                self.requests.sort(key=lambda r: r.row)
        self.settle(finished)
        prefilled = time.perf_counter()
        stage_s = self.step() if self.requests else {}
        self.settle(finished)
        if not self.requests:
            self.in_flight = None  # a step launched for requests that have all finished since: nobody reads it
            self.last_step_end = None  # the time until the next request arrives is no round's
        self.last_round = RoundTimes(prefill_s=prefilled - begun, step_s=time.perf_counter() - prefilled,
                                     stage_s=stage_s)
        return finished

    def settle(self, finished: list[BatchRequest]) -> None:
        """Every decoding request with a stop reason leaves, its trace summarized; added to ``finished``."""
        for request in list(self.requests):
            request.finished = request.finished or request.stop_reason()
            if request.finished is not None:
                request.finish()
                finished.append(request)
                self.release(request)

    def run(self, jobs: list[tuple[list[int], DecodeSettings]]) -> list[Trace]:
        """Every job to its end, all joined at once: their traces, in order (tests and the bench)."""
        requests = [self.admit(ids, settings) for ids, settings in jobs]
        while not self.idle:
            self.advance()
        return [request.trace for request in requests]

    # -- the prompt

    def prefill(self, request: BatchRequest, budget: int) -> int:
        """The next chunk of ``request``'s prompt (at most ``budget`` tokens) into its cache row; the first token
        once the last chunk is in. Returns the tokens prefilled."""
        ids = request.prompt_ids
        begin, end = request.prefilled, min(len(ids), request.prefilled + budget)
        device = self.target.device
        if begin == 0:
            request.t0 = request.clock.now()
        with request.clock.stage("target"):
            chunk = to_device([ids[begin:end]], device)
            positions = torch.arange(begin, end, device=device)[None]
            visible = torch.arange(end, device=device)[None, :] <= positions[0, :, None]  # causal over the past
            bias = ddtree.batch.layout_bias(visible[None], self.target.dtype)
            cache = self.kv.prompt(request.row, begin, end - begin)
            logits, hidden = self.target.forward(chunk, positions, cache, bias, hidden_states=request.drafts,
                                                 last_logits=True)
        request.prefilled = end
        if request.drafts:
            with request.clock.stage("context"):  # the steps' drafter passes then bring at most a block of rows each
                self.read_rows(request, self.drafter.context_features(hidden)[0], positions[0])
        if end == len(ids):
            self.first_token(request, logits)
        return end - begin

    def read_rows(self, request: BatchRequest, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Context rows (``features [n, width]`` at ``positions [n]``) into ``request``'s row of the drafter's cache
        now, by passes whose drafts are dropped: where the drafter's pass is recorded, a block of rows a replay (on a
        GPU an eager pass of a prompt's rows costs many replays' time); else one eager pass over a block of one
        slot."""
        embedding, _ = self.decoder.draft_weights
        device, mask = features.device, self.drafter.mask_token_id
        if self.graphed_draft is None:
            rows = self.context.rows_view([request.row], features.shape[0])
            self.drafter(self.drafter.embed(torch.tensor([[mask]], device=device), embedding),
                         features[None].to(embedding.dtype), block_positions=positions[-1:][None] + 1,
                         context_positions=positions[None], cache=rows,
                         context_count=torch.tensor([features.shape[0]], device=device))
            return
        block_size = request.settings.block_size
        block = torch.full((1, block_size), mask, device=device)
        # a scratch row past the request's; its rows lie before its prompt's end or its root, whichever is later
        self.context.reserve(request.row + 2, max(request.prefilled, request.start) + block_size)
        for begin in range(0, features.shape[0], block_size):
            piece, at = features[begin:begin + block_size], positions[begin:begin + block_size].to(device)
            self.graphed_draft(block, at[-1] + 1 + torch.arange(block_size, device=device)[None], piece[None],
                               at[None], to_device([piece.shape[0]], device), [request.row])

    def first_token(self, request: BatchRequest, logits: torch.Tensor) -> None:
        first = int(ddtree.sample_tokens(logits[-1:], request.settings.temperature, request.generator)[0])
        request.start, request.root = len(request.prompt_ids), first
        request.output_ids.append(first)
        prefill = Prefill(t_end=request.elapsed(), first_token=first, first_text=request.text.push(first),
                          first_margin=logit_margins(logits[-1:])[0], stage_s=request.clock.take())
        request.trace = Trace(config=request.config, prefill=prefill)

    # -- the step

    def step(self) -> dict[str, float]:
        """One batched step for every decoding request: plan who drafts, draft, size and build the trees,
        pack them, verify them in one pass, walk and commit each, record each request's step; its stages' seconds.
        Where every request can, the same step as fixed-shape programs (``fixed_step``)."""
        active = list(self.requests)
        fixed = self.fixed and all(steps_greedily(r.settings) for r in active) and len(
            {r.settings.block_size for r in active if r.drafts}) <= 1
        t_start = time.perf_counter() if fixed else self.clock.now()  # a fixed step never waits for the device here
        if self.last_step_end is not None:
            self.gaps.append(t_start - self.last_step_end)
        self.cost = self.round_cost
        if fixed:
            return self.fixed_step(active, t_start)
        if self.in_flight is not None:  # this round finishes the fixed step in flight, the next steps readably
            return self.drain()
        self.hand_back(active)
        self.on_device.clear()  # the readable step moves the host's roots and pasts, not the device's
        with self.clock.stage("draft"):
            drafts = self.draft(active, self.plan(active))
        with self.clock.stage("tree_build"):
            planned, allocation = self.build(active, drafts)
        with self.clock.stage("tree_compile"):
            layout = pack_trees([p.tree for p in planned], [r.root for r in active], [r.start for r in active],
                                [r.row for r in active])  # on the host: the target moves what its pass reads
        with self.clock.stage("verify"):
            logits, hidden = self.verify(layout, any(r.drafts for r in active))
        with self.clock.stage("commit"):
            outcomes = self.commit(planned, layout.query_start_loc.tolist(), logits, hidden)
        stage_s = self.clock.take()
        for p, outcome in zip(planned, outcomes):
            request = p.request
            full = request.settings.trace_detail == "full"
            top = draft_top(p.log_probs, request.settings.record_top_k) if full else ([], [])
            self.record_step(request, p.root, top, outcome, layout.tokens - len(active), active, t_start, stage_s,
                             p.reason, 0 if p.log_probs is None else p.log_probs.shape[0])
        # the step's time as a request waits it, its record and stream included: what the cost model is fitted to
        self.last_step_end = self.clock.now()
        self.measured(StepShape(len(active), layout.tokens - len(active), len(drafts), drafted_rows(drafts),
                                self.last_step_end - t_start, stage_s["draft"]))
        return stage_s

    def fixed_step(self, active: list[BatchRequest], t_start: float) -> dict[str, float]:
        """The step as fixed-shape programs (``engine.loop.fixed_batch``), pipelined: this round launches a step for
        every decoding request, then finishes the one the round before launched (reads its record, commits, records,
        learns) while the device runs the new one; its stages' seconds. The first round finishes none."""
        launched = self.launch_fixed(active, t_start)
        previous, self.in_flight = self.in_flight, launched
        return self.finish_fixed(previous) if previous is not None else {}

    def launch_fixed(self, active: list[BatchRequest], t_start: float) -> LaunchedStep:
        """A fixed step launched on the device: the host tells it each request's budget, method and row in one copy
        (its root and past are where the step before left them, ``RowState``), and its record is copied back without
        waiting. Every "auto" request's budget is the step's shared one (``shared_auto_budget``); it drafts
        ``AUTO_NODES`` candidates, and learns from them what its next draft is worth. Where no draft is expected to
        pay, the step drafts nothing and verifies roots, as AR's does, its drafting requests' accepted rows still read
        into the drafter's context."""
        drafting = [r for r in active if r.row_method.drafts]
        learns = any(r.settings.auto_budget for r in drafting)
        depth = max(r.settings.block_size for r in active) - 1
        shared = self.shared_auto_budget(active, depth) if learns else 0
        drafts = bool(shared) or any(not r.settings.auto_budget for r in drafting)
        if learns and not drafts:  # each "auto" request drifts back to its method's typical draft, as one the
            # readable step does not draft for does (``Budgeting.relax``)
            for request in drafting:
                request.expected = self.budgeting.relax(request.row_method, request.expected)
        budgets = [0 if not r.row_method.drafts else shared if r.settings.auto_budget else fixed_nodes(r)
                   for r in active]
        nodes = node_bucket(max(budgets)) if drafts else 0
        candidates = (AUTO_NODES if learns else nodes) if drafts else 0
        full = [r for r in drafting if r.settings.trace_detail == "full"]
        program = self.fixed_program(nodes, candidates, depth + 1,
                                     max((r.settings.record_top_k for r in full), default=0), learns,
                                     keeps_context=bool(drafting))
        for request in active:
            if request not in self.on_device:  # it joined, or stepped readably: the host's root and past are its
                self.row_state.set(request.row, request.root, request.start)
                self.on_device.add(request)
        cuda = self.target.device.type == "cuda"
        marks = StageMarks(cuda)  # the device's own clock: no waits between stages
        with marks.stage("draft"):  # the rows a readable step left go to the device, a block a request
            if program.keeps:
                self.hand_over(active, program)
            count, spare = count_bucket(len(active)), len(self.requests) + len(self.waiting)  # rows past everyone's
            inputs = SlotInputs.of([(budget, slot_kind(r.settings), r.row) for r, budget in zip(active, budgets)],
                                   count, spare, self.row_state)
            # the host's pasts lag the step in flight by at most a block
            program.room([r.row for r in active], [r.start + program.depth + 1 for r in active],
                         range(spare, spare + count - len(active)))
            log_probs = program.draft(inputs) if program.keeps else None
        with marks.stage("verify"):  # the trees, the pass, the walks, the compaction: one program
            record = program.advance(inputs, log_probs)[:len(active)]
        arrived = None
        if cuda:  # into host memory while the host finishes the step before
            host = torch.empty(record.shape, dtype=record.dtype, pin_memory=True)
            host.copy_(record, non_blocking=True)
            record, arrived = host, torch.cuda.Event()
            arrived.record()
        return LaunchedStep(active, program, marks, record, arrived, t_start)

    def expectation(self, request: BatchRequest) -> torch.Tensor | None:
        """What a request's next draft is expected to be worth: its own drafts' say, else its method's typical draft
        (``Budgeting.expectation``); None before either."""
        return request.expected if request.expected is not None else self.budgeting.expectation(request.row_method)

    def shared_auto_budget(self, active: list[BatchRequest], depth: int) -> int:
        """The nodes a fixed step gives each drafting "auto" request before it drafts (0: none drafts). The program
        verifies as many nodes in every slot, so each is given them all, and the count is the one whose step the
        requests' expected drafts make the most tokens a second (``ddtree.allocate.shared_budget``; a request not yet
        priced, with no expectation, its first node sure): a power of two (``node_bucket``), at least the bucket of
        any fixed budget's request, whose draft the step makes whatever it costs."""
        auto = [r for r in active if r.row_method.drafts and r.settings.auto_budget]
        fixed = [fixed_nodes(r) for r in active if r.row_method.drafts and not r.settings.auto_budget]
        worth = torch.zeros(len(auto), AUTO_NODES, dtype=torch.float64)  # [auto, AUTO_NODES]
        unpriced = False
        for index, request in enumerate(auto):
            expected = self.expectation(request)
            if expected is None:
                unpriced, worth[index, 0] = True, 1.0
            else:
                worth[index] = expected
        floor = max(node_bucket(max(fixed, default=0)), int(unpriced))
        drafting = len(auto) + len(fixed)
        return shared_budget(worth, self.cost, len(active), [n for n in SHARED_BUDGETS if n >= floor], drafting,
                             drafting * depth).nodes[0]

    def finish_fixed(self, launched: LaunchedStep) -> dict[str, float]:
        """A launched fixed step read once and committed for the requests still decoding (one that finished in the
        step before it was stepped too, and its part is dropped); its stages' seconds."""
        if launched.arrived is not None:
            launched.arrived.synchronize()
        began = time.perf_counter()  # the commit: the host's alone
        program = launched.program
        still = [index for index, request in enumerate(launched.active) if request.finished is None]
        kept = [launched.active[index] for index in still]
        roots = [request.root for request in kept]
        records = program.unpack(launched.record[still])
        outcomes = [self.fixed_outcome(request, step, tree)
                    for request, step, tree in zip(kept, records.steps, records.trees)]
        verified = [outcome for outcome, _ in outcomes]
        self.budgeting.observe([outcome.tree for outcome in verified], [outcome.accepted for outcome in verified])
        if records.candidates is not None:
            self.learn_fixed(kept, records.candidates, program.depth)
        stage_s = launched.marks.seconds() | {"commit": time.perf_counter() - began}
        nodes_verified = sum(outcome.tree.size for outcome in verified)
        for request, root, (outcome, top) in zip(kept, roots, outcomes):
            self.record_step(request, root, top, outcome, nodes_verified, launched.active, launched.t_start, stage_s,
                             fixed_reason(request, program.nodes, program.drafts),
                             program.layout.depth if request.row_method.drafts else 0)
        self.last_step_end = time.perf_counter()  # the step launched meanwhile runs on
        drafting = sum(1 for request in launched.active if request.row_method.drafts) if program.drafts else 0
        # its pass's nodes, as ``shared_budget`` prices them: every slot verifies the program's
        self.measured(StepShape(len(launched.active), len(launched.active) * program.nodes, drafting,
                                drafting * program.layout.depth, self.last_step_end - launched.t_start,
                                stage_s["draft"]))
        return stage_s

    def drain(self) -> dict[str, float]:
        """The fixed step in flight, finished (before a readable step, or once every request has left)."""
        launched, self.in_flight = self.in_flight, None
        return self.finish_fixed(launched) if launched is not None else {}

    def learn_fixed(self, active: list[BatchRequest], candidates: FixedTree, depth: int) -> None:
        """Each drafting "auto" request's expectation and reach, from the candidates its fixed step drafted
        (``candidates [len(active), n]``; each method's requests priced together, ``Budgeting.learn_fixed``)."""
        by_method: dict = {}
        for index, request in enumerate(active):
            if request.drafts and request.settings.auto_budget:
                by_method.setdefault(request.row_method, []).append(index)
        for row, chosen in by_method.items():
            rows = torch.tensor(chosen)
            own = FixedTree.each(lambda field, rows=rows: field[rows], candidates)
            learned = self.budgeting.learn_fixed(row, [active[index].expected for index in chosen], own, depth)
            for index, (expected, reach) in zip(chosen, learned):
                active[index].expected, active[index].reach = expected, reach

    def fixed_program(self, nodes: int, candidates: int, block_size: int, top_k: int, learns: bool,
                      keeps_context: bool) -> FixedBatchProgram:
        key = (nodes, candidates, block_size, top_k, learns, keeps_context)
        if key not in self.programs:
            if keeps_context and self.accepted is None:
                config = self.drafter.config
                self.accepted = AcceptedRows(block_size, len(config.target_layer_ids) * config.hidden_size,
                                             self.drafter.dtype, self.target.device)
            self.programs[key] = FixedBatchProgram(self.decoder, self.kv, self.context, self.accepted, self.row_state,
                                                   nodes, candidates, block_size, top_k, learns, self.graphed_draft,
                                                   self.fixed_graphs, keeps_context)
        return self.programs[key]

    def hand_over(self, active: list[BatchRequest], program: FixedBatchProgram) -> None:
        """The context rows a drafting request's drafter has not read, into the fixed steps' keeping: the last block
        of them (the ones before it read now, ``behind``)."""
        config = self.drafter.config
        width = len(config.target_layer_ids) * config.hidden_size
        for request in active:
            if request.drafts and request.pending_context:
                rows, at = self.behind(request, *request.context_rows(width), program.depth + 1)
                program.accepted.load(request.row, rows, at)
                request.read_context()

    def hand_back(self, active: list[BatchRequest]) -> None:
        """What the fixed steps kept of each request's accepted rows, back to the request: the readable step drafts
        from its own list."""
        if self.accepted is None:
            return
        for request in active:
            kept = self.accepted.take(request.row)
            if kept is not None:
                features, positions = kept
                first = int(positions[0])
                request.pending_context.append(features)
                request.pending_positions.append(range(first, first + features.shape[0]))

    def fixed_outcome(self, request: BatchRequest, step: dict[str, list[float]], tree: ddtree.DraftTree
                      ) -> tuple[Outcome, tuple[list[list[int]], list[list[float]]]]:
        """A request's part of a fixed step's record (its parts and its verified tree), committed: its outcome and
        its draft's top tokens."""
        length = int(step["length"][0])
        tokens = [int(t) for t in step["committed"][:length]]
        committed = request.clip(tokens)
        request.output_ids.extend(committed)
        outcome = Outcome(tree, [int(t) for t in step["target_tokens"][:tree.size + 1]],
                          [int(i) for i in step["path"][:length]], tokens[-1], committed,
                          pieces=[request.text.push(token) for token in committed],
                          margins=step["margins"][:len(committed)])
        request.start += length
        request.root = tokens[-1]
        full = request.settings.trace_detail == "full" and request.drafts
        return outcome, record_top(step, request.settings.record_top_k) if full else ([], [])

    def measured(self, shape: StepShape) -> None:
        """A step taken: its size and time kept, and every ``REFIT_STEPS`` steps the cost's parts scaled to the steps
        kept (where the budgeting follows them)."""
        self.shapes.append(shape)
        self.steps_taken += 1
        if self.budgeting.follow_steps and self.steps_taken % REFIT_STEPS == 0:
            self.scales = measured_scales(self.budgeting.cost, [(kept.requests, kept.nodes, kept.drafts,
                                                                 kept.draft_rows, kept.seconds)
                                                                for kept in self.shapes])

    @property
    def round_cost(self) -> StepCost:
        """The step cost trees are sized by: the machine's (``Budgeting.cost``, fitted to steps of fixed budgets),
        its roots' and its trees' parts each scaled to what this batch's own steps took (``scales``: a served step
        also sizes, prices and records its trees), plus what a round costs here beyond its step (the median gap
        between steps: a server's hop to the model's process, its streams, a prompt's chunk), which every client
        waits for once a round and a larger tree spreads over more tokens."""
        if not self.budgeting.follow_steps:
            return self.budgeting.cost
        cost = self.budgeting.cost.scaled(*self.scales)
        return replace(cost, fixed_s=cost.fixed_s + statistics.median(self.gaps)) if self.gaps else cost

    def plan(self, active: list[BatchRequest]) -> list[int]:
        """How deep each request drafts this step (0: not at all). A fixed budget drafts as deep as its tree can
        reach; an "auto" one by what its draft is expected to be worth (``expected_nodes``): as deep as the nodes the
        batch is expected to give it reach (``BatchRequest.depth_for``), and a little deeper, since the drafter's
        lm_head costs per depth; AR never."""
        offers, drafting, nodes = self.expected_nodes(active)
        depths = []
        for request, offer, draft, count in zip(active, offers, drafting, nodes):
            full = request.settings.block_size - 1
            if not draft:
                own = 0
            elif not offer.fixed:
                own = request.depth_for(count) + DEPTH_MARGIN
            else:  # as deep as its tree can reach: a chain its block, a tree of n nodes n depths
                own = full if request.settings.auto_budget else fixed_nodes(request)
            depths.append(min(full, own))
        return depths

    def expected_nodes(self, active: list[BatchRequest]) -> tuple[list[Offer | None], list[bool], list[int]]:
        """Before the drafts: each request's offer (an "auto" one's what its draft is expected to be worth,
        ``Budgeting.learn``; before its first, its method's typical draft; with neither, and for a fixed budget, a
        draft of its whole block), whether it drafts (``plan_drafts``) and the nodes the batch is expected to give
        it (``allocate``)."""
        offers: list[Offer | None] = []
        for request in active:
            expected = self.expectation(request)
            if not request.row_method.drafts:
                offers.append(None)
            elif request.settings.auto_budget and expected is not None:
                offers.append(Offer(tuple(expected.tolist()), AUTO_NODES))
            else:
                offers.append(Offer((1.0,), 1, fixed=True))
        cost = self.cost.before_drafting(DEPTH_MARGIN)
        drafting = plan_drafts(offers, cost, len(active))
        chosen = [offer for offer, draft in zip(offers, drafting) if draft]
        expected = iter(allocate(chosen, cost, len(active), len(chosen)).nodes)
        return offers, drafting, [next(expected) if draft else 0 for draft in drafting]

    def draft(self, active: list[BatchRequest], depths: list[int]) -> dict[BatchRequest, DraftRow]:
        """One drafter pass over the drafting requests' blocks (those with a depth): log-probabilities
        ``[depth, vocab]`` each, to the deepest any of them drafts (read to the host once for them all)."""
        chosen = [r for r, depth in zip(active, depths) if depth]
        if not chosen:
            return {}
        block_size = chosen[0].settings.block_size
        if any(r.settings.block_size != block_size for r in chosen):
            raise EngineError("requests of one batch draft blocks of one size")
        device = self.target.device
        config = self.drafter.config
        width = len(config.target_layer_ids) * config.hidden_size
        features = [r.context_rows(width) for r in chosen]
        if self.graphed_draft is not None:  # a recorded pass brings a block of rows a request: the older ones first
            features = [self.behind(r, rows, at, block_size) for r, (rows, at) in zip(chosen, features)]
        padded = pad_sequence([rows.to(self.target.dtype) for rows, _ in features], batch_first=True)  # [b, new, width]
        positions = pad_sequence([at for _, at in features], batch_first=True).to(device)  # [b, new]
        new = padded.shape[1]
        added = torch.tensor([rows.shape[0] for rows, _ in features], device=device)
        block = torch.full((len(chosen), block_size), self.drafter.mask_token_id, device=device)
        block[:, 0] = torch.tensor([r.root for r in chosen], device=device)
        block_positions = torch.tensor([r.start for r in chosen], device=device)[:, None] + torch.arange(
            block_size, device=device)
        rows, depth = [r.row for r in chosen], max(depths)
        if self.graphed_draft is not None:  # a scratch row past theirs; a request's context ends before its root
            self.context.reserve(max(rows) + 2, max(r.start for r in chosen) + block_size)
            log_probs = self.graphed_draft(block, block_positions, padded, positions, added, rows)[:, :depth]
        else:
            embedding, lm_head = self.decoder.draft_weights
            log_probs = draft_log_probs(self.drafter, embedding, lm_head, block, block_positions, padded, positions,
                                        self.context.rows_view(rows, new), added, depth=depth)
        for request in chosen:
            request.read_context()
        return dict(zip(chosen, Drafts(log_probs).rows()))

    def behind(self, request: BatchRequest, rows: torch.Tensor, at: torch.Tensor, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last block of a request's unread context rows, the ones before them read now (``read_rows``): rows
        pile up while an "auto" request does not draft."""
        behind = rows.shape[0] - block_size
        if behind <= 0:
            return rows, at
        self.read_rows(request, rows[:behind], at[:behind])
        return rows[behind:], at[behind:]

    def build(self, active: list[BatchRequest], drafts: dict[BatchRequest, DraftRow]
              ) -> tuple[list[Planned], Allocation]:
        """Each request's tree: its candidates (the whole tree an "auto" budget could grow, or its fixed
        budget's), then as many nodes as the allocation gives it."""
        auto = self.auto_candidates(drafts)
        candidates, offers = [], []
        for request in active:
            log_probs, settings = drafts.get(request), request.settings
            if log_probs is None:
                tree, offer = ddtree.DraftTree.empty(), Offer((), 0, fixed=True)
                if settings.auto_budget:
                    request.expected = self.budgeting.relax(request.row_method, request.expected)
            else:
                tree, offer = auto.get(request) or self.budgeting.candidates(request.row_method, log_probs,
                                                                             settings.tree_budget, auto=False)
                if settings.auto_budget:
                    request.expected = self.budgeting.learn(request.row_method, request.expected, offer)
                    request.reach = tree.depths.cummax(0).values
            candidates.append(tree)
            offers.append(offer)
        allocation = allocate(offers, self.cost, len(active), len(drafts), drafted_rows(drafts))
        planned = []
        for request, tree, offer, nodes in zip(active, candidates, offers, allocation.nodes):
            planned.append(Planned(request, request.root, first_nodes(tree, nodes), drafts.get(request),
                                   self.reason(request, drafts, offer, nodes, allocation)))
        return planned, allocation

    def auto_candidates(self, drafts: dict[BatchRequest, DraftRow]
                        ) -> dict[BatchRequest, tuple[ddtree.DraftTree, Offer]]:
        """The drafted "auto" requests' candidate trees and offers, built and priced together for each method
        (``Budgeting.auto_candidates``): a request's host work would otherwise grow the step by its own tree's."""
        by_method: dict = {}
        for request, row in drafts.items():
            if request.settings.auto_budget:
                by_method.setdefault(request.row_method, []).append((request, row.index))
        built = {}
        log_probs = next(iter(drafts.values())).drafts.log_probs if drafts else None  # [b, D, V]: every draft
        for method_row, chosen in by_method.items():
            rows = torch.tensor([index for _, index in chosen], device=log_probs.device)
            built.update(zip([request for request, _ in chosen],
                             self.budgeting.auto_candidates(method_row, log_probs.index_select(0, rows))))
        return built

    def reason(self, request: BatchRequest, drafts: dict, offer: Offer, nodes: int, allocation: Allocation) -> str:
        """Why the request's tree has the size it has, in a few words (the trace keeps it)."""
        if not request.row_method.drafts:
            return f"{request.row_method.title}: the root alone"
        if not request.settings.auto_budget:
            return f"its own budget: {offer.cap} nodes"
        if request not in drafts:
            return "auto: not drafted, the nodes it is expected to offer are worth less than drafting costs here"
        if nodes == offer.available:
            return f"auto: every node of its draft paid ({nodes})"
        return (f"auto: nodes worth at least {allocation.cutoff:.2f} tokens each, what the batch earns in a node's "
                "time")

    def verify(self, layout: BatchLayout, hidden_states: bool):
        target = self.target
        verify = packed_pass if self.verify_kind == "packed" else padded_pass
        return target.verify_batch(verify, self.kv, layout, hidden_states)

    def commit(self, planned: list[Planned], bounds: list[int], logits: torch.Tensor, hidden) -> list[Outcome]:
        """Each request's walk along the target's choices, its cache and drafter context kept for the accepted
        path, its committed tokens. ``bounds``: the requests' rows in ``logits [T, vocab]`` (``query_start_loc``).
        What the host needs of the pass is read from the device once for the whole batch, not once a request."""
        choices = self.target_choices(planned, bounds, logits)
        walks = [ddtree.follow_tree(p.tree, own) for p, own in zip(planned, choices)]
        paths = [accepted for accepted, _ in walks]
        self.kv.compact([p.request.row for p in planned], [p.request.start for p in planned], paths)
        self.budgeting.observe([p.tree for p in planned], paths)
        # [kept]: every request's accepted rows, request by request
        kept = torch.tensor([begin + node for begin, path in zip(bounds, paths) for node in path], device=logits.device)
        margins = logit_margins(logits.index_select(0, kept))
        taps = self.drafter.hidden_state_indices  # each tap's kept rows, then joined: not every row of the pass
        features = (self.drafter.context_features({i: hidden[i].index_select(1, kept) for i in taps})[0]
                    .split([len(p) for p in paths]) if hidden is not None else [None] * len(paths))
        outcomes, taken = [], 0
        for p, own, (accepted, bonus), rows in zip(planned, choices, walks, features):
            request, tree = p.request, p.tree
            if request.drafts:
                request.pending_context.append(rows)
                request.pending_positions.append(range(request.start, request.start + len(accepted)))
            tokens = tree.tokens.tolist()
            committed = request.clip([tokens[node - 1] for node in accepted[1:]] + [bonus])
            request.output_ids.extend(committed)
            outcomes.append(Outcome(tree, own, accepted, bonus, committed,
                                    pieces=[request.text.push(token) for token in committed],
                                    margins=margins[taken:taken + len(committed)]))
            taken += len(accepted)
            request.start += len(accepted)
            request.root = bonus
        return outcomes

    @staticmethod
    def target_choices(planned: list[Planned], bounds: list[int], logits: torch.Tensor) -> list[list[int]]:
        """The target's token after each node of each request's tree (its rows of ``logits``): the greedy requests'
        read at once, a sampled request's drawn with its own generator."""
        greedy = (ddtree.sample_tokens(logits, 0.0).tolist() if any(not p.request.settings.temperature for p in planned)
                  else [])
        return [ddtree.sample_tokens(logits[begin:end], p.request.settings.temperature, p.request.generator).tolist()
                if p.request.settings.temperature else greedy[begin:end]
                for p, begin, end in zip(planned, bounds, bounds[1:])]

    def record_step(self, request: BatchRequest, root: int, top: tuple[list[list[int]], list[list[float]]],
                    outcome: Outcome, verified: int, active: list[BatchRequest], t_start: float,
                    stage_s: dict[str, float], reason: str, draft_rows: int) -> None:
        """The request's step as its trace keeps it (below ``root``, its draft's ``top`` tokens per depth), with the
        batch it ran in (``verified`` nodes in all; the request's own tree drafted ``draft_rows`` slots deep); its
        stop reason, if it has one."""
        step = request.record(len(request.trace.steps), t_start - request.t0, root, top, outcome, dict(stage_s))
        alone = self.cost.seconds(1, outcome.tree.size, int(draft_rows > 0), draft_rows)
        step.batch = StepBatch(size=len(active), nodes=verified, budget=outcome.tree.size, reason=reason,
                               neighbours=[r.name for r in active if r is not request], alone_s=alone)
        request.trace.steps.append(step)
        if request.on_step is not None:
            request.on_step(request.trace, step)
        request.finished = request.stop_reason()


def steps_greedily(settings: DecodeSettings) -> bool:
    """Whether a request's steps can run as fixed-shape programs (whose walk takes the target's first choices)."""
    return not settings.temperature


def fixed_nodes(request: BatchRequest) -> int:
    """The nodes below its root a request of a fixed budget verifies each step."""
    return request.row_method.nodes(request.settings.tree_budget, request.settings.block_size - 1)


def fixed_reason(request: BatchRequest, nodes: int, drafted: bool) -> str:
    """What a trace says of a fixed step of ``nodes`` nodes a slot (``Batch.reason`` of the readable step);
    ``drafted``: whether the step drafted."""
    if not request.row_method.drafts:
        return f"{request.row_method.title}: the root alone"
    if not request.settings.auto_budget:
        return f"its own budget: {fixed_nodes(request)} nodes"
    if not drafted:
        return "auto: not drafted, the batch's drafts are expected to be worth less than drafting costs here"
    return (f"auto: {nodes} nodes, the step's shared budget: the most tokens a second its drafts were expected to "
            "give")


def drafted_rows(drafts: dict[BatchRequest, DraftRow]) -> int:
    """The slots a step's drafter pass drafted (``drafts``: each request's ``[depth, vocab]``)."""
    return sum(log_probs.shape[0] for log_probs in drafts.values())
