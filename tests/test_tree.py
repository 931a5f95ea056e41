"""Tree construction, compilation, walking and compaction: the invariants of ddtree/."""

import dataclasses
import itertools
import math

import pytest
import torch

import ddtree
from ddtree.tree import DraftTree, on_first_choices_of


def random_log_probs(depth, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(depth, vocab, generator=g) * 2, dim=-1)


def node_paths(tree):
    """Token path (root excluded) of every draft node."""
    paths = {0: ()}
    for node, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()), start=1):
        paths[node] = paths[parent] + (token,)
    return [paths[n] for n in range(1, tree.size + 1)]


def brute_force_top(log_probs, budget):
    depth, vocab = log_probs.shape
    scored = []
    for d in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=d):
            scored.append((sum(log_probs[i, t].item() for i, t in enumerate(path)), path))
    scored.sort(reverse=True)
    return {path for _, path in scored[:budget]}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [1, 2, 5, 13, 40])
def test_best_first_equals_brute_force_top_budget(seed, budget):
    log_probs = random_log_probs(3, 4, seed)
    tree = ddtree.build_tree(log_probs, budget)
    assert tree.size == budget
    assert set(node_paths(tree)) == brute_force_top(log_probs, budget)


@pytest.mark.parametrize("budget", [1, 7, 32, 200])
def test_tree_is_prefix_closed_and_consistent(budget):
    log_probs = random_log_probs(15, 50, seed=budget)
    tree = ddtree.build_tree(log_probs, budget)
    assert tree.size == budget
    paths = node_paths(tree)
    assert len(set(paths)) == tree.size  # no duplicate nodes
    for node, (parent, depth) in enumerate(zip(tree.parents.tolist(), tree.depths.tolist()), start=1):
        assert parent < node  # parents come first
        parent_depth = 0 if parent == 0 else tree.depths[parent - 1].item()
        assert depth == parent_depth + 1
        parent_path_lp = 0.0 if parent == 0 else tree.path_log_probs[parent - 1].item()
        assert math.isclose(tree.path_log_probs[node - 1].item(), parent_path_lp + tree.log_probs[node - 1].item(),
                            rel_tol=1e-5, abs_tol=1e-5)
        rank = tree.ranks[node - 1].item()
        assert log_probs[depth - 1].argsort(descending=True)[rank].item() == tree.tokens[node - 1].item()
    # popped in non-increasing path probability
    assert (tree.path_log_probs[1:] <= tree.path_log_probs[:-1] + 1e-6).all()


def test_budget_beyond_possible_nodes_stops_when_tree_is_full():
    tree = ddtree.build_tree(random_log_probs(2, 3, 0), budget=100)
    assert tree.size == 3 + 9


def test_chain_is_width_one_tree_of_greedy_tokens():
    log_probs = random_log_probs(6, 20, 3)
    chain = ddtree.chain_tree(log_probs)
    assert chain.tokens.tolist() == log_probs.argmax(-1).tolist()
    assert chain.parents.tolist() == list(range(6))
    assert chain.depths.tolist() == list(range(1, 7))
    assert ddtree.ancestor_mask(chain.parents).equal(torch.ones(7, 7, dtype=torch.bool).tril())


def test_invalid_budget_raises():
    with pytest.raises(ValueError, match="budget"):
        ddtree.build_tree(random_log_probs(2, 3, 0), budget=-1)
    assert ddtree.build_tree(random_log_probs(2, 3, 0), budget=0).size == 0


def test_compiled_inputs_mask_is_ancestors_and_positions_are_depth():
    tree = ddtree.build_tree(random_log_probs(5, 6, 1), budget=24)
    inputs = ddtree.compile_tree(tree, root_token=99, start=40)
    assert inputs.input_ids[0, 0].item() == 99
    assert inputs.input_ids[0, 1:].tolist() == tree.tokens.tolist()
    assert inputs.position_ids[0].tolist() == [40] + (40 + tree.depths).tolist()
    parents = [-1] + tree.parents.tolist()
    for i in range(tree.size + 1):
        ancestors, node = {i}, i
        while parents[node] >= 0:
            node = parents[node]
            ancestors.add(node)
        assert set(inputs.visible[i].nonzero().flatten().tolist()) == ancestors


