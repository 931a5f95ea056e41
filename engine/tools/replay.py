"""τ at every tree budget in a minute: greedy decoding replayed along AR's own output.

Greedy DFlash and DDTree commit exactly AR's tokens, so every step's root lies on AR's output,
and what the drafter sees there (the target's features of everything before the root) comes
from one target pass over prompt + output. One drafter pass per output position then holds
every step any method could take: a step's acceptance is its tree's longest path along AR's
next tokens (``ddtree.follow_tree`` with AR as the target). No verify pass runs, so this
estimates acceptance, not speed or exactness; the bench measures those. It is for choosing
among drafters, checkpoints and budgets quickly: one target pass and one drafter pass per output
position stand for every method at every budget, where the bench decodes each of them in turn.

    python -m engine.tools.replay --prompts assets/prompts/fresh.jsonl --drafter FOLDER \\
        --methods dflash,ddtree --tree-budget 4,8,16,32,64 [--ar-outputs RESULTS.json] [--first-slot]

``--first-slot`` also tells where the drafter misses: how often its first slot holds AR's next token,
by category and by how sure the target itself was of that token (two prompt sets whose drafts differ
at equal target confidence differ in what the drafter learned, not in how hard the text is).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from engine.errors import EngineError, run_command
from engine.loop.decode import Decoder
from engine.loop.loading import AUTO, load_decoder
from engine.loop.settings import DecodeSettings
from engine.measure.acceptance import CONFIDENCE_EDGES, Proposals, replay
from engine.methods import BASELINE, NAMES, method
from engine.tools.bench import (
    Job,
    per_category,
    plan_jobs,
    prompt_tokens,
    read_prompts,
    recorded_runs,
    tokenize_prompts,
)


def proposals_along(decoder: Decoder, prompt_ids: list[int], output_ids: list[int], top_k: int) -> Proposals:
    """One drafter pass per position of ``output_ids``, fed the target's features as the decoder
    feeds them (new context rows appended to the drafter's cache, in its own dtype)."""
    target, drafter = decoder.target, decoder.drafter
    ids = prompt_ids + output_ids
    device = target.device
    positions = torch.arange(len(ids) - 1, device=device)
    with torch.inference_mode():
        logits, hidden = target.forward(torch.tensor([ids[:-1]], device=device), positions[None], target.new_cache(),
                                        hidden_states=True)
        # AR's tokens are the target's argmax: the top probability is the one it gave the next token
        confidence = logits[len(prompt_ids): len(ids) - 1].float().softmax(-1).amax(-1).cpu()
        features = drafter.context_features(hidden)
        draft = decoder.draft_pass(drafter.config.block_size)
        rows, seen = [], 0
        for j, root in enumerate(output_ids):
            start = len(prompt_ids) + j
            log_probs = draft(root, start, features[:, seen:start], positions[None, seen:start])
            seen = start
            rows.append(log_probs.topk(min(top_k, log_probs.shape[-1]), dim=-1))
    return Proposals(output_ids, torch.stack([r.values for r in rows]).cpu(),
                     torch.stack([r.indices for r in rows]).cpu(), confidence)


def estimate(decoder: Decoder, prompts: list[dict], outputs: dict[str, list[int]],
             jobs: list[Job]) -> tuple[dict, dict[str, list[tuple[bool, float]]]]:
    """τ per job (overall and per category) from every prompt's proposals along its AR output, and
    per category every root's first-slot hit with the target's confidence (``first_slot_table``)."""
    top_k = max([job.tree_budget or 1 for job in jobs])  # a tree of B nodes uses no rank past B at any depth
    lengths: dict[str, dict[str, list[int]]] = {job.label: {} for job in jobs}
    first_slot: dict[str, list[tuple[bool, float]]] = {}
    for prompt in prompts:
        category = prompt.get("category") or "-"
        proposals = proposals_along(decoder, prompt_tokens(decoder, prompt), outputs[prompt["id"]], top_k)
        first_slot.setdefault(category, []).extend(proposals.first_slot_hits())
        for job in jobs:
            replayed = replay(proposals, method(job.method), job.tree_budget or 0)
            lengths[job.label].setdefault(category, []).extend(replayed)

    def tau(values: list[int]) -> float:
        return sum(values) / len(values) if values else 0.0

    return ({label: {"tau": tau([n for values in by_category.values() for n in values]),
                     "tau_by_category": {c: tau(v) for c, v in sorted(by_category.items())}}
             for label, by_category in lengths.items()}, first_slot)



def first_slot_table(first_slot: dict[str, list[tuple[bool, float]]]) -> list[str]:
    """How often the first slot holds AR's next token, per category and per band of the target's own
    confidence in that token; each cell is "rate (roots)"."""
    bands = list(zip((0.0,) + CONFIDENCE_EDGES, CONFIDENCE_EDGES + (1.01,)))

    def cell(hits: list[tuple[bool, float]]) -> str:
        return f"{sum(hit for hit, _ in hits) / len(hits):.2f} ({len(hits)})" if hits else "–"

    headers = [f"target {low:g}–{high:g}" if high <= 1 else f"target ≥ {low:g}" for low, high in bands]
    lines = ["| category | first slot right | mean target confidence | " + " | ".join(headers) + " |",
             "|---|---|---|" + "---|" * len(bands)]
    for category, hits in sorted(first_slot.items()) + [("all", [h for v in first_slot.values() for h in v])]:
        if hits:
            lines.append(f"| {category} | {cell(hits)} | {sum(c for _, c in hits) / len(hits):.2f} | "
                         + " | ".join(cell([h for h in hits if low <= h[1] < high]) for low, high in bands) + " |")
    return lines


def recorded_outputs(prompts: list[dict], results: str) -> dict[str, list[int]]:
    """Every prompt's greedy AR output, from an earlier bench's results."""
    _, runs = recorded_runs(results, BASELINE.label())
    missing = [p["id"] for p in prompts if p["id"] not in runs]
    if missing:
        raise EngineError(f"{results} has no AR run for {missing[0]} ({len(missing)} prompts missing)")
    return {p["id"]: runs[p["id"]]["output_ids"] for p in prompts}


def decoded_outputs(decoder: Decoder, prompts: list[dict], max_new_tokens: int) -> dict[str, list[int]]:
    settings = DecodeSettings(BASELINE.name, max_new_tokens=max_new_tokens, trace_detail="tokens")
    return {p["id"]: decoder.run(p["prompt"], settings, prompt_ids=prompt_tokens(decoder, p)).output_ids
            for p in prompts}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--per-category", type=int, default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped one)")
    parser.add_argument("--draft-dtype", default=AUTO)
    parser.add_argument("--methods", default=",".join(name for name in NAMES if method(name).drafts))
    parser.add_argument("--tree-budget", default="4,8,16,32,64")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ar-outputs", default=None, help="a bench results JSON whose AR runs give the outputs")
    parser.add_argument("--first-slot", action="store_true",
                        help="also: how often the first slot is right, by the target's confidence")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, parse_args(argv))


