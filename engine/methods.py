"""The decoding methods, one row each: every branch on a method reads this table.

Every method is a tree with a budget: AR verifies the root alone, DFlash a chain, DDTree the best-first
tree. A row says what the method is called where (settings and traces, the page, the report and the
video), whether its steps draft, how many nodes a budget gives it, and how its tree is built from the
drafter's per-depth log-probabilities: the readable builder (``ddtree.tree``), and the fixed-shape one
(``ddtree.fixed``) that a CUDA graph can hold. Adding a method is a row here plus its builders.

A run's label is its name, with its budget where the user chooses one (``ddtree@32``), or ``@auto``
where the budget is chosen step by step for the batch (``engine.loop.batch``); a run of a second drafter
beside the first (the page's comparison of two drafters) adds that drafter's tag (``ddtree@32+candidate``)
and draws in a lighter shade of its method's colour.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

import ddtree
import ddtree.fixed
from ddtree.fixed import FixedTree
from ddtree.tree import DraftRow
from engine.errors import EngineError

AUTO = "auto"  # a tree budget chosen every step for the batch, not by the user
MAX_TREE_BUDGET = 1024
TAG_MARK = "+"  # between a label and a second drafter's tag
SECOND_SHADE = 0.45  # how far a second drafter's colour moves towards white

Budget = int | str  # a node count, or AUTO


def no_tree(log_probs: torch.Tensor | DraftRow | None, nodes: int) -> ddtree.DraftTree:
    """AR's tree: the root alone."""
    return ddtree.DraftTree.empty()


def no_fixed_tree(log_probs: torch.Tensor, nodes: int) -> FixedTree:
    return FixedTree.empty(log_probs.device)


def chain_nodes(log_probs: torch.Tensor | DraftRow, nodes: int) -> ddtree.DraftTree:
    """DFlash's chain, cut to ``nodes`` depths (the first ``nodes`` nodes of the width-1 best-first tree)."""
    return ddtree.build_tree(log_probs, nodes, width=1)


def fixed_chain(log_probs: torch.Tensor, nodes: int) -> FixedTree:
    return ddtree.fixed.chain_tree(log_probs)


@dataclass(frozen=True)
class Method:
    name: str  # what settings, traces, the API and the CLI say
    title: str  # what the page, the report and the video say
    caption: str  # a text column's heading
    colour: str  # the page's figures
    print_colour: str  # the report's plots and the video's frames (drawn on a dark card)
    drafts: bool  # its steps run the drafter
    budgeted: bool  # its tree size is a budget the user chooses, and its label carries it
    readable: Callable[[torch.Tensor | DraftRow | None, int], ddtree.DraftTree]  # (log-probs [D, V], nodes) -> tree
    fixed: Callable[[torch.Tensor, int], FixedTree]  # the same as a fixed-shape program (``ddtree.fixed``)

    def nodes(self, budget: int | None, depth: int) -> int:
        """Draft nodes below the root that a step of this method verifies at most, for blocks of ``depth``
        draft slots: none for AR, a slot each for a chain, the budget for a tree."""
        if not self.drafts:
            return 0
        return budget if self.budgeted else depth

    def label(self, budget: Budget | None = None, drafter_tag: str | None = None) -> str:
        """``ar``, ``dflash``, ``ddtree@32``, ``ddtree@auto``: how results, traces and the page name a run; a second
        drafter's run carries its tag (``ddtree@32+candidate``)."""
        if budget == AUTO and self.drafts:
            label = f"{self.name}@{AUTO}"
        else:
            label = f"{self.name}@{budget}" if self.budgeted and budget is not None else self.name
        return f"{label}{TAG_MARK}{drafter_tag}" if drafter_tag and self.drafts else label

    def heading(self, budget: Budget | None = None, long: bool = False, drafter_tag: str | None = None) -> str:
        """The label as a person reads it: ``DDTree@32`` (``long``: ``DDTree · budget 32``), a second drafter's
        run with its tag: ``DDTree@32 · candidate``."""
        shown = self.label(budget).removeprefix(self.name)
        heading = self.title if not shown else f"{self.title} · budget {shown[1:]}" if long else f"{self.title}{shown}"
        return f"{heading} · {drafter_tag}" if drafter_tag and self.drafts else heading

    def run_colour(self, drafter_tag: str | None = None, printed: bool = False) -> str:
        """The colour of a run of this method (``printed``: on the report's and the video's dark cards); a second
        drafter's run a lighter shade of it, so the two drafters read as one method twice."""
        colour = self.print_colour if printed else self.colour
        if not (drafter_tag and self.drafts):
            return colour
        return "#" + "".join(f"{round(c + (255 - c) * SECOND_SHADE):02x}" for c in _hex_rgb(colour))


