"""Which ops change a row's numbers with the number of rows a verify pass holds.

    python -m engine.tools.row_invariance [--model M [--random-weights]] [--device cuda] [--dtype bfloat16] \\
        [--rows 1,17,65,129] [--prompts assets/prompts/fresh.jsonl --limit 3] [--out report.json]
    python -m engine.tools.row_invariance --engine vllm [--drafter D] ...   # vLLM's model and kernels (GPU)

Lossless decoding needs each verified row to score its token exactly as AR's one-token step
does. A verify pass over a chain of AR's own greedy tokens holds, in every row, an AR step:
row i after the context must give AR's i-th logits bit for bit. A tree holds the chain and
siblings beside it; its chain rows must too. Where they do not, the arithmetic depends on how
many rows the pass holds: a GEMM kernel or split-K chosen by the row count, a fused op, an
attention that groups its reduction over the context differently with an explicit mask.

For each row count the tool verifies the same context as a chain and as a tree, counts the rows
whose logits equal AR's bit for bit, and, for the first row that does not, compares every module's
output with its AR step's in execution order and names the first that differs: the op to make
row-invariant first. Prints one table; ``--out`` writes the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

import torch

from engine.errors import EngineError
from engine.measure.row_check import RowCheck, check
from engine.models.target import load_target
from engine.tools.bench import read_prompts


def format_checks(checks: list[RowCheck]) -> str:
    lines = ["| prompt | shape | rows | rows equal to AR | largest logit gap | first row leaving AR "
             "| its first module leaving AR | its largest gap |",
             "|---|---|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.prompt_id} | {c.shape} | {c.rows} | {c.equal_rows}/{c.compared_rows} | "
                     f"{c.max_abs_diff:.3g} | {'–' if c.first_row is None else c.first_row} | "
                     f"{c.first_module or '– (none)'} | {c.module_abs_diff:.3g} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder, hub id or GGUF (default: the bundled SmolLM2)")
    parser.add_argument("--random-weights", action="store_true", help="--model's config.json alone, random weights")
    parser.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                        help="vllm: the check runs in vLLM's worker on its model and kernels (all-attention targets)")
    parser.add_argument("--drafter", default=None, help="--engine vllm with --random-weights: a drafter config folder")
    parser.add_argument("--vllm-compile", action="store_true",
                        help="--engine vllm: vLLM compiles the target (one graph for every row count; its fused "
                             "layers hide their modules from the tap, so no module is named)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", default="1,17,65,129", help="row counts to verify (default 1,17,65,129)")
    parser.add_argument("--prompts", default="assets/prompts/fresh.jsonl")
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the report as JSON")
    return parser.parse_args(argv)


def torch_checks(args: argparse.Namespace, prompts: list[dict], rows: list[int]) -> list[RowCheck]:
    target = load_target(args.model, args.device, args.dtype, random_weights=args.random_weights)
    with torch.inference_mode():
        return [found for prompt in prompts for found in check(target, prompt["id"], target.chat_ids(prompt["prompt"]),
                                                               rows)]


def vllm_checks(args: argparse.Namespace, prompts: list[dict], rows: list[int]) -> list[RowCheck]:
    from engine.on_vllm.vllm_engine import VllmOptions, load_vllm_decoder

    decoder = load_vllm_decoder(args.model, args.drafter, dtype=args.dtype,
                                options=VllmOptions(random_weights=args.random_weights, vllm_compile=args.vllm_compile))
    try:
        contexts = [(prompt["id"], decoder.target.chat_ids(prompt["prompt"])) for prompt in prompts]
        return [RowCheck(**found) for found in decoder.llm.collective_rpc("studio_rows", args=(contexts, rows))[0]]
    finally:
        decoder.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
        if not rows or min(rows) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --rows takes positive row counts, got {args.rows!r}", file=sys.stderr)
        return 2
    try:
        prompts = read_prompts(args.prompts)[: args.limit]
        checks = vllm_checks(args, prompts, rows) if args.engine == "vllm" else torch_checks(args, prompts, rows)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_checks(checks))
    if args.out:
        with open(args.out, "w") as out:
            trees = "vLLM's kernel, query bias" if os.environ.get("DDTREE_ATTENTION") == "bias" else "path attention"
            where = ({"engine": "vllm", "tree_attention": trees, "vllm_compile": args.vllm_compile}
                     if args.engine == "vllm" else {"engine": "torch", "device": args.device})
            json.dump({"model": args.model, **where, "dtype": args.dtype, "checks": [asdict(c) for c in checks]}, out,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
