"""The drafter's pass of one decoding step: per-position log-probabilities for the block.

``EagerDraft`` runs it as plain PyTorch with a context cache that grows as tokens commit.
``GraphedDraft`` keeps the context in fixed buffers and replays the pass as a CUDA graph:
on a GPU a small drafter is launch-bound, and its ~400 kernel launches cost more than the
target's verify pass.
"""

from __future__ import annotations

import torch

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
                               feature_positions, self.context)


class GraphedDraft:
    """The same pass over fixed shapes, captured once and replayed (CUDA; any drafter but a scripted one).

    A step brings at most a block of new context rows, padded to the block; the prompt,
    longer than that, goes through the same buffers eagerly. The first padded pass runs
    eagerly too, and its inputs are then captured. Reused across runs (``reset``).
    """

    def __init__(self, drafter: DFlashDrafter, embedding: torch.Tensor, lm_head: torch.Tensor, block_size: int,
                 capacity: int):
        device, dtype = embedding.device, embedding.dtype
        self.drafter, self.embedding, self.lm_head, self.block_size = drafter, embedding, lm_head, block_size
        self.context = StaticDraftContext(drafter.config, capacity + block_size, device, dtype)
        width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
        self.block = torch.full((1, block_size), drafter.mask_token_id, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, block_size, dtype=torch.long, device=device)
        self.offsets = torch.arange(block_size, device=device)
        self.features = torch.zeros(1, block_size, width, dtype=dtype, device=device)
        self.feature_positions = torch.zeros(1, block_size, dtype=torch.long, device=device)
        self.count = torch.zeros((), dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    def reset(self) -> None:
        self.context.length.zero_()

    def __call__(self, root: int, start: int, features: torch.Tensor, feature_positions: torch.Tensor) -> torch.Tensor:
        self.block[0, :1].fill_(root)
        torch.add(self.offsets, start, out=self.positions[0])
        added = features.shape[1]
        if added > self.block_size:
            return self._pass(features, feature_positions, added)
        self.features[0, :added].copy_(features[0])
        self.feature_positions[0, :added].copy_(feature_positions[0])
        self.count.fill_(added)
        if self.graph is not None:
            self.graph.replay()
            return self.output
        log_probs = self._pass(self.features, self.feature_positions, self.count)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records without running: this step's pass is the eager one above
            self.output = self._pass(self.features, self.feature_positions, self.count)
        self.graph = graph
        return log_probs

    def _pass(self, features, feature_positions, added) -> torch.Tensor:
        return draft_log_probs(self.drafter, self.embedding, self.lm_head, self.block, self.positions, features,
                          feature_positions, self.context, added)


def draft_log_probs(drafter, embedding, lm_head, block, positions, features, feature_positions, context, added=None):
    """The drafter's log-probabilities ``[block-1, vocab]`` for the slots after the root: the pass both
    steps run (the fixed step through its own buffers)."""
    hidden = drafter(drafter.embed(block, embedding), features.to(embedding.dtype), block_positions=positions,
                     context_positions=feature_positions, cache=context, context_count=added)
    return torch.log_softmax(drafter.logits(hidden[0, 1:], lm_head).float(), dim=-1)