def _hex_rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


AR = Method("ar", "AR", "AR (target only)", "#7f7f7f", "#94a3b8", drafts=False, budgeted=False,
            readable=no_tree, fixed=no_fixed_tree)
DFLASH = Method("dflash", "DFlash", "DFlash (chain)", "#ff7f0e", "#38bdf8", drafts=True, budgeted=False,
                readable=chain_nodes, fixed=fixed_chain)
DDTREE = Method("ddtree", "DDTree", "DDTree (tree)", "#1f6fd1", "#f59e0b", drafts=True, budgeted=True,
                readable=ddtree.build_tree, fixed=ddtree.fixed.build_tree)

METHODS: dict[str, Method] = {method.name: method for method in (AR, DFLASH, DDTREE)}
NAMES = tuple(METHODS)
BASELINE = AR  # what every speed-up is measured against
TREE = DDTREE  # the method a budget sweep, the doctor's τ and the opening budget are about


def method(name) -> Method:
    """The row of ``name``; anything else is refused with the names there are."""
    if not isinstance(name, str) or name not in METHODS:
        raise EngineError(f"unknown method {name!r}; choose from {', '.join(NAMES)}", field="method")
    return METHODS[name]


def print_rgb(method_row: Method, drafter_tag: str | None = None) -> tuple[int, int, int]:
    """``print_colour`` (a second drafter's run: its shade) as the video's frames take it."""
    return _hex_rgb(method_row.run_colour(drafter_tag, printed=True))


@dataclass(frozen=True)
class Label:
    """A run's label read back: its method, its budget (a number, ``AUTO`` or None), a second drafter's tag and a
    suffix the bench adds (``:tokens``); a label of no method here (vLLM's own baselines) has ``method`` None."""

    text: str
    method: Method | None
    budget: Budget | None
    suffix: str
    drafter_tag: str | None = None

    @staticmethod
    def parse(text: str) -> Label:
        head, colon, suffix = text.partition(":")
        head, _, tag = head.partition(TAG_MARK)
        name, _, budget = head.partition("@")
        row = METHODS.get(name)
        value: Budget | None = int(budget) if budget.isdigit() else (AUTO if budget == AUTO else None)
        return Label(text, row, value, colon + suffix, tag or None)

    @property
    def heading(self) -> str:
        """The label as the page's figures name it: ``DDTree@32``, ``DDTree@32 · candidate``."""
        return self.method.heading(self.budget, drafter_tag=self.drafter_tag) if self.method is not None else self.text

    @property
    def order(self) -> tuple[int, int, str]:
        """Where the label sorts among others: by method (the table's order, others last), then budget."""
        rank = NAMES.index(self.method.name) if self.method is not None else len(NAMES)
        return rank, self.budget if isinstance(self.budget, int) else 0, self.text

    @property
    def is_baseline(self) -> bool:
        return self.method is BASELINE and not self.suffix


def budget_sweep(labels: Iterable[str]) -> dict[int, str]:
    """The budget sweep among run labels: ``TREE``'s runs at a chosen budget with full traces (no suffix), label
    by budget (``{8: "ddtree@8", 32: "ddtree@32"}``), what the bench's best budget and the opening budget read."""
    return {run.budget: run.text for run in map(Label.parse, labels)
            if run.method is TREE and isinstance(run.budget, int) and not run.suffix}


def check_budget(budget, where: str = "tree budget") -> Budget:
    """A tree budget as every entry point takes it: ``"auto"`` or a whole number 1..``MAX_TREE_BUDGET``
    (``"16"`` as typed is 16); anything else is an ``EngineError`` that says so, the same sentence everywhere."""
    if isinstance(budget, str):
        text = budget.strip().lower()
        if text == AUTO:
            return AUTO
        if text.lstrip("-").isdigit():
            budget = int(text)
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_TREE_BUDGET:
        raise EngineError(f"{where} must be \"auto\" or a whole number from 1 to {MAX_TREE_BUDGET}, got {budget!r}",
                          field="tree_budget")
    return budget
