"""The drafter's pass of one decoding step: per-position log-probabilities for the block.

``EagerDraft`` runs it as plain PyTorch with a context cache that grows as tokens commit.
``GraphedDraft`` keeps the context in fixed buffers and replays the pass as a CUDA graph:
on a GPU a small drafter is launch-bound: its many small kernels' launches cost more than the
target's verify pass (kernels per stage: BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from engine.gpu.copies import to_device
from engine.gpu.graphs import GraphedCall
from engine.models.drafter import DFlashDrafter, DraftContext, StaticDraftContext


class EagerDraft:
    """One eager drafter pass per step (any drafter, any device)."""

    def __init__(self, drafter: DFlashDrafter, embedding: torch.Tensor, lm_head: torch.Tensor, block_size: int):
        self.drafter, self.embedding, self.lm_head, self.block_size = drafter, embedding, lm_head, block_size
        self.context = DraftContext.empty(len(drafter.layers))

    def __call__(self, root: int, start: int, features: torch.Tensor, feature_positions: torch.Tensor) -> torch.Tensor:
        """Log-probabilities ``[block-1, vocab]`` for the slots after ``root`` (at position ``start``),
        given the newly committed tokens' target ``features [1, c, taps*hidden]``."""
        device = features.device
        block = torch.full((1, self.block_size), self.drafter.mask_token_id, device=device)
        block[0, 0] = root
        positions = torch.arange(start, start + self.block_size, device=device)[None]
        return draft_log_probs(self.drafter, self.embedding, self.lm_head, block, positions, features,
                               feature_positions, self.context)[0]


@dataclass(frozen=True)
class DraftBuffers:
    """The drafter's inputs for one block at fixed addresses, what a CUDA graph of its pass reads:
    its context cache, the block (the root, then mask tokens) and its positions, and up to a block
    of newly committed context rows with their positions and count."""

    context: StaticDraftContext
    block: torch.Tensor  # [1, block_size] long
    positions: torch.Tensor  # [1, block_size] long
    features: torch.Tensor  # [1, block_size, taps * hidden]
    feature_positions: torch.Tensor  # [1, block_size] long
    count: torch.Tensor  # () long

    @staticmethod
    def allocate(drafter: DFlashDrafter, block_size: int, capacity: int, device: torch.device,
                 dtype: torch.dtype) -> DraftBuffers:
        """For contexts of up to ``capacity`` tokens (a block more: the last block's rows)."""
        config = drafter.config
        long = dict(dtype=torch.long, device=device)
        return DraftBuffers(
            context=StaticDraftContext(config, capacity + block_size, device, dtype),
            block=torch.full((1, block_size), drafter.mask_token_id, **long),
            positions=torch.zeros(1, block_size, **long),
            features=torch.zeros(1, block_size, len(config.target_layer_ids) * config.hidden_size, dtype=dtype,
                                 device=device),
            feature_positions=torch.zeros(1, block_size, **long), count=torch.zeros((), **long))

    def log_probs(self, drafter: DFlashDrafter, embedding: torch.Tensor, lm_head: torch.Tensor, features: torch.Tensor,
                  feature_positions: torch.Tensor, count, draft=None) -> torch.Tensor:
        """The pass over the block with these context rows (``draft``: ``draft_log_probs`` or a compiled copy)."""
        return (draft or draft_log_probs)(drafter, embedding, lm_head, self.block, self.positions, features,
                                          feature_positions, self.context, count)[0]


class GraphedDraft:
    """The same pass over fixed shapes, captured once and replayed (CUDA; any drafter but a scripted one).

    A step brings at most a block of new context rows, padded to the block; the prompt,
    longer than that, goes through the same buffers eagerly. The first padded pass runs
    eagerly too, and its inputs are then captured. Reused across runs (``reset``).
    """

    def __init__(self, drafter: DFlashDrafter, embedding: torch.Tensor, lm_head: torch.Tensor, block_size: int,
                 capacity: int):
        self.drafter, self.embedding, self.lm_head, self.block_size = drafter, embedding, lm_head, block_size
        self.buffers = DraftBuffers.allocate(drafter, block_size, capacity, embedding.device, embedding.dtype)
        self.offsets = torch.arange(block_size, device=embedding.device)
        buffers = self.buffers
        self.graphed = GraphedCall(lambda: self._pass(buffers.features, buffers.feature_positions, buffers.count))

    def reset(self) -> None:
        self.buffers.context.length.zero_()

    def __call__(self, root: int, start: int, features: torch.Tensor, feature_positions: torch.Tensor) -> torch.Tensor:
        buffers = self.buffers
        buffers.block[0, :1].fill_(root)
        torch.add(self.offsets, start, out=buffers.positions[0])
        added = features.shape[1]
        if added > self.block_size:
            return self._pass(features, feature_positions, added)
        buffers.features[0, :added].copy_(features[0])
        buffers.feature_positions[0, :added].copy_(feature_positions[0])
        buffers.count.fill_(added)
        return self.graphed()

    def _pass(self, features, feature_positions, added) -> torch.Tensor:
        return self.buffers.log_probs(self.drafter, self.embedding, self.lm_head, features, feature_positions, added)


