"""What DDTree would give at a real model size (``engine.measure.projection``), printed.

    python -m engine.tools.projection benchmarks/shapes/gpu-qwen3-8b-random.json [--curve DRAFTER_FOLDER]
    python -m engine.tools.projection --memory assets/shapes/qwen3-8b assets/shapes/qwen3-8b-dflash-b16 [--memory ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.errors import EngineError
from engine.measure.projection import memory_table, projection_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.projection", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?",
                        help="results JSON of engine.tools.bench --random-weights at a model shape")
    parser.add_argument("--curve", default=None, help="drafter folder whose config.json holds an acceptance curve "
                                                      "(default: the shipped drafter)")
    parser.add_argument("--memory", nargs=2, action="append", metavar=("TARGET", "DRAFTER"), default=[],
                        help="config folders of a target and its drafter: the memory estimate alone (repeatable)")
    parser.add_argument("--gpu-gib", type=float, default=141.0, help="GPU memory for the memory estimate (H200: 141)")
    parser.add_argument("--utilization", type=float, default=0.9, help="share of it vLLM may take")
    args = parser.parse_args(argv)
    try:
        if args.results is None and not args.memory:
            raise EngineError("give a results JSON, or --memory TARGET DRAFTER")
        if args.results is not None:
            print(projection_report(json.loads(Path(args.results).read_text()), args.curve, args.gpu_gib,
                                    args.utilization))
        if args.memory:
            print(memory_table(args.memory, args.gpu_gib, args.utilization))
    except (OSError, json.JSONDecodeError, KeyError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
