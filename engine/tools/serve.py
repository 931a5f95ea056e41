"""An OpenAI-compatible endpoint on the Studio's engine (``engine.serving.openai_api``), every request's trace kept
for the Studio (``python app.py --server http://127.0.0.1:8000``).

    python -m engine.tools.serve [--host 127.0.0.1] [--port 8000] [--method ddtree] [--tree-budget N]
                                 [--traces DIR] [the app's model flags: --model, --drafter, --engine vllm, ...]

It loads what ``python app.py`` loads with the same flags (the bundled SmolLM2 and the shipped drafter on the CPU
by default). The DDTree budget a request does not set is the one the app opens at on this machine (the bench's
record, or what the app timed here before), else the app's provisional budget: the server times nothing itself.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import uvicorn

from engine.errors import EngineError
from engine.methods import MAX_TREE_BUDGET, NAMES
from engine.serving.model_queue import ModelQueue
from engine.serving.openai_api import ServeOptions, create_app
from engine.serving.startup import add_model_arguments, check_model_arguments, load_studio_decoder, opening_budget

log = logging.getLogger("ddtree-serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on")
    parser.add_argument("--port", type=int, default=8000)
    add_model_arguments(parser)
    parser.add_argument("--method", choices=NAMES, default="ddtree", help="what a request that names none runs")
    parser.add_argument("--tree-budget", type=int, default=None,
                        help="the DDTree budget of a request that sets none (default: the budget the app opens at "
                             "on this machine)")
    parser.add_argument("--traces", type=Path, default=None, help="also write every request's trace file here")
    args = parser.parse_args(argv)
    if args.tree_budget is not None and not 1 <= args.tree_budget <= MAX_TREE_BUDGET:
        parser.error(f"--tree-budget must be between 1 and {MAX_TREE_BUDGET}, got {args.tree_budget}")
    check_model_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    queue = ModelQueue()
    try:
        decoder = queue.run(load_studio_decoder, args)  # on the model's thread, which runs every call after it
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    budget, untimed = opening_budget(decoder, args.tree_budget)
    why = budget.sentence() if untimed is None else (
        f"DDTree budget {budget.budget}: the app's provisional budget, as no bench record or earlier timing fits "
        "this machine (python app.py times the budgets here once, and the server then opens at its choice).")
    log.info("serving %s with drafter %s, %s by default. %s", decoder.target.name, decoder.drafter_info.name,
             args.method, why)
    options = ServeOptions(method=args.method, tree_budget=budget.budget, traces_dir=args.traces)
    uvicorn.run(create_app(decoder, options, queue), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
