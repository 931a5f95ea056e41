"""The batched step (``engine.loop.batch``): many requests advanced together give, token for token, what each
gives alone; requests join and leave between steps; requests of every method share a step; one request's bad
input never takes its batch down. On the tiny models (``tests/tiny.py``), float64 and float32."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import pytest
import torch

import ddtree
from ddtree.allocate import Offer, StepCost, plan_drafts
from ddtree.batch import pack_trees
from engine.errors import EngineError
from engine.gpu.triton_support import triton_runs_on
from engine.loop.batch import DEPTH_MARGIN, PREFILL_TOKENS, Batch, StepShape
from engine.loop.budgeting import AUTO_NODES, Budgeting, expected_worth
from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.draft_pass import GraphedBatchDraft
from engine.loop.settings import DecodeSettings
from engine.methods import DDTREE, DFLASH
from engine.models.batched import BatchKV
from engine.models.drafter import ScriptedDrafter, fresh_config
from engine.models.paged import PagedBatchKV
from engine.models.rows import linear_rows, run_rows
from tests.tiny import tiny_drafter, tiny_target

VOCAB = 48
TOKENS = 40
CHEAP_NODES = StepCost(fixed_s=0.05, per_request_s=0.001, per_node_s=0.0005, per_draft_s=0.002)  # trees pay
DEAR_NODES = StepCost(fixed_s=0.001, per_request_s=0.01, per_node_s=0.01, per_draft_s=0.05)  # nothing pays


def pinned(cost: StepCost) -> Budgeting:
    """A budgeting whose cost stays as given (a batch does not scale it to its own steps' times), so that what a test
    asserts of the allocation's choices does not turn on this machine's speed."""
    return Budgeting(cost, follow_steps=False)


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB - 1, (int(length),), generator=generator).tolist()
            for length in torch.randint(3, 18, (count,), generator=generator)]


def oracle_decoder(dtype=torch.float64, count: int = 5) -> tuple[Decoder, list[list[int]]]:
    """A decoder whose drafter knows the prompts' AR answers (deep acceptance, real branching)."""
    target = tiny_target(0, vocab=VOCAB, dtype=dtype)
    plain = Decoder(target, tiny_drafter(target, 0), DrafterInfo("random", trained=False))
    asked = prompts(count)
    answers = [ids + plain.run(prompt_ids=ids, settings=DecodeSettings("ar", max_new_tokens=TOKENS + 20)).output_ids
               for ids in asked]
    config = fresh_config(target.config, num_layers=1, mask_token_id=VOCAB - 1, num_taps=2)
    oracle = ScriptedDrafter(config, answers).initialize(0).to(dtype).eval()
    return Decoder(target, oracle, DrafterInfo("oracle", trained=False)), asked


@pytest.fixture(scope="module")
def oracle64():
    return oracle_decoder(torch.float64)


@pytest.fixture(scope="module")
def oracle32():
    return oracle_decoder(torch.float32)


MIXED = [DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=16),
         DecodeSettings("dflash", max_new_tokens=TOKENS), DecodeSettings("ar", max_new_tokens=TOKENS),
         DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=5),
         DecodeSettings("ddtree", max_new_tokens=TOKENS - 9, tree_budget=40)]


def alone(decoder: Decoder, ids: list[int], settings: DecodeSettings):
    return decoder.run(prompt_ids=ids, settings=settings)


@pytest.mark.parametrize("cache", ["rows", "paged"])
@pytest.mark.parametrize("verify", ["packed", "padded"])
@pytest.mark.parametrize("precision", ["oracle64", "oracle32"])
def test_a_batch_of_three_methods_gives_each_request_what_it_gives_alone(request, precision, verify, cache):
    decoder, asked = request.getfixturevalue(precision)
    batch = Batch(decoder, pinned(CHEAP_NODES), verify=verify, cache=cache)
    traces = batch.run(list(zip(asked, MIXED)))
    for ids, settings, trace in zip(asked, MIXED, traces):
        single = alone(decoder, ids, settings)
        assert trace.output_ids == single.output_ids, settings.label
        assert [s.acceptance_length for s in trace.steps] == [s.acceptance_length for s in single.steps]
        assert [s.tree_tokens for s in trace.steps] == [s.tree_tokens for s in single.steps]
    first = traces[0].steps[0].batch
    assert first.size == len(MIXED) and len(first.neighbours) == len(MIXED) - 1
    assert first.nodes == 16 + 15 + 0 + 5 + 40  # every request's own budget (DFlash: its chain of 15)
    assert traces[0].summary.tau > traces[1].summary.tau > 1.0 == traces[2].summary.tau
    assert traces[4].summary.new_tokens == TOKENS - 9


