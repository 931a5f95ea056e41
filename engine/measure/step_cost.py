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
GRID_NODES = (0, 4, 16, 32)  # per request; 0: AR, else DDTree at that budget
QUICK_REQUESTS, QUICK_NODES = (1, 4), (0, 16)  # what a start-up with no record times
MEASURED_STEPS = 10
WARM_UP_STEPS = 2
BATCHED = "batched"  # the step kind step costs are recorded under


def batch_key(decoder: Decoder) -> str:
    """The machine kind a step cost holds for: ``machine_key``'s, for the batched step."""
    return machine_key(decoder, BATCHED)


@dataclass(frozen=True)
class CostTiming:
    shapes: list[StepShape]  # every measured step
    cost: StepCost  # the line through them
    calibration: Calibration  # what the timed DDTree steps accepted


def fit(shapes: list[StepShape], grouping: tuple[int, int] = (1, 0)) -> StepCost:
    """Least squares of seconds on (1, requests, nodes as the pass runs them (``grouping``: the device's
    ``row_grouping``), drafts, whether it drafts), through the median step of each shape (a step the machine
    stalled does not tilt the line), each weighed by one over its time so that a small batch's step is fitted as
    closely as a large one's (the allocation's choices turn on ratios); a term that comes out negative (noise, or
    a grid that cannot tell it apart) is dropped and the rest fitted again."""
    names = ["fixed_s", "per_request_s", "per_node_s", "per_draft_s", "draft_pass_s"]
    timed: dict[tuple[int, int, int], list[float]] = {}
    for shape in shapes:
        timed.setdefault((shape.requests, shape.nodes, shape.drafts), []).append(shape.seconds)
    kinds = sorted(timed)
    columns = {"fixed_s": [1.0] * len(kinds), "per_request_s": [requests for requests, _, _ in kinds],
               "per_node_s": [grouped_rows(requests + nodes, *grouping) - requests for requests, nodes, _ in kinds],
               "per_draft_s": [drafts for _, _, drafts in kinds],
               "draft_pass_s": [float(drafts > 0) for _, _, drafts in kinds]}
    seconds = torch.tensor([[statistics.median(timed[kind])] for kind in kinds], dtype=torch.float64)
    weight = 1 / seconds
    kept = list(names)
    while True:
        design = torch.tensor([columns[name] for name in kept], dtype=torch.float64).T
        solution = torch.linalg.lstsq(design * weight, seconds * weight).solution[:, 0].tolist()
        fitted = dict(zip(kept, solution))
        negative = [name for name in kept if fitted[name] < 0]
        if not negative:
            return StepCost(**{name: fitted.get(name, 0.0) for name in names}, row_group=grouping[0],
                            few_rows=grouping[1])
        kept.remove(min(negative, key=fitted.get))


def time_step_costs(decoder: Decoder, prompts: list[list[int]], requests: tuple[int, ...] = GRID_REQUESTS,
                    nodes: tuple[int, ...] = GRID_NODES, steps: int = MEASURED_STEPS,
                    progress=None) -> CostTiming:
    """Each (requests, nodes) of the grid timed over ``steps`` steps after ``WARM_UP_STEPS``: the prompts are
    cycled; every request decodes greedily well past the steps timed."""
    budgeting = Budgeting()
    shapes: list[StepShape] = []
    grid = [(count, per) for count in requests for per in nodes if per == 0 or decoder.drafter is not None]
    for done, (count, per) in enumerate(grid):
        settings = (DecodeSettings("ddtree", max_new_tokens=1024, tree_budget=per) if per else
                    DecodeSettings("ar", max_new_tokens=1024))
        batch = Batch(decoder, budgeting)
        for index in range(count):
            batch.admit(prompts[index % len(prompts)], settings)
        while batch.waiting:
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
