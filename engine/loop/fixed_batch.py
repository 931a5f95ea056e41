"""The batched step's fast path: every request's draft, tree, verify, walk and commit as fixed-shape programs on
the device, and one host read a step.

``Batch.step`` (``engine.loop.batch``) is the readable batched step: it builds each request's tree on the host,
packs the trees into a layout and walks each request's own. Here the same step for a batch of greedy requests of
fixed budgets runs as two programs over slots (a slot a request, in its row of the batch's caches; their count
rounded up to a power of two, ``count_bucket``, the slots past the requests padding of budget 0 in rows of their own,
whose work nobody reads), whose shapes depend on the slots, the nodes and the caches' buffers alone, so that each
can be recorded as a CUDA graph (on a GPU the drafter's pass replays the batch's recorded ones, and ``advance`` one
of its own for each count of slots, ``RecordedAdvance``):

- ``draft``: the drafter's pass over every slot's block (its root, then mask tokens, at its past), fed the rows
  the request accepted last step (``AcceptedRows``: ``[rows, block, taps*hidden]``, how many of them real), which the
  ``advance`` before left on the device (a step whose drafts would not pay passes the roots alone, for those rows);
- ``advance``: each slot's tree of ``nodes`` nodes below its root (its method's: the best-first tree in the heap's
  order, DFlash's chain, or none), cut to the slot's own budget by the tree's ``valid`` mask; one target pass over
  ``[b, nodes + 1]`` tokens (``TargetModel.verify_slots``: each slot's past, then its tree, ancestors only); the
  walk (``ddtree.fixed.follow_tree``); the KV compaction of each accepted path; the accepted rows' features kept
  for the next draft; each request's new root and past (``RowState``); and the step's record,
  ``[b, StepLayout.size]`` float64, which the host reads once.

Since a step starts from the roots and pasts the step before left on the device, ``Batch`` launches step k+1 before
it reads step k's record, and finishes step k (commits, records, streams) while the device runs step k+1, as
``engine.loop.fixed_step.FixedRun`` does for one request.

Worked example, nodes 4, block 4 (depth 3), two requests and so two slots: slot 0 a DDTree request of budget 3 at
past 10 in row 0, slot 1 an AR request at past 7 (budget 0) in row 1. Slot 0's tree of 4 nodes in heap order is
cut to its first 3 (valid [1, 1, 1, 0]); slot 1's nodes are all invalid, so its walk accepts the root alone. The
pass writes slot 0's 5 tokens at its row's columns 10..14 and slot 1's at 7..11; slot 0 accepts path [0, 2]
(length 2): column 12 moves to 11 and past becomes 12, root the target's token after node 2; slot 1's past
becomes 8.

Requests that sample, or whose budget the batch chooses ("auto"), take the readable step, and while any of them is
in the batch so do their neighbours; a batch moves between the two steps between rounds, each request's accepted
rows going with it (``AcceptedRows.take`` and ``load``; ``Batch.hand_back`` and ``hand_over``). Tests hold the fast
path to the readable step and to each request alone, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

import ddtree
import ddtree.fixed
from ddtree.fixed import FixedTree
from engine.gpu.copies import to_device
from engine.gpu.graphs import GraphedCall
from engine.loop.draft_pass import GraphedBatchDraft, draft_log_probs
from engine.loop.fixed_step import TREE_PARTS, StepLayout, record_trees
from engine.loop.settings import DecodeSettings
from engine.methods import method as method_row

# a slot's method, as ``advance`` tells them apart: the tree's nodes, the chain's, or none
TREE, CHAIN, NO_TREE = 0, 1, 2


def node_bucket(nodes: int) -> int:
    """The nodes a step's program verifies below each root, for requests asking up to ``nodes``: the next power of
    two (0 stays 0), so that a handful of programs serve every mix of budgets."""
    return 0 if nodes <= 0 else 1 << (nodes - 1).bit_length()


class RowState:
    """Each request's root (its last committed token) and past (its committed cache rows) on the device, by its row
    of the batch's caches: where a fixed step leaves them for the next, so that the next can be launched before the
    host has read the one before (the host's own copy then lags a step)."""

    def __init__(self, device: torch.device):
        self.values = torch.zeros(2, 0, dtype=torch.long, device=device)  # [2, rows]: root, past

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows, grown by doubling: a recorded step reads this buffer where it was."""
        have = self.values.shape[1]
        if rows > have:
            self.values = torch.cat([self.values, self.values.new_zeros(2, max(rows, 2 * have) - have)], dim=1)

    def set(self, row: int, root: int, past: int) -> None:
        """The host's root and past for the request in ``row`` (it joined, or stepped readably)."""
        self.reserve(row + 1)
        self.values[:, row] = to_device([root, past], self.values.device)

    def move_row(self, source: int, target: int) -> None:
        """The request in row ``source`` moved to ``target`` (``Batch.release``)."""
        if max(source, target) < self.values.shape[1]:
            self.values[:, target] = self.values[:, source]


@dataclass(frozen=True)
class SlotInputs:
    """A step's slots on the device, ``[S]`` long each; and how the pass reads their rows (``read``: a view of the
    caches where they are consecutive, as they are while no request is joining)."""

    root: torch.Tensor
    past: torch.Tensor
    budget: torch.Tensor
    kind: torch.Tensor  # ``TREE``, ``CHAIN`` or ``NO_TREE``
    rows: torch.Tensor  # each slot's row of the batch's caches
    read: slice | torch.Tensor
    row_list: list[int]  # the rows, on the host: what the drafter's recorded pass is told (``GraphedBatchDraft``)

    @staticmethod
    def of(slots: list[tuple[int, int, int]], count: int, spare: int, state: RowState) -> SlotInputs:
        """``slots``: each request's (budget, kind, row), its root and past from ``state`` (where the step before left
        them); the ``count - len(slots)`` padding slots verify a root of nothing at past 0, each in a row of its own
        from ``spare`` on, where no request is.

        E.g. 3 requests in rows 0, 1, 2 and spare row 3: 4 slots over rows 0..3, read as a view; requests in rows 0,
        2, 3 (row 1 still joining) and spare row 4: rows [0, 2, 3, 4], gathered."""
        padding = [(0, NO_TREE, spare + extra, 0) for extra in range(count - len(slots))]
        rows = [row for _, _, row in slots] + [row for _, _, row, _ in padding]
        consecutive = rows == list(range(rows[0], rows[0] + count))
        state.reserve(max(rows) + 1)
        # [4, S]: budget, kind, row, whether a request is in the slot; one copy, in stream order
        budget, kind, row, real = to_device([(*slot, 1) for slot in slots] + padding, state.values.device).T
        root, past = torch.where(real.bool(), state.values[:, row], 0)
        return SlotInputs(root, past, budget, kind, row, slice(rows[0], rows[0] + count) if consecutive else row, rows)


@dataclass
class RecordedAdvance:
    """A program's ``advance`` for one count of slots over inputs at fixed addresses (``inputs``, ``log_probs``),
    replayed from the CUDA graph recorded after its first run where ``call`` holds one (else run eagerly over the same
    buffers: how the CPU tests it), and the addresses of the buffers it read and wrote when recorded (``over``): a
    buffer that moved drops the recording."""

    inputs: SlotInputs
    log_probs: torch.Tensor | None
    over: tuple[int, ...]
    call: GraphedCall | None = None

    @staticmethod
    def allocate(inputs: SlotInputs, log_probs: torch.Tensor | None, over: tuple[int, ...]) -> RecordedAdvance:
        """Buffers shaped as ``inputs`` and ``log_probs``; the rows are always read gathered (a view's bounds would be
        recorded as they were)."""
        root, past, budget, kind, rows = (value.clone() for value in (inputs.root, inputs.past, inputs.budget,
                                                                       inputs.kind, inputs.rows))
        return RecordedAdvance(SlotInputs(root, past, budget, kind, rows, rows, []),
                               None if log_probs is None else log_probs.clone(), over)

    def load(self, inputs: SlotInputs, log_probs: torch.Tensor | None) -> None:
        for name in ("root", "past", "budget", "kind", "rows"):
            getattr(self.inputs, name).copy_(getattr(inputs, name))
        if log_probs is not None:
            self.log_probs.copy_(log_probs)


def fitted(tree: FixedTree, nodes: int) -> FixedTree:
    """``tree`` cut or padded to ``nodes`` nodes; a padding node hangs below the root, invalid."""
    have = tree.tokens.shape[-1]
    if have >= nodes:
        return FixedTree.each(lambda field: field[..., :nodes], tree)
    extra, device = (*tree.tokens.shape[:-1], nodes - have), tree.tokens.device
    zeros = torch.zeros(extra, dtype=torch.long, device=device)
    unlikely = torch.full(extra, ddtree.fixed.NEG_INF, device=device)
    padding = FixedTree(zeros, zeros, torch.ones_like(zeros), unlikely, unlikely, zeros,
                        torch.zeros(extra, dtype=torch.bool, device=device))
    return FixedTree.each(lambda field, pad: torch.cat([field, pad], dim=-1), tree, padding)


def slot_trees(log_probs: torch.Tensor, kind: torch.Tensor, budget: torch.Tensor, nodes: int, candidates: int
               ) -> tuple[FixedTree, FixedTree]:
    """Each slot's candidates from its draft ``log_probs [b, D, V]``, ``candidates`` nodes (at least ``nodes``): the
    best-first tree in the heap's order or the chain by ``kind [b]``; and the tree it verifies, their first ``nodes``,
    those past ``budget [b]`` invalid (a prefix of the heap's order is the best-first tree of that many nodes, of a
    chain the chain that deep), so one program holds every budget. An "auto" request learns what its drafts are worth
    from its candidates (``Budgeting.learn_fixed``)."""
    width = max(candidates, nodes)
    best = ddtree.fixed.heap_order(ddtree.fixed.build_tree(log_probs, width))
    chain = fitted(ddtree.fixed.chain_tree(log_probs), width)
    is_chain = (kind == CHAIN)[:, None]
    whole = FixedTree.each(lambda of_chain, of_best: torch.where(is_chain, of_chain, of_best), chain, best)
    tree = fitted(whole, nodes)
    within = torch.arange(nodes, device=kind.device)[None, :] < budget[:, None]
    return replace(tree, valid=tree.valid & within & (kind != NO_TREE)[:, None]), whole


class AcceptedRows:
    """The rows each request accepted in its last fixed-shape step, kept on the device for its next draft (its
    target features ``[rows, block, taps*hidden]``, their positions and how many are real), by the request's row of
    the batch's caches; shared by the batch's programs, whatever their nodes."""

    def __init__(self, block_size: int, width: int, dtype: torch.dtype, device: torch.device):
        self.features = torch.zeros(0, block_size, width, dtype=dtype, device=device)
        self.positions = torch.zeros(0, block_size, dtype=torch.long, device=device)
        self.added = torch.zeros(0, dtype=torch.long, device=device)

    def reserve(self, rows: int) -> None:
        """Room for the requests in ``rows`` rows (what is kept stays), grown by doubling: a recorded step reads these
        buffers where they were."""
        if rows <= self.added.numel():
            return
        extra = max(rows, 2 * self.added.numel()) - self.added.numel()
        self.features = torch.cat([self.features, self.features.new_zeros(extra, *self.features.shape[1:])])
        self.positions = torch.cat([self.positions, self.positions.new_zeros(extra, self.positions.shape[1])])
        self.added = torch.cat([self.added, self.added.new_zeros(extra)])

    def take(self, row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows the next draft of the request in ``row`` has not read (``[c, width]``, positions ``[c]``), handed
        over and forgotten here: the request goes on by the readable step."""
        if row >= self.added.numel():
            return None
        count = int(self.added[row])
        self.added[row] = 0
        return (self.features[row, :count], self.positions[row, :count]) if count else None

    def load(self, row: int, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Rows the next draft of the request in ``row`` reads: at most a block, ``features [c, width]`` at
        ``positions [c]`` (none forgets what the row's last request left)."""
        self.reserve(row + 1)
        count = features.shape[0]
        self.features[row, :count] = features.to(self.features.dtype)
        self.positions[row, :count] = to_device(positions, self.positions.device)
        self.added[row] = count

    def move_row(self, source: int, target: int) -> None:
        """The request in row ``source`` moved to ``target`` (``Batch.release``)."""
        if max(source, target) < self.added.numel():
            for buffer in (self.features, self.positions, self.added):
                buffer[target] = buffer[source]
            self.added[source] = 0


@dataclass
class SlotRecords:
    """A fixed step's record read on the host, slot by slot (``FixedBatchProgram.unpack``)."""

    steps: list[dict[str, list[float]]]  # each slot's parts (``StepLayout``)
    trees: list[ddtree.DraftTree]  # each slot's verified tree, its real nodes
    candidates: FixedTree | None  # [count, candidates]: what an "auto" slot drafted, where the program learns


class FixedBatchProgram:
    """The two programs of a batch's fixed-shape step for one ``nodes`` (module docstring), over the batch's own
    caches: the target's rows (``BatchKV``), the drafter's context (``BatchDraftContext``) and the rows each request
    accepted last (``AcceptedRows``)."""

    def __init__(self, decoder, kv, context, accepted: AcceptedRows | None, state: RowState, nodes: int,
                 candidates: int, block_size: int, top_k: int, learns: bool = False,
                 graphed_draft: GraphedBatchDraft | None = None, graphs: bool = False, keeps_context: bool = False):
        self.target, self.drafter, self.kv, self.context = decoder.target, decoder.drafter, kv, context
        self.accepted, self.state = accepted, state
        self.graphed_draft = graphed_draft  # the batch's recorded drafter pass, where a GPU records it
        # ``graphs``: ``advance`` over buffers at fixed addresses, one set a count of slots, replayed as a CUDA graph
        # on a GPU (on the CPU run eagerly over the same buffers)
        self.graphs = graphs
        self.recorded: dict[int, RecordedAdvance] = {}
        self.nodes, self.depth = nodes, block_size - 1
        # a batch of AR requests alone verifies roots and drafts nothing; where any request drafts, every drafting
        # request drafts every step, ``nodes`` of its ``candidates`` verified. A step whose drafts would not pay
        # (``keeps_context``) drafts nothing and verifies roots, and still reads its drafting requests' accepted rows
        # into the drafter's context and keeps the rows they accept, so that a later step can draft from them
        self.drafts = candidates > 0
        self.keeps = self.drafts or keeps_context
        self.candidates = max(candidates, nodes) if self.drafts else 0
        self.learns = learns and self.drafts  # the record brings every slot's candidates back ("auto" requests)
        if self.keeps and self.drafter is None:
            raise ValueError("a program that drafts needs the decoder's drafter")
        top_k = min(top_k, self.target.config.vocab_size) if self.drafts else 0
        self.layout = StepLayout(self.depth if self.drafts else 0, nodes, top_k)
        device = self.target.device
        self.slots = torch.arange(self.depth + 1, device=device)
        if self.keeps:
            self.embedding, self.lm_head = decoder.draft_weights

    # -- a step

    def room(self, rows: list[int], pasts: list[int], padding: range) -> None:
        """Before a step over the requests in ``rows`` at ``pasts`` and padding slots in ``padding`` rows: room for
        every tree (and the compaction's scratch) in the target's cache, and for a block past every context in the
        drafter's. Sizes move buffers, so they are the host's to know, not read from the device."""
        self.kv.hold_slots(rows, [past + self.nodes + 1 for past in pasts], padding)
        if self.keeps:
            last = max([*rows, *padding])
            self.accepted.reserve(last + 1)
            self.context.reserve(last + 2, max(pasts) + self.depth + 2)  # a scratch row past every slot's

    def draft(self, inputs: SlotInputs) -> torch.Tensor | None:
        """``[S, depth, vocab]``: every slot's block drafted at once, from the rows it accepted last. A program that
        drafts nothing passes its roots alone, for the rows it reads into the drafter's context: None."""
        rows, width = inputs.rows, self.layout.depth + 1
        block = torch.full((rows.numel(), width), self.drafter.mask_token_id, device=self.slots.device)
        block[:, 0] = inputs.root
        positions = inputs.past[:, None] + self.slots[:width]  # [S, width]
        # a slot that drafts nothing (AR, padding) reads no rows: a padding slot's row keeps an empty context
        accepted = self.accepted
        added = torch.where(inputs.kind == NO_TREE, 0, accepted.added[rows])
        features, at = accepted.features[rows], accepted.positions[rows]
        if self.graphed_draft is not None:  # replayed from the graph of its bucket of slots, as the readable step's
            log_probs = self.graphed_draft(block, positions, features, at, added, inputs.row_list)
        else:
            log_probs = draft_log_probs(self.drafter, self.embedding, self.lm_head, block, positions, features, at,
                                        self.context.fixed_view(rows, inputs.read), added)
        accepted.added.index_fill_(0, rows, 0)  # a scalar set by index would be copied from the host, and wait
        return log_probs if self.drafts else None

    def advance(self, inputs: SlotInputs, log_probs: torch.Tensor | None) -> torch.Tensor:
        """The step after its draft: trees, verify, walk, compaction, the next draft's rows; the record. With
        ``graphs``, replayed over the recorded advance of its count of slots, recorded anew where a buffer it reads
        or writes has moved since (a cache or a table grown, a row joined)."""
        if not self.graphs:
            return self._advance(inputs, log_probs)
        count, over = inputs.root.numel(), self.buffers()
        held = self.recorded.get(count)
        if held is None or held.over != over:
            held = self.recorded[count] = RecordedAdvance.allocate(inputs, log_probs, over)
            if self.target.device.type == "cuda":
                held.call = GraphedCall(partial(self._advance, held.inputs, held.log_probs),
                                        capturing=self.target.capturing, synchronize=True)
        held.load(inputs, log_probs)
        return held.call() if held.call is not None else self._advance(held.inputs, held.log_probs)

    def buffers(self) -> tuple[int, ...]:
        """Where the buffers ``advance`` reads and writes live now: the caches' (``pass_buffers``), the roots' and
        pasts', the accepted rows'."""
        tensors = [self.state.values, *self.kv.pass_buffers()]
        if self.keeps:
            tensors += [self.accepted.features, self.accepted.positions, self.accepted.added]
        return tuple(tensor.data_ptr() for tensor in tensors)

    def _advance(self, inputs: SlotInputs, log_probs: torch.Tensor | None) -> torch.Tensor:
        root, past, rows = inputs.root, inputs.past, inputs.rows
        count = root.numel()
        if not self.drafts:
            tree = best = FixedTree.each(lambda field: field.expand(count, 0), FixedTree.empty(root.device))
        else:
            tree, best = slot_trees(log_probs, inputs.kind, inputs.budget, self.nodes, self.candidates)
        ids = torch.cat([root[:, None], tree.tokens], dim=1)  # [count, nodes + 1]
        positions = past[:, None] + torch.cat([torch.zeros_like(root)[:, None], tree.depths], dim=1)
        visible = ddtree.fixed.ancestor_mask(tree.parents, max(self.depth, 1))  # [count, nodes + 1, nodes + 1]
        logits, hidden = self.target.verify_slots(self.kv, rows, inputs.read, ids, positions, past, visible,
                                                  self.keeps)
        target_tokens = logits.argmax(dim=-1)  # [count, nodes + 1]
        path, length, bonus = ddtree.fixed.follow_tree(tree, target_tokens, visible, self.layout.depth)  # [count, D+1]
        self.kv.compact_slots(rows, past, path, length)
        self.state.values[:, rows] = torch.stack([bonus, past + length])  # what the next step starts from
        if self.keeps:
            features = self.drafter.context_features(hidden)  # [count, nodes + 1, width]
            kept = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))  # [count, D + 1, width]
            wide = kept.shape[1]
            self.accepted.features[rows, :wide] = kept.to(self.accepted.features.dtype)  # the drafter's dtype
            self.accepted.positions[rows, :wide] = past[:, None] + self.slots[:wide]
            self.accepted.added[rows] = length
        record = self.record(tree, ids, path, length, bonus, logits, target_tokens, log_probs)
        if not self.learns:
            return record
        priced = torch.cat([best.path_log_probs.double(), best.ranks, best.parents, best.valid, best.depths], dim=1)
        return torch.cat([record, priced.double()], dim=1)  # [count, size + 5 * candidates]

    def unpack(self, record: torch.Tensor) -> SlotRecords:
        """``advance``'s record on the host (``[count, size (+ 5 * candidates)]``, float64): each slot's step
        (``StepLayout.unpack``) and verified tree (``record_trees``), and, where the program ``learns``, every slot's
        candidates as one tree ``[count, candidates]`` (their path log-probabilities, ranks, parents, depths and
        valid: what ``Budgeting.learn_fixed`` prices; no tokens)."""
        layout = self.layout
        steps = [layout.unpack(values) for values in record[:, :layout.size].tolist()]
        trees = record_trees(torch.stack([record[:, layout.columns[name]] for name in TREE_PARTS], dim=1))
        if not self.learns:
            return SlotRecords(steps, trees, None)
        rest = record[:, layout.size:].view(-1, 5, self.candidates)
        path_log_probs = rest[:, 0].float()
        candidates = FixedTree(torch.zeros_like(rest[:, 0], dtype=torch.long), rest[:, 2].long(), rest[:, 4].long(),
                               path_log_probs, path_log_probs, rest[:, 1].long(), rest[:, 3].bool())
        return SlotRecords(steps, trees, candidates)

    def record(self, tree: FixedTree, ids, path, length, bonus, logits, target_tokens, log_probs) -> torch.Tensor:
        """Each slot's step in ``StepLayout`` order, float64: ``[count, size]``, one read for the host."""
        count, slots = ids.shape[0], torch.arange(path.shape[1], device=ids.device)
        along = ids.gather(1, torch.cat([path[:, 1:], path[:, -1:]], dim=1))
        committed = torch.where(slots[None, :] < (length - 1)[:, None], along, bonus[:, None])
        top2 = logits.gather(1, path[..., None].expand(-1, -1, logits.shape[-1])).float().topk(2, dim=-1).values
        margins = top2[..., 0] - top2[..., 1]
        if self.layout.top_k:
            top_log_probs, top_tokens = log_probs.topk(self.layout.top_k, dim=-1)
        else:
            top_log_probs = torch.zeros(count, 0, device=ids.device)
            top_tokens = torch.zeros(count, 0, dtype=torch.long, device=ids.device)
        wide = self.layout.depth + 1  # a step without drafts records a path of the root alone
        whole = torch.cat([length[:, None], committed[:, :wide], path[:, :wide]], dim=1).double()
        tail = torch.cat([target_tokens, tree.tokens, tree.parents, tree.depths, tree.ranks, tree.valid.long(),
                          top_tokens.reshape(count, -1)], dim=1).double()
        reals = torch.cat([tree.log_probs, tree.path_log_probs, top_log_probs.exp().reshape(count, -1)], dim=1).double()
        return torch.cat([whole, margins[:, :wide].double(), tail, reals], dim=1)


def slot_kind(settings: DecodeSettings) -> int:
    """How a request's step builds its tree in a fixed-shape program."""
    row = method_row(settings.method)
    if not row.drafts:
        return NO_TREE
    return TREE if row.budgeted else CHAIN
