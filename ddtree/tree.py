"""Best-first construction of the most probable draft tree within a node budget."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """A prefix-closed token tree hanging below a root (the last committed token).

    Node 0 is the root and carries no draft; draft nodes are 1..size, stored in the
    order the heap produced them, so every parent precedes its children. All tensors
    describe the draft nodes only (length ``size``).
    """

    tokens: torch.Tensor  # [n] long
    parents: torch.Tensor  # [n] long, index of the parent node (0 = root)
    depths: torch.Tensor  # [n] long, 1-based
    log_probs: torch.Tensor  # [n] float, the node's own draft log-prob at its depth
    path_log_probs: torch.Tensor  # [n] float, sum of log-probs root -> node
    ranks: torch.Tensor  # [n] long, rank of the token in its depth's draft distribution

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    def on_first_choices(self) -> torch.Tensor:
        """``[n]`` bool: whether each node lies on the drafter's first-choice path, its depth's most probable token
        below its depth's most probable token all the way from the root (the chain DFlash drafts). The drafter
        drafts every depth as if that path were taken, so a node off it is accepted less often than its path
        probability says. Parents come first, so one pass settles every node."""
        return on_first_choices_of([self])

    def child_maps(self) -> list[dict[int, int]]:
        """For every node (root included), its children keyed by token id."""
        children: list[dict[int, int]] = [{} for _ in range(self.size + 1)]
        for node, (parent, token) in enumerate(zip(self.parents.tolist(), self.tokens.tolist()), start=1):
            children[parent][token] = node
        return children

    def reordered(self, order: torch.Tensor) -> DraftTree:
        """The same tree with its nodes in ``order`` (``[n]``: old node indices, 0-based, parents before their
        children), its parent indices renumbered to match."""
        renumbered = torch.zeros(self.size + 1, dtype=torch.long)  # old node (root 0) -> new node
        renumbered[order + 1] = torch.arange(1, self.size + 1)
        parents = renumbered[self.parents[order]]
        if bool((parents >= torch.arange(1, self.size + 1)).any()):
            raise ValueError("a reordered tree must keep every parent before its children")
        return DraftTree(self.tokens[order], parents, self.depths[order], self.log_probs[order],
                         self.path_log_probs[order], self.ranks[order])

    @staticmethod
    def empty() -> DraftTree:
        long = torch.empty(0, dtype=torch.long)
        real = torch.empty(0, dtype=torch.float32)
        return DraftTree(long, long, long, real, real, long)


def on_first_choices_of(trees: list[DraftTree]) -> torch.Tensor:
    """``DraftTree.on_first_choices`` of every tree, concatenated (``[sum of sizes]``), in one pass over their nodes."""
    if not trees:
        return torch.zeros(0, dtype=torch.bool)
    parents = torch.cat([tree.parents for tree in trees]).tolist()
    ranks = torch.cat([tree.ranks for tree in trees]).tolist()
    begins, begin = [], 0  # each node's tree's first place in ``on``
    for tree in trees:
        begins += [begin] * tree.size
        begin += tree.size
    on: list[bool] = []
    for parent, rank, begin in zip(parents, ranks, begins):
        on.append(rank == 0 and (parent == 0 or on[begin + parent - 1]))
    return torch.tensor(on, dtype=torch.bool)


class Drafts:
    """Many requests' drafts ``[b, D, V]`` (one drafter pass), read to the host as their trees need them: each
    top-k width once for every request, in one ``topk`` and one read, where a tree built from its own draft
    reads its own (a round trip to the device each)."""

    def __init__(self, log_probs: torch.Tensor):
        self.log_probs = log_probs
        self._top: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[b, D, k]`` log-probabilities and tokens of every depth's ``k`` most probable, on the host."""
        if k not in self._top:
            values, tokens = torch.topk(self.log_probs.detach().float(), k=k, dim=-1)
            self._top[k] = values.cpu(), tokens.cpu()
        return self._top[k]

    def rows(self) -> list[DraftRow]:
        return [DraftRow(self, index) for index in range(self.log_probs.shape[0])]


@dataclass(frozen=True)
class DraftRow:
    """One request's draft of a ``Drafts``: what a tree builder reads of a ``[D, V]`` draft."""

    drafts: Drafts
    index: int

    @property
    def shape(self) -> torch.Size:
        return self.drafts.log_probs.shape[1:]

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        values, tokens = self.drafts.top(k)
        return values[self.index], tokens[self.index]


def top_drafts(log_probs: torch.Tensor | DraftRow, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[D, k]`` log-probabilities and tokens of each depth's ``k`` most probable draft tokens: of a batch's
    draft as read once for the batch, or of one draft ``[D, V]`` where it lies."""
    if isinstance(log_probs, DraftRow):
        return log_probs.top(k)
    return torch.topk(log_probs.detach().float(), k=k, dim=-1)


def build_tree(log_probs: torch.Tensor | DraftRow, budget: int, width: int | None = None) -> DraftTree:
    """The ``budget`` nodes of highest path probability, as a prefix-closed tree.

    ``log_probs`` is ``[depth, vocab]`` (or a batch's ``DraftRow``): one block-diffusion pass gives an independent
    distribution per depth, so a node's path probability is the product of its
    tokens' probabilities along the path. Expanding a node pushes only its best
    child and its next sibling, so the heap holds O(budget) entries and pops nodes
    in non-increasing path probability, which is why the popped set is prefix-closed.
    ``width`` caps the candidates per depth (``width=1`` is a DFlash chain).
    """
    if budget < 0:
        raise ValueError(f"tree budget must be >= 0, got {budget}")
    depth_limit, vocab = log_probs.shape
    top_k = min(budget, vocab, width if width is not None else budget)
    if budget == 0 or depth_limit == 0 or top_k == 0:
        return DraftTree.empty()

    top_log_probs, top_tokens = top_drafts(log_probs, top_k)
    lp = top_log_probs.tolist()
    tok = top_tokens.tolist()

    # heap entries: (-path_log_prob, tie-break counter, parent, depth, rank, path_log_prob)
    heap = [(-lp[0][0], 0, 0, 1, 0, lp[0][0])]
    pushed = 1
    tokens, parents, depths, node_lp, path_lp, ranks = [], [], [], [], [], []
    while heap and len(tokens) < budget:
        _, _, parent, depth, rank, path = heapq.heappop(heap)
        tokens.append(tok[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        node_lp.append(lp[depth - 1][rank])
        path_lp.append(path)
        ranks.append(rank)
        node = len(tokens)
        if rank + 1 < top_k:
            sibling = path - lp[depth - 1][rank] + lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, pushed, parent, depth, rank + 1, sibling))
            pushed += 1
        if depth < depth_limit:
            child = path + lp[depth][0]
            heapq.heappush(heap, (-child, pushed, node, depth + 1, 0, child))
            pushed += 1

    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        depths=torch.tensor(depths, dtype=torch.long),
        log_probs=torch.tensor(node_lp, dtype=torch.float32),
        path_log_probs=torch.tensor(path_lp, dtype=torch.float32),
        ranks=torch.tensor(ranks, dtype=torch.long),
    )


def chain_tree(log_probs: torch.Tensor) -> DraftTree:
    """DFlash's linear draft: the greedy token at every depth, as a one-branch tree."""
    return build_tree(log_probs, budget=log_probs.shape[0], width=1)
