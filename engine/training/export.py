"""Write a trained drafter as a z-lab checkpoint folder: ``config.json`` + bf16 safetensors,
split into shards when asked (files coming back from the GPU machine must stay under 16 MiB)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from engine.methods import DFLASH, TREE, budget_sweep
from engine.models.drafter import ARCHITECTURE, DFlashDrafter, load_drafter, save_drafter

INDEX_FILE = "model.safetensors.index.json"
HEADER_BYTES = 256  # per tensor, an upper bound on its entry in a safetensors JSON header (plus its name)


def export_drafter(drafter: DFlashDrafter, folder: str | Path, *, shard_mb: float | None = 15.0,
                   dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> list[Path]:
    """Save ``drafter`` (a copy cast to ``dtype``) with ``save_drafter``; then split its weights
    into ``model-0000i-of-0000n.safetensors`` of at most ``shard_mb`` MiB. Returns the weight files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # load_drafter reads every *.safetensors in the folder: stale shards would mix in
    for stale in [*folder.glob("*.safetensors"), folder / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    save_drafter(copy.deepcopy(drafter).to(dtype), folder, extra)
    weights = folder / "model.safetensors"
    if shard_mb is None:
        return [weights]
    return split_safetensors(weights, int(shard_mb * 2**20))


def split_safetensors(path: Path, max_bytes: int) -> list[Path]:
    """Split one safetensors file into files of at most ``max_bytes`` each (header included),
    with an HF-style index; a file that already fits stays as it is."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    groups: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size() + len(name) + HEADER_BYTES
        if size > max_bytes:
            raise ValueError(f"tensor {name} has {size} bytes, more than a whole shard ({max_bytes})")
        if groups[-1] and used + size > max_bytes:
            groups.append({})
            used = 0
        groups[-1][name] = tensor
        used += size
    if len(groups) == 1:
        return [path]
    path.unlink()
    files = [path.parent / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for file, group in zip(files, groups):
        save_file(group, str(file), metadata={"format": "pt"})
        weight_map.update({name: file.name for name in group})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path.parent / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
    return files


def main(argv=None) -> None:
    """Re-export a drafter folder, e.g. shards brought back from the GPU machine as the one
    ``model.safetensors`` the repository ships:

        python -m engine.training.export OUT/drafter assets/drafters/NAME --shard-mb 0
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("destination", type=Path)
    parser.add_argument("--shard-mb", type=float, default=0.0, help="max MiB per weight file; 0: one file")
    parser.add_argument("--acceptance", type=Path, default=None,
                        help="an engine.tools.bench results file on prompts the drafter never saw: its τ per method "
                             "goes into config.json (the app's start-up budget calibration reads it)")
    args = parser.parse_args(argv)
    raw = json.loads((args.source / "config.json").read_text())
    drafter = load_drafter(args.source)
    extra = {key: value for key, value in raw.items() if key not in drafter.config.to_json()}
    if args.acceptance is not None:
        drafter.config.acceptance = acceptance_record(json.loads(args.acceptance.read_text()))
    export_drafter(drafter, args.destination, shard_mb=args.shard_mb or None,
                   extra=extra if raw.get("architectures") == [ARCHITECTURE] else None)


def acceptance_record(results: dict) -> dict:
    """τ per method from an ``engine.tools.bench`` results file, as ``DrafterConfig.acceptance`` holds it."""
    summary, config = results["summary"], results["config"]
    curve = {str(budget): round(summary[label]["tau"], 3) for budget, label in budget_sweep(summary).items()}
    record = {"prompts": config.get("prompts"), "max_new_tokens": config.get("max_new_tokens"),
              "dtype": config.get("dtype"), TREE.name: curve}
    if config.get("draft_dtype"):  # the bench names it only where the drafter ran in another dtype
        record["draft_dtype"] = config["draft_dtype"]
    if DFLASH.label() in summary:
        record[DFLASH.name] = round(summary[DFLASH.label()]["tau"], 3)
    return record


if __name__ == "__main__":
    main()
