"""The batched step as fixed-shape programs (``engine.loop.fixed_batch``): the same tokens, acceptances and trees as
the readable batched step and as each request alone; requests joining, leaving, and moving between the two steps;
the programs' parts against their readable forms. On the tiny models (``tests/tiny.py``), float64."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import ddtree
import ddtree.fixed
from ddtree.fixed import FixedTree
from engine.loop.batch import Batch
from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.draft_pass import GraphedBatchDraft
from engine.loop.fixed_batch import (
    CHAIN,
    NO_TREE,
    TREE,
    FixedBatchProgram,
    RowState,
    SlotInputs,
    node_bucket,
    slot_trees,
)
from engine.loop.settings import DecodeSettings
from engine.models.batched import BatchKV
from tests.test_batch import CHEAP_NODES, DEAR_NODES, MIXED, TOKENS, VOCAB, alone, oracle_decoder, pinned, prompts
from tests.test_fixed_step import _HostWork
from tests.tiny import tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def fixed64():
    """The oracle decoder with the fixed step on, and the plain one (each request alone runs the readable loop)."""
    decoder, asked = oracle_decoder(torch.float64)
    return Decoder(decoder.target, decoder.drafter, decoder.drafter_info, fixed_step=True), decoder, asked


def tree_worth(step) -> list[float]:
    """A step's tree as its nodes' path probabilities, sorted: what the best-first tree of its size is, whatever the
    order of its nodes and whichever of two tokens of equal probability it took."""
    return sorted(step.tree_path_probs)


def same_steps(batched, single) -> None:
    assert batched.output_ids == single.output_ids
    assert [s.acceptance_length for s in batched.steps] == [s.acceptance_length for s in single.steps]
    for mine, theirs in zip(batched.steps, single.steps):  # float32 sums of the same log-probabilities, in two orders
        assert tree_worth(mine) == pytest.approx(tree_worth(theirs), rel=1e-6)
    assert [s.committed_text for s in batched.steps] == [s.committed_text for s in single.steps]


@pytest.mark.parametrize("cache, recorded", [("rows", False), ("paged", False), ("rows", True), ("paged", True)])
def test_every_method_in_one_fixed_step_gives_each_request_what_it_gives_alone(fixed64, cache, recorded):
    fixed, plain, asked = fixed64
    batch = Batch(fixed, pinned(CHEAP_NODES), cache=cache)
    if recorded:  # what a GPU records, run eagerly: the drafter's pass (a bucket of slots, every context column)
        # and each program's advance over its buffers at fixed addresses
        batch.graphed_draft = GraphedBatchDraft(fixed.drafter, *fixed.draft_weights, batch.context, replay=False)
        batch.fixed_graphs = True
    traces = batch.run(list(zip(asked, MIXED)))
    assert all(bool(program.recorded) == recorded for program in batch.programs.values())
    readable = Batch(plain, pinned(CHEAP_NODES), cache=cache).run(list(zip(asked, MIXED)))
    for ids, settings, trace, other in zip(asked, MIXED, traces, readable):
        same_steps(trace, alone(plain, ids, settings))
        same_steps(trace, other)
        assert trace.config.step == "batched fixed" and set(trace.steps[0].stage_s) == {"draft", "verify", "commit"}
        assert trace.steps[0].draft_top_tokens == other.steps[0].draft_top_tokens, settings.label
    first = traces[0].steps[0].batch
    assert first.nodes == 16 + 15 + 0 + 5 + 40 and first.reason == "its own budget: 16 nodes"
    assert traces[2].steps[0].batch.reason.endswith("the root alone") and traces[2].steps[0].tree_tokens == []
    assert traces[4].summary.new_tokens == TOKENS - 9


@pytest.mark.parametrize("cache", ["rows", "paged"])
def test_the_batchs_recorded_advance_does_nothing_a_cuda_graph_cannot_replay(fixed64, cache, monkeypatch):
    """A GPU records ``advance`` over its buffers; a host read or a shape read from the device inside it fails the
    recording there. Every method's slots, both caches."""
    fixed, _, asked = fixed64
    batch = Batch(fixed, pinned(CHEAP_NODES), cache=cache)
    batch.fixed_graphs = True
    found: list[str] = []
    advance = FixedBatchProgram._advance

    def watched(program, inputs, log_probs):
        with _HostWork() as host:
            out = advance(program, inputs, log_probs)
        found.extend(host.found)
        return out

    monkeypatch.setattr(FixedBatchProgram, "_advance", watched)
    traces = batch.run(list(zip(asked, MIXED)))
    assert all(trace.config.step == "batched fixed" for trace in traces) and all(batch.programs.values())
    assert found == []


