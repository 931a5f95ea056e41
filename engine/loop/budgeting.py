"""How big a tree is worth drafting: the machine's step cost, the drafter's calibration, and a request's
candidate tree cut to the nodes the allocation gives it (``ddtree.allocate``).

A request with ``tree_budget`` "auto" drafts the candidates an ``AUTO_NODES`` budget would (its method's
tree: a DDTree's best-first tree, a DFlash chain); each node is worth its calibrated path probability;
the allocation, for the whole batch, says how many of its first nodes it verifies. A single run is a
batch of one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

import ddtree
import ddtree.fixed
from ddtree.allocate import Calibration, Offer, StepCost, allocate, in_worth_order, worth_order
from ddtree.tree import DraftRow, on_first_choices_of
from engine.methods import Method

AUTO_NODES = 64  # the most nodes an "auto" tree drafts: the candidates the allocation chooses among
LEARN = 0.2  # how much a request's new draft moves what its next one is expected to be worth
TYPICAL_LEARN = 0.05  # ... and what any request's draft is expected to be worth
RELAX = 0.25  # how far, each step it does not draft, a request's expectation returns to the typical one
RECORDED = Path(__file__).resolve().parent.parent.parent / "assets" / "batching.json"
# Until this machine's step costs are timed or recorded: a step's fixed part and a request's row dominate,
# a node costs a tenth of a row, a draft half of one (orders of magnitude, not a measurement).
PROVISIONAL_COST = StepCost(fixed_s=0.02, per_request_s=0.02, per_node_s=0.002, per_draft_s=0.01)


@dataclass
class Budgeting:
    """How trees are sized: the step's cost model on this machine, the drafter's calibration (every verified node
    updates it), and what a method's draft is worth, node by node in heap order, before a request has drafted:
    its ``prior`` (the drafter's recorded acceptance, ``expected_worth``) and its ``typical`` draft (every "auto"
    draft of the method moves it; every request-step that does not draft moves it back towards the prior, so that
    drafts which stopped being taken are tried again once the evidence against them is old)."""

    cost: StepCost = PROVISIONAL_COST
    calibration: Calibration = field(default_factory=Calibration)
    source: str = "provisional: no step costs recorded or timed for this machine"
    prior: dict[str, torch.Tensor] = field(default_factory=dict)  # method name -> [AUTO_NODES] worth, best first
    typical: dict[str, torch.Tensor] = field(default_factory=dict)  # likewise, learned
    # whether a batch sizes trees by what its own rounds take (``Batch.round_cost``: the cost scaled to its steps,
    # and the gap between them); False holds the cost as given
    follow_steps: bool = True

    def expectation(self, row: Method) -> torch.Tensor | None:
        """What a draft of this method is expected to be worth before the request's own drafts say."""
        return self.typical.get(row.name, self.prior.get(row.name))

    def learn(self, row: Method, expected: torch.Tensor | None, offer: Offer) -> torch.Tensor:
        """A request drafted and offered ``offer``: what its next draft is now expected to be worth (its last
        expectation moved towards this draft's), and its method's typical draft likewise."""
        return self.learned(row, expected, torch.tensor(offer.worth[:AUTO_NODES], dtype=torch.float64))

    def learned(self, row: Method, expected: torch.Tensor | None, offered: torch.Tensor) -> torch.Tensor:
        """``learn`` from a draft's nodes' worth, best first (``offered [n]``)."""
        worth = torch.zeros(1, AUTO_NODES, dtype=torch.float64)
        worth[0, : offered.shape[0]] = offered[:AUTO_NODES]
        return self.learned_rows(row, [expected], worth)[0]

    def learned_rows(self, row: Method, expected: list[torch.Tensor | None], offered: torch.Tensor) -> torch.Tensor:
        """``learned`` for many drafts of one method at once (``offered [a, AUTO_NODES]``, zeros past each one's
        nodes): ``[a, AUTO_NODES]``, each one's next expectation; the method's typical draft moves towards each in
        turn."""
        for own in offered:
            typical = self.expectation(row)
            self.typical[row.name] = own.clone() if typical is None else torch.lerp(typical, own, TYPICAL_LEARN)
        known = [r for r, own in enumerate(expected) if own is not None]
        moved = offered.clone()
        if known:
            moved[known] = torch.lerp(torch.stack([expected[r] for r in known]), offered[known], LEARN)
        return moved

    def relax(self, row: Method, expected: torch.Tensor | None) -> torch.Tensor | None:
        """A request that did not draft this step: its expectation a step nearer its method's typical draft, and
        that a step nearer the prior, so that poor drafts do not keep a request, or a method, from drafting for
        good."""
        if row.name in self.typical and row.name in self.prior:
            self.typical[row.name] = torch.lerp(self.typical[row.name], self.prior[row.name], TYPICAL_LEARN)
        typical = self.expectation(row)
        return expected if expected is None or typical is None else torch.lerp(expected, typical, RELAX)

    def candidates(self, row: Method, log_probs: torch.Tensor | DraftRow, budget, auto: bool
                   ) -> tuple[ddtree.DraftTree, Offer]:
        """The tree a request drafts from ``log_probs [D, V]`` and its offer to the allocation: every node's worth,
        best first. An "auto" one's are its ``AUTO_NODES`` candidates in order of worth (``in_worth_order``), so
        that the nodes the allocation gives it are its most valuable; a fixed budget's tree keeps its heap order."""
        tree = row.readable(log_probs, row.nodes(AUTO_NODES if auto else budget, log_probs.shape[0]))
        worth = self.calibration.worth(tree.path_log_probs.exp(), tree.on_first_choices())
        if auto:
            tree, worth = in_worth_order(tree, worth)
        return tree, Offer(tuple(worth.tolist()), tree.size, fixed=not auto)

    def auto_candidates(self, row: Method, log_probs: torch.Tensor) -> list[tuple[ddtree.DraftTree, Offer]]:
        """``candidates`` of many "auto" requests of one method at once, from their drafts ``[b, D, V]``: the trees
        built as one fixed-shape program (``row.fixed``), put in the heap's order, then read to the host once, and
        priced and ordered by worth for all of them together. ``candidates`` is the reference (equal but for ties
        and the last bits of a path's probability, which the two sum in different orders)."""
        depth = log_probs.shape[-2]
        tree = ddtree.fixed.heap_order(row.fixed(log_probs, row.nodes(AUTO_NODES, depth))).cpu()
        tree, worth, counts = self.priced(tree, depth)
        trees = [ddtree.DraftTree(tree.tokens[r, :n], tree.parents[r, :n], tree.depths[r, :n], tree.log_probs[r, :n],
                                  tree.path_log_probs[r, :n], tree.ranks[r, :n]) for r, n in enumerate(counts)]
        return [(own, Offer(tuple(worth[r, :n].tolist()), n)) for r, (own, n) in enumerate(zip(trees, counts))]

    def priced(self, tree: ddtree.fixed.FixedTree, depth: int
               ) -> tuple[ddtree.fixed.FixedTree, torch.Tensor, list[int]]:
        """Candidate trees on the host (``[a, n]``, the heap's order, blocks of ``depth`` slots): each node's worth
        (its calibrated path probability), the trees in order of worth, and how many real nodes each has (padding:
        a block too small for the budget, its nodes last)."""
        worth = self.calibration.worth(tree.path_log_probs.exp(), ddtree.fixed.on_first_choices(tree, depth))
        order, worth = worth_order(worth.masked_fill(~tree.valid, -1.0), tree.parents, depth)
        return ddtree.fixed.reordered(tree, order), worth, tree.valid.sum(-1).tolist()

    def learn_fixed(self, row: Method, expected: list[torch.Tensor | None], tree: ddtree.fixed.FixedTree, depth: int
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``learn`` for "auto" requests of one method whose candidates a fixed-shape step drafted (``tree [a, n]`` on
        the host, ``engine.loop.fixed_batch``): each one's next expectation and how deep its candidates reach
        (``BatchRequest.reach``), priced together."""
        ordered, worth, counts = self.priced(tree, depth)
        width = min(AUTO_NODES, worth.shape[1])
        real = torch.arange(width) < torch.tensor(counts)[:, None]  # [a, width]: each one's own nodes
        offered = torch.zeros(len(counts), AUTO_NODES, dtype=torch.float64)  # [a, AUTO_NODES]: as ``learned`` pads
        offered[:, :width] = torch.where(real, worth[:, :width].to(torch.float64), 0.0)
        moved = self.learned_rows(row, expected, offered)
        reach = ordered.depths.cummax(-1).values  # [a, n]
        return [(moved[r], reach[r, :n]) for r, n in enumerate(counts)]

    def alone(self, row: Method, log_probs: torch.Tensor) -> ddtree.DraftTree:
        """An "auto" tree for a request that runs alone: a batch of one, drafting."""
        tree, offer = self.candidates(row, log_probs, None, auto=True)
        return first_nodes(tree, allocate([offer], self.cost, 1, 1, log_probs.shape[0]).nodes[0])

    def observe(self, trees: list[ddtree.DraftTree], paths: list[list[int]]) -> None:
        """Verified trees' nodes and which the target accepted (``paths``: node indices, root first), counted at
        once."""
        grown = [(tree, path) for tree, path in zip(trees, paths) if tree.size]
        if grown:
            accepted, start = [], 0  # every accepted node's place among all the trees' nodes
            for tree, path in grown:
                accepted += [start + node - 1 for node in path[1:]]
                start += tree.size
            taken = torch.zeros(start, dtype=torch.bool)
            taken[torch.tensor(accepted, dtype=torch.long)] = True
            self.calibration.observe(torch.cat([tree.path_log_probs for tree, _ in grown]).exp(),
                                     on_first_choices_of([tree for tree, _ in grown]), taken)


def first_nodes(tree: ddtree.DraftTree, count: int) -> ddtree.DraftTree:
    """The tree's first ``count`` nodes: a tree of that size, as its nodes come parents first (heap order)."""
    return ddtree.DraftTree(tree.tokens[:count], tree.parents[:count], tree.depths[:count], tree.log_probs[:count],
                            tree.path_log_probs[:count], tree.ranks[:count])


def recorded_budgeting(machine: str, drafter_revision: str | None, path: Path = RECORDED) -> Budgeting | None:
    """The step costs recorded for this kind of machine (``engine.tools.step_cost``), with the calibration
    recorded for these drafter weights where there is one; None where no costs fit."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    costs = data.get("costs", {}).get(machine)
    if costs is None:
        return None
    calibration = data.get("calibration", {}).get(drafter_revision or "")
    return Budgeting(StepCost(**costs["step_cost"]),
                     Calibration.from_dict(calibration) if calibration else Calibration(),
                     f"step costs recorded for this kind of machine ({machine}) by {costs['command']}")


def expected_worth(acceptance: dict, row: Method, depths: int) -> torch.Tensor | None:
    """What a draft of method ``row`` is worth node by node (``[AUTO_NODES]``, best first), from a drafter's
    recorded acceptance (its config's ``acceptance``: τ per budget, or one τ for the whole block of ``depths``
    nodes); None without a record. Between two recorded budgets each node adds an equal share of the τ they
    differ by; a single τ is a chain's, whose depth k is reached with probability a**k."""
    record = acceptance.get(row.name)
    if record is None:
        return None
    worth = torch.zeros(AUTO_NODES, dtype=torch.float64)
    if not isinstance(record, dict):
        span = min(depths, AUTO_NODES)
        worth[:span] = chain_worth(float(record) - 1.0, span)
        return worth
    below, tau_below = 0, 1.0
    for budget, tau in sorted((int(budget), float(tau)) for budget, tau in record.items()):
        end = min(budget, AUTO_NODES)
        if end > below:
            worth[below:end] = max(tau - tau_below, 0.0) / (budget - below)
        below, tau_below = end, tau
    return torch.cummin(worth, dim=0).values  # best first: never rising


def chain_worth(accepted: float, depths: int) -> torch.Tensor:
    """``[depths]`` a**1 .. a**depths, with ``a`` such that they sum to ``accepted`` (the nodes a chain of that
    many depths is expected to have accepted): each depth taken with one probability, found by bisection."""
    powers = torch.arange(1, depths + 1, dtype=torch.float64)
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if float((middle ** powers).sum()) < accepted else (low, middle)
    return low ** powers
