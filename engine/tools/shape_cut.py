"""A shape folder cut to its first layers, with its DFlash drafter's config tapping layers within them.

    python -m engine.tools.shape_cut assets/shapes/qwen3.6-27b 8 /tmp/shapes/qwen3.6-27b-8l

Writes ``OUT`` (the target) and ``OUT-dflash-b16`` (from ``SHAPE-dflash-b16``). Every layer keeps its
real size, so a kernel profile of the cut model names what each layer kind costs, and the model
starts and compiles in a fraction of the whole one's time. Timings of a cut model are per layer
only: its embedding and head weigh as much as the whole model's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engine.errors import EngineError


def cut(shape: Path, layers: int, out: Path) -> None:
    config = json.loads((shape / "config.json").read_text())
    text = config.get("text_config", config)
    if not 2 <= layers <= text["num_hidden_layers"]:
        raise EngineError(f"{shape} has {text['num_hidden_layers']} layers: cut it to 2 or more of them")
    text["num_hidden_layers"] = layers
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:layers]
    drafter = json.loads(Path(f"{shape}-dflash-b16/config.json").read_text())
    taps = len(drafter["dflash_config"]["target_layer_ids"])
    drafter["dflash_config"]["target_layer_ids"] = [1 + round(i * (layers - 2) / max(1, taps - 1)) for i in range(taps)]
    drafter["num_target_layers"] = layers
    for folder, content in ((out, config), (Path(f"{out}-dflash-b16"), drafter)):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(content, indent=1))


if __name__ == "__main__":
    try:
        cut(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
    except (EngineError, IndexError, ValueError) as error:
        sys.exit(f"error: {error}\nusage: python -m engine.tools.shape_cut SHAPE LAYERS OUT")
