"""DDTree's stages as fixed-shape tensor programs: no host reads, no data-dependent shapes.

Each function here is the fixed-shape form of the readable stage of the same name
(``ddtree.tree.build_tree`` and ``chain_tree``, ``ddtree.verify.ancestor_mask`` and ``follow_tree``),
written so that a whole decoding step can be captured once and replayed as a CUDA graph: every loop
runs a fixed number of times (the block depth, or its logarithm) and every tensor has a
shape fixed by the budget. The readable forms stay the reference; tests hold these to them.

- ``build_tree``: per depth, expand the best ``budget`` partial paths by their best
  ``budget`` tokens and keep the best ``budget`` (a beam); then the global best ``budget`` nodes.
  A node of the best-first tree has fewer than ``budget`` better nodes in all, so fewer
  at its own depth: the beam holds it, and the global cut finds exactly the heap's nodes
  (ties aside). Nodes come parents first: by depth, then by path probability.
- ``chain_tree``: DFlash's chain, the most probable token at every depth.
- ``ancestor_mask``: the ancestors-and-self mask by repeated squaring of the parent relation.
- ``follow_tree``: the walk, from the ancestor mask: a node is on the path when it and
  all its ancestors hold the target's choice after their parents; the deepest is the leaf.
- ``heap_order`` and ``on_first_choices``: a beam's tree in the heap's order, and the nodes on the drafter's
  first-choice path (``DraftTree.on_first_choices``), for pricing many requests' trees at once.
- ``compaction_rows``: the KV rows that move so the accepted path follows the past, as a
  fixed number of (source, target) pairs.

Each takes any leading batch dimensions (a tree per row), so many requests' steps can be one
program; the decoding loops here run one request, without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class FixedTree:
    """``budget`` draft nodes (node 0, the root, is implicit), parents first. ``valid`` is False
    for padding nodes, which exist only when the block cannot hold ``budget`` nodes."""

    tokens: torch.Tensor  # [B] long
    parents: torch.Tensor  # [B] long, 0 = root, else 1 + index of the parent
    depths: torch.Tensor  # [B] long, 1-based
    log_probs: torch.Tensor  # [B] float32
    path_log_probs: torch.Tensor  # [B] float32
    ranks: torch.Tensor  # [B] long
    valid: torch.Tensor  # [B] bool

    def cpu(self) -> FixedTree:
        """The tree on the host, in two reads (its whole numbers, then its log-probabilities), not one a field."""
        tokens, parents, depths, ranks, valid = torch.stack([self.tokens, self.parents, self.depths, self.ranks,
                                                             self.valid.long()]).cpu()
        log_probs, path_log_probs = torch.stack([self.log_probs, self.path_log_probs]).cpu()
        return FixedTree(tokens, parents, depths, log_probs, path_log_probs, ranks, valid.bool())

    @staticmethod
    def each(combine: Callable[..., torch.Tensor], *trees: FixedTree) -> FixedTree:
        """The tree whose every field is ``combine`` of the ``trees``' same field (a cut, a stack, a choice...)."""
        return FixedTree(*(combine(*(getattr(tree, field.name) for tree in trees)) for field in fields(FixedTree)))

    @staticmethod
    def empty(device: torch.device) -> FixedTree:
        """AR's tree: the root alone."""
        long = torch.empty(0, dtype=torch.long, device=device)
        real = torch.empty(0, dtype=torch.float32, device=device)
        return FixedTree(long, long, long, real, real, long, torch.empty(0, dtype=torch.bool, device=device))


