"""The fixed-shape (graph-replayable) tree stages against the readable reference: the heap,
the ancestor mask and the walk."""

from __future__ import annotations

import pytest
import torch

import ddtree
from ddtree.fixed import FixedTree, ancestor_mask, build_tree, chain_tree, compaction_rows, follow_tree


def random_log_probs(depth: int, vocab: int, seed: int, peaked: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(depth, vocab, generator=generator) * peaked, dim=-1)


def token_paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """Every node as the token sequence from the root to it (what identifies a node)."""
    paths: list[tuple[int, ...]] = [()]
    for token, parent in zip(tokens, parents):
        paths.append(paths[parent] + (token,))
    return set(paths[1:])


def as_reference(tree: FixedTree) -> ddtree.DraftTree:
    keep = tree.valid
    return ddtree.DraftTree(tree.tokens[keep], tree.parents[keep], tree.depths[keep], tree.log_probs[keep],
                            tree.path_log_probs[keep], tree.ranks[keep])


@pytest.mark.parametrize("depth, vocab, budget, seed", [
    (15, 64, 1, 0), (15, 64, 4, 1), (15, 500, 16, 2), (15, 500, 64, 3), (15, 2000, 200, 4), (3, 8, 30, 5),
    (15, 49, 512, 6), (1, 100, 10, 7),
])
def test_the_beam_build_finds_the_heaps_tree(depth, vocab, budget, seed):
    log_probs = random_log_probs(depth, vocab, seed)
    heap = ddtree.build_tree(log_probs, budget)
    beam = build_tree(log_probs, budget)
    assert int(beam.valid.sum()) == heap.size == budget
    assert token_paths(beam.tokens.tolist(), beam.parents.tolist()) == token_paths(heap.tokens.tolist(),
                                                                                    heap.parents.tolist())
    parents, depths = beam.parents.tolist(), beam.depths.tolist()
    for node, (parent, depth_of) in enumerate(zip(parents, depths), start=1):
        assert parent < node, "parents first"
        assert depth_of == (1 if parent == 0 else depths[parent - 1] + 1)
        parent_lp = 0.0 if parent == 0 else float(beam.path_log_probs[parent - 1])
        assert float(beam.path_log_probs[node - 1]) == pytest.approx(parent_lp + float(beam.log_probs[node - 1]),
                                                                    abs=1e-4)
        assert float(beam.log_probs[node - 1]) == pytest.approx(float(log_probs[depth_of - 1, beam.tokens[node - 1]]))


def test_the_chain_is_dflashs_draft():
    log_probs = random_log_probs(15, 300, seed=9)
    fixed, reference = chain_tree(log_probs), ddtree.chain_tree(log_probs)
    for name in ("tokens", "parents", "depths", "ranks"):
        assert torch.equal(getattr(fixed, name), getattr(reference, name)), name
    torch.testing.assert_close(fixed.path_log_probs, reference.path_log_probs)


def test_ties_never_leave_a_node_without_its_parent():
    """A certain token (probability 1 in float32) gives a child the path probability of its
    parent; the cut between equals must keep the parent."""
    log_probs = torch.full((6, 5), -30.0)
    log_probs[:, 0] = 0.0
    log_probs[2] = torch.log_softmax(torch.zeros(5), dim=-1)  # a five-way tie at depth 3
    for budget in range(1, 12):
        tree = build_tree(log_probs, budget)
        for node, parent in enumerate(tree.parents.tolist(), start=1):
            assert parent < node and (parent == 0 or tree.depths[node - 1] == tree.depths[parent - 1] + 1)


@pytest.mark.parametrize("budget, seed", [(1, 0), (8, 1), (33, 2), (128, 3)])
def test_the_squared_ancestor_mask_is_the_climbed_one(budget, seed):
    tree = ddtree.build_tree(random_log_probs(15, 300, seed, peaked=1.0), budget)
    assert torch.equal(ancestor_mask(tree.parents, max_depth=15), ddtree.ancestor_mask(tree.parents))


@pytest.mark.parametrize("seed", range(12))
def test_the_fixed_walk_is_the_walk(seed):
    generator = torch.Generator().manual_seed(seed)
    log_probs = random_log_probs(15, 40, seed, peaked=1.5)
    fixed = build_tree(log_probs, 48)
    tree = as_reference(fixed)
    target = torch.randint(0, 40, (tree.size + 1,), generator=generator)
    # make the target follow a random node's path, so walks go deep
    node = int(torch.randint(1, tree.size + 1, (1,), generator=generator))
    while node:
        parent = int(tree.parents[node - 1])
        target[parent] = tree.tokens[node - 1]
        node = parent
    expected_path, expected_bonus = ddtree.follow_tree(tree, target.tolist())
    path, length, bonus = follow_tree(fixed, target, ancestor_mask(fixed.parents, 15), max_depth=15)
    assert int(length) == len(expected_path) and int(bonus) == expected_bonus
    assert path[: int(length)].tolist() == expected_path
    assert set(path[int(length):].tolist()) <= {expected_path[-1]}, "padding repeats the leaf"


def test_the_walk_ignores_padding_nodes():
    log_probs = torch.log_softmax(torch.randn(2, 3), dim=-1)  # only 3 + 9 nodes exist
    tree = build_tree(log_probs, 16)
    assert int(tree.valid.sum()) == 12
    target = torch.zeros(17, dtype=torch.long)
    path, length, _ = follow_tree(tree, target, ancestor_mask(tree.parents, 2), max_depth=2)
    assert all(bool(tree.valid[i - 1]) for i in path[1: int(length)].tolist())


def test_a_batch_of_trees_is_each_tree_on_its_own():
    """Every stage takes leading batch dimensions: row b of a batched call is the unbatched call on row b."""
    generator = torch.Generator().manual_seed(21)
    rows = [random_log_probs(15, 60, seed, peaked=1.5) for seed in (30, 31, 32)]
    batched = build_tree(torch.stack(rows), 24)
    singles = [build_tree(log_probs, 24) for log_probs in rows]
    for name in FixedTree.__dataclass_fields__:
        assert torch.equal(getattr(batched, name), torch.stack([getattr(one, name) for one in singles])), name
    chains = chain_tree(torch.stack(rows))
    assert torch.equal(chains.tokens, torch.stack([chain_tree(log_probs).tokens for log_probs in rows]))

    visible = ancestor_mask(batched.parents, 15)
    assert torch.equal(visible, torch.stack([ancestor_mask(one.parents, 15) for one in singles]))
    target = torch.randint(0, 60, (3, 25), generator=generator)
    for one, row in zip(singles, target):  # walks that go deep: the target follows the deepest node's path
        node = int(one.depths.argmax()) + 1
        while node:
            parent = int(one.parents[node - 1])
            row[parent] = one.tokens[node - 1]
            node = parent
    path, length, bonus = follow_tree(batched, target, visible, 15)
    for b, one in enumerate(singles):
        single = follow_tree(one, target[b], visible[b], 15)
        assert torch.equal(path[b], single[0]) and int(length[b]) == int(single[1]) and int(bonus[b]) == int(single[2])
    assert int(length.max()) >= 3

    past = torch.tensor([5, 40, 77])
    sources, targets = compaction_rows(past, path, length, scratch=999)
    for b in range(3):
        single = compaction_rows(past[b], path[b], length[b], scratch=999)
        assert torch.equal(sources[b], single[0]) and torch.equal(targets[b], single[1])
