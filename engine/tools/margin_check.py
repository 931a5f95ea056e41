"""How far a GPU engine's logits stray from exact arithmetic, prompt by prompt.

    python -m engine.tools.margin_check RESULTS.json [--model FOLDER] [--prompts PROMPTS.jsonl]

A bench run with ``--native ar`` records, at every token vLLM's own AR chose, the gap between its
two best logits (``margins``). This replays each of those outputs through the transformers target
here in float64, teacher-forced (one pass per prompt), and sets the two gaps side by side: at the
first token (the prompt's pass alone) and over the whole output, with the prompt's length, so an
error that grows with the prompt, or one that starts in the decode steps, shows where it starts.
A float32 engine that computes what the model says stays within ~1e-5 of float64 at these logit
sizes; a gap that differs by more is the engine's arithmetic (or formula), not rounding. Where the
run's output left float64's own choice, the first such token is named.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import EngineError, run_command
from engine.models.target import load_target
from engine.tools.bench import read_prompts
from engine.trace import NATIVE_AR


@dataclass(frozen=True)
class MarginCheck:
    prompt_id: str
    prompt_tokens: int
    first: float  # |engine gap - float64 gap| at the first new token
    median: float  # the same, median over the output
    worst: float
    leaves_float64_at: int | None  # the first output token that is not float64's own argmax


def exact_margins(target, prompt_ids: list[int], output_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 top-2 logit gaps and argmaxes at each output position, the output teacher-forced."""
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1: -1].double()
    top = logits.topk(2, dim=-1)
    return top.values[:, 0] - top.values[:, 1], top.indices[:, 0]


def check_run(target, prompt: str, run: dict, prompt_ids: list[int] | None = None) -> MarginCheck:
    """``prompt_ids``: the tokens the run decoded, where it recorded them (another machine's tokenizer
    can split the text apart: replaying other tokens is not the same pass)."""
    prompt_ids = prompt_ids or target.chat_ids(prompt)
    output = run["output_ids"]
    exact, argmax = exact_margins(target, prompt_ids, output)
    engine = torch.tensor(run["margins"][: len(output)], dtype=torch.float64)
    gap = (engine - exact).abs()
    left = (argmax != torch.tensor(output)).nonzero()
    return MarginCheck(run["prompt_id"], len(prompt_ids), float(gap[0]), float(gap.median()), float(gap.max()),
                       int(left[0]) if left.numel() else None)


def native_runs(results: dict) -> list[dict]:
    runs = [run for run in results.get("runs", []) if run.get("label") == NATIVE_AR and run.get("margins")]
    if not runs:
        raise EngineError("the results hold no vLLM AR run with margins: bench with --engine vllm --native ar")
    return runs


def format_checks(checks: list[MarginCheck]) -> str:
    rows = ["| prompt | prompt tokens | first token | median | worst | leaves float64's argmax at |",
            "|---|---|---|---|---|---|"]
    for check in sorted(checks, key=lambda c: (c.prompt_tokens, c.prompt_id)):
        left = "–" if check.leaves_float64_at is None else f"new token {check.leaves_float64_at}"
        rows.append(f"| {check.prompt_id} | {check.prompt_tokens} | {check.first:.1e} | {check.median:.1e} | "
                    f"{check.worst:.1e} | {left} |")
    return "|engine top-2 gap − float64 top-2 gap|, in logits\n" + "\n".join(rows)


def _main(args: argparse.Namespace) -> int:
    try:
        results = json.loads(Path(args.results).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineError(f"{args.results}: not a readable bench result ({exc})") from None
    runs = native_runs(results)
    prompts = {prompt["id"]: prompt["prompt"] for prompt in read_prompts(args.prompts or results["config"]["prompts"])}
    missing = [run["prompt_id"] for run in runs if run["prompt_id"] not in prompts]
    if missing:
        raise EngineError(f"the prompts file has no prompt {missing[0]!r}: pass the run's own with --prompts")
    target = load_target(args.model or results["config"]["model"], device="cpu", dtype="float64")
    decoded = results["config"].get("prompt_ids", {})
    checks = [check_run(target, prompts[run["prompt_id"]], run, decoded.get(run["prompt_id"])) for run in runs]
    print(format_checks(checks))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.margin_check", description=__doc__.splitlines()[0])
    parser.add_argument("results", help="engine.tools.bench results with vLLM's own AR (--native ar)")
    parser.add_argument("--model", default=None, help="the target here (default: the run's --model)")
    parser.add_argument("--prompts", default=None, help="the run's prompts file (default: the one it names)")
    return run_command(_main, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
