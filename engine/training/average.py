"""Average drafters of one shape weight by weight (a "model soup"), as one drafter.

Each training session warm-starts from the last one's weights and ends at a different point of
the same basin; their mean drafts better on prompts none of them saw than any one of them (the
model card has the numbers). Averaging needs the same architecture and the same tapped layers:
anything else is refused before a weight is read.

    python -m engine.training.average OUT DRAFTER DRAFTER [DRAFTER ...] [--acceptance RESULTS.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from engine.errors import run_command
from engine.models.drafter import DFlashDrafter, DrafterError, load_drafter, read_drafter_config, weights_digest
from engine.training.export import acceptance_record, export_drafter

# Fields that describe a checkpoint's history or measurements, not its shape: they may differ.
NOT_SHAPE = ("acceptance",)


def shape_fields(folder: Path) -> dict:
    return {key: value for key, value in read_drafter_config(folder).to_json().items() if key not in NOT_SHAPE}


def average_drafters(folders: list[Path]) -> DFlashDrafter:
    """One drafter whose every weight is the float32 mean of the folders' weights."""
    if len(folders) < 2:
        raise DrafterError("averaging needs at least two drafter folders")
    reference = shape_fields(folders[0])
    for folder in folders[1:]:
        differing = sorted(key for key, value in shape_fields(folder).items() if reference.get(key) != value)
        if differing:
            raise DrafterError(f"drafter {str(folder)!r} has another shape than {str(folders[0])!r} "
                               f"(differs in {', '.join(differing)}): only drafters of one shape can be averaged")
    drafters = [load_drafter(folder).float() for folder in folders]
    states = [drafter.state_dict() for drafter in drafters]
    mean = drafters[0]
    with torch.no_grad():
        for name, tensor in mean.state_dict().items():
            for state in states[1:]:
                tensor += state[name]
            tensor /= len(states)
    mean.config.acceptance = {}  # the first folder's measurements are not the mean's
    return mean


def sources_record(folders: list[Path]) -> list[dict]:
    """Which weights went in, and how each was trained (from its config.json, where recorded)."""
    record = []
    for folder in folders:
        raw = json.loads((folder / "config.json").read_text())
        record.append({"weights": weights_digest(folder),
                       **({"training": raw["training"]} if "training" in raw else {})})
    return record


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the averaged drafter's folder (config.json + one bf16 safetensors)")
    parser.add_argument("drafters", type=Path, nargs="+", help="drafter folders of one shape")
    parser.add_argument("--acceptance", type=Path, default=None,
                        help="an engine.tools.bench results file measured with the averaged drafter: its τ goes into "
                             "config.json, as with engine.training.export")
    return parser.parse_args(argv)


def _main(args: argparse.Namespace) -> int:
    drafter = average_drafters(args.drafters)
    if args.acceptance is not None:
        drafter.config.acceptance = acceptance_record(json.loads(args.acceptance.read_text()))
    export_drafter(drafter, args.out, shard_mb=None, extra={"average_of": sources_record(args.drafters)})
    print(f"averaged {len(args.drafters)} drafters into {args.out} (weights {weights_digest(args.out)})")
    return 0


def main(argv=None) -> int:
    return run_command(_main, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
