"""The composed-prompts file: user turns written apart from our templates, added in rounds.

Each round's requests come as JSON lines ``{"prompt", "category"}`` (``assets/training/README.md``
says who wrote them and from what). ``add`` appends the new ones to the file: not those already in
it or repeated within the round (case and spacing ignored), nor near-duplicates of any evaluation
prompt (word n-gram overlap, ``overlap``); it prints the overlap report.

    python -m engine.training.composed ROUND.jsonl [...] --out assets/training/composed-prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.training.data import DataSettings, normalized, prompt_id
from engine.training.overlap import OverlapIndex, OverlapReport


def read_requests(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def add(sources: list[Path], out: Path, eval_prompts: str = DataSettings.eval_prompts) -> tuple[int, OverlapReport]:
    """Append the new requests of ``sources`` to ``out``; returns how many were added, and the overlap report."""
    seen = {normalized(row["prompt"]) for row in read_requests(out)} if out.exists() else set()
    new = []
    for row in (row for path in sources for row in read_requests(path)):
        key = normalized(row["prompt"])
        if key not in seen:
            seen.add(key)
            new.append(row)
    kept, report = OverlapIndex.from_files(eval_prompts).filter(new, text=lambda row: row["prompt"])
    with out.open("a") as f:
        for row in kept:
            f.write(json.dumps({"id": prompt_id(row["prompt"]), "category": row["category"], "prompt": row["prompt"]},
                               ensure_ascii=False) + "\n")
    return len(kept), report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", type=Path, help="JSONL files of {\"prompt\", \"category\"}")
    parser.add_argument("--out", type=Path, default=Path(DataSettings.composed_file))
    parser.add_argument("--eval", default=DataSettings.eval_prompts, help="glob of evaluation prompt files")
    args = parser.parse_args(argv)
    added, report = add(args.sources, args.out, args.eval)
    print("\n".join(report.lines()))
    print(f"added {added} requests to {args.out}")


if __name__ == "__main__":
    main()