def _main(args: argparse.Namespace) -> int:
    prompts = per_category(read_prompts(args.prompts), args.per_category)[: args.limit]
    jobs = [job for job in plan_jobs(args.methods, args.tree_budget) if job.drafts]
    outputs = recorded_outputs(prompts, args.ar_outputs) if args.ar_outputs else None  # before the slow load
    decoder = load_decoder(args.model, args.drafter, draft_dtype=args.draft_dtype)
    for note in tokenize_prompts(decoder.target, prompts, args.ar_outputs):  # the tokens the outputs followed
        print(note)
    if outputs is None:
        outputs = decoded_outputs(decoder, prompts, args.max_new_tokens)
    summary, first_slot = estimate(decoder, prompts, outputs, jobs)
    categories = sorted({c for entry in summary.values() for c in entry["tau_by_category"]})
    print(f"estimated τ (greedy steps replayed along AR's output; {len(prompts)} prompts, "
          f"drafter {decoder.drafter_info.name}, draft dtype {decoder.drafter.dtype})")
    print("| method | τ | " + " | ".join(categories) + " |")
    print("|---|---|" + "---|" * len(categories))
    for label, entry in summary.items():
        print(f"| {label} | {entry['tau']:.2f} | "
              + " | ".join(f"{entry['tau_by_category'].get(c, 0.0):.2f}" for c in categories) + " |")
    if args.first_slot:
        print("\nthe first slot against AR's next token, by the target's own confidence in it (rate (roots))")
        print("\n".join(first_slot_table(first_slot)))
    if args.out:
        Path(args.out).write_text(json.dumps({"prompts": args.prompts, "drafter": decoder.drafter_info.name,
                                              "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
