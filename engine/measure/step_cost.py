"""What a batched step costs on this machine: ``ddtree.allocate.StepCost`` fitted to timed steps.

A grid of batches (requests × nodes each, AR's and DDTree's), each taken for a few steps after a warm-up,
every step's size and wall time kept (``engine.loop.batch.StepShape``); a least-squares line through them
gives the fixed part and the cost of a request's row, a node and a draft. The same runs count how the
drafter's path probabilities turned into accepted nodes (``Calibration``). Both are kept in
``assets/batching.json`` (``python -m engine.tools.step_cost --record``), by machine kind and drafter weights,
for the page and the server to size "auto" trees without timing anything.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ddtree.allocate import Calibration, StepCost
from ddtree.batch import grouped_rows
from engine.loop.batch import Batch, StepShape
from engine.loop.budgeting import RECORDED, Budgeting
from engine.loop.decode import Decoder
from engine.loop.settings import DecodeSettings
from engine.measure.calibration import machine_key
from engine.models.rows import row_grouping

GRID_REQUESTS = (1, 2, 4, 8)
# per request; 0: AR, else DDTree at that budget, which drafts as deep as its tree can reach (2, 8, the block):
# nodes and drafted rows vary apart, so the fit tells a verified node from a drafted slot
GRID_NODES = (0, 2, 8, 32)
QUICK_REQUESTS, QUICK_NODES = (1, 4), (0, 2, 16)  # what a start-up with no record times
# ... on a GPU, where a step of many requests costs little more to time and is what serving meets: the batch the
# costs are fitted to reaches the concurrency they size trees for, instead of extrapolating from four requests
QUICK_REQUESTS_GPU = (1, 4, 16)
MEASURED_STEPS = 10
WARM_UP_STEPS = 2
# tokens each request decodes before its steps are timed: a served request's context is its prompt and half its
# answer on average, and a step's cost grows with its requests' contexts (a verified node's more than a root's)
GROWN_TOKENS = 48
BATCHED = "batched"  # the step kind step costs are recorded under


def batch_key(decoder: Decoder) -> str:
    """The machine kind a step cost holds for: ``machine_key``'s, for the batched step."""
    return machine_key(decoder, BATCHED)


@dataclass(frozen=True)
class CostTiming:
    shapes: list[StepShape]  # every measured step
    cost: StepCost  # the line through them
    calibration: Calibration  # what the timed DDTree steps accepted

    def to_dict(self) -> dict:
        """Plain data, as the vLLM engine's workers send it back."""
        return {"shapes": [asdict(shape) for shape in self.shapes], "cost": asdict(self.cost),
                "calibration": self.calibration.to_dict()}

    @staticmethod
    def from_dict(data: dict) -> CostTiming:
        return CostTiming([StepShape(**shape) for shape in data["shapes"]], StepCost(**data["cost"]),
                          Calibration.from_dict(data["calibration"]))


def fit(shapes: list[StepShape], grouping: tuple[int, int] = (1, 0)) -> StepCost:
    """The line through the timed steps, in two parts fitted apart, since the grid's drafted rows grow with its
    nodes: the drafter's stage on (whether it drafts, drafts, drafted rows), over the steps that draft; the rest of
    the step on (1, requests, nodes as the pass runs them: ``grouping``, the device's ``row_grouping``, and where
    it verifies any node 1 and requests again: the knee a tree's mask makes). Each is
    least squares through the median step of each shape (a step the machine stalled does not tilt the line), each
    weighed by one over its time so that a small batch's step is fitted as closely as a large one's (the
    allocation's choices turn on ratios); a term that comes out negative (noise, or a grid that cannot tell it
    apart) is dropped and the rest fitted again."""
    drafting: dict[tuple[int, int], list[float]] = {}
    rest: dict[tuple[int, int], list[float]] = {}
    for shape in shapes:
        if shape.drafts:
            drafting.setdefault((shape.drafts, shape.draft_rows), []).append(shape.draft_seconds)
        rest.setdefault((shape.requests, shape.nodes), []).append(shape.seconds - shape.draft_seconds)
    fitted = least_squares(drafting, {"draft_pass_s": lambda kind: 1.0, "per_draft_s": lambda kind: kind[0],
                                      "per_draft_row_s": lambda kind: kind[1]})
    fitted |= least_squares(rest, {"fixed_s": lambda kind: 1.0, "per_request_s": lambda kind: kind[0],
                                   "per_node_s": lambda kind: grouped_rows(sum(kind), *grouping) - kind[0],
                                   "tree_step_s": lambda kind: float(kind[1] > 0),
                                   "per_tree_request_s": lambda kind: kind[0] * float(kind[1] > 0)})
    return StepCost(**fitted, row_group=grouping[0], few_rows=grouping[1])


