"""Turn a draft tree into one verification pass, and read the target's answer back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.tree import DraftTree


@dataclass(frozen=True)
class TreeInputs:
    """What the target needs to score every tree node in one forward pass."""

    input_ids: torch.Tensor  # [1, n+1]: root, then the draft nodes
    position_ids: torch.Tensor  # [1, n+1]: start + depth
    visible: torch.Tensor  # [n+1, n+1] bool: row i may attend to column j (ancestors and self)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """``[n+1, n+1]`` bool: node i sees node j iff j is i itself or one of its ancestors.

    ``parents [n]`` lists the parent of nodes 1..n. Every node climbs one level per round (the
    root is its own parent), so the loop runs depth times, not once per node.
    """
    return ancestor_masks(parents[None])[0]


def ancestor_masks(parents: torch.Tensor) -> torch.Tensor:
    """``ancestor_mask`` of many trees at once: ``parents [B, n]`` (a shorter tree's row padded with nodes hung
    on its root, which are no one's ancestors), ``[B, n+1, n+1]``."""
    trees, n = parents.shape
    parent_of = torch.cat([torch.zeros(trees, 1, dtype=torch.long), parents.long()], dim=1)  # [B, n+1]
    visible = torch.eye(n + 1, dtype=torch.bool).repeat(trees, 1, 1)
    ancestor = torch.arange(n + 1).repeat(trees, 1)
    while bool(ancestor.any()):
        ancestor = parent_of.gather(1, ancestor)
        visible.scatter_(2, ancestor[..., None], True)
    return visible


def compile_tree(tree: DraftTree, root_token: int, start: int) -> TreeInputs:
    """Inputs for verifying ``tree`` whose root sits at absolute position ``start``."""
    input_ids = torch.cat([torch.tensor([root_token], dtype=torch.long), tree.tokens])
    depths = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])
    return TreeInputs(
        input_ids=input_ids[None],
        position_ids=(start + depths)[None],
        visible=ancestor_mask(tree.parents),
    )


def attention_bias(visible: torch.Tensor, past_length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask ``[1, 1, q, past + q]`` for ``visible [q, q]``: the whole past, then the tree block."""
    q = visible.shape[0]
    bias = torch.zeros(1, 1, q, past_length + q, dtype=dtype, device=visible.device)
    bias[0, 0, :, past_length:].masked_fill_(~visible, torch.finfo(dtype).min)
    return bias


def sample_tokens(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row of ``logits [..., vocab]``: argmax at temperature 0, else a draw.

    Drawing the target's token independently at every tree node keeps the output
    distribution exactly the target's: each committed token is a draw from the
    target conditioned on the committed prefix, whatever the draft proposed.
    """
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    draws = torch.multinomial(flat, 1, generator=generator)
    return draws.reshape(probs.shape[:-1])


def follow_tree(tree: DraftTree, target_tokens: list[int]) -> tuple[list[int], int]:
    """Walk from the root, stepping into the child that holds the target's token.

    ``target_tokens[i]`` (n+1 of them) is the target's choice after node i. Returns the accepted
    node indices (root first) and the bonus token: the target's choice at the last
    accepted node, which no child matched.
    """
    children = tree.child_maps()
    accepted = [0]
    node = 0
    while (child := children[node].get(target_tokens[node])) is not None:
        accepted.append(child)
        node = child
    return accepted, target_tokens[node]