def test_a_fixed_budget_drafts_no_deeper_than_its_tree_can_reach(oracle64):
    """A tree of n nodes reaches n depths at most, so the drafter's pass stops there: as deep as the deepest
    request of the step needs, every drafted request's block to that depth."""
    decoder, asked = oracle64
    jobs = [(asked[0], DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=5)),
            (asked[1], DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=3))]
    batch = Batch(decoder, pinned(CHEAP_NODES))
    traces = batch.run(jobs)
    assert [len(trace.steps[0].draft_top_tokens) for trace in traces] == [5, 5]
    assert batch.shapes[0].draft_rows == 10
    for (ids, settings), trace in zip(jobs, traces):
        assert trace.output_ids == alone(decoder, ids, settings).output_ids


def prefilled(decoder: Decoder, asked: list[list[int]], **kind) -> Batch:
    """A batch of ``MIXED``'s requests whose prompts are all in (a step taken by those prefilled first)."""
    batch = Batch(decoder, pinned(CHEAP_NODES), **kind)
    for ids, settings in zip(asked, MIXED):
        batch.admit(ids, settings)
    while batch.waiting:
        batch.advance()
    return batch


@pytest.mark.parametrize("nodes", [(0, 7, 15, 1, 30), (1, 0, 0, 0, 0), (0, 2, 0, 0, 0), (3, 0, 2, 0, 0)],
                         ids=["58 tokens", "6 run as 8", "7 run as 8", "10 run as 12"])