def build_tree(log_probs: torch.Tensor, budget: int) -> FixedTree:
    """``ddtree.tree.build_tree``'s fixed-shape form, by a beam per depth and a global cut: the ``budget`` most
    probable nodes below the root, from per-depth ``log_probs [..., D, V]`` (any leading batch dimensions: one
    tree per row)."""
    *batch, depth_limit, vocab = log_probs.shape
    device = log_probs.device
    width = min(budget, vocab)
    top_lp, top_tokens = torch.topk(log_probs.float(), width, dim=-1)  # [..., D, K]
    # flat index parent * width + rank per beam entry, decoded once for all depths below;
    # depth 1's parent is the root (its entries decode to parent 0, unused)
    path = _pad(top_lp[..., 0, :width], budget)
    beam_lp, beam_flat = [path], [_pad(torch.arange(width, device=device), budget, 0).expand(*batch, budget)]
    for depth in range(1, depth_limit):
        candidates = (path[..., :, None] + top_lp[..., depth, None, :]).flatten(-2)  # [..., B * K]
        path, flat = torch.topk(candidates, budget, dim=-1)
        beam_lp.append(path), beam_flat.append(flat)
    all_lp = torch.stack(beam_lp, dim=-2).flatten(-2)  # [..., D * B]: entry d * budget + b
    flat = torch.stack(beam_flat, dim=-2).flatten(-2)
    beam_parent, beam_rank = flat // width, flat % width
    # the global cut; stable sorts keep a parent ahead of a child with the same path probability
    depth_of = torch.arange(depth_limit, device=device)[:, None].expand(-1, budget).reshape(-1)
    order = torch.sort(all_lp, dim=-1, descending=True, stable=True).indices[..., :budget]
    order = order.gather(-1, torch.sort(depth_of[order], dim=-1, stable=True).indices)  # parents first
    depth_index = order // budget
    numbers = torch.arange(1, budget + 1, device=device).expand(*batch, budget)
    node_of = torch.full((*batch, depth_limit * budget), -1, dtype=torch.long,
                         device=device).scatter_(-1, order, numbers)
    parent_entry = (depth_index - 1).clamp(min=0) * budget + beam_parent.gather(-1, order)
    parents = torch.where(depth_index == 0, 0, node_of.gather(-1, parent_entry))
    ranks = beam_rank.gather(-1, order)
    chosen = depth_index * width + ranks  # entry of [..., D * K]
    path_lp = all_lp.gather(-1, order)
    return FixedTree(tokens=top_tokens.flatten(-2).gather(-1, chosen), parents=parents.clamp(min=0),
                     depths=depth_index + 1, log_probs=top_lp.flatten(-2).gather(-1, chosen), path_log_probs=path_lp,
                     ranks=ranks, valid=path_lp > NEG_INF)


def chain_tree(log_probs: torch.Tensor) -> FixedTree:
    """``ddtree.tree.chain_tree``'s fixed-shape form: DFlash's draft, the most probable token at every depth,
    one branch."""
    top_lp, tokens = log_probs.float().max(dim=-1)  # [..., D]
    nodes = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    return FixedTree(tokens=tokens, parents=nodes, depths=nodes + 1, log_probs=top_lp,
                     path_log_probs=torch.cumsum(top_lp, -1), ranks=torch.zeros_like(nodes),
                     valid=torch.ones_like(tokens, dtype=torch.bool))


def reordered(tree: FixedTree, order: torch.Tensor) -> FixedTree:
    """``DraftTree.reordered``'s batched form: each row's nodes in its ``order [..., n]`` (old node indices, 0-based,
    parents before their children), parent indices renumbered to match."""
    numbers = torch.arange(1, order.shape[-1] + 1, device=order.device).expand_as(order)
    renumbered = torch.zeros(*order.shape[:-1], order.shape[-1] + 1, dtype=torch.long,
                             device=order.device).scatter_(-1, order + 1, numbers)  # old node (root 0) -> new node
    taken = [field.gather(-1, order) for field in (tree.tokens, tree.parents, tree.depths, tree.log_probs,
                                                   tree.path_log_probs, tree.ranks, tree.valid)]
    taken[1] = renumbered.gather(-1, taken[1])
    return FixedTree(*taken)


def heap_order(tree: FixedTree) -> FixedTree:
    """The tree's nodes in the order ``ddtree.tree.build_tree``'s heap pops them: by path probability, best first;
    the beam lays them out by depth, so a stable sort keeps a parent ahead of a child of the same probability, and
    padding nodes go last."""
    return reordered(tree, torch.sort(tree.path_log_probs, dim=-1, descending=True, stable=True).indices)