def test_auto_requests_take_the_fixed_step_sized_before_they_draft_and_learn_from_their_candidates(fixed64):
    fixed, plain, asked = fixed64
    kinds = [DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget="auto"),
             DecodeSettings("dflash", max_new_tokens=TOKENS, tree_budget="auto"),
             DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=8),
             DecodeSettings("ar", max_new_tokens=TOKENS),
             DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget="auto")]
    batch = Batch(fixed, pinned(CHEAP_NODES))
    requests = [batch.admit(ids, settings) for ids, settings in zip(asked, kinds)]
    while not batch.idle:
        batch.advance()
    for request, ids in zip(requests, asked):
        trace = request.trace
        assert trace.output_ids == alone(plain, ids, DecodeSettings("ar", max_new_tokens=TOKENS)).output_ids
        assert trace.config.step == "batched fixed" and all("tree_build" not in step.stage_s for step in trace.steps)
    for request in (requests[0], requests[1], requests[4]):
        sizes = [step.batch.budget for step in request.trace.steps]
        assert request.expected is not None and request.reach is not None and max(sizes) > 1
        assert request.trace.steps[-1].batch.reason.startswith("auto: ")
        assert request.trace.summary.tau > 1.5  # the oracle drafts deep: the trees the batch gave them paid
    assert {step.batch.budget for step in requests[2].trace.steps} == {8}
    # every slot verifies the program's nodes, so a drafting DDTree request's tree is the step's whole shared budget
    for request in (requests[0], requests[4]):
        drafted = [step for step in request.trace.steps if "shared budget" in step.batch.reason]
        assert drafted and all(step.batch.budget == int(step.batch.reason.split()[1]) for step in drafted)


def test_each_auto_request_learns_from_its_own_candidates_in_the_steps_record(fixed64, monkeypatch):
    """The record's candidates are read once for the whole step; each "auto" request learns from its own row of them
    (as from a step of its own), whatever requests sit between them."""
    fixed, _, asked = fixed64
    kinds = [DecodeSettings("dflash", max_new_tokens=12, tree_budget="auto"), DecodeSettings("ar", max_new_tokens=12),
             DecodeSettings("ddtree", max_new_tokens=12, tree_budget="auto"),
             DecodeSettings("ddtree", max_new_tokens=12, tree_budget=8),
             DecodeSettings("ddtree", max_new_tokens=12, tree_budget="auto")]
    batch = Batch(fixed, pinned(CHEAP_NODES))
    steps = []
    learn = Batch.learn_fixed

    def row_of(tree: FixedTree, index: int) -> FixedTree:
        return FixedTree.each(lambda field: field[index:index + 1], tree)

    def watched(self, active, candidates, depth):  # each request's row priced alone, by the budgeting as it is now
        before = [request.expected for request in active]
        priced = [copy.deepcopy(self.budgeting).learn_fixed(request.row_method, [request.expected],
                                                            row_of(candidates, index), depth)[0]
                  for index, request in enumerate(active)]
        learn(self, active, candidates, depth)
        steps.append([(request, before[index], (request.expected, request.reach), priced[index])
                      for index, request in enumerate(active)])

    monkeypatch.setattr(Batch, "learn_fixed", watched)
    batch.run(list(zip(asked, kinds)))
    learned = 0
    for step in steps:
        for index, (request, before, (expected, reach), on_its_own) in enumerate(step):
            if not (request.drafts and request.settings.auto_budget):
                assert expected is before
                continue
            assert torch.equal(expected, on_its_own[0]) and torch.equal(reach, on_its_own[1])
            learned += index == len(step) - 1
    assert learned  # the last request, behind the ones that do not learn, learned


