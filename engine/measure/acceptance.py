"""Acceptance along a greedy output, without verifying: the drafter's proposals at every root, and the
steps DFlash or DDTree would take along them (``engine.tools.replay``, the doctor's probe)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import ddtree
from engine.methods import Method

# bands of the target's own confidence in its next token, for first-slot hit rates
CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.9)


@dataclass(frozen=True)
class Proposals:
    """The drafter's proposals at every root along one greedy output: row ``j`` is the pass whose
    root is ``output_ids[j]`` (its ``top_k`` most probable tokens per slot, and their log-probs)."""

    output_ids: list[int]
    log_probs: torch.Tensor  # [len(output_ids), block - 1, top_k]
    tokens: torch.Tensor  # [len(output_ids), block - 1, top_k] vocabulary ids
    confidence: torch.Tensor  # [len(output_ids) - 1]: the target's probability of output_ids[j + 1]

    def first_slot_hits(self) -> list[tuple[bool, float]]:
        """Per root but the last: (the first slot's top token is AR's next one, the target's confidence)."""
        hits = (self.tokens[:-1, 0, 0] == torch.tensor(self.output_ids[1:])).tolist()
        return list(zip(hits, self.confidence.tolist()))


def replay(proposals: Proposals, method: Method, tree_budget: int) -> list[int]:
    """The acceptance length of every step (tokens committed) of greedy ``method`` along the output, its trees
    built on the top-k columns (``method.readable``, as the readable step builds them)."""
    output, lengths, j = proposals.output_ids, [], 0
    while j < len(output) - 1:
        log_probs, tokens = proposals.log_probs[j], proposals.tokens[j]
        tree = method.readable(log_probs, method.nodes(tree_budget, log_probs.shape[0]))
        depths = tree.depths.tolist()
        # AR's choice after every node: nodes off AR's path are never reached, whatever they hold
        after = [output[j + 1 + d] if j + 1 + d < len(output) else -1 for d in [0] + depths]
        vocab_tree = replace(tree, tokens=tokens[tree.depths - 1, tree.tokens])  # top-k columns -> token ids
        accepted, _ = ddtree.follow_tree(vocab_tree, after)
        committed = min(len(accepted), len(output) - 1 - j)  # the bonus past the output's end is never committed
        lengths.append(committed)
        j += committed
    return lengths