def ancestors_min(values: torch.Tensor, parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[..., n]``: each node's least value among itself and its ancestors (``parents``: 0 the root, else 1 + the
    parent's index), one depth further up the tree a round."""
    top = torch.full_like(values[..., :1], torch.finfo(values.dtype).max if values.is_floating_point()
                          else torch.iinfo(values.dtype).max)
    for _ in range(max_depth - 1):
        values = torch.minimum(values, torch.cat([top, values], dim=-1).gather(-1, parents))
    return values


def on_first_choices(tree: FixedTree, max_depth: int) -> torch.Tensor:
    """``DraftTree.on_first_choices``' fixed-shape form: ``[..., n]`` bool, every node whose path from the root takes
    its depth's most probable token at every depth."""
    return ancestors_min((tree.ranks == 0).int(), tree.parents, max_depth) > 0


def _pad(values: torch.Tensor, size: int, fill=NEG_INF) -> torch.Tensor:
    """``values [..., n]`` cut or padded with ``fill`` to ``[..., size]``."""
    if values.shape[-1] >= size:
        return values[..., :size]
    return torch.cat([values, values.new_full((*values.shape[:-1], size - values.shape[-1]), fill)], dim=-1)


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``ddtree.verify.ancestor_mask``'s fixed-shape form, by repeated squaring of the parent relation:
    ``[..., n+1, n+1]`` bool, row i sees column j iff j is i or an ancestor."""
    *batch, n = parents.shape
    device = parents.device
    step = torch.zeros(*batch, n + 1, n + 1, device=device)
    # child -> parent, as entries of the flattened matrix; ones from the device (a Python scalar is a host copy)
    entries = torch.arange(1, n + 1, device=device) * (n + 1) + parents
    step.view(*batch, (n + 1) * (n + 1)).scatter_(-1, entries, torch.ones_like(entries, dtype=step.dtype))
    reach = step + torch.eye(n + 1, device=device)
    for _ in range(max(1, max_depth - 1).bit_length()):  # paths of up to 2^r edges after r squarings
        reach = (reach @ reach).clamp(max=1.0)
    return reach > 0


def follow_tree(tree: FixedTree, target_tokens: torch.Tensor, visible: torch.Tensor, max_depth: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ddtree.verify.follow_tree``'s fixed-shape form: the walk without a host read, in a few whole-tree
    operations. ``target_tokens [..., n+1]``: the target's choice after each node, root first; ``visible``:
    the tree's ``ancestor_mask``. A node is accepted when it and every ancestor hold the target's
    choice after their parents (siblings hold distinct tokens, so these nodes form one chain);
    the deepest is the leaf, and its row of ``visible`` is the path. Returns ``(path
    [..., max_depth+1], length, bonus)``: the accepted node indices root first (padded with the
    leaf), how many there are, and the target's choice at the leaf."""
    device = target_tokens.device
    root = torch.zeros_like(target_tokens[..., :1])
    holds = torch.cat([torch.ones_like(root, dtype=torch.bool),
                       (tree.tokens == target_tokens.gather(-1, tree.parents)) & tree.valid], dim=-1)
    accepted = ~(visible & ~holds[..., None, :]).any(dim=-1)
    depth = torch.cat([root, tree.depths], dim=-1)
    leaf = torch.argmax(torch.where(accepted, depth, -1), dim=-1, keepdim=True)  # [..., 1]
    on_path = visible.gather(-2, leaf[..., None].expand(*leaf.shape, visible.shape[-1])).squeeze(-2)
    # node i of the path goes to row depth[i]; every other node to a spare last row
    rows = torch.where(on_path, depth, max_depth + 1)
    nodes = torch.arange(depth.shape[-1], device=device).expand_as(depth)
    path = torch.zeros(*depth.shape[:-1], max_depth + 2, dtype=torch.long, device=device)
    path = path.scatter_(-1, rows, nodes)[..., : max_depth + 1]
    length = depth.gather(-1, leaf) + 1  # [..., 1]
    path = torch.where(torch.arange(max_depth + 1, device=device) < length, path, leaf)
    return path, length.squeeze(-1), target_tokens.gather(-1, leaf).squeeze(-1)


def compaction_rows(past: torch.Tensor, path: torch.Tensor, length: torch.Tensor, scratch: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sources, targets)``, one pair per row of ``path``: accepted node k moves from
    ``past + path[k]`` to ``past + k``; the padding rows past ``length`` go to the ``scratch``
    row, which no request reads. Copy all sources before writing any target."""
    past, length = past.unsqueeze(-1), length.unsqueeze(-1)
    slots = torch.arange(path.shape[-1], device=path.device)
    return past + path, torch.where(slots < length, past + slots, scratch)