@dataclass(frozen=True)
class BatchDraftInputs:
    """A batch's drafter pass for ``count`` requests at fixed addresses: each request's block (its root, then mask
    tokens; the root alone where a fixed step drafts nothing and reads rows) and positions, up to ``new`` context rows
    (a block's worth; the real ones first, ``added`` of them) with their positions, and the request's row of the
    ``BatchDraftContext``."""

    block: torch.Tensor  # [count, block] long
    positions: torch.Tensor  # [count, block] long
    features: torch.Tensor  # [count, new, taps * hidden]
    feature_positions: torch.Tensor  # [count, new] long
    added: torch.Tensor  # [count] long
    rows: torch.Tensor  # [count] long

    @staticmethod
    def allocate(count: int, block: int, new: int, width: int, device: torch.device, dtype: torch.dtype
                 ) -> BatchDraftInputs:
        long = dict(dtype=torch.long, device=device)
        return BatchDraftInputs(torch.zeros(count, block, **long), torch.zeros(count, block, **long),
                                torch.zeros(count, new, width, dtype=dtype, device=device),
                                torch.zeros(count, new, **long), torch.zeros(count, **long),
                                torch.zeros(count, **long))

    def load(self, block, positions, features, feature_positions, added, rows, scratch: int) -> None:
        """The step's inputs for its ``c`` requests (``features [c, new, width]``, ``new`` at most a block: the rest
        stays padding). The slots past ``c`` are padding requests: no new rows, in the context's ``scratch`` row, which
        no request of the pass is in (a row written twice in one pass keeps either write)."""
        count, new = block.shape[0], features.shape[1]
        for buffer, values, padding in ((self.block, block, 0), (self.positions, positions, 0), (self.added, added, 0),
                                        (self.rows, rows, scratch)):
            buffer[count:] = padding
            buffer[:count].copy_(values)
        self.features.zero_()[:count, :new].copy_(features)  # padding as the eager pass pads
        self.feature_positions.zero_()[:count, :new].copy_(feature_positions)


class GraphedBatchDraft:
    """The batched step's drafter pass over a ``BatchDraftContext`` at fixed shapes, replayed as a CUDA graph, one
    per block size (a fixed step that drafts nothing passes roots alone) and bucket of drafting requests
    (``count_bucket``: the slots past the requests are padding, so
    a step's count seldom records a graph): each request brings a block's worth of new context rows (padded,
    and masked past its real ones), the pass reads every column of the context's buffers and drafts the
    whole block, and the caller keeps the depth it asked for. The graphs read the context's buffers in place, so
    they go when the buffers grow. ``replay`` False runs the same fixed-shape pass eagerly every time (where no GPU
    records it)."""

    def __init__(self, drafter: DFlashDrafter, embedding: torch.Tensor, lm_head: torch.Tensor, context,
                 replay: bool = True):
        self.drafter, self.embedding, self.lm_head, self.context = drafter, embedding, lm_head, context
        self.replay = replay
        # by (count, block, new rows)
        self.shapes: dict[tuple[int, int, int], tuple[BatchDraftInputs, GraphedCall | None]] = {}
        self.generation = context.generation

    def __call__(self, block: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                 feature_positions: torch.Tensor, added: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Log-probabilities ``[count, block_size - 1, vocab]`` for every request's block (``draft_log_probs``'
        arguments, ``block [count, block_size]``; ``rows``: the requests' rows of the context). The caller has
        reserved the context's room, by the host's own bounds: a scratch row past ``rows``, and a block of columns past
        each of their contexts (their lengths are the device's, not read back)."""
        context, index = self.context, to_device(rows, self.embedding.device)
        count, block_size = block.shape
        shape = (count_bucket(count), block_size, features.shape[1])
        if context.rows < max(rows) + 2:
            raise ValueError(f"the drafter's context has {context.rows} rows: a recorded pass of rows up to "
                             f"{max(rows)} needs a scratch row past them (reserve it before drafting)")
        if context.generation != self.generation:
            self.shapes.clear()
            self.generation = context.generation
        if shape not in self.shapes:
            inputs = BatchDraftInputs.allocate(*shape, features.shape[-1], self.embedding.device, self.embedding.dtype)
            graphed = GraphedCall(partial(self._pass, inputs), synchronize=True) if self.replay else None
            self.shapes[shape] = inputs, graphed
        inputs, graphed = self.shapes[shape]
        inputs.load(block, positions, features, feature_positions, added, index, scratch=context.rows - 1)
        return (graphed() if graphed is not None else self._pass(inputs))[:count]

    def _pass(self, inputs: BatchDraftInputs) -> torch.Tensor:
        return draft_log_probs(self.drafter, self.embedding, self.lm_head, inputs.block, inputs.positions,
                               inputs.features, inputs.feature_positions, self.context.fixed_view(inputs.rows),
                               inputs.added)


def count_bucket(count: int) -> int:
    """The drafting requests a recorded drafter pass of ``count`` runs: the next power of two, so that a batch's
    steps, whose counts vary step by step, record a handful of graphs rather than one a count."""
    return 1 << (count - 1).bit_length()


def draft_log_probs(drafter, embedding, lm_head, block, positions, features, feature_positions, context, added=None,
                    depth: int | None = None):
    """The drafter's log-probabilities ``[b, depth, vocab]`` for the first ``depth`` slots after each block's root
    (``block``, ``positions [b, block]``; all ``block-1`` by default): the pass every step runs (the fixed step
    through its own buffers, the batched step for many requests at once, as deep as their trees can use, since
    the lm_head is most of the pass)."""
    hidden = drafter(drafter.embed(block, embedding), features.to(embedding.dtype), block_positions=positions,
                     context_positions=feature_positions, cache=context, context_count=added)
    slots = hidden[:, 1:] if depth is None else hidden[:, 1:1 + depth]
    return torch.log_softmax(drafter.logits(slots, lm_head).float(), dim=-1)
