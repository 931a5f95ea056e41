"""Tree nodes for the batch (``ddtree.allocate``) and the batch's verify layout (``ddtree.batch``): the allocation
is the best the cost model allows (against brute force), never past a request's cap, and shrinks from trees to
chains to roots as the batch grows; on drafts the shipped drafter recorded, a batch of one gets the budget the
bench found fastest on this kind of machine."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import ddtree
from ddtree.allocate import (
    SCALE_BOUNDS,
    Calibration,
    Offer,
    StepCost,
    allocate,
    densities,
    in_worth_order,
    measured_scales,
    plan_drafts,
    prefix_rates,
    prefix_rates_readable,
    shared_budget,
)
from ddtree.batch import pack_trees
from engine.loop.budgeting import AUTO_NODES, Budgeting
from engine.methods import DDTREE, DFLASH

ROOT = Path(__file__).resolve().parent.parent
RECORDED_TRACE = ROOT / "assets" / "traces" / "cpu-python-reverse.json"
CPU = "CPU, 2 threads | torch | float32 | batched step"  # the kind of machine CI and this project's sessions run on


def brute_force(offers: list[Offer], cost: StepCost, requests: int, drafts: int) -> float:
    """The best tokens per second over every count per free offer (fixed ones take their cap)."""
    ranges = [range(o.available, o.available + 1) if o.fixed else range(o.available + 1) for o in offers]
    best = 0.0
    for counts in itertools.product(*ranges):
        tokens = requests + sum(sum(o.worth[:c]) for o, c in zip(offers, counts))
        best = max(best, tokens / cost.seconds(requests, sum(counts), drafts))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_allocation_is_the_best_the_cost_model_allows(seed):
    generator = torch.Generator().manual_seed(seed)
    offers = []
    for index in range(3):
        worth = torch.rand(5, generator=generator).sort(descending=True).values.tolist()
        offers.append(Offer(tuple(worth), cap=int(torch.randint(1, 6, (1,), generator=generator)),
                            fixed=index == 2 and seed % 2 == 0))
    grouping = {"row_group": 4, "few_rows": 12} if seed % 3 == 0 else {}  # a CPU's filler rows, or none
    cost = StepCost(*torch.rand(4, generator=generator).mul(0.01).tolist(), **grouping)
    allocation = allocate(offers, cost, requests=4, drafts=3)
    assert allocation.tokens_per_s == pytest.approx(brute_force(offers, cost, 4, 3))
    for offer, nodes in zip(offers, allocation.nodes):
        assert nodes <= offer.available
        assert not offer.fixed or nodes == offer.available


def test_nodes_that_fill_rows_the_pass_runs_anyway_are_taken_however_little_they_are_worth():
    offers = [Offer((0.01, 0.01, 0.01), 3), Offer((0.01,), 1)]
    plain = StepCost(fixed_s=0.05, per_request_s=0.005, per_node_s=0.002, per_draft_s=0.01)
    grouped = StepCost(fixed_s=0.05, per_request_s=0.005, per_node_s=0.002, per_draft_s=0.01, row_group=4, few_rows=12)
    assert allocate(offers, plain, requests=2, drafts=2).nodes == (0, 0)
    taken = allocate(offers, grouped, requests=2, drafts=2)
    assert sum(taken.nodes) == 2  # two roots and two nodes: the four rows a pass of two runs as
    assert taken.seconds == pytest.approx(plain.seconds(2, 2, 2)) == pytest.approx(grouped.seconds(2, 0, 2))
    assert [grouped.seconds(13, 0, 0), grouped.seconds(1, 2, 0)] == [plain.seconds(13, 0, 0), plain.seconds(1, 3, 0)]


def test_trees_shrink_to_chains_and_roots_as_the_batch_grows():
    worth = (0.9, 0.8, 0.6, 0.5, 0.3, 0.25, 0.2, 0.1, 0.05)
    cost = StepCost(fixed_s=0.030, per_request_s=0.004, per_node_s=0.004, per_draft_s=0.003)  # compute-bound
    nodes = {}
    for batch in (1, 4, 16, 64):
        allocation = allocate([Offer(worth, 9)] * batch, cost, batch, batch)
        nodes[batch] = max(allocation.nodes)
    assert nodes[1] >= nodes[4] >= nodes[16] >= nodes[64]
    assert nodes[1] >= 5 and nodes[64] <= 2  # a tree for one, a short chain for 64


def test_drafting_stops_where_it_does_not_pay():
    good, poor = Offer((0.9, 0.8, 0.7), 3), Offer((0.02, 0.01), 2)
    cost = StepCost(fixed_s=0.01, per_request_s=0.002, per_node_s=0.001, per_draft_s=0.004)
    assert plan_drafts([good, poor, None], cost, 3) == [True, False, False]
    dear = StepCost(fixed_s=0.001, per_request_s=0.01, per_node_s=0.01, per_draft_s=0.2)
    assert plan_drafts([good, poor, None], dear, 3) == [False, False, False]
    assert plan_drafts([Offer((0.0,), 1, fixed=True)], dear, 1) == [True]  # a fixed budget drafts whatever it costs


def test_calibration_learns_acceptance_and_stays_monotone():
    calibration = Calibration()
    probs = torch.tensor([0.95] * 200 + [0.15] * 200)
    first = torch.ones(400, dtype=torch.bool)
    calibration.observe(probs, first, torch.cat([torch.rand(200) < 0.5, torch.rand(200) < 0.9]))
    low, high = calibration.worth(torch.tensor([0.15, 0.95]), first[:2]).tolist()
    assert low == pytest.approx(high, abs=0.1)  # an over-confident top bin is pulled down to what it earned
    rates = calibration.rates()
    assert torch.all(rates[:, 1:] >= rates[:, :-1])
    assert Calibration.from_dict(json.loads(json.dumps(calibration.to_dict()))).rates().equal(rates)


def test_calibration_keeps_the_first_choice_path_apart_from_the_rest_of_a_tree():
    calibration = Calibration()
    probs = torch.full((400,), 0.35)
    first = torch.arange(400) < 200
    calibration.observe(probs, first, torch.cat([torch.arange(200) < 120, torch.arange(200) < 60]))
    on_path, off_path = calibration.worth(torch.tensor([0.35, 0.35]), torch.tensor([True, False])).tolist()
    assert on_path == pytest.approx((120 + 20 * 0.35) / 220) and off_path == pytest.approx((60 + 20 * 0.35) / 220)
    with pytest.raises(ValueError, match="record it again"):  # a calibration of one kind for every node
        Calibration.from_dict({"edges": [0.0, 1.0], "verified": [3.0], "accepted": [1.0]})


def test_the_first_choice_path_is_the_chain_inside_a_tree():
    # depth 1: a (rank 0), b (rank 1); depth 2: c below a (rank 0), d below b (rank 0), e below a (rank 1)
    log_probs = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]))
    tree = ddtree.build_tree(log_probs, budget=5)
    on = tree.on_first_choices()
    assert on.tolist() == [rank == 0 and (parent == 0 or on[parent - 1].item())
                           for parent, rank in zip(tree.parents.tolist(), tree.ranks.tolist())]
    chain = ddtree.chain_tree(log_probs)
    assert on.sum() == chain.size == 2 and tree.tokens[on].tolist() == chain.tokens.tolist()
    assert not on[(tree.ranks > 0)].any() and (tree.ranks[~on] > 0).any() and not on.all()
    off_below_alternative = (tree.ranks == 0) & (tree.parents > 0) & ~on
    assert off_below_alternative.any()  # a first choice below an alternative is off the path


def test_a_tree_in_worth_order_puts_a_deep_first_choice_before_a_shallow_alternative():
    # heap order: a (0.6, first choice), b (0.35, beside a), c (0.3, below a), e (0.18, beside c), d (0.175, below b)
    log_probs = torch.log(torch.tensor([[0.6, 0.35, 0.05], [0.5, 0.3, 0.2]]))
    tree = ddtree.build_tree(log_probs, budget=5)
    assert tree.tokens.tolist() == [0, 1, 0, 1, 0] and tree.parents.tolist() == [0, 0, 1, 1, 2]
    # d's worth above its parent's is capped at it: a child is accepted only where its parent is
    worth = torch.tensor([0.6, 0.2, 0.35, 0.1, 0.25], dtype=torch.float64)
    ordered, ordered_worth = in_worth_order(tree, worth)
    assert ordered.parents.tolist() == [0, 1, 0, 3, 1] and ordered.path_log_probs.exp().tolist() == pytest.approx(
        [0.6, 0.3, 0.35, 0.175, 0.18])  # a, c, b, d, e: the chain a-c first
    assert ordered_worth.tolist() == [0.6, 0.35, 0.2, 0.2, 0.1]  # d capped at b's 0.2, after b (stable)
    assert ordered.on_first_choices().tolist() == [True, True, False, False, False]


@pytest.mark.parametrize("seed", range(6))
def test_every_first_count_of_a_tree_in_worth_order_is_a_tree_of_its_best_nodes(seed):
    generator = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(3 * torch.randn(8, 12, generator=generator), dim=-1)
    tree = ddtree.build_tree(log_probs, budget=40)
    calibration = Calibration()
    calibration.observe(torch.rand(500, generator=generator), torch.rand(500, generator=generator) < 0.5,
                        torch.rand(500, generator=generator) < 0.4)
    ordered, worth = in_worth_order(tree, calibration.worth(tree.path_log_probs.exp(), tree.on_first_choices()))
    assert (ordered.parents < torch.arange(1, tree.size + 1)).all()  # parents first: every prefix is a tree
    assert (worth[1:] <= worth[:-1]).all() and (worth[ordered.parents[ordered.parents > 0] - 1]
                                                 >= worth[ordered.parents > 0]).all()
    same = {(t, p) for t, p in zip(tree.tokens.tolist(), tree.path_log_probs.tolist())}
    assert {(t, p) for t, p in zip(ordered.tokens.tolist(), ordered.path_log_probs.tolist())} == same
    with pytest.raises(ValueError, match="parent before its children"):
        tree.reordered(torch.arange(tree.size).flip(0))


@pytest.mark.parametrize(("depth", "vocab"), [(15, 300), (4, 80), (2, 5), (1, 7)])
def test_auto_candidates_built_for_many_requests_at_once_are_each_requests_own(depth, vocab):
    """``Budgeting.auto_candidates`` (one beam for every request, priced and ordered together) against
    ``Budgeting.candidates`` request by request: the same nodes in the same order, the same offers; a block too small
    for ``AUTO_NODES`` candidates (2 x 5, 1 x 7) gives as many nodes as it holds."""
    generator = torch.Generator().manual_seed(depth * vocab)
    budgeting = Budgeting()
    budgeting.calibration.observe(torch.rand(500, generator=generator), torch.rand(500, generator=generator) < 0.5,
                                  torch.rand(500, generator=generator) < 0.4)
    log_probs = torch.log_softmax(3 * torch.randn(6, depth, vocab, generator=generator), dim=-1)
    for row in (DDTREE, DFLASH):
        together = budgeting.auto_candidates(row, log_probs)
        assert len(together) == len(log_probs)
        for own_draft, (tree, offer) in zip(log_probs, together):
            alone, alone_offer = budgeting.candidates(row, own_draft, None, auto=True)
            assert tree.size == alone.size == min(row.nodes(AUTO_NODES, depth), sum(vocab ** d for d in
                                                                                    range(1, depth + 1)))
            for name in ("tokens", "parents", "depths", "ranks"):
                assert getattr(tree, name).equal(getattr(alone, name)), name
            assert tree.path_log_probs == pytest.approx(alone.path_log_probs, abs=1e-5)
            assert offer.cap == alone_offer.cap and not offer.fixed
            assert offer.worth == pytest.approx(alone_offer.worth)


def test_a_request_s_best_bundle_rate_is_its_best_prefix_over_a_draft_and_its_nodes():
    cost = StepCost(fixed_s=0.01, per_request_s=0.01, per_node_s=0.002, per_draft_s=0.005)
    offers = [Offer((0.9, 0.5, 0.1), 3), Offer((), 0), Offer((0.3,), 1, fixed=True), Offer((0.8, 0.7, 0.6), 2)]
    rates = densities(offers, cost)
    assert rates[1] == 0.0 and rates[2] == float("inf")
    assert rates[0] == pytest.approx(max((0.9, 1.4, 1.5)[k] / (0.005 + 0.002 * (k + 1)) for k in range(3)))
    assert rates[3] == pytest.approx(1.5 / (0.005 + 0.004))  # past its cap a node is not offered


MEASURED = StepCost(fixed_s=0.004, per_request_s=0.0002, per_node_s=0.00003, per_draft_s=0.0001, draft_pass_s=0.003,
                    per_draft_row_s=0.00001, tree_step_s=0.001, per_tree_request_s=0.0001)


def measured_steps(roots: float, trees: float) -> list[tuple[int, int, int, int, float]]:
    """Steps of AR, chains and trees at 4-16 requests that took ``roots`` times ``MEASURED``'s roots' part and
    ``trees`` times the rest."""
    steps = []
    for requests, per in itertools.product((4, 8, 16), (0, 5, 20, 50)):
        nodes, drafts = requests * per, requests if per else 0
        own_roots, own_trees = MEASURED.parts(requests, nodes, drafts, drafts * 8)
        steps.append((requests, nodes, drafts, drafts * 8, roots * own_roots + trees * own_trees))
    return steps


def test_measured_steps_scale_a_costs_roots_and_its_trees_apart():
    """``measured_scales``: steps that took 1.3 times the roots' part and twice the trees' give those scales back,
    pulled a little towards 1 by the prior (the roots' by the steps of roots alone, a quarter of them); steps that
    never drafted leave the trees' part as fitted; a stalled step counts as a few times the usual; no part scales past
    its bounds."""
    roots, trees = 3.0, 5.0
    assert MEASURED.scaled(roots, trees).parts(8, 40, 8, 64) == pytest.approx(
        tuple(scale * part for scale, part in zip((roots, trees), MEASURED.parts(8, 40, 8, 64))))
    assert measured_scales(MEASURED, []) == (1.0, 1.0)
    steps = measured_steps(1.3, 2.0) * 32
    roots, trees = measured_scales(MEASURED, steps)
    assert roots == pytest.approx(1.3, rel=0.05) and trees == pytest.approx(2.0, rel=0.08) and trees < 2.0
    few_roots, few_trees = measured_scales(MEASURED, steps[:6])
    assert 1.0 < few_trees < trees  # a few steps move the prior less far
    ar = [step for step in measured_steps(1.5, 9.0) if not step[2]] * 8
    roots, trees = measured_scales(MEASURED, ar)
    assert roots == pytest.approx(1.5, rel=0.1) and trees == pytest.approx(1.0)
    stalled = list(steps)
    stalled[5] = (*stalled[5][:4], stalled[5][4] * 100)  # a recording or a compilation
    assert measured_scales(MEASURED, stalled) == pytest.approx(measured_scales(MEASURED, steps), abs=0.15)
    assert measured_scales(MEASURED, measured_steps(10.0, 10.0) * 32) == (SCALE_BOUNDS[1], SCALE_BOUNDS[1])
    assert measured_scales(MEASURED, measured_steps(0.05, 0.05) * 32) == (SCALE_BOUNDS[0], SCALE_BOUNDS[0])


def test_what_steps_that_all_draft_take_beyond_the_cost_is_their_trees():
    """Steps that all draft cannot tell their roots' time from their trees': their roots stay as fitted (the steps of
    roots alone say what they cost), and the whole excess scales the trees, so that an AR step does not look dearer
    with them."""
    drafting = [step for step in measured_steps(1.0, 3.0) if step[2]] * 8
    roots, trees = measured_scales(MEASURED, drafting)
    assert roots == 1.0 and trees > 2.7
    both = [step for step in measured_steps(1.5, 1.5) if step[2]] * 8  # roots slower too, and no step to tell
    roots, trees = measured_scales(MEASURED, both)
    assert roots == 1.0 and trees > 1.5


@pytest.mark.parametrize("true, accepted", [
    (StepCost(fixed_s=0.002, per_request_s=0.0001, per_node_s=3e-5, per_draft_s=1e-4, draft_pass_s=0.002,
              per_draft_row_s=1e-5, tree_step_s=0.001, per_tree_request_s=1e-4), 0.75),  # drafts do not pay
    (StepCost(fixed_s=0.002, per_request_s=0.0001, per_node_s=1e-5, per_draft_s=5e-5, draft_pass_s=0.001,
              per_draft_row_s=5e-6, tree_step_s=0.0005, per_tree_request_s=5e-5), 0.8),  # small trees pay
])
def test_a_batch_whose_trees_cost_three_times_the_fit_comes_to_the_true_costs_budget(true, accepted):
    """A fixed step's shared budget chosen by the cost scaled to the batch's own steps, as ``Batch`` refits it: where
    the fit prices trees at a third of what they take, the steps take the budget the true cost picks, but for a few
    tries of a bigger one each time the steps that taught it have left the window. (With the excess of drafting steps
    shared with the roots, AR steps looked dearer too and every step kept the fit's too big trees.)"""
    worth = (accepted ** torch.arange(1, 65, dtype=torch.float64))[None].repeat(16, 1)  # 16 requests' drafts
    budgets, believed = [0, 1, 2, 4, 8, 16, 32, 64], true.scaled(1.0, 1 / 3)
    kept, scales, chosen = [], (1.0, 1.0), []
    for step in range(800):
        nodes = shared_budget(worth, believed.scaled(*scales), 16, budgets, 16, 16 * 15).nodes[0]
        drafts = 16 if nodes else 0
        kept = [*kept, (16, 16 * nodes, drafts, drafts * 15, true.seconds(16, 16 * nodes, drafts, drafts * 15))][-256:]
        if step % 16 == 15:
            scales = measured_scales(believed, kept)
        chosen.append(nodes)
    best = shared_budget(worth, true, 16, budgets, 16, 16 * 15).nodes[0]
    cycle = chosen[-272:]  # a window of steps and the tries after it
    assert cycle.count(best) >= 0.85 * len(cycle)
    assert shared_budget(worth, believed, 16, budgets, 16, 16 * 15).nodes[0] > best  # where the fit alone would go


def recorded_drafts() -> list[torch.Tensor]:
    """The shipped drafter's per-depth distributions as its DDTree run recorded them (top-8 per depth, the rest of
    each depth's mass left off)."""
    data = json.loads(RECORDED_TRACE.read_text())
    trace = next(t for t in data["traces"] if t["config"]["method"] == DDTREE.name)
    drafts = []
    for step in trace["steps"]:
        tokens, probs = torch.tensor(step["draft_top_tokens"]), torch.tensor(step["draft_top_probs"])
        log_probs = torch.full((tokens.shape[0], 49152), float("-inf"))
        drafts.append(log_probs.scatter_(1, tokens, probs.log()))
    return drafts


def shipped_budgeting() -> Budgeting:
    """This kind of machine's recorded step costs and the shipped drafter's recorded calibration."""
    from engine.loop.budgeting import recorded_budgeting
    from engine.loop.loading import shipped_drafter
    from engine.models.drafter import weights_digest

    return recorded_budgeting(CPU, weights_digest(shipped_drafter()))


def test_on_recorded_drafts_a_batch_of_one_gets_the_bench_s_best_budget_and_a_large_batch_chains_or_roots():
    """The shipped drafter's recorded drafts (an easy prompt: trees pay here even in large batches) with this kind of
    machine's recorded step costs: alone, a request gets about the budget the bench found fastest here; as the batch
    grows fewer requests draft and their trees shrink, to a chain or two nodes on average at 64."""
    budgeting, drafts = shipped_budgeting(), recorded_drafts()
    alone = sorted(budgeting.alone(DDTREE, log_probs).size for log_probs in drafts)
    assert 8 <= alone[len(alone) // 2] <= 32  # the bench's fastest budget on this machine kind: 16 (budgets.json)
    mean_nodes, drafting = [], []
    for batch in (1, 4, 16, 64):
        offers = [budgeting.candidates(DDTREE, log_probs, None, auto=True)[1] for log_probs in
                  (drafts * batch)[:batch]]
        drafted = plan_drafts(offers, budgeting.cost, batch)
        allocation = allocate([o for o, d in zip(offers, drafted) if d], budgeting.cost, batch, sum(drafted))
        assert all(nodes <= AUTO_NODES for nodes in allocation.nodes)
        mean_nodes.append(sum(allocation.nodes) / batch)
        drafting.append(sum(drafted) / batch)
    assert mean_nodes == sorted(mean_nodes, reverse=True) and drafting == sorted(drafting, reverse=True)
    assert mean_nodes[-1] <= 3 and drafting[-1] < 0.5


def test_the_layout_of_the_worked_example():
    """ddtree/batch.py's docstring: a root with two children after 5 tokens, and AR's root after 2."""
    two_children = ddtree.DraftTree(torch.tensor([7, 8]), torch.tensor([0, 0]), torch.tensor([1, 1]),
                                    torch.zeros(2), torch.zeros(2), torch.tensor([0, 1]))
    layout = pack_trees([two_children, ddtree.DraftTree.empty()], roots=[5, 9], pasts=[5, 2])
    assert layout.query_start_loc.tolist() == [0, 3, 4]
    assert layout.input_ids.tolist() == [5, 7, 8, 9]
    assert layout.position_ids.tolist() == [5, 6, 6, 2]
    assert layout.kv_rows.tolist() == [0, 0, 0, 1] and layout.kv_columns.tolist() == [5, 6, 7, 2]
    assert layout.padded.tolist() == [[0, 1, 2], [3, 3, 3]] and layout.unpadded.tolist() == [0, 1, 2, 3]
    assert layout.visible[0].long().tolist() == [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0],
                                                 [1, 1, 1, 1, 1, 1, 0, 1]]
    assert layout.visible[1].long().tolist() == [[1, 1, 1, 0, 0, 0, 0, 0]] * 3


def test_the_step_cost_fit_finds_the_line_through_each_shapes_median_step_its_tree_knee_and_filler_rows():
    from engine.loop.batch import StepShape
    from engine.measure.step_cost import GRID_NODES, fit

    truth = StepCost(fixed_s=0.06, per_request_s=0.005, per_node_s=0.002, per_draft_s=0.003, draft_pass_s=0.02,
                     per_draft_row_s=0.0004, tree_step_s=0.015, per_tree_request_s=0.006, row_group=4, few_rows=12)
    shapes = []
    for requests, per in itertools.product((1, 2, 4, 8), GRID_NODES):
        drafts = requests if per else 0
        rows = drafts * min(per, 15)  # the grid's trees draft as deep as they can reach, a block at most
        seconds = truth.seconds(requests, requests * per, drafts, rows)
        drafting = truth.seconds(requests, requests * per, drafts, rows) - truth.seconds(requests, requests * per, 0)
        shapes += [StepShape(requests, requests * per, drafts, rows, seconds * (1 + 0.01 * (step % 3 - 1)),
                             drafting * (1 + 0.01 * (step % 3 - 1))) for step in range(9)]
        shapes.append(StepShape(requests, requests * per, drafts, rows, seconds * 4, drafting * 4))  # a stall
    fitted = fit(shapes, (4, 12))
    assert (fitted.row_group, fitted.few_rows) == (4, 12)
    for name in ("fixed_s", "per_request_s", "per_node_s", "per_draft_s", "per_draft_row_s", "draft_pass_s",
                 "tree_step_s", "per_tree_request_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.02, abs=2e-4), name


def test_before_drafting_a_node_brings_its_drafted_row_and_a_draft_its_margin():
    cost = StepCost(fixed_s=0.05, per_request_s=0.003, per_node_s=0.002, per_draft_s=0.002, draft_pass_s=0.01,
                    per_draft_row_s=0.0005)
    planned = cost.before_drafting(2)
    # a chain of 5 nodes drafted 5 + 2 slots deep costs what the step will cost once its rows are known
    assert planned.seconds(3, 5, 1) == pytest.approx(cost.seconds(3, 5, 1, 7))
    assert planned.per_draft_row_s == 0.0
    # with drafted rows dear, fewer nodes pay
    worth = (0.9, 0.6, 0.5, 0.45, 0.4, 0.35)
    dear = StepCost(fixed_s=0.05, per_request_s=0.003, per_node_s=0.002, per_draft_s=0.002, per_draft_row_s=0.02)
    cheap = allocate([Offer(worth, 6)], cost.before_drafting(2), 1, 1).nodes[0]
    assert allocate([Offer(worth, 6)], dear.before_drafting(2), 1, 1).nodes[0] < cheap


def test_the_knee_of_verifying_any_node_is_paid_once_a_step_and_can_keep_a_large_batch_at_ar():
    """Nodes bought one by one each pay their row; the first also pays the step's knee (a tree mask over every
    request's context), so a batch whose knee outweighs what its best nodes earn verifies roots alone, where the
    same cost without the knee buys them."""
    knee = StepCost(fixed_s=0.06, per_request_s=0.01, per_node_s=0.002, per_draft_s=0.0, tree_step_s=0.02,
                    per_tree_request_s=0.008)
    flat = replace(knee, tree_step_s=0.0, per_tree_request_s=0.0)
    assert knee.seconds(8, 0, 0) == flat.seconds(8, 0, 0)
    assert knee.seconds(8, 1, 0) - flat.seconds(8, 1, 0) == pytest.approx(0.02 + 8 * 0.008)
    assert knee.seconds(8, 5, 0) - knee.seconds(8, 1, 0) == pytest.approx(4 * 0.002)
    assert knee.seconds(2, torch.tensor([0.0, 2.0]), 0).tolist() == pytest.approx([0.08, 0.08 + 0.004 + 0.036])
    offers = [Offer((0.5, 0.3), 2) for _ in range(8)]
    assert allocate(offers, knee, 8, 0).nodes == (0,) * 8
    assert sum(allocate(offers, flat, 8, 0).nodes) > 0


def test_a_batchs_trees_observed_at_once_count_as_each_observed_alone():
    trees = [ddtree.build_tree(torch.log_softmax(torch.randn(5, 30, generator=torch.Generator().manual_seed(seed)),
                                                 dim=-1), budget) for seed, budget in ((1, 9), (2, 0), (3, 14))]
    paths = [[0, 1, 3], [0], [0, 2]]
    together, apart = Budgeting(), Budgeting()
    together.observe(trees, paths)
    for tree, path in zip(trees, paths):
        apart.calibration.rates()  # read between observations: each observation makes them anew
        apart.observe([tree], [path])
    assert together.calibration == apart.calibration
    assert sum(map(sum, together.calibration.verified)) == 23 and sum(map(sum, together.calibration.accepted)) == 3
    assert torch.equal(together.calibration.rates(), apart.calibration.rates())


@pytest.mark.parametrize("seed", range(6))
def test_every_prefixs_rate_in_one_pass_is_each_prefixs_own_allocation(seed):
    generator = torch.Generator().manual_seed(seed)
    offers = []
    for index in range(int(torch.randint(1, 12, (1,), generator=generator))):
        size = int(torch.randint(0, 20, (1,), generator=generator))
        worth = torch.rand(size, generator=generator, dtype=torch.float64).sort(descending=True).values
        worth = (worth * 8).round() / 8 if index % 2 else worth  # coarse worths: ties across offers
        offers.append(Offer(tuple(worth.tolist()), int(torch.randint(0, 24, (1,), generator=generator)),
                            fixed=index % 4 == 3))
    cost = StepCost(fixed_s=0.01, per_request_s=0.002, per_node_s=0.0008, per_draft_s=0.003, draft_pass_s=0.004,
                    tree_step_s=0.002, per_tree_request_s=0.0005, row_group=4, few_rows=12)
    assert prefix_rates(offers, cost, 12) == prefix_rates_readable(offers, cost, 12)


def shared_budget_readable(worth: list[list[float]], cost: StepCost, requests: int, budgets: list[int], drafts: int,
                           draft_rows: int) -> tuple[int, float]:
    """Each budget's step priced in plain floats, one at a time: the best budget and its tokens a second."""
    best, best_rate = None, -1.0
    for n in budgets:
        tokens = requests + sum(sum(own[:n]) for own in worth)
        rate = tokens / cost.seconds(requests, requests * n, drafts if n else 0, draft_rows if n else 0)
        if rate > best_rate:
            best, best_rate = n, rate
    return best, best_rate


@pytest.mark.parametrize("seed", range(8))
def test_a_fixed_steps_shared_budget_is_the_fastest_of_its_budgets(seed):
    generator = torch.Generator().manual_seed(seed)
    free = int(torch.randint(1, 6, (1,), generator=generator))
    worth = torch.rand(free, 16, generator=generator, dtype=torch.float64).sort(dim=1, descending=True).values
    worth[:, int(torch.randint(2, 16, (1,), generator=generator)):] = 0.0  # zeros past a request's own nodes
    cost = StepCost(*torch.rand(4, generator=generator).mul(0.01).tolist(), draft_pass_s=0.002, per_draft_row_s=1e-4,
                    tree_step_s=0.001, per_tree_request_s=2e-4)
    budgets = [0, 1, 2, 4, 8, 16, 32] if seed % 2 else [4, 8, 16, 32]  # with a fixed budget's floor: no 0
    requests = free + seed % 3  # and AR requests beside them, whose slots verify the nodes too
    allocation = shared_budget(worth, cost, requests, budgets, free, free * 15)
    best, rate = shared_budget_readable(worth.tolist(), cost, requests, budgets, free, free * 15)
    assert allocation.nodes == (best,) * free
    assert allocation.tokens_per_s == pytest.approx(rate)


def test_a_shared_budget_grows_with_cheap_nodes_and_is_none_where_drafts_do_not_pay():
    worth = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], [0.9, 0.5, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0]],
                         dtype=torch.float64)
    budgets = [0, 1, 2, 4, 8]
    cheap = StepCost(fixed_s=0.01, per_request_s=0.001, per_node_s=1e-5, per_draft_s=1e-4)
    assert shared_budget(worth, cheap, 2, budgets, 2, 30).nodes == (8, 8)  # nodes the pass runs anyway all given
    dear_nodes = replace(cheap, per_node_s=0.004)
    assert shared_budget(worth, dear_nodes, 2, budgets, 2, 30).nodes == (1, 1)
    dear_drafts = replace(cheap, per_draft_s=0.05)
    assert shared_budget(worth, dear_drafts, 2, budgets, 2, 30).nodes == (0, 0)
    # AR requests beside them verify every node of the bucket too, and earn nothing from it
    assert shared_budget(worth, replace(cheap, per_node_s=0.0003), 2, budgets, 2, 30).nodes == (8, 8)
    assert shared_budget(worth, replace(cheap, per_node_s=0.0003), 16, budgets, 2, 30).nodes[0] < 8
