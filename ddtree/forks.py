"""Recurrent states forked along a tree: where every node's state comes from.

A linear-attention layer (Gated DeltaNet) carries a state from token to token: a short
convolution window over its last inputs and a recurrent matrix. In a tree each node
continues its parent's state, so siblings share a prefix and then diverge. From the tree's
ancestor mask alone (fixed shapes, no host reads, so a CUDA graph can hold them) these
functions say which inputs each node's state is made of:

- ``path_table``: the node at each depth of every node's root-to-node path;
- ``leaf_chains``: which walks along those paths score which nodes;
- ``window_columns``: a node's convolution window, as columns of ``[committed window |
  node inputs]``;
- ``path_replay``: every node's path laid out as one sequence of a batch, so that a
  recurrent kernel running a batch of sequences from one shared initial state yields every
  node's output in one launch. Each node's state is then its path replayed from the committed
  state, the very arithmetic of decoding that path token by token; no node's state is ever
  written where a sibling could read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def depths(visible: torch.Tensor) -> torch.Tensor:
    """Each node's depth (the root's is 0): how many ancestors it sees."""
    return visible.sum(dim=1) - 1


def path_table(visible: torch.Tensor, length: int) -> torch.Tensor:
    """``[q, length]`` long: column d of row i is node i's ancestor at depth d (i itself at its
    own depth); columns past its depth repeat node i. ``visible`` is the ancestors-and-self mask."""
    q = visible.shape[0]
    nodes = torch.arange(q, device=visible.device)
    columns = torch.where(visible, depths(visible)[None, :], length)  # not an ancestor: a spare column
    table = nodes[:, None].expand(q, length + 1).contiguous()
    table.scatter_(1, columns, nodes[None, :].expand(q, q))
    return table[:, :length]


def leaf_chains(table: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """``[q]`` long: for each leaf, the depth its chain starts at; -1 for a node with children.

    A node's chain runs down through first children (the lowest-numbered child) to a leaf, so
    every node lies on exactly one leaf's chain: walking each leaf's path from its root and
    scoring the nodes from its chain's start on scores each node once, with as many walks as
    the tree has leaves (``table``: ``path_table``, ``depth``: ``depths``). The pass may hold a
    forest (a batch's trees, block-diagonal): every root starts a chain.

    E.g. two trees packed, parents [-, 0, 0 | -, 3]: node 1 is node 0's first child, so the
    chains are 0-1 (leaf 1, from depth 0), 2 (leaf 2, from depth 1) and 3-4 (leaf 4, from depth 0)."""
    q, length = table.shape
    nodes = torch.arange(q, device=table.device)
    root = depth == 0
    parent = table.gather(1, (depth - 1).clamp(min=0)[:, None])[:, 0]  # a root's: itself
    first_child = torch.full((q + 1,), q, dtype=nodes.dtype, device=nodes.device)  # a spare entry for the roots
    first_child.scatter_reduce_(0, torch.where(root, q, parent), nodes, reduce="amin")
    starts = (first_child[parent] != nodes) | root
    columns = torch.arange(length, device=nodes.device)
    on_path = starts[table] & (columns[None, :] <= depth[:, None])
    start_depth = torch.where(on_path, columns[None, :], 0).amax(dim=1)
    leaf = first_child[:q] == q  # no child
    return torch.where(leaf, start_depth, -1)


def packed_paths(local: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """``path_table`` of a batch's pass from each token's path in its own tree's numbering (``local [T, length]``,
    ``ddtree.verify_paths``' layout, whose columns past a token's depth stay in its tree): the same paths in the
    pass's numbering, where token i's own local index ``local[i, depth[i]]`` sits at i.

    E.g. two trees of 3 and 2 nodes: token 4 (the second tree's node 1) has local path [0, 1] and becomes [3, 4]."""
    own = local.gather(1, depth[:, None].long())  # [T, 1]: each token's index in its own tree
    offset = torch.arange(local.shape[0], device=local.device)[:, None] - own
    return local.long() + offset


def window_columns(table: torch.Tensor, last_depth: torch.Tensor, width: int) -> torch.Tensor:
    """``[q, width]`` long: the ``width`` inputs of row i's path ending at depth ``last_depth[i]``,
    as columns of ``[committed window (width columns, oldest first) | node 0 input | node 1 ...]``.
    ``last_depth = depth - 1`` gives the window a node starts from, ``depth`` the one it leaves."""
    offsets = last_depth[:, None] - width + 1 + torch.arange(width, device=table.device)
    inside = table.gather(1, offsets.clamp(min=0))
    return torch.where(offsets < 0, width + offsets, width + inside)


@dataclass(frozen=True)
class PathReplay:
    """Every node's root-to-node path as one sequence of a batch of ``q + 1`` sequences.

    Sequence i (i < q) is node i's path, ``depth[i] + 1`` tokens; the last sequence covers the
    unused tail so that the layout has a fixed ``q * length`` tokens (give it no state to read
    and a kernel skips it).
    """

    nodes: torch.Tensor  # [q * length] long: the node whose inputs each replayed token reads
    starts: torch.Tensor  # [q + 2] int32: sequence boundaries (cumulative lengths)
    last: torch.Tensor  # [q] long: where node i's own token sits (its sequence's last)


def path_replay(table: torch.Tensor, depth: torch.Tensor) -> PathReplay:
    q, length = table.shape
    device = table.device
    lengths = depth + 1
    ends = torch.cumsum(lengths, 0)
    total = q * length
    starts = torch.cat([torch.zeros(1, dtype=torch.long, device=device), ends,
                        torch.full((1,), total, dtype=torch.long, device=device)])
    steps = torch.arange(length, device=device)
    # token t of node i's path goes to starts[i] + t; the rest to a spare slot, dropped
    slots = torch.where(steps[None, :] < lengths[:, None], starts[:q, None] + steps[None, :], total)
    nodes = torch.zeros(total + 1, dtype=torch.long, device=device).scatter_(0, slots.reshape(-1), table.reshape(-1))
    return PathReplay(nodes=nodes[:total], starts=starts.to(torch.int32), last=ends - 1)