@pytest.mark.parametrize("cache, recorded", [("rows", False), ("paged", False), ("paged", True)])
def test_requests_join_leave_and_move_between_the_fixed_and_the_readable_step(fixed64, cache, recorded):
    """``recorded``: each program's advance over buffers at fixed addresses, recorded anew as the caches grow and rows
    join (run eagerly, as a GPU's first run of each recording)."""
    fixed, plain, asked = fixed64
    batch = Batch(fixed, pinned(CHEAP_NODES), cache=cache)
    batch.fixed_graphs = recorded
    first = batch.admit(asked[0], DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=8))
    second = batch.admit(asked[1], DecodeSettings("dflash", max_new_tokens=TOKENS))
    for _ in range(3):
        batch.advance()
    # a sampled request joins: every step runs readably while it is in the batch, and it leaves early
    sampled = batch.admit(asked[2], DecodeSettings("ddtree", max_new_tokens=6, tree_budget=4, temperature=0.8,
                                                   seed=3))
    while sampled.finished is None:
        batch.advance()
    # a long prompt joins in the middle rows while the others step (rows no longer consecutive), then an AR request
    long_prompt = (asked[3] * 30)[:150]
    late = batch.admit(long_prompt, DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=16))
    after = batch.admit(asked[4], DecodeSettings("ar", max_new_tokens=TOKENS))
    while not batch.idle:
        batch.advance()
    kinds = [set(step.stage_s) for step in first.trace.steps]
    assert {"draft", "verify", "commit"} in kinds and any("tree_build" in kind for kind in kinds)  # both steps ran
    assert sampled.trace.output_ids == alone(plain, asked[2], sampled.settings).output_ids
    for request, ids in ((first, asked[0]), (second, asked[1]), (late, long_prompt), (after, asked[4])):
        same_steps(request.trace, alone(plain, ids, request.settings))
    if cache == "paged":  # every block back in the pool, the padding slots' too
        tables = batch.kv.tables
        assert sorted(tables.free) == list(range(batch.kv.blocks - 1)) and not any(tables.held)


def test_a_budget_cuts_the_slots_tree_to_the_best_first_tree_of_that_many_nodes():
    generator = torch.Generator().manual_seed(0)
    log_probs = torch.log_softmax(torch.randn(4, 6, 30, generator=generator, dtype=torch.float64), dim=-1)
    kind = torch.tensor([TREE, TREE, CHAIN, NO_TREE])
    budget = torch.tensor([16, 5, 6, 16])
    trees, candidates = slot_trees(log_probs, kind, budget, 16, 24)
    assert candidates.tokens.shape == (4, 24) and bool(candidates.valid[:2].all())
    assert torch.equal(candidates.tokens[:, :16], trees.tokens)  # what a step verifies: its candidates' first
    for slot, nodes in ((0, 16), (1, 5)):
        valid = trees.valid[slot]
        assert valid.tolist() == [True] * nodes + [False] * (16 - nodes)  # a prefix: any count is a tree
        readable = ddtree.build_tree(log_probs[slot], nodes)
        assert sorted(trees.tokens[slot][valid].tolist()) == sorted(readable.tokens.tolist())
        assert torch.allclose(trees.path_log_probs[slot][valid].sort().values,
                              readable.path_log_probs.double().sort().values.float().to(trees.path_log_probs.dtype))
        assert bool((trees.parents[slot][valid] < torch.arange(1, nodes + 1)).all())  # parents come first
    chain = trees.valid[2]
    assert chain.tolist() == [True] * 6 + [False] * 10  # the chain is as deep as the block, padded to 16 nodes
    assert candidates.valid[2].tolist() == [True] * 6 + [False] * 18
    assert trees.tokens[2][:6].tolist() == log_probs[2].argmax(-1).tolist()
    assert trees.parents[2][:6].tolist() == list(range(6))
    assert not bool(trees.valid[3].any())  # AR: the root alone


def test_slots_read_the_caches_rows_as_a_view_unless_a_joining_request_sits_between_them():
    state = RowState(torch.device("cpu"))
    for row, (root, past) in enumerate([(5, 10), (6, 7), (7, 3), (8, 4)]):
        state.set(row, root, past)
    together = SlotInputs.of([(4, TREE, 0), (0, NO_TREE, 1), (15, CHAIN, 2)], 4, 3, state)
    assert together.read == slice(0, 4) and together.rows.tolist() == [0, 1, 2, 3]
    assert together.kind.tolist() == [TREE, NO_TREE, CHAIN, NO_TREE]
    assert together.past.tolist() == [10, 7, 3, 0] and together.root.tolist() == [5, 6, 7, 0]  # padding: 0, 0
    apart = SlotInputs.of([(4, TREE, 0), (0, NO_TREE, 2), (15, CHAIN, 3)], 4, 4, state)
    assert torch.equal(apart.read, torch.tensor([0, 2, 3, 4])) and apart.past.tolist() == [10, 3, 4, 0]
    assert [node_bucket(n) for n in (0, 1, 5, 15, 16, 17, 40)] == [0, 1, 8, 16, 16, 32, 64]


