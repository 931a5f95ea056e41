"""An OpenAI-compatible endpoint on the Studio's engine (``engine.serving.openai_api``), every request's trace kept
for the Studio (``python app.py --server http://127.0.0.1:8000``).

    python -m engine.tools.serve [--host 127.0.0.1] [--port 8000] [--method ddtree] [--tree-budget auto|N]
                                 [--one-at-a-time] [--traces DIR] [the app's model flags: --model, --drafter, ...]

It loads what ``python app.py`` loads with the same flags (the bundled SmolLM2 and the shipped drafter on the CPU
by default). Requests share decoding steps; a request's tree budget is "auto" unless it (or ``--tree-budget``)
sets one: every step sizes each request's tree for the batch, with the step costs recorded for this kind of
machine (``assets/batching.json``), or timed here in about half a minute at start-up where none are recorded.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import uvicorn

from engine.errors import EngineError
from engine.methods import AUTO, NAMES, TREE, check_budget, method
from engine.serving.model_queue import ModelQueue
from engine.serving.openai_api import ServeOptions, create_app
from engine.serving.startup import add_model_arguments, batch_budgeting, check_model_arguments, load_studio_decoder

log = logging.getLogger("ddtree-serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsShown)
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on")
    parser.add_argument("--port", type=int, default=8000, help="port to serve on")
    add_model_arguments(parser)
    parser.add_argument("--method", choices=NAMES, default=TREE.name, help="what a request that names none runs")
    parser.add_argument("--tree-budget", type=budget_argument, default=AUTO,
                        help='the tree budget of a request that sets none: "auto" (each step sizes every request\'s '
                             "tree for the batch) or 1..1024 nodes")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="serve requests one at a time, in turn, instead of batching them into shared steps")
    parser.add_argument("--traces", type=Path, default=None, help="also write every request's trace file here")
    args = parser.parse_args(argv)
    check_model_arguments(parser, args)
    return args


class DefaultsShown(argparse.HelpFormatter):
    """Every option's default in its help, where the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def budget_argument(text: str):
    """``--tree-budget``'s value, refused with the sentence every entry point says."""
    try:
        return check_budget(text)
    except EngineError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    queue = ModelQueue()
    try:
        decoder = queue.run(load_studio_decoder, args)  # on the model's thread, which runs every call after it
        budgeting = queue.run(batch_budgeting, decoder, True)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    batching = not args.one_at_a_time and decoder.target.runs_batched
    log.info("serving %s with drafter %s at http://%s:%d/v1; a request that names none runs %s.", decoder.target.name,
             decoder.drafter_info.name, args.host, args.port, method(args.method).label(args.tree_budget))
    log.info("%s", "requests share decoding steps (continuous batching); \"auto\" trees are sized with "
             f"{budgeting.source}." if batching else "requests run one at a time, in turn.")
    if batching:
        log.info("step costs: %s", budgeting.cost)
    options = ServeOptions(method=args.method, tree_budget=args.tree_budget, traces_dir=args.traces,
                           batching=batching)
    uvicorn.run(create_app(decoder, options, queue), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