def test_attention_bias_sees_whole_past_and_tree_ancestors():
    visible = ddtree.ancestor_mask(torch.tensor([0, 0, 1]))
    bias = ddtree.attention_bias(visible, past_length=3, dtype=torch.float32)
    assert bias.shape == (1, 1, 4, 7)
    assert (bias[0, 0, :, :3] == 0).all()
    assert ((bias[0, 0, :, 3:] == 0) == visible).all()


def test_follow_tree_walks_target_choices_and_returns_bonus():
    # root -> a(5) -> c(7); root -> b(6) -> d(8)
    tree = ddtree.DraftTree(
        tokens=torch.tensor([5, 6, 7, 8]), parents=torch.tensor([0, 0, 1, 2]), depths=torch.tensor([1, 1, 2, 2]),
        log_probs=torch.zeros(4), path_log_probs=torch.zeros(4), ranks=torch.tensor([0, 1, 0, 0]),
    )
    # target after root says 6 (take b), after b says 8 (take d), after d says 3 (bonus)
    assert ddtree.follow_tree(tree, [6, 0, 8, 0, 3]) == ([0, 2, 4], 3)
    assert ddtree.follow_tree(tree, [9, 5, 6, 7, 8]) == ([0], 9)
    assert ddtree.follow_tree(ddtree.DraftTree.empty(), [4]) == ([0], 4)


def test_compaction_keeps_exactly_the_accepted_rows_in_path_order():
    cache = torch.arange(2 * 10 * 3, dtype=torch.float32).reshape(1, 2, 10, 3)
    original = cache.clone()
    kept = ddtree.compact_rows(cache, past_length=4, accepted=[0, 2, 5])
    assert kept.shape == (1, 2, 7, 3)
    assert kept[:, :, :4].equal(original[:, :, :4])
    assert kept[:, :, 4:].equal(original[:, :, [4, 6, 9]])
    assert ddtree.kept_rows(4, [0, 2, 5]).tolist() == [4, 6, 9]


def test_sampling_is_argmax_at_zero_temperature_and_seeded_otherwise():
    logits = torch.randn(5, 11)
    assert ddtree.sample_tokens(logits, 0.0).equal(logits.argmax(-1))
    a = ddtree.sample_tokens(logits, 1.0, torch.Generator().manual_seed(3))
    b = ddtree.sample_tokens(logits, 1.0, torch.Generator().manual_seed(3))
    assert a.equal(b) and a.shape == (5,)


def test_a_batchs_drafts_read_once_build_the_trees_and_tops_each_draft_builds_alone():
    from ddtree.tree import Drafts
    from engine.loop.run import draft_top

    generator = torch.Generator().manual_seed(3)
    log_probs = torch.log_softmax(torch.randn(3, 6, 40, generator=generator), dim=-1)  # [b, D, V]
    drafts = Drafts(log_probs)
    for row, alone in zip(drafts.rows(), log_probs):
        for budget, width in ((12, None), (6, 1), (40, None)):
            together, apart = ddtree.build_tree(row, budget, width), ddtree.build_tree(alone, budget, width)
            assert together.size and all(torch.equal(getattr(together, f.name), getattr(apart, f.name))
                                         for f in dataclasses.fields(apart))
        assert draft_top(row, 5) == draft_top(alone, 5)
    assert sorted(drafts._top) == [1, 5, 12, 40], "one read per width, for every request at once"


def test_first_choices_of_many_trees_read_each_nodes_parent_in_its_own_tree():
    def tree(parents, ranks):
        size = len(parents)
        return DraftTree(torch.arange(size), torch.tensor(parents), torch.ones(size, dtype=torch.long),
                         torch.zeros(size), torch.zeros(size), torch.tensor(ranks))

    # the second tree's third node hangs below its own second node (off the first choices), not the first tree's
    trees = [tree([0, 1, 0], [0, 0, 1]), DraftTree.empty(), tree([0, 1, 2], [0, 1, 0]), tree([0], [1])]
    assert on_first_choices_of(trees).tolist() == [True, True, False, True, False, False, False]
    assert torch.cat([t.on_first_choices() for t in trees]).tolist() == on_first_choices_of(trees).tolist()
    assert on_first_choices_of([]).tolist() == []
