"""The one-program tree build (engine.gpu.beam_kernel) against ``ddtree.fixed.build_tree`` and the heap.

It runs where Triton runs: natively on a GPU (``engine/tools/gpu_session.sh check``), or on the
CPU under Triton's interpreter, which tests/conftest.py turns on there. Without Triton it is skipped.
"""

from __future__ import annotations

import pytest
import torch

import ddtree
from ddtree.fixed import build_tree
from engine.gpu.beam_kernel import fused_beam_tree, fused_fits
from tests.test_fixed import random_log_probs, token_paths

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [pytest.mark.triton, pytest.mark.skipif(not fused_fits(DEVICE, 16), reason="Triton does not run here")]
FIELDS = ("tokens", "parents", "depths", "ranks", "valid", "log_probs", "path_log_probs")


@pytest.mark.parametrize("depth, vocab, budget, seed", [
    (15, 500, 16, 2), (15, 49, 32, 6), (3, 8, 30, 5), (1, 100, 10, 7), (15, 64, 1, 0), (4, 5, 24, 8),
    # the interpreter's time grows with depth x budget: the larger trees are the edit loop's to skip
    pytest.param(6, 3, 100, 9, marks=pytest.mark.slow), pytest.param(8, 500, 64, 3, marks=pytest.mark.slow),
    pytest.param(15, 500, 128, 4, marks=pytest.mark.slow),
])
def test_the_fused_build_is_the_beam_and_finds_the_heaps_tree(depth, vocab, budget, seed):
    log_probs = random_log_probs(depth, vocab, seed).to(DEVICE)
    fused, readable = fused_beam_tree(log_probs, budget), build_tree(log_probs, budget)
    for name in FIELDS:
        assert torch.equal(getattr(fused, name), getattr(readable, name)), name
    if vocab ** depth >= budget:  # the block holds the budget: no padding nodes, the heap's exact tree
        heap = ddtree.build_tree(log_probs.cpu(), budget)
        assert token_paths(fused.tokens.tolist(), fused.parents.tolist()) == token_paths(heap.tokens.tolist(),
                                                                                          heap.parents.tolist())


def test_a_batch_of_trees_is_each_tree_on_its_own():
    rows = torch.stack([random_log_probs(8, 300, seed) for seed in range(3)]).to(DEVICE)
    batched = fused_beam_tree(rows, 24)
    for row in range(3):
        single = build_tree(rows[row], 24)
        assert all(torch.equal(getattr(batched, name)[row], getattr(single, name)) for name in FIELDS)


def test_ties_never_leave_a_node_without_its_parent():
    log_probs = torch.full((6, 5), -30.0)
    log_probs[:, 0] = 0.0
    log_probs[2] = torch.log_softmax(torch.zeros(5), dim=-1)  # a five-way tie at depth 3
    for budget in range(1, 12):
        tree = fused_beam_tree(log_probs.to(DEVICE), budget)
        for node, parent in enumerate(tree.parents.tolist(), start=1):
            assert parent < node and (parent == 0 or tree.depths[node - 1] == tree.depths[parent - 1] + 1)


def test_trees_beyond_one_programs_sort_stay_readable():
    assert fused_fits(DEVICE, 128) and not fused_fits(DEVICE, 129)
