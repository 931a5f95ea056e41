"""The one-launch KV compaction (engine.gpu.kv_moves) against the readable per-layer moves.

It runs where Triton runs: natively on a GPU (``engine/tools/gpu_session.sh check``), or on the
CPU under Triton's interpreter, which tests/conftest.py turns on there. Without Triton it is skipped.
"""

from __future__ import annotations

import pytest
import torch

import ddtree
from engine.gpu.kv_moves import RowMover
from engine.gpu.triton_support import triton_runs_on

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_runs_on(DEVICE), reason="Triton does not run here")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, dim, moves", [(3, 64, 16), (2, 8, 5), (8, 128, 32)])
def test_every_layer_moves_its_rows_as_the_per_layer_reference_does(dtype, heads, dim, moves):
    generator = torch.Generator().manual_seed(heads * moves)
    caches = [torch.randn(6, 2, 16, heads, dim, generator=generator).to(device=DEVICE, dtype=dtype) for _ in range(4)]
    reference = [cache.clone() for cache in caches]
    targets = torch.randperm(96, generator=generator)[:moves]
    sources = torch.randint(0, 96, (moves,), generator=generator)
    sources[0] = targets[1]  # a source that another move overwrites: read before anything is written
    mover = RowMover(caches, block_size=16)
    assert mover.fused
    mover(sources.to(DEVICE), targets.to(DEVICE))
    for cache in reference:
        ddtree.move_rows(cache, ddtree.paged_slots(sources, 16), ddtree.paged_slots(targets, 16))
    assert all(torch.equal(mine, theirs.to(DEVICE)) for mine, theirs in zip(caches, reference))


def test_a_cache_set_the_kernel_cannot_take_falls_back_to_the_reference():
    caches = [torch.zeros(4, 2, 16, 2, 8, device=DEVICE), torch.zeros(4, 2, 16, 2, 4, device=DEVICE)]
    assert not RowMover(caches, block_size=16).fused


def test_many_requests_compactions_in_one_launch_are_each_request_s_own():
    from tests.test_paged import batch_of_requests, compact_each_alone

    block_table, past, path, length, accepted, cache = batch_of_requests(seed=5)
    caches = [cache.to(DEVICE), (cache * 2).to(DEVICE)]
    reference = [c.clone().cpu() for c in caches]
    sources, targets = ddtree.compaction_slots(block_table, past, path, length, block_size=4, scratch_slot=0)
    RowMover(caches, block_size=4)(sources.to(DEVICE), targets.to(DEVICE))
    for c in reference:
        compact_each_alone(c, block_table, past, accepted)
    assert all(torch.equal(mine[1:].cpu(), theirs[1:]) for mine, theirs in zip(caches, reference))


def test_a_paged_batchs_one_compaction_in_one_launch_is_each_requests_own():
    from tests.test_batch import compacted_together_and_alone

    together, alone, untouched = compacted_together_and_alone(paged=True, device=DEVICE)
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    assert not all(torch.equal(a, b) for a, b in zip(together, untouched))
