"""Keep evaluation prompts out of the training data: word n-gram overlap, not only exact matches.

A training prompt is a near-duplicate of an evaluation prompt when at least half of the
evaluation prompt's word 4-grams occur in it (the evaluation prompt is contained, with
other words around it) or at least half of its own 4-grams occur in the evaluation prompt
(it is contained): this removes rephrasings and template siblings ("... the second largest
number in a list" in any wording). Words are lower-cased runs of letters and digits;
prompts shorter than 4 words count as one gram.

``heldout.jsonl`` is in-distribution by design (held out from the very templates the
data uses, so its siblings share a template and differ in topic or style): for it only
copies count, 80% of the grams shared both ways.

    python -m engine.training.overlap --train DIR/prompts.jsonl --eval "assets/prompts/*.jsonl"
"""

from __future__ import annotations

import argparse
import glob
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

WORD = re.compile(r"[a-z0-9]+")
NGRAM = 4


@dataclass(frozen=True)
class Policy:
    """When a training prompt counts as a near-duplicate of one evaluation set's prompt."""

    threshold: float = 0.5  # share of grams in common
    both_ways: bool = False  # False: either prompt mostly inside the other; True: each inside the other

    def matches(self, shared: int, eval_grams: int, train_grams: int) -> bool:
        inside_train, inside_eval = shared >= self.threshold * eval_grams, shared >= self.threshold * train_grams
        return (inside_train and inside_eval) if self.both_ways else (inside_train or inside_eval)


SIBLINGS = Policy()
COPIES = Policy(threshold=0.8, both_ways=True)
POLICIES = {"heldout": COPIES}  # other sets: SIBLINGS


def word_ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = WORD.findall(text.lower())
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


@dataclass
class EvalPrompt:
    set_name: str
    line: int  # its index in its set
    text: str
    grams: set


@dataclass
class OverlapReport:
    """What the filter removed: per evaluation set, how many of its prompts had a near-duplicate
    in the training prompts, and how many training prompts were dropped for it."""

    checked: int = 0
    removed: int = 0
    eval_prompts: dict[str, int] = field(default_factory=dict)
    eval_prompts_hit: dict[str, list[int]] = field(default_factory=dict)  # per set, which of its prompts (by line)
    train_removed_by_set: dict[str, int] = field(default_factory=dict)
    examples: list[dict] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"overlap: {self.removed} of {self.checked} training prompts removed as near-duplicates "
               f"of evaluation prompts (word {NGRAM}-grams)"]
        for name, total in sorted(self.eval_prompts.items()):
            policy = POLICIES.get(name, SIBLINGS)
            rule = f"{policy.threshold:.0%} shared {'both ways' if policy.both_ways else 'either way'}"
            out.append(f"overlap:   {name} ({rule}): {len(self.eval_prompts_hit.get(name, []))}/{total} "
                       "evaluation prompts had a near-duplicate; "
                       f"{self.train_removed_by_set.get(name, 0)} training prompts removed")
        for example in self.examples[:5]:
            out.append(f"overlap:   e.g. {example['train'][:90]!r} ~ {example['eval'][:90]!r} ({example['set']})")
        return out

    def merge(self, other: OverlapReport) -> OverlapReport:
        hit = {name: sorted(set(self.eval_prompts_hit.get(name, [])) | set(other.eval_prompts_hit.get(name, [])))
               for name in self.eval_prompts_hit.keys() | other.eval_prompts_hit.keys()}
        return OverlapReport(self.checked + other.checked, self.removed + other.removed,
                             self.eval_prompts or other.eval_prompts, hit,
                             dict(Counter(self.train_removed_by_set) + Counter(other.train_removed_by_set)),
                             (self.examples + other.examples)[:10])


class OverlapIndex:
    """Evaluation prompts indexed by their n-grams."""

    def __init__(self, sets: dict[str, list[str]], policies: dict[str, Policy] = POLICIES):
        self.policies = policies
        self.prompts = [EvalPrompt(name, line, text, word_ngrams(text)) for name, texts in sets.items()
                        for line, text in enumerate(texts)]
        self.sizes = {name: len(texts) for name, texts in sets.items()}
        self.by_gram: dict[tuple, list[int]] = defaultdict(list)
        for index, prompt in enumerate(self.prompts):
            for gram in prompt.grams:
                self.by_gram[gram].append(index)

    @staticmethod
    def from_files(pattern: str) -> OverlapIndex:
        """Every ``{"prompt": ...}`` line of the JSONL files matching ``pattern``, keyed by file stem."""
        sets = {}
        for path in sorted(glob.glob(pattern)):
            lines = Path(path).read_text().splitlines()
            sets[Path(path).stem] = [json.loads(line)["prompt"] for line in lines if line.strip()]
        return OverlapIndex(sets)

    def match(self, text: str) -> EvalPrompt | None:
        """The evaluation prompt ``text`` nearly duplicates, if any."""
        grams = word_ngrams(text)
        if not grams:
            return None
        shared = Counter(index for gram in grams for index in self.by_gram.get(gram, ()))
        for index, count in shared.most_common():
            prompt = self.prompts[index]
            if self.policies.get(prompt.set_name, SIBLINGS).matches(count, len(prompt.grams), len(grams)):
                return prompt
        return None

    def filter(self, prompts: list, text=lambda p: p.text) -> tuple[list, OverlapReport]:
        """``prompts`` without the near-duplicates, and the report."""
        report = OverlapReport(checked=len(prompts), eval_prompts=dict(self.sizes))
        kept, hit = [], defaultdict(set)
        for prompt in prompts:
            found = self.match(text(prompt))
            if found is None:
                kept.append(prompt)
                continue
            report.removed += 1
            report.train_removed_by_set[found.set_name] = report.train_removed_by_set.get(found.set_name, 0) + 1
            hit[found.set_name].add(found.line)
            if len(report.examples) < 10:
                report.examples.append({"train": text(prompt), "eval": found.text, "set": found.set_name})
        report.eval_prompts_hit = {name: sorted(lines) for name, lines in hit.items()}
        return kept, report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", required=True, help="JSONL of training prompts ({\"prompt\": ...} per line)")
    parser.add_argument("--eval", default="assets/prompts/*.jsonl", help="glob of evaluation prompt files")
    args = parser.parse_args(argv)
    train = [json.loads(line)["prompt"] for line in Path(args.train).read_text().splitlines() if line.strip()]
    _, report = OverlapIndex.from_files(args.eval).filter(train, text=lambda t: t)
    print("\n".join(report.lines()))


if __name__ == "__main__":
    main()
