"""What a batched step costs on this machine: ``engine.measure.step_cost`` as a command.

    python -m engine.tools.step_cost [--record] [the app's model flags: --model, --drafter, --dtype, ...]

Times a grid of batches (1, 2, 4, 8 requests; AR, and DDTree at 2, 8 and 32 nodes each), prints every
measured step's mean per grid point and the fitted line (``StepCost``), and with ``--record`` keeps it in
``assets/batching.json`` under this kind of machine, with the calibration those runs observed under the drafter's
weights: what the page and the server size "auto" trees with, without timing anything at start-up. Run it on a
quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from engine.errors import run_command
from engine.loop.budgeting import RECORDED
from engine.measure.step_cost import batch_key, record, time_step_costs
from engine.serving.startup import add_model_arguments, check_model_arguments, load_studio_decoder
from engine.tools.bench import read_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.step_cost", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--prompts", default="assets/prompts/fresh.jsonl", help="prompts the batches decode")
    parser.add_argument("--record", action="store_true", help=f"keep the result in {RECORDED.name}")
    args = parser.parse_args(argv)
    check_model_arguments(parser, args)
    return args


def main(args: argparse.Namespace) -> int:
    decoder = load_studio_decoder(args)
    prompts = [decoder.target.chat_ids(row["prompt"]) for row in read_prompts(args.prompts)[:8]]
    with torch.inference_mode():
        timing = time_step_costs(decoder, prompts, progress=lambda done, total: print(f"{done}/{total} batches",
                                                                                     file=sys.stderr))
    points: dict[tuple[int, int, int, int], list[float]] = {}
    for shape in timing.shapes:
        points.setdefault((shape.requests, shape.nodes, shape.drafts, shape.draft_rows), []).append(shape.seconds)
    print("| requests | nodes | drafts | drafted rows | ms a step (measured) | ms (fitted) |")
    print("|---|---|---|---|---|---|")
    for (requests, nodes, drafts, rows), seconds in sorted(points.items()):
        print(f"| {requests} | {nodes} | {drafts} | {rows} | {1000 * statistics.mean(seconds):.1f} | "
              f"{1000 * timing.cost.seconds(requests, nodes, drafts, rows):.1f} |")
    print(json.dumps({"machine": batch_key(decoder), "step_cost": vars(timing.cost)}))
    if args.record:
        command = "python -m engine.tools.step_cost " + " ".join(sys.argv[1:])
        print(f"recorded under {record(decoder, timing, command)!r} in {RECORDED}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, parse_args()))