def least_squares(timed: dict[tuple, list[float]], columns: dict[str, Callable[[tuple], float]]) -> dict[str, float]:
    """Each column's seconds (none negative) from ``timed``: a shape's steps' seconds; zero for every column where
    nothing was timed."""
    if not timed:
        return dict.fromkeys(columns, 0.0)
    kinds = sorted(timed)
    seconds = torch.tensor([[statistics.median(timed[kind])] for kind in kinds], dtype=torch.float64)
    weight = 1 / seconds.clamp_min(1e-6)
    kept = list(columns)
    while True:
        design = torch.tensor([[columns[name](kind) for name in kept] for kind in kinds], dtype=torch.float64)
        solution = torch.linalg.lstsq(design * weight, seconds * weight).solution[:, 0].tolist()
        fitted = dict(zip(kept, solution))
        negative = [name for name in kept if fitted[name] < 0]
        if not negative:
            return {name: fitted.get(name, 0.0) for name in columns}
        kept.remove(min(negative, key=fitted.get))


def quick_requests(decoder: Decoder) -> tuple[int, ...]:
    """The batch sizes a start-up with no recorded step costs times on this decoder's device."""
    return QUICK_REQUESTS_GPU if decoder.target.device.type == "cuda" else QUICK_REQUESTS


def time_step_costs(decoder: Decoder, prompts: list[list[int]], requests: tuple[int, ...] = GRID_REQUESTS,
                    nodes: tuple[int, ...] = GRID_NODES, steps: int = MEASURED_STEPS,
                    progress=None) -> CostTiming:
    """Each (requests, nodes) of the grid timed over ``steps`` steps once every request has decoded
    ``GROWN_TOKENS`` and ``WARM_UP_STEPS`` more: the prompts are cycled; every request decodes greedily well past
    the steps timed. Where the models live in other processes
    (``Decoder.remote_step_costs``), they time them there (``progress`` is not reported across)."""
    remote = decoder.remote_step_costs(prompts, requests, nodes)
    if remote is not None:
        return CostTiming.from_dict(remote)
    budgeting = Budgeting()
    shapes: list[StepShape] = []
    grid = [(count, per) for count in requests for per in nodes if per == 0 or decoder.drafter is not None]
    for done, (count, per) in enumerate(grid):
        settings = (DecodeSettings("ddtree", max_new_tokens=1024, tree_budget=per) if per else
                    DecodeSettings("ar", max_new_tokens=1024))
        batch = Batch(decoder, budgeting)
        for index in range(count):
            batch.admit(prompts[index % len(prompts)], settings)
        while batch.waiting or any(r.start < len(r.prompt_ids) + GROWN_TOKENS for r in batch.requests):
            batch.advance()
        start = len(batch.shapes)
        for _ in range(WARM_UP_STEPS + steps):
            batch.advance()
        shapes.extend(list(batch.shapes)[start + WARM_UP_STEPS:])
        if progress is not None:
            progress(done + 1, len(grid))
    return CostTiming(shapes, fit(shapes, row_grouping(decoder.target.device)), budgeting.calibration)


def record(decoder: Decoder, timing: CostTiming, command: str, path: Path = RECORDED) -> str:
    """The timing's cost under this machine's key, and its calibration under the drafter's weights, into
    ``path``; returns the key."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    key = batch_key(decoder)
    data.setdefault("costs", {})[key] = {"step_cost": asdict(timing.cost), "steps": len(timing.shapes),
                                         "command": command}
    if decoder.drafter_info.revision:
        data.setdefault("calibration", {})[decoder.drafter_info.revision] = timing.calibration.to_dict()
    path.write_text(json.dumps(data, indent=1) + "\n")
    return key