def test_the_slots_compaction_moves_each_rows_accepted_path_as_the_readable_compaction_does(fixed64):
    config = fixed64[0].target.config
    together, alone_kv = (BatchKV(config, 4, 64, torch.float64, torch.device("cpu")) for _ in range(2))
    for kv in (together, alone_kv):
        for buffers in (kv.keys, kv.values):
            for buffer in buffers:
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(buffer.numel()),
                                         dtype=buffer.dtype))
    rows, pasts = [2, 0, 1], [6, 3, 9]
    paths = [[0, 2, 3, 7], [0, 1], [0, 5]]
    padded = torch.tensor([path + [path[-1]] * (4 - len(path)) for path in paths])
    together.compact_slots(torch.tensor(rows), torch.tensor(pasts), padded, torch.tensor([len(p) for p in paths]))
    alone_kv.compact(rows, pasts, paths)
    for mine, theirs in zip(together.keys + together.values, alone_kv.keys + alone_kv.values):
        assert torch.equal(mine[:, :, :-1], theirs[:, :, :-1])  # the last column is the slots' scratch


def test_a_round_launches_the_next_fixed_step_before_it_finishes_the_one_in_flight(fixed64):
    """Pipelined: the round that launches a batch's first fixed step finishes none; each later round finishes the step
    the round before launched, from roots and pasts that step left on the device; a readable step waits for it."""
    fixed, plain, asked = fixed64
    batch = Batch(fixed, pinned(CHEAP_NODES))
    requests = [batch.admit(ids, DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=8)) for ids in asked[:3]]
    batch.advance()  # the prompts, then the first step launched
    assert batch.in_flight is not None and all(not r.trace.steps for r in requests)
    launched = batch.in_flight
    batch.advance()
    assert all(len(r.trace.steps) == 1 for r in requests) and batch.in_flight is not launched
    device = batch.row_state.values[1, [r.row for r in requests]].tolist()
    assert all(ahead > host for ahead, host in zip(device, [r.start for r in requests]))  # the host a step behind
    sampled = batch.admit(asked[3], DecodeSettings("ar", max_new_tokens=4, temperature=0.5, seed=1))
    batch.advance()  # its prompt; the step in flight finished, none launched
    assert batch.in_flight is None and all(len(r.trace.steps) == 2 for r in requests) and not sampled.trace.steps
    while not batch.idle:
        batch.advance()
    for request, ids in zip(requests, asked):
        same_steps(request.trace, alone(plain, ids, request.settings))


def test_a_drafter_in_a_dtype_of_its_own_drafts_in_the_fixed_step():
    """The rows a fixed step keeps for the next draft are kept in the drafter's dtype (bfloat16 drafts beside a float32
    target is the CPU's default): here a float32 drafter beside a float64 target, each request its solo AR output."""
    target = tiny_target(0, vocab=VOCAB)
    drafter = tiny_drafter(target, 0).to(torch.float32)
    fixed = Decoder(target, drafter, DrafterInfo("random", trained=False), fixed_step=True)
    asked = prompts(2)
    kinds = [DecodeSettings("ddtree", max_new_tokens=12, tree_budget=8), DecodeSettings("dflash", max_new_tokens=12)]
    traces = Batch(fixed, pinned(CHEAP_NODES)).run(list(zip(asked, kinds)))
    for trace, ids in zip(traces, asked):
        assert trace.config.step == "batched fixed" and any(step.tree_tokens for step in trace.steps)
        assert trace.output_ids == alone(fixed, ids, DecodeSettings("ar", max_new_tokens=12)).output_ids


CONTEXT_SWAY = 20.0  # a random drafter's weights times this: drafts that turn on the context, not on the block alone