def test_the_packed_pass_scores_every_row_as_the_padded_one_does(oracle64, nodes):
    """Every row's logits and hidden states as the padded reference gives them, with the filler tokens a CPU pass
    of a few tokens runs with (``run_rows``) writing nothing into the cache columns any request owns."""
    packed, padded = prefilled(*oracle64), prefilled(*oracle64, verify="padded")
    trees = [ddtree.build_tree(torch.randn(15, VOCAB).log_softmax(-1), count) for count in nodes]
    layout = pack_trees(trees, [r.root for r in packed.requests], [r.start for r in packed.requests])
    assert layout.tokens == len(nodes) + sum(nodes)
    with torch.inference_mode():
        logits, hidden = packed.verify(layout, True)
        logits_padded, hidden_padded = padded.verify(layout, True)
    assert logits.shape[0] == hidden[-1].shape[1] == layout.tokens
    torch.testing.assert_close(logits, logits_padded, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(hidden[-1], hidden_padded[-1], rtol=1e-10, atol=1e-10)
    for row, (request, count) in enumerate(zip(packed.requests, nodes)):
        owned = request.start + count + 1  # its past, its root and its tree
        for cache, reference in zip(packed.kv.keys + packed.kv.values, padded.kv.keys + padded.kv.values):
            torch.testing.assert_close(cache[row, :, :owned], reference[row, :, :owned], rtol=1e-10, atol=1e-10)


def test_a_paged_cache_holds_what_the_rows_cache_holds_through_each_requests_own_blocks(oracle64):
    """After a prefill and a verify pass of five requests, each request's rows read through its block table equal
    its row of the rows cache; blocks are the request's own, never the scratch block."""
    rows, paged = prefilled(*oracle64), prefilled(*oracle64, cache="paged")
    trees = [ddtree.build_tree(torch.randn(15, VOCAB).log_softmax(-1), count) for count in (3, 0, 9, 15, 1)]
    layout = pack_trees(trees, [r.root for r in rows.requests], [r.start for r in rows.requests])
    with torch.inference_mode():
        logits_rows, _ = rows.verify(layout, False)
        logits_paged, _ = paged.verify(layout, False)
    torch.testing.assert_close(logits_paged, logits_rows, rtol=1e-10, atol=1e-10)
    tables = paged.kv.tables
    held = [block for blocks in tables.held for block in blocks]
    assert len(held) == len(set(held)) and tables.scratch not in held
    for row, (request, tree) in enumerate(zip(rows.requests, trees)):
        owned = request.start + tree.size + 1
        slots = tables.read_slots(torch.tensor([row]), owned)[0]
        for layer, cache in enumerate(paged.kv.caches):
            keys = cache[slots // tables.block_size, 0, slots % tables.block_size].transpose(0, 1)
            values = cache[slots // tables.block_size, 1, slots % tables.block_size].transpose(0, 1)
            torch.testing.assert_close(keys, rows.kv.keys[layer][row, :, :owned], rtol=0, atol=0)
            torch.testing.assert_close(values, rows.kv.values[layer][row, :, :owned], rtol=0, atol=0)


def test_block_tables_hand_blocks_out_take_them_back_and_grow_the_pool():
    config = tiny_target(0, vocab=VOCAB).config
    kv = PagedBatchKV.for_model(config, blocks=3, block_size=4, dtype=torch.float64, device=torch.device("cpu"))
    tables = kv.tables
    kv.reserve(2, 0)
    kv.hold([0], 5)  # two blocks: the pool's two besides scratch
    assert tables.held == [[0, 1], []] and tables.free == []
    kv.caches[0][tables.held[0][1], 0, 0] = 7.0  # row 0's fifth cache row
    kv.hold([1], 6)  # two more blocks: the pool doubles, the old scratch block is handed out
    assert kv.blocks == 6 and tables.scratch == 5 and sorted(tables.held[1]) == [2, 3]
    assert bool((kv.caches[0][1, 0, 0] == 7.0).all()), "what was cached stays where it was"
    assert tables.table.tolist() == [[0, 1], [2, 3]]
    kv.release(0, 1, 6)  # row 0 leaves; row 1's request takes row 0 with its own blocks
    assert tables.held == [[2, 3], []] and tables.table.tolist() == [[2, 3], [5, 5]]
    kv.hold([1], 4)  # a new request in row 1 gets a block row 0's request gave back
    assert tables.held[1] == [0]
    assert tables.read_slots(torch.tensor([1]), 9).tolist() == [[0, 1, 2, 3, 20, 21, 22, 23, 20]]
    fixed = PagedBatchKV(kv.caches, block_size=4, grow=False)  # vLLM's pool: what it allocated, no more
    fixed.reserve(1, 20)
    with pytest.raises(EngineError, match="the KV cache.s 5 blocks of 4 tokens are held by the requests in flight, "
                                          "1 more needed"):
        fixed.reserve(2, 4)


CPU = torch.device("cpu")
COMPACTED = ([2, 0, 1], [6, 3, 9], [[0, 2, 3, 7], [0, 1], [0, 5]])  # rows, pasts, paths: the middle path stays put


def compacted_together_and_alone(paged: bool, device: torch.device = CPU
                                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """A batch's cache buffers after one compaction of ``COMPACTED``'s three requests, after the three one at a
    time, and untouched (rows or paged: ``PagedBatchKV`` through ``RowMover``, fused where Triton runs)."""
    config = tiny_target(0, vocab=VOCAB).config

    def filled():
        kv = (PagedBatchKV.for_model(config, blocks=2, block_size=4, dtype=torch.float32, device=device) if paged
              else BatchKV(config, 3, 24, torch.float64, device))
        assert not paged or kv.move_rows.fused == triton_runs_on(device)
        kv.reserve(3, 20)
        torch.manual_seed(0)
        for buffer in buffers(kv):
            buffer.copy_(torch.randn_like(buffer))
        return kv

    def buffers(kv):
        return kv.caches if paged else kv.keys + kv.values

    together, alone = filled(), filled()
    together.compact(*COMPACTED)
    for row, past, path in zip(*COMPACTED):
        alone.compact([row], [past], [path])
    return buffers(together), buffers(alone), buffers(filled())


@pytest.mark.parametrize("paged", [False, True])
def test_one_compaction_for_the_batch_moves_each_requests_rows_as_its_own_does(paged):
    together, alone, untouched = compacted_together_and_alone(paged)
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    assert not all(torch.equal(a, b) for a, b in zip(together, untouched)), "rows moved"
    assert [t.tolist() for t in ddtree.compaction_moves_of(*COMPACTED)] == [[2, 2, 2, 1], [8, 9, 13, 14],
                                                                             [7, 8, 9, 10]]


def test_a_few_rows_run_as_the_next_multiple_of_four_on_a_cpu_only_where_that_is_faster():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert [run_rows(rows, cpu) for rows in range(1, 14)] == [1, 4, 4, 4, 5, 8, 8, 8, 9, 12, 12, 12, 13]
    assert [run_rows(rows, gpu) for rows in range(1, 14)] == list(range(1, 14))
    weight, inputs = torch.randn(50, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(linear_rows(inputs, weight), inputs @ weight.T, rtol=1e-12, atol=1e-12)


def test_seeded_sampling_in_a_batch_draws_what_the_request_draws_alone(oracle64):
    decoder, asked = oracle64
    sampled = [DecodeSettings(method, max_new_tokens=TOKENS, temperature=0.9, seed=seed, tree_budget=12)
               for method, seed in (("ddtree", 3), ("dflash", 4), ("ar", 5), ("ddtree", 6))]
    traces = Batch(decoder, pinned(CHEAP_NODES)).run(list(zip(asked, sampled)))
    for ids, settings, trace in zip(asked, sampled, traces):
        assert trace.output_ids == alone(decoder, ids, settings).output_ids, settings.label


@pytest.mark.parametrize("cache", ["rows", "paged"])
def test_requests_join_mid_batch_and_leave_done_stopped_or_abandoned(oracle64, cache):
    decoder, asked = oracle64
    batch = Batch(decoder, pinned(CHEAP_NODES), cache=cache)
    stop_flags = {"stopped": False, "left": False}
    long_one = batch.admit(asked[0], DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=16))
    short = batch.admit(asked[1], DecodeSettings("dflash", max_new_tokens=6))
    stopped = batch.admit(asked[2], DecodeSettings("ar", max_new_tokens=TOKENS),
                          should_stop=lambda: stop_flags["stopped"])
    finished = []
    for _ in range(3):
        finished += batch.advance()
    late = batch.admit(asked[3], DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=8))
    left = batch.admit(asked[4], DecodeSettings("ar", max_new_tokens=TOKENS), should_stop=lambda: stop_flags["left"])
    stop_flags["left"] = True  # its client is gone before its first token
    finished += batch.advance()
    assert left in finished and left.trace is None and left.finished == "cancelled"
    stop_flags["stopped"] = True
    while not batch.idle:
        finished += batch.advance()
    assert {r.name for r in finished} == {r.name for r in (long_one, short, stopped, late, left)}
    assert short.trace.summary.stop_reason == "max_new_tokens" and short.trace.summary.new_tokens == 6
    assert stopped.trace.summary.stop_reason == "cancelled"
    for request, ids in ((long_one, asked[0]), (short, asked[1]), (late, asked[3])):
        assert request.trace.output_ids == alone(decoder, ids, request.settings).output_ids
    joined = {step.batch.size for step in late.trace.steps}
    assert max(joined) >= 3 and min(joined) == 1  # it ran beside others, and alone at the end
    if cache == "paged":  # every block back in the pool, every table row empty
        tables = batch.kv.tables
        assert sorted(tables.free) == list(range(batch.kv.blocks - 1)) and not any(tables.held)
        assert bool((tables.table == tables.scratch).all())


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_keep_stepping(oracle64):
    decoder, asked = oracle64
    batch = Batch(decoder, pinned(CHEAP_NODES))
    running = batch.admit(asked[0], DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=8))
    long_prompt = (asked[1] * 40)[: 2 * PREFILL_TOKENS + 17]
    late = batch.admit(long_prompt, DecodeSettings("ar", max_new_tokens=8))
    after = batch.admit(asked[2], DecodeSettings("dflash", max_new_tokens=TOKENS))  # a row past the prefilling one
    rounds = 0
    while late.trace is None:
        batch.advance()
        rounds += 1
    assert rounds == 3  # 273 prompt tokens, 128 a round, the short prompts' first
    # they stepped while the prompt went in, ``after`` in a row past the prefilling one's
    assert after.row > late.row and len(running.trace.steps) >= 2 and len(after.trace.steps) >= 2
    while not batch.idle:
        batch.advance()
    for request, ids in ((running, asked[0]), (late, long_prompt), (after, asked[2])):
        assert request.trace.output_ids == alone(decoder, ids, request.settings).output_ids


def test_a_request_that_cannot_run_is_refused_alone(oracle64):
    decoder, asked = oracle64
    batch = Batch(decoder, pinned(CHEAP_NODES))
    fine = batch.admit(asked[0], DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=8))
    with pytest.raises(EngineError, match="exceeds the model's context of 512 tokens"):
        batch.admit([3] * 500, DecodeSettings("ar", max_new_tokens=TOKENS))
    while not batch.idle:
        batch.advance()
    assert fine.trace.output_ids == alone(decoder, asked[0], fine.settings).output_ids


def test_auto_trees_grow_where_nodes_are_cheap_and_fall_to_ar_where_they_are_not(oracle64):
    decoder, asked = oracle64
    auto = [DecodeSettings(method, max_new_tokens=TOKENS, tree_budget="auto") for method in ("ddtree", "dflash")]
    cheap = Batch(decoder, pinned(CHEAP_NODES)).run(list(zip(asked, auto)))
    dear = Batch(decoder, pinned(DEAR_NODES)).run(list(zip(asked, auto)))
    for ids, settings, grown, shrunk in zip(asked, auto, cheap, dear):
        reference = alone(decoder, ids, DecodeSettings("ar", max_new_tokens=TOKENS)).output_ids
        assert grown.output_ids == shrunk.output_ids == reference
        assert grown.config.label == f"{settings.method}@auto"
        assert grown.summary.tau > 2.0 and shrunk.summary.tau < 1.2
        assert all(step.batch.budget == 0 for step in shrunk.steps[1:])
        assert all(step.batch.reason.startswith("auto: not drafted") for step in shrunk.steps[1:])
    assert max(step.batch.budget for step in cheap[0].steps) > 15  # a tree, wider than DFlash's chain
    assert max(step.batch.budget for step in cheap[1].steps) <= 15  # a chain never exceeds its block


class Told(Batch):
    """A batch told what its rounds take instead of timing them, so that a test of how its trees follow the machine
    neither waits nor turns on this machine's speed: each step ``roots`` times its cost's roots' part and ``trees``
    times the rest (``StepCost.parts``), each round ``hop_s`` beyond its step (a server's hop to the model's
    process)."""

    def __init__(self, decoder, budgeting: Budgeting, roots: float = 1.0, trees: float = 1.0, hop_s: float = 0.0):
        super().__init__(decoder, budgeting)
        self.told = roots, trees, hop_s

    def step(self) -> dict[str, float]:
        self.last_step_end = None  # no gap timed: the told one stands
        self.gaps.clear()
        self.gaps.append(self.told[2])
        return super().step()

    def measured(self, shape: StepShape) -> None:
        roots, trees = self.budgeting.cost.parts(shape.requests, shape.nodes, shape.drafts, shape.draft_rows)
        super().measured(replace(shape, seconds=self.told[0] * roots + self.told[1] * trees))


def test_auto_trees_grow_where_a_round_costs_more_than_its_step(oracle64):
    """Nodes that do not pay against the step alone (``DEAR_NODES``) pay once every round costs a second more than
    its step: the clients wait that second whatever the trees, so the tokens a tree adds come at the step's price.
    Every output stays its solo AR's."""
    decoder, asked = oracle64
    auto = [DecodeSettings(method, max_new_tokens=TOKENS, tree_budget="auto") for method in ("ddtree", "dflash")]
    near = Told(decoder, Budgeting(DEAR_NODES))
    far = Told(decoder, Budgeting(DEAR_NODES), hop_s=1.0)
    quick, slow = near.run(list(zip(asked, auto))), far.run(list(zip(asked, auto)))
    assert near.scales == pytest.approx((1.0, 1.0)) and far.scales == pytest.approx((1.0, 1.0))  # steps as costed
    for ids, alone_quick, alone_slow in zip(asked, quick, slow):
        assert alone_quick.output_ids == alone_slow.output_ids == alone(
            decoder, ids, DecodeSettings("ar", max_new_tokens=TOKENS)).output_ids
        assert alone_quick.summary.tau < 1.2 and alone_slow.summary.tau > 2.0
        assert sum(step.batch.budget > 0 for step in alone_slow.steps) > len(alone_slow.steps) // 2


def test_trees_grow_once_the_batch_s_own_steps_show_its_rows_cost_more_than_fitted(oracle64, monkeypatch):
    """A cost under which nothing pays (``DEAR_NODES``) is scaled to the batch's own steps: once they show each
    request's row costs more than was fitted, a node's worth pays for it and the requests draft again. A pinned cost
    (``follow_steps`` False) never moves, and its requests never draft after their first step. Every output stays
    its solo AR's."""
    monkeypatch.setattr("engine.loop.batch.REFIT_STEPS", 4)
    decoder, asked = oracle64
    auto = [DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget="auto")] * 3
    held, following = Told(decoder, pinned(DEAR_NODES), roots=4.0), Told(decoder, Budgeting(DEAR_NODES), roots=4.0)
    traces = {kind: batch.run(list(zip(asked, auto))) for kind, batch in (("held", held), ("following", following))}
    assert held.scales == (1.0, 1.0) and held.round_cost == DEAR_NODES
    assert following.scales[0] > 2.0 and following.scales[1] == pytest.approx(1.0, abs=0.2)
    for ids, stayed, moved in zip(asked, traces["held"], traces["following"]):
        assert stayed.output_ids == moved.output_ids == alone(decoder, ids, DecodeSettings("ar", max_new_tokens=TOKENS)
                                                              ).output_ids
        assert all(step.batch.budget == 0 for step in stayed.steps[1:] + moved.steps[1:4])  # the first: no record yet
    later_trees = [step.batch.budget for trace in traces["following"] for step in trace.steps[4:]]
    assert sum(budget > 1 for budget in later_trees) >= 3
    assert sum(len(trace.steps) for trace in traces["following"]) < sum(len(trace.steps) for trace in traces["held"])


