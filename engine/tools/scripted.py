"""A scripted drafter from a bench run's own outputs, for exactness runs that go deep.

    python -m engine.tools.scripted RESULTS.json --shape DRAFTER_FOLDER --out OUT [--label vllm-ar]

The sequences are RESULTS' prompts (the tokens the run recorded, else chat-encoded as the bench
encodes them) followed by the outputs of its runs labelled LABEL (vLLM's own AR where the run has
it, else the Studio's AR); the config is DRAFTER_FOLDER's, so the drafter fits the same target.
Bench again with ``--drafter OUT`` and every method is accepted levels deep
(``engine.models.drafter.ScriptedDrafter``), on random weights too: vLLM's dummy weights and the
torch engine's random ones are seeded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.errors import EngineError
from engine.methods import BASELINE
from engine.models.drafter import read_drafter_config, write_scripted_drafter
from engine.models.target import Target, shape_tokenizer
from engine.tools.bench import read_prompts
from engine.trace import NATIVE_AR


def sequences_from(results: dict, label: str | None = None) -> tuple[str, list[list[int]]]:
    """The label used and, per run with it, the chat-encoded prompt followed by the run's output."""
    labels = {run["label"] for run in results["runs"]}
    label = label or (NATIVE_AR if NATIVE_AR in labels else BASELINE.label())
    if label not in labels:
        raise EngineError(f"the results hold no runs labelled {label!r} (they hold {', '.join(sorted(labels))})")
    config = results["config"]
    encoder = Target(model=None, tokenizer=shape_tokenizer(str(config["model"])), name="", stop_ids=[])
    prompts = {prompt["id"]: prompt["prompt"] for prompt in read_prompts(config["prompts"])}
    decoded = config.get("prompt_ids", {})  # the run's own tokens where recorded (tokenizers differ by version)
    return label, [(decoded.get(run["prompt_id"]) or encoder.chat_ids(prompts[run["prompt_id"]])) + run["output_ids"]
                   for run in results["runs"] if run["label"] == label]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.scripted", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="results JSON of engine.tools.bench")
    parser.add_argument("--shape", required=True, help="the drafter folder whose config the scripted drafter takes")
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default=None, help="whose outputs to script (default: vllm-ar, else ar)")
    parser.add_argument("--demote-every", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        label, sequences = sequences_from(json.loads(Path(args.results).read_text()), args.label)
        folder = write_scripted_drafter(args.out, read_drafter_config(args.shape), sequences, args.demote_every)
    except (OSError, json.JSONDecodeError, KeyError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{folder}: {len(sequences)} sequences from the {label} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
