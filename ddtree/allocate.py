"""Tree nodes given to the requests of a batch where they are worth most per marginal second.

Every request of a batched step verifies a tree: AR's is its root alone, DFlash's a chain, DDTree's the
best-first tree. A node's worth is the tokens it is expected to add: the probability that the target
accepts it, which is the drafter's path probability to it as calibrated against what the target really
accepted, apart for the drafter's first-choice path and the rest of a tree (``Calibration``). A step's
time follows ``StepCost``: a fixed part, each request's root row, each node, each request the drafter
drafts for and each slot it drafts (a row of its lm_head), the drafter's pass itself where any
request drafts, and what a pass that verifies any node costs beyond its rows (its tree's mask over every
request's context, where a pass of roots alone reads one row each).
The batch's tokens per second is therefore

    (requests + the worth of every node verified) / StepCost.seconds(requests, nodes, drafts, draft_rows)

and nodes are added best first, across requests, while the next one earns more per marginal second
than the batch already does (``allocate``): past that point each node lowers the batch's rate. A
request's nodes come in its own order of worth, parents first (``in_worth_order``), so any count is a tree
of that size. As the batch grows its rate rises and fewer nodes clear it: the trees
shrink to chains and then to roots (AR), and the step never runs slower than AR's, by the cost model.

Drafting itself costs, so which requests draft is decided before the drafter runs (``plan_drafts``),
from each request's worth at its last draft.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

import ddtree.fixed
from ddtree.batch import grouped_rows
from ddtree.tree import DraftTree


@dataclass(frozen=True)
class StepCost:
    """Seconds a batched step takes, as a line through timings measured on the machine. Where the machine runs a
    pass of fewer than ``few_rows`` rows as a multiple of ``row_group`` (2 or 3 past one: the next), its rows
    (requests' roots and nodes) are counted as it runs them, so a node that fills such a row costs nothing."""

    fixed_s: float  # a step whatever it holds
    per_request_s: float  # each request's root row through the target, its walk and commit
    per_node_s: float  # each draft node verified
    per_draft_s: float  # each request the drafter drafts a block for
    draft_pass_s: float = 0.0  # a step that drafts at all: the drafter's weights and lm_head read once a pass
    per_draft_row_s: float = 0.0  # each slot drafted (a request's block as deep as the pass goes): its lm_head row
    tree_step_s: float = 0.0  # a step that verifies any node, beyond its rows ...
    per_tree_request_s: float = 0.0  # ... and each of its requests: attention under a tree mask over its context
    row_group: int = 1
    few_rows: int = 0

    def run_nodes(self, requests: int, nodes: int | torch.Tensor) -> int | torch.Tensor:
        """The nodes a step of ``requests`` roots and ``nodes`` nodes (any shape) is run with, fillers counted."""
        return grouped_rows(requests + nodes, self.row_group, self.few_rows) - requests

    def seconds(self, requests: int, nodes, drafts, draft_rows: int = 0):
        """Seconds of a step; ``nodes`` an int, or a tensor of alternatives (the seconds of each, ``drafts`` an int
        or a tensor broadcast against it)."""
        alternatives = isinstance(nodes, torch.Tensor)  # an int is priced in plain floats: a step asks per request
        nodes = nodes.double() if alternatives else nodes
        run = self.run_nodes(requests, nodes)
        trees = (nodes > 0).double() if alternatives else float(nodes > 0)  # fillers are no tree: the knee is nodes'
        drafting = (drafts > 0).double() if isinstance(drafts, torch.Tensor) else float(drafts > 0)
        return (self.fixed_s + self.per_request_s * requests + self.per_node_s * run + self.per_draft_s * drafts
                + self.per_draft_row_s * draft_rows + self.draft_pass_s * drafting
                + trees * (self.tree_step_s + self.per_tree_request_s * requests))

    def parts(self, requests: int, nodes: int, drafts: int, draft_rows: int = 0) -> tuple[float, float]:
        """A step's ``seconds`` in two parts: its roots' (the fixed part and each request's row), and what its drafts
        and nodes add to them."""
        roots = self.fixed_s + self.per_request_s * requests
        return roots, self.seconds(requests, nodes, drafts, draft_rows) - roots

    def scaled(self, roots: float, trees: float) -> StepCost:
        """The cost with its roots' part (``parts``) ``roots`` times as long and its drafts' and nodes' ``trees``
        times."""
        return replace(self, fixed_s=self.fixed_s * roots, per_request_s=self.per_request_s * roots,
                       per_node_s=self.per_node_s * trees, per_draft_s=self.per_draft_s * trees,
                       draft_pass_s=self.draft_pass_s * trees, per_draft_row_s=self.per_draft_row_s * trees,
                       tree_step_s=self.tree_step_s * trees, per_tree_request_s=self.per_tree_request_s * trees)

    def before_drafting(self, margin: int) -> StepCost:
        """The cost as a step sees it before its drafts are sized: a request drafts as deep as its nodes and
        ``margin`` slots more, so each node brings at most one drafted row and each draft ``margin`` rows (a chain
        brings exactly one a node; a tree's nodes share depths, so it is a bound)."""
        return replace(self, per_node_s=self.per_node_s + self.per_draft_row_s,
                       per_draft_s=self.per_draft_s + margin * self.per_draft_row_s, per_draft_row_s=0.0)


SCALE_PRIOR_STEPS = 8.0  # steps' worth of belief that a cost's parts are as fitted, before measured steps say
SCALE_BOUNDS = (0.25, 4.0)  # how far measured steps may scale a part
STALL = 3.0  # a step slower than this many times the steps' median ratio to the cost counts as this slow


def measured_scales(cost: StepCost, steps: list[tuple[int, int, int, int, float]]) -> tuple[float, float]:
    """How much longer than ``cost`` predicts measured steps took, part by part (``StepCost.parts``): ``(roots,
    trees)`` multipliers (``steps``: requests, nodes, drafts, drafted rows and seconds each), each least squares on
    the steps' relative errors, pulled towards 1 as if ``SCALE_PRIOR_STEPS`` steps had taken what ``cost`` says, so
    that a few steps, or none of a kind, leave a part as it was. The roots' part is scaled by the steps that verified
    roots alone (no node, no draft), the trees' by the others, their roots as scaled: a step that drafts cannot tell
    its roots' time from its trees', and what a served step adds to the fitted cost (sizing, pricing and recording
    its trees) is its trees'. Were such a step's excess shared with the roots, an AR step would look dearer too,
    and trees that cost more than the fit says would go on looking worth it. A step that stalled (a recording, a
    compilation) counts as ``STALL`` times the steps' usual ratio to the cost, not as long as it took.

    What it is for: the fitted cost times steps of fixed budgets alone, where a served step also sizes, prices and
    records its trees; measured against its own steps the allocation prices nodes at what they cost here."""
    if not steps:
        return 1.0, 1.0
    parts = torch.tensor([cost.parts(*shape[:4]) for shape in steps], dtype=torch.float64)  # [S, 2]
    predicted = parts.sum(1).clamp_min(1e-12)
    ratio = torch.tensor([shape[4] for shape in steps], dtype=torch.float64) / predicted  # [S]
    ratio = ratio.clamp(max=STALL * float(ratio.median()))
    rows = parts / predicted[:, None]  # [S, 2]: each step's parts as shares of its prediction, so each weighs alike
    bare = torch.tensor([nodes == 0 and drafts == 0 for _, nodes, drafts, _, _ in steps])  # [S]: roots alone
    roots = scale_towards_one(rows[bare, 0], ratio[bare] - rows[bare, 1])  # a bare step's filler rows as fitted
    trees = scale_towards_one(rows[~bare, 1], ratio[~bare] - roots * rows[~bare, 0])
    return roots, trees


def scale_towards_one(share: torch.Tensor, excess: torch.Tensor) -> float:
    """The least-squares ``s`` of ``share * s ≈ excess`` over steps (``[S]`` each: a part's share of a step's
    predicted time, and what the step took of it, relative to the prediction), with ``SCALE_PRIOR_STEPS`` typical
    steps' worth of belief that ``s`` is 1; 1 where no step had the part; within ``SCALE_BOUNDS``."""
    if not share.numel():
        return 1.0
    prior = SCALE_PRIOR_STEPS * float((share ** 2).mean().clamp_min(1e-6))
    scale = (float(share @ excess) + prior) / (float(share @ share) + prior)
    return min(max(scale, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])


CALIBRATION_EDGES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
PRIOR_WEIGHT = 20.0  # a bin's first observations are weighed against this many at its own path probability
PATHS = ("first choices", "others")  # nodes on the drafter's first-choice path, and the rest of a tree


@dataclass
class Calibration:
    """The target's acceptance rate of a node by the drafter's path probability to it, in bins, kept apart for
    the nodes on the drafter's first-choice path and the others (``DraftTree.on_first_choices``: a tree's
    alternatives, and what hangs below them, are accepted less often than their path probabilities say, the
    first choices more often). Each bin counts the nodes verified and accepted; its rate is pulled towards its
    own mid probability while it has few observations (``PRIOR_WEIGHT``), and made non-decreasing in the
    probability."""

    edges: tuple[float, ...] = CALIBRATION_EDGES
    # [paths][bins]: the counts of the first-choice path's nodes, then the others'
    verified: list[list[float]] = field(default_factory=lambda: [[0.0] * (len(CALIBRATION_EDGES) - 1)
                                                                 for _ in PATHS])
    accepted: list[list[float]] = field(default_factory=lambda: [[0.0] * (len(CALIBRATION_EDGES) - 1)
                                                                 for _ in PATHS])

    _rates: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # until ``observe``

    def rates(self) -> torch.Tensor:
        """``[paths, bins]`` acceptance rate per bin, non-decreasing along each path's bins."""
        if self._rates is None:
            edges = torch.tensor(self.edges, dtype=torch.float64)
            middle = (edges[:-1] + edges[1:]) / 2
            verified, accepted = torch.tensor(self.verified), torch.tensor(self.accepted)
            raw = (accepted + PRIOR_WEIGHT * middle) / (verified + PRIOR_WEIGHT)
            self._rates = torch.cummax(raw, dim=1).values
        return self._rates

    def worth(self, path_probs: torch.Tensor, first_choices: torch.Tensor) -> torch.Tensor:
        """Expected acceptance of nodes with these path probabilities, on the first-choice path or not
        (``first_choices``: bool, the same shape)."""
        return self.rates()[self._paths(first_choices), self._bins(path_probs)]

    def observe(self, path_probs: torch.Tensor, first_choices: torch.Tensor, accepted: torch.Tensor) -> None:
        """Count verified nodes (``path_probs [n]``, ``first_choices [n]`` bool) and which the target accepted
        (``accepted [n]`` bool)."""
        size = len(self.edges) - 1
        cell = self._paths(first_choices) * size + self._bins(path_probs)
        verified = torch.bincount(cell, minlength=len(PATHS) * size).view(len(PATHS), size)
        taken = torch.bincount(cell, weights=accepted.double(), minlength=len(PATHS) * size).view(len(PATHS), size)
        self.verified = [[a + float(b) for a, b in zip(mine, new)] for mine, new in zip(self.verified, verified)]
        self.accepted = [[a + float(b) for a, b in zip(mine, new)] for mine, new in zip(self.accepted, taken)]
        self._rates = None

    def _bins(self, path_probs: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(path_probs.double(), torch.tensor(self.edges[1:-1], dtype=torch.float64), right=True)

    @staticmethod
    def _paths(first_choices: torch.Tensor) -> torch.Tensor:
        return (~first_choices.bool()).long()  # 0: on the first-choice path, 1: off it

    def to_dict(self) -> dict:
        return {"edges": list(self.edges), "paths": list(PATHS), "verified": self.verified, "accepted": self.accepted}

    @staticmethod
    def from_dict(data: dict) -> Calibration:
        if data.get("paths") != list(PATHS):
            raise ValueError(f"a calibration recorded per path ({', '.join(PATHS)}) was expected, got "
                             f"{data.get('paths', 'one for every node')}: record it again "
                             "(python -m engine.tools.step_cost --record)")
        return Calibration(tuple(data["edges"]), [list(v) for v in data["verified"]],
                           [list(v) for v in data["accepted"]])


def in_worth_order(tree: DraftTree, worth: torch.Tensor) -> tuple[DraftTree, torch.Tensor]:
    """The tree's nodes most valuable first, and their worth in that order. Heap order is path probability's, and
    the calibration prices a first choice above an alternative of the same probability, so a deep node of the
    first-choice path can be worth more than a shallow alternative the heap put before it. A node is worth at
    most its parent (it is accepted only where its parent is), so the order, stable for equal worth, keeps
    every parent before its children and any first ``count`` nodes are a tree.

    Worked example: heap order [a (first choice), b (alternative beside a), c (first choice below a)] with
    worth [0.6, 0.15, 0.3] becomes [a, c, b]: the two best nodes are the chain a-c, not a and b."""
    capped = worth.tolist()
    for node, parent in enumerate(tree.parents.tolist()):
        if parent:
            capped[node] = min(capped[node], capped[parent - 1])
    capped_t = torch.tensor(capped, dtype=torch.float64)
    order = torch.sort(capped_t, descending=True, stable=True).indices
    return tree.reordered(order), capped_t[order]


def worth_order(worth: torch.Tensor, parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``in_worth_order``'s tensor form, for trees laid out as ``ddtree.fixed`` lays them (any leading batch
    dimensions, nodes in heap order): ``(order [..., n], worth [..., n])``, each row's nodes most valuable first and
    their worth, every node's worth capped at its parent's."""
    capped = ddtree.fixed.ancestors_min(worth, parents, max_depth)
    order = torch.sort(capped, dim=-1, descending=True, stable=True).indices
    return order, capped.gather(-1, order)


@dataclass(frozen=True)
class Offer:
    """What one request of the batch could verify: the worth of its nodes in the order they would be
    added (non-increasing: ``in_worth_order``), at most ``cap`` of them; a ``fixed`` request verifies
    exactly ``cap`` (its own budget) whatever the batch."""

    worth: tuple[float, ...]
    cap: int
    fixed: bool = False

    @property
    def available(self) -> int:
        return min(self.cap, len(self.worth))


@dataclass(frozen=True)
class Allocation:
    nodes: tuple[int, ...]  # per request
    tokens: float  # expected tokens the step commits
    seconds: float  # its predicted time
    cutoff: float | None  # the worth below which no node was taken: what a node had to earn

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def allocate(offers: list[Offer], cost: StepCost, requests: int, drafts: int, draft_rows: int = 0) -> Allocation:
    """How many nodes each offer gets: every fixed offer its cap, then as many of the best remaining nodes of all
    the others as give the step the most tokens per second: past a point each node's worth is less than the
    batch's tokens per second earn in its time (``worth / cost.per_node_s < tokens / seconds``), except nodes
    that fill rows the pass runs anyway, which cost nothing. ``requests``: every request in the step (those
    without an offer verify their root alone); ``draft_rows``: the slots the step's drafter pass drafted."""
    fixed = [offer.available if offer.fixed else 0 for offer in offers]
    tokens = requests + sum(sum(offer.worth[:count]) for offer, count in zip(offers, fixed))
    # [M] every free node's worth and its request, best first (ties: the earlier request, then its order)
    worth, owner = [], []
    for index, offer in enumerate(offers):
        if not offer.fixed:
            worth.extend(offer.worth[:offer.available])
            owner.extend([index] * offer.available)
    worth_t = torch.tensor(worth, dtype=torch.float64)
    order = torch.sort(worth_t, descending=True, stable=True).indices
    gains = torch.cat([torch.zeros(1, dtype=torch.float64), worth_t[order].cumsum(0)])  # [M+1]: taking k nodes
    taken = torch.arange(len(worth) + 1, dtype=torch.float64)
    seconds = cost.seconds(requests, sum(fixed) + taken, drafts, draft_rows)
    rate = (tokens + gains) / seconds
    best = int(torch.argmax(rate))  # the first maximum: a tie is won by the smaller tree
    counts = list(fixed)
    for node in order[:best].tolist():
        counts[owner[node]] += 1
    cutoff = float(worth_t[order[best]]) if best < len(worth) else None
    return Allocation(tuple(counts), float(tokens + gains[best]), float(seconds[best]), cutoff)


def shared_budget(worth: torch.Tensor, cost: StepCost, requests: int, budgets: list[int], drafts: int,
                  draft_rows: int) -> Allocation:
    """The nodes a fixed-shape step verifies below every root, one of ``budgets`` (the sizes its programs come in; 0:
    none, and then no draft). Its pass runs that many nodes in every slot, so each free request is given them all: a
    request cut to fewer would leave nodes the pass runs anyway. ``worth [F, N]``: each free request's expected
    nodes' worth, best first (zeros past its own); ``drafts`` and ``draft_rows``: the step's drafting, where it drafts.
    Each budget n is priced as ``allocate`` prices a step, every slot n nodes, ``(requests + Σ each free request's
    first n) / cost.seconds(requests, requests * n, ...)``; the fastest wins, a tie the smaller. ``Allocation.nodes``:
    the budget, once a free request.

    Worked example, two free requests worth (0.9, 0.5, 0.1, 0) and (0.8, 0.2, 0, 0), budgets 0, 2, 4: tokens 2,
    2 + 1.4 + 1.0 = 4.4 and 2 + 1.5 + 1.0 = 4.5; of 2 and 4, 4 wins only where two more nodes a slot add under 2.3 %
    to the step of 2."""
    sizes = torch.tensor(budgets, dtype=torch.long)  # [K]
    gains = torch.cat([worth.new_zeros(worth.shape[0], 1), worth.cumsum(1)], dim=1)  # [F, N + 1]: each first n
    tokens = requests + gains[:, sizes.clamp(max=worth.shape[1])].sum(0).double()  # [K]
    drafting = (sizes > 0).long()
    seconds = cost.seconds(requests, requests * sizes, drafting * drafts, drafting * draft_rows)  # [K]
    best = int(torch.argmax(tokens / seconds))  # the first maximum: ``budgets`` run smallest first
    return Allocation((budgets[best],) * worth.shape[0], float(tokens[best]), float(seconds[best]), None)


def plan_drafts(offers: list[Offer | None], cost: StepCost, requests: int) -> list[bool]:
    """Which requests to draft for this step: ``offers[r]`` is request r's worth at its last draft (None:
    it cannot draft; a request never drafted offers what its prior says). Requests are taken in order of
    their best bundle's rate (their top k nodes' worth over the draft and k nodes' time), and the longest
    prefix of that order whose allocation runs fastest drafts. ``cost`` counts drafted rows as the step will
    draft them (``StepCost.before_drafting``)."""
    able = [r for r, offer in enumerate(offers) if offer is not None]
    density = dict(zip(able, densities([offers[r] for r in able], cost)))
    ranked = sorted(able, key=lambda r: -density[r])
    best, chosen = allocate([], cost, requests, 0).tokens_per_s, 0
    rates = prefix_rates([offers[r] for r in ranked], cost, requests)
    for count, rate in enumerate(rates, start=1):
        if rate > best or offers[ranked[count - 1]].fixed:
            best, chosen = max(best, rate), count
    drafted = set(ranked[:chosen])
    return [r in drafted for r in range(len(offers))]


def densities(offers: list[Offer], cost: StepCost) -> list[float]:
    """Each offer's best bundle's rate: its top k nodes' worth over the time of a draft and k nodes, at the best k
    (0 with no nodes; a fixed offer drafts whatever the rate: infinite). The offers' worth is padded with zeros to
    one length, which no bundle's best rate takes: a zero node adds time and no worth."""
    if not offers:
        return []
    longest = max(offer.available for offer in offers)
    worth = torch.tensor([[*offer.worth[:offer.available], *[0.0] * (longest + 1 - offer.available)]
                          for offer in offers], dtype=torch.float64)  # [offers, longest + 1]: a column of zeros last
    spend = cost.per_draft_s + cost.per_node_s * torch.arange(1, longest + 2, dtype=torch.float64)
    best = (worth.cumsum(1) / spend).max(dim=1).values
    return [math.inf if offer.fixed else rate for offer, rate in zip(offers, best.tolist())]


def prefix_rates(offers: list[Offer], cost: StepCost, requests: int) -> list[float]:
    """The batch's tokens per second if the first c offers draft, for every c: ``allocate(offers[:c], cost,
    requests, c).tokens_per_s`` (``prefix_rates_readable``), in one pass rather than one allocation each. A
    prefix's free nodes, best first, are the whole list's in that order with the later offers' left out (a
    stable sort breaks ties towards the earlier offer, as ``allocate`` does), so row c of ``[C, M + 1]`` masks the
    later offers' nodes out of one cumulative sum and prices each count of nodes taken.

    Worked example: free offers A (0.9, 0.2) and B (0.5): best first [A0.9, B0.5, A0.2]; prefix 1 takes
    [A0.9, A0.2] (gains 0, 0.9, 0.9, 1.1 at positions 0..3, position 2 not its own), prefix 2 all three."""
    if not offers:
        return []
    fixed_nodes, fixed_worth, nodes, worth_sum = [], [], 0, 0
    worth, owner = [], []
    for index, offer in enumerate(offers):
        if offer.fixed:
            nodes, worth_sum = nodes + offer.available, worth_sum + sum(offer.worth[:offer.available])
        else:
            worth.extend(offer.worth[:offer.available])
            owner.extend([index] * offer.available)
        fixed_nodes.append(nodes)
        fixed_worth.append(worth_sum)
    worth_t = torch.tensor(worth, dtype=torch.float64)
    order = torch.sort(worth_t, descending=True, stable=True).indices
    own = torch.tensor(owner, dtype=torch.long)[order][None, :] < torch.arange(1, len(offers) + 1)[:, None]  # [C, M]
    start = torch.zeros(len(offers), 1, dtype=torch.float64)
    gains = torch.cat([start, (worth_t[order] * own).cumsum(1)], dim=1)  # [C, M + 1]: adding a 0 changes no sum
    taken = torch.cat([start, own.double().cumsum(1)], dim=1)  # [C, M + 1]: the nodes each position has taken
    valid = torch.cat([torch.ones(len(offers), 1, dtype=torch.bool), own], dim=1)
    drafts = torch.arange(1, len(offers) + 1, dtype=torch.float64)[:, None]
    seconds = cost.seconds(requests, torch.tensor(fixed_nodes)[:, None] + taken, drafts)
    rate = (requests + torch.tensor(fixed_worth, dtype=torch.float64)[:, None] + gains) / seconds
    return rate.masked_fill(~valid, -math.inf).max(dim=1).values.tolist()


def prefix_rates_readable(offers: list[Offer], cost: StepCost, requests: int) -> list[float]:
    """``prefix_rates``' reference: an allocation for each prefix."""
    return [allocate(offers[:count], cost, requests, count).tokens_per_s for count in range(1, len(offers) + 1)]