def test_a_round_s_cost_beyond_its_step_is_the_median_gap_between_steps_while_requests_decode(oracle64):
    decoder, asked = oracle64
    batch = Batch(decoder, Budgeting(DEAR_NODES))  # fewer steps than a refit: the cost's parts stay
    assert batch.round_cost == DEAR_NODES  # nothing measured yet
    batch.admit(asked[0], DecodeSettings("ar", max_new_tokens=6))
    while not batch.requests:
        batch.advance()
    for _ in range(3):
        time.sleep(0.05)
        batch.advance()
    assert len(batch.gaps) == 3 and min(batch.gaps) >= 0.05
    assert batch.round_cost.fixed_s == pytest.approx(DEAR_NODES.fixed_s + statistics.median(batch.gaps))
    assert replace(batch.round_cost, fixed_s=DEAR_NODES.fixed_s) == DEAR_NODES
    while not batch.idle:
        batch.advance()
    time.sleep(0.2)  # idle: no round is waited for
    batch.admit(asked[1], DecodeSettings("ar", max_new_tokens=6))
    while not batch.idle:
        batch.advance()
    assert max(batch.gaps) < 0.2


def test_an_auto_tree_drafts_as_deep_as_its_expected_nodes_reach(oracle64):
    """A best-first tree's first n nodes reach fewer than n depths: an "auto" request drafts as deep as its last
    candidate tree's first n nodes reached, and DEPTH_MARGIN more, n the nodes it is expected to get."""
    decoder, asked = oracle64
    batch = Batch(decoder, pinned(CHEAP_NODES))
    request = batch.admit(asked[0], DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget="auto"))
    while batch.waiting:
        batch.advance()
    # every depth: three tokens at 0.5, 0.3, 0.2; best first: a, b, aa, c, ab, ba, aaa, ... (depths 1 1 2 1 2 2 3)
    log_probs = torch.full((6, 8), float("-inf"))
    log_probs[:, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    request.reach = ddtree.build_tree(log_probs, 7).depths.cummax(0).values
    assert [request.depth_for(nodes) for nodes in (0, 1, 2, 3, 4, 6, 7, 8)] == [0, 1, 1, 2, 2, 2, 3, 8]
    request.expected = torch.zeros(AUTO_NODES, dtype=torch.float64)
    request.expected[:4] = 0.9  # four nodes the batch will give it, where nodes are this cheap
    assert batch.plan([request]) == [request.depth_for(4) + DEPTH_MARGIN] == [2 + DEPTH_MARGIN]


def test_a_hybrid_target_is_refused_a_batch():
    from tests.hybrid_models import hybrid_decoder

    with pytest.raises(EngineError, match="cannot verify a batch of trees in one pass"):
        Batch(hybrid_decoder(), Budgeting())


def test_the_page_says_what_batch_a_step_ran_in_and_what_sharing_cost_the_request(oracle64):
    from viz.figures import economics_text, explain_stop

    decoder, asked = oracle64
    traces = Batch(decoder, pinned(CHEAP_NODES)).run(list(zip(asked, MIXED)))
    step = traces[0].steps[0]
    said = explain_stop(step, lambda token: f"t{token}")
    assert said.endswith(f"In a batch of **5** requests ({step.batch.nodes} draft nodes verified in all), its tree "
                         "had **16** nodes: its own budget: 16 nodes. Beside it: `request-2`, `request-3`, "
                         "`request-4`, `request-5`.")
    alone_ms = 1000 * CHEAP_NODES.seconds(1, 16, 1)
    sharing = economics_text(traces[:1])
    assert f"where its trees alone would take {alone_ms:.0f} ms by this machine's step costs" in sharing
    assert "shared its" not in economics_text([alone(decoder, asked[0], MIXED[0])])


def test_a_request_in_a_row_another_left_reads_only_its_own_context():
    """One request at a time through the same batch: each joins the row the one before left, and drafts as it does
    alone (the drafter's context of the row's last request is not its own). A drafter whose probabilities follow
    its context (a random one, not the scripted oracle) shows it at every depth."""
    target = tiny_target(0, vocab=VOCAB)
    decoder = Decoder(target, tiny_drafter(target, 0), DrafterInfo("random", trained=False))
    batch = Batch(decoder, pinned(CHEAP_NODES))
    settings = DecodeSettings("ddtree", max_new_tokens=12, tree_budget=16)  # drafts its whole block, as alone
    for ids in prompts(3):
        request = batch.admit(ids, settings)
        while not batch.idle:
            batch.advance()
        single = alone(decoder, ids, settings)
        assert request.row == 0 and request.trace.output_ids == single.output_ids
        for batched, solo_step in zip(request.trace.steps, single.steps, strict=True):
            torch.testing.assert_close(torch.tensor(batched.draft_top_probs), torch.tensor(solo_step.draft_top_probs),
                                       rtol=1e-6, atol=1e-12)


def test_a_start_up_on_a_gpu_times_the_batch_it_will_serve_and_on_a_cpu_a_quick_one():
    from types import SimpleNamespace

    from engine.measure.step_cost import quick_requests

    on = [SimpleNamespace(target=SimpleNamespace(device=torch.device(kind))) for kind in ("cuda", "cpu")]
    assert quick_requests(on[0]) == (1, 4, 16) and quick_requests(on[1]) == (1, 4)


def counted(function):
    def call(*args):
        call.calls += 1
        return function(*args)
    call.calls = 0
    return call


def eager_or_fixed(decoder: Decoder, fixed: bool) -> Batch:
    """A batch whose drafter pass is eager, or (``fixed``) the fixed-shape pass a GPU records, run eagerly here."""
    batch = Batch(decoder, pinned(CHEAP_NODES))
    assert batch.graphed_draft is None  # no GPU here: eager unless asked
    if fixed:
        batch.graphed_draft = GraphedBatchDraft(decoder.drafter, *decoder.draft_weights, batch.context, replay=False)
    return batch


def test_the_drafters_fixed_shape_pass_drafts_what_the_eager_pass_drafts():
    """``GraphedBatchDraft`` (what a GPU records: a block of new context rows a request, every context column read,
    the whole block drafted) run eagerly here: the same drafts as the eager pass, step by step, through requests
    that join late, leave early and take over others' rows, and every output its solo run's."""
    target = tiny_target(0, vocab=VOCAB, dtype=torch.float64)
    decoder = Decoder(target, tiny_drafter(target, 0).to(torch.float64), DrafterInfo("random", trained=False))
    kinds = [DecodeSettings("ddtree", max_new_tokens=14, tree_budget=16), DecodeSettings("ar", max_new_tokens=6),
             DecodeSettings("dflash", max_new_tokens=20), DecodeSettings("ddtree", max_new_tokens=9, tree_budget=4)]
    asked = prompts(6, seed=4)
    runs = []
    for fixed in (False, True):
        batch = eager_or_fixed(decoder, fixed)
        if fixed:
            passes = batch.graphed_draft._pass = counted(batch.graphed_draft._pass)
        requests = [batch.admit(ids, kinds[i % len(kinds)]) for i, ids in enumerate(asked[:4])]
        for _ in range(3):
            batch.advance()
        requests += [batch.admit(ids, kinds[i % len(kinds)]) for i, ids in enumerate(asked[4:])]
        while not batch.idle:
            batch.advance()
        runs.append([request.trace for request in requests])
    # 3 drafting requests run as 4: a padding request in the scratch row beside them
    assert passes.calls >= 10 and {count for count, _, _ in batch.graphed_draft.shapes} >= {1, 2, 4}
    for index, (eager, fixed) in enumerate(zip(*runs)):
        settings = kinds[(index if index < 4 else index - 4) % len(kinds)]
        assert fixed.output_ids == eager.output_ids == alone(decoder, asked[index], settings).output_ids
        for one, other in zip(eager.steps, fixed.steps, strict=True):
            assert one.tree_tokens == other.tree_tokens
            torch.testing.assert_close(torch.tensor(other.draft_top_probs), torch.tensor(one.draft_top_probs),
                                       rtol=1e-9, atol=1e-12)


def test_context_rows_read_a_block_at_a_time_fill_the_drafters_cache_as_one_eager_pass_does():
    """Where the drafter's pass is recorded, a prompt's rows (and the rows an "auto" request piled up while it did not
    draft) go in a block at a time through that pass (``Batch.read_rows``): the same keys and values in the request's
    row of the drafter's cache as the eager pass writes, and the same drafts after, for prompts of several blocks."""
    target = tiny_target(0, vocab=VOCAB, dtype=torch.float64)
    decoder = Decoder(target, tiny_drafter(target, 0).to(torch.float64), DrafterInfo("random", trained=False))
    config = decoder.drafter.config
    width = len(config.target_layer_ids) * config.hidden_size
    features = torch.randn(40, width, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    caches = []
    for fixed in (False, True):
        batch = eager_or_fixed(decoder, fixed)
        if fixed:
            passes = batch.graphed_draft._pass = counted(batch.graphed_draft._pass)
        request = batch.admit([5, 6, 7], DecodeSettings("ddtree", max_new_tokens=4, tree_budget=4))
        with torch.inference_mode():  # as a round reads them
            batch.read_rows(request, features[:30], torch.arange(30))
            rows, at = (batch.behind(request, features[30:], torch.arange(30, 40), block_size=4) if fixed else
                        (None, None))
        caches.append((batch, request, rows, at))
    (eager, first, _, _), (fixed, second, rows, at) = caches
    assert passes.calls == 2 + 1, "30 rows in blocks of 16, then the 6 behind the last 4 in one"
    assert int(eager.context.lengths[first.row]) == 30 and int(fixed.context.lengths[second.row]) == 36
    assert torch.equal(rows, features[36:]) and at.tolist() == [36, 37, 38, 39]
    for layer in range(config.num_hidden_layers):
        for cache in ("keys", "values"):
            torch.testing.assert_close(getattr(fixed.context, cache)[layer][second.row, :, :30],
                                       getattr(eager.context, cache)[layer][first.row, :, :30], rtol=1e-12, atol=1e-12)
    long_prompts = [list(range(2, 46)), [3 + (7 * i) % 40 for i in range(37)]]
    settings = DecodeSettings("ddtree", max_new_tokens=12, tree_budget=8)
    traces = []
    for fixed in (False, True):
        traces.append(eager_or_fixed(decoder, fixed).run([(ids, settings) for ids in long_prompts]))
    for ids, eager_trace, fixed_trace in zip(long_prompts, *traces):
        assert fixed_trace.output_ids == eager_trace.output_ids == alone(decoder, ids, settings).output_ids
        for one, other in zip(eager_trace.steps, fixed_trace.steps, strict=True):
            assert one.tree_tokens == other.tree_tokens


def test_a_drafters_record_becomes_what_each_methods_draft_is_worth_before_any_is_seen():
    recorded = {"ddtree": {"4": 2.6, "8": 3.0}, "dflash": 2.62}
    tree = expected_worth(recorded, DDTREE, 15)
    assert tree[:4].tolist() == pytest.approx([0.4] * 4) and tree[4:8].tolist() == pytest.approx([0.1] * 4)
    assert float(tree[8:].abs().sum()) == 0.0
    chain = expected_worth(recorded, DFLASH, 15)
    assert float(chain.sum()) == pytest.approx(1.62) and float(chain[15:].abs().sum()) == 0.0
    assert bool((chain[1:15] < chain[:14]).all())  # each depth is reached less often than the one above it
    assert expected_worth({"dflash": 2.62}, DDTREE, 15) is None


def test_drafts_that_stop_paying_are_tried_again_and_never_stop_another_methods_drafts():
    """A request whose drafts turned out poor stops drafting; each step without a draft brings its expectation,
    and its method's typical draft, back towards the drafter's record, so it drafts again; a chain's poor drafts
    never lower what a tree's draft is expected to be worth."""
    cost = StepCost(fixed_s=0.05, per_request_s=0.005, per_node_s=0.002, per_draft_s=0.01, draft_pass_s=0.02)
    recorded = {"ddtree": {"4": 2.6, "16": 3.4}, "dflash": 2.62}
    budgeting = Budgeting(cost, prior={row.name: expected_worth(recorded, row, 15) for row in (DDTREE, DFLASH)})

    def drafts(expected) -> bool:
        return plan_drafts([Offer(tuple(expected.tolist()), AUTO_NODES)], cost, 1)[0]

    poor = Offer((0.05,) * 15, 15)
    expected = None
    for _ in range(30):
        expected = budgeting.learn(DFLASH, expected, poor)
    assert drafts(budgeting.prior["dflash"]) and not drafts(expected)
    assert not drafts(budgeting.expectation(DFLASH))
    assert torch.equal(budgeting.expectation(DDTREE), budgeting.prior["ddtree"]) and drafts(budgeting.prior["ddtree"])
    waited = [drafts(expected := budgeting.relax(DFLASH, expected)) for _ in range(100)]
    assert not waited[0] and any(waited)  # not at once: the evidence against it counts for a while


def test_the_batch_profile_times_vllms_own_decoders_only_beside_the_vllm_engine(capsys):
    from engine.tools.batch_profile import parse_args

    assert [job.label for job in parse_args(["--engine", "vllm", "--native", "ar,mtp"]).native_jobs] == [
        "vllm-ar", "vllm-mtp"]
    for argv, said in ((["--native", "ar"], "add --engine vllm"),
                       (["--engine", "vllm", "--native", "ar,eagle"], "--native takes ar, ar-graphless, dflash")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert said in capsys.readouterr().err


def test_the_batch_profile_decodes_every_request_and_reports_each_stage(oracle32):
    from engine.loop.remote_batch import open_batch
    from engine.tools.batch_profile import decode_batch

    decoder, asked = oracle32
    settings = DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget="auto")
    batch = open_batch(decoder, pinned(CHEAP_NODES))  # one for both runs, as the tool (and a server) keeps one
    run = decode_batch(batch, decoder, asked[:3], settings)
    assert run.tokens == sum(len(alone(decoder, ids, settings).output_ids) for ids in asked[:3])
    assert set(run.stages) == {"draft", "tree_build", "tree_compile", "verify", "commit"}
    assert run.steps < run.tokens and len(run.rounds) >= run.steps / 3
    assert run.line("ddtree x 3").startswith(f"ddtree x 3: {run.tokens / run.seconds:.1f} tokens/s, τ ")
    assert run.nodes > 1 and 0 < run.grown <= 1 and f"{run.nodes:.1f} nodes a request a step" in run.line("x")
    ar = decode_batch(batch, decoder, asked[:2], DecodeSettings("ar", max_new_tokens=8))
    assert (ar.nodes, ar.grown) == (0.0, 0.0)