@pytest.mark.parametrize("cache, recorded", [("rows", False), ("paged", True)])
def test_a_fixed_step_whose_drafts_do_not_pay_verifies_roots_and_keeps_the_drafters_context(cache, recorded):
    """Where the batch's drafts are worth less than drafting costs (``plan_drafts``), the fixed step drafts nothing and
    verifies roots, as the readable step does, yet reads each request's accepted rows into the drafter's context: the
    first draft once drafts pay again (nodes cheap) is the draft a request alone makes from the whole of its context.
    A random drafter, its weights scaled up so that its draft turns on every row of its context."""
    target = tiny_target(0, vocab=VOCAB)
    drafter = tiny_drafter(target, 0)
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(CONTEXT_SWAY)
    plain = Decoder(target, drafter, DrafterInfo("random", trained=False))
    fixed = Decoder(target, plain.drafter, plain.drafter_info, fixed_step=True)
    asked = prompts(3)
    kinds = [DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget="auto"),
             DecodeSettings("dflash", max_new_tokens=TOKENS, tree_budget="auto"),
             DecodeSettings("ar", max_new_tokens=TOKENS)]
    batch = Batch(fixed, pinned(DEAR_NODES), cache=cache)
    if recorded:  # the drafter's recorded pass reads the rows of a step that drafts nothing too (its roots alone)
        batch.graphed_draft = GraphedBatchDraft(fixed.drafter, *fixed.draft_weights, batch.context, replay=False)
        batch.fixed_graphs = True
    requests = [batch.admit(ids, settings) for ids, settings in zip(asked, kinds)]
    for _ in range(6):
        batch.advance()
    assert any(program.keeps and not program.drafts for program in batch.programs.values())
    batch.budgeting.cost = CHEAP_NODES
    while not batch.idle:
        batch.advance()
    for request, ids in zip(requests, asked):
        assert request.trace.output_ids == alone(plain, ids, DecodeSettings("ar", max_new_tokens=TOKENS)).output_ids
    for request, ids in zip(requests[:2], asked):
        steps = request.trace.steps
        skipped = [step.batch.reason.startswith("auto: not drafted") for step in steps]
        assert all(not step.tree_tokens for step, skip in zip(steps, skipped) if skip)
        # the first draft after steps that drafted nothing (the random drafter's first drafts teach the batch that
        # they are worth little)
        drafted = next(index for index in range(2, len(steps)) if skipped[index - 2] and skipped[index - 1]
                       and steps[index].tree_tokens)
        first = steps[drafted]
        # the request alone, its prompt what the batch had committed before the step's root (the prompt pass's token,
        # then the steps'): its prompt pass picks the root
        past = ids + request.trace.output_ids[:sum(len(step.committed_ids) for step in steps[:drafted])]
        budget = len(first.tree_tokens)
        single = alone(plain, past, replace(request.settings, max_new_tokens=TOKENS, tree_budget=budget)).steps[0]
        assert first.root_token == single.root_token
        # its best ``budget`` nodes (a DFlash request alone verifies its whole chain, whatever the budget)
        assert tree_worth(first) == pytest.approx(sorted(single.tree_path_probs[:budget]), rel=1e-6)


def test_a_steps_auto_requests_learn_together_what_each_would_learn_from_its_offer():
    """``Budgeting.learn_fixed`` prices every "auto" request's candidates at once; each request's next expectation and
    reach, and the method's typical draft after them all, are what ``learn`` makes of each one's offer in turn."""
    from ddtree.allocate import Offer
    from engine.loop.budgeting import Budgeting
    from engine.methods import method

    generator = torch.Generator().manual_seed(0)
    row = method("ddtree")
    tree = ddtree.fixed.heap_order(row.fixed(torch.log_softmax(torch.randn(4, 2, 6, generator=generator) * 3, -1),
                                             row.nodes(64, 2)))
    expected = [None, torch.rand(64, dtype=torch.float64, generator=generator), None,
                torch.rand(64, dtype=torch.float64, generator=generator)]
    together, each = Budgeting(), Budgeting()
    learned = together.learn_fixed(row, expected, tree, 2)
    ordered, worth, counts = each.priced(tree, 2)
    assert max(counts) < 64  # a block of 2 holds fewer candidates: the expectation is padded past them
    for r, (next_expected, reach) in enumerate(learned):
        own = each.learn(row, expected[r], Offer(tuple(worth[r, :counts[r]].tolist()), counts[r]))
        assert torch.equal(next_expected, own) and torch.equal(reach, ordered.depths[r, :counts[r]].cummax(0).values)
    assert torch.equal(together.typical["ddtree"], each.typical["ddtree"])
