"""Self-distilled training data: prompts -> the target's own greedy replies -> token files.

Prompts come from templates (``prompts``) and from the target itself, which finishes
user turns that start with a short opener (sampled, so they vary). Replies are
greedy, encoded with the app's chat template (``Target.chat_ids``), so the drafter
trains on exactly the sequences it will see when the app decodes greedily.

Files written to the output folder:
  prompts.jsonl          training prompts  {"id", "prompt", "source"}
  heldout.jsonl          held-out prompts (never trained on), same fields, for the bench
  responses-NNNNN.pt     one shard per chunk of prompts: flat token ids + per-sequence
                         lengths and the offset where the reply begins
  data-stats.json        counts and timings; its presence marks the stage as done

    python -m engine.training.data --model /tmp/smol-hf --out /tmp/dflash --backend vllm
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.target import Target, load_target
from engine.training.generation import (Generator, Sampling, TransformersGenerator, VllmGenerator, VllmSettings,
                                       device_and_dtype)
from engine.training.prompts import (Prompt, code_prompts, general_prompts, math_prompts, self_written_openers,
                                     stub_prompts)

STATS_FILE = "data-stats.json"
MIN_CHUNK_PROMPTS = 64  # fewer than this left in the budget: stop
SHARD_PATTERN = "responses-*.pt"
# per shard: replies that ended their turn (untrimmed), were cut at a loop, were too short; tokens
COUNTS = ("stopped", "trimmed", "dropped", "generated_tokens", "reply_tokens")


@dataclass
class DataSettings:
    num_prompts: int = 50_000
    self_written_fraction: float = 0.30
    code_fraction: float = 0.20
    math_fraction: float = 0.15
    stub_fraction: float = 0.02  # HumanEval-style stubs (a few hundred exist); general topics get the rest
    heldout_fraction: float = 0.02
    min_heldout: int = 200
    max_new_tokens: int = 384
    prompt_max_tokens: int = 64
    prompt_temperature: float = 1.0
    prompt_top_p: float = 0.95
    min_prompt_chars: int = 12
    chunk_prompts: int = 8192  # prompts per vLLM call (and shard); later chunks shrink to fit the deadline
    max_minutes: float | None = None  # the whole stage, engine start included: no new chunk that would overrun it
    ngram: int = 8
    max_ngram_repeats: int = 4
    min_response_tokens: int = 8
    seed: int = 0


# ---- prompts ---------------------------------------------------------------------------------

def normalized(text: str) -> str:
    return " ".join(text.lower().split())


def prompt_id(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def user_turn_ids(chat: Target, opener: str) -> list[int]:
    """The chat template up to the user's message, then ``opener``: the target writes the rest."""
    tokenizer = chat.tokenizer
    if tokenizer.chat_template is None:
        return tokenizer(opener)["input_ids"]
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text[: text.index(marker)] + opener, add_special_tokens=False)["input_ids"]


def self_written_prompts(generator: Generator, chat: Target, count: int, settings: DataSettings,
                         rng: random.Random) -> list[Prompt]:
    """User turns the target writes itself, sampled from openers that seed the topic."""
    if count == 0:
        return []
    openers = self_written_openers(count, rng)
    sampling = Sampling(settings.prompt_max_tokens, settings.prompt_temperature, settings.prompt_top_p)
    completions = generator.complete([user_turn_ids(chat, o) for o in openers], sampling)
    texts = [(opener + chat.decode(c.token_ids)).strip() for opener, c in zip(openers, completions)]
    return [Prompt(t, "self") for t in texts if len(t) >= settings.min_prompt_chars]


def build_prompts(generator: Generator, chat: Target, settings: DataSettings) -> list[Prompt]:
    """All sources, deduplicated, in a seeded random order."""
    rng = random.Random(settings.seed)
    n = settings.num_prompts
    counts = {name: round(n * fraction) for name, fraction in
              [("self", settings.self_written_fraction), ("code", settings.code_fraction),
               ("math", settings.math_fraction), ("stub", settings.stub_fraction)]}
    counts["general"] = max(0, n - sum(counts.values()))
    stubs = stub_prompts()
    # a quarter more self-written ones than needed: some are too short or repeat
    written = self_written_prompts(generator, chat, math.ceil(counts["self"] * 1.25), settings, rng)
    prompts = deduplicated(deduplicated(written)[: counts["self"]] + general_prompts(counts["general"], rng)
                           + code_prompts(counts["code"], rng) + math_prompts(counts["math"], rng)
                           + rng.sample(stubs, min(counts["stub"], len(stubs))))
    rng.shuffle(prompts)
    return prompts


def deduplicated(prompts: list[Prompt]) -> list[Prompt]:
    """First of each text, case and spacing ignored."""
    seen, unique = set(), []
    for prompt in prompts:
        key = normalized(prompt.text)
        if key not in seen:
            seen.add(key)
            unique.append(prompt)
    return unique


def split_heldout(prompts: list[Prompt], settings: DataSettings) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out); prompts are already shuffled, so the first ones are a random sample."""
    count = min(max(math.ceil(settings.heldout_fraction * len(prompts)), settings.min_heldout), len(prompts) // 2)
    return prompts[count:], prompts[:count]


def write_prompts(path: Path, prompts: list[Prompt]) -> None:
    with path.open("w") as f:
        for p in prompts:
            f.write(json.dumps({"id": prompt_id(p.text), "prompt": p.text, "source": p.source}) + "\n")


def read_prompts(path: Path) -> list[Prompt]:
    return [Prompt(r["prompt"], r.get("source", "")) for r in map(json.loads, path.read_text().splitlines())]


# ---- replies ---------------------------------------------------------------------------------

def repetition_cut(ids: list[int], n: int, max_repeats: int) -> int:
    """How many tokens to keep: all, or up to where some ``n``-gram starts its
    ``max_repeats + 1``-th occurrence. Greedy small models fall into loops; the first
    repeats stay (the drafter should learn to copy) but a loop cannot swamp the data."""
    if len(ids) < n:
        return len(ids)
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(ids), n)
    _, group = np.unique(windows, axis=0, return_inverse=True)
    group = group.reshape(-1)
    order = np.argsort(group, kind="stable")
    sorted_group = group[order]
    first_of_group = np.r_[0, np.flatnonzero(np.diff(sorted_group)) + 1]
    starts = np.repeat(first_of_group, np.diff(np.r_[first_of_group, len(order)]))
    occurrence = np.empty(len(order), dtype=np.int64)
    occurrence[order] = np.arange(len(order)) - starts  # 0 for the first time an n-gram appears
    too_many = np.flatnonzero(occurrence >= max_repeats)
    return int(too_many[0]) if len(too_many) else len(ids)


@dataclass
class ShardBuilder:
    """Accumulates kept sequences of one chunk and writes them as one torch file."""

    tokens: list[torch.Tensor] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    response_starts: list[int] = field(default_factory=list)
    prompt_ids: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))

    def add(self, prompt: Prompt, prompt_ids: list[int], reply: list[int], stopped: bool, settings: DataSettings):
        self.counts["generated_tokens"] += len(reply)
        keep = repetition_cut(reply, settings.ngram, settings.max_ngram_repeats)
        if keep < settings.min_response_tokens:
            self.counts["dropped"] += 1
            return
        self.counts["trimmed"] += keep < len(reply)
        self.counts["stopped"] += stopped and keep == len(reply)
        self.counts["reply_tokens"] += keep
        sequence = prompt_ids + reply[:keep]
        self.tokens.append(torch.tensor(sequence, dtype=torch.int32))
        self.lengths.append(len(sequence))
        self.response_starts.append(len(prompt_ids))
        self.prompt_ids.append(prompt_id(prompt.text))

    def save(self, path: Path, prompt_range: tuple[int, int], seconds: float) -> None:
        torch.save({
            "tokens": torch.cat(self.tokens) if self.tokens else torch.zeros(0, dtype=torch.int32),
            "lengths": torch.tensor(self.lengths, dtype=torch.int64),
            "response_starts": torch.tensor(self.response_starts, dtype=torch.int64),
            "prompt_ids": self.prompt_ids,
            "prompt_range": prompt_range,
            "counts": self.counts,
            "seconds": seconds,
        }, path)


def generate_responses(generator: Generator, chat: Target, prompts: list[Prompt], settings: DataSettings,
                       folder: Path, deadline: float = math.inf, log=print) -> None:
    """Greedy replies, one shard per chunk of prompts, continuing after the shards already on
    disk. The first chunk (a quarter size) measures the speed; later chunks are sized so they
    end before ``deadline`` (``time.monotonic()`` seconds): a chunk cannot be cut short."""
    sampling = Sampling(settings.max_new_tokens)
    start, index = answered_so_far(folder)
    done, busy_seconds = 0, 0.0
    while start < len(prompts):
        size = chunk_size(settings, done / busy_seconds if done else None, deadline - time.monotonic())
        if size == 0:
            log(f"replies: time budget reached; prompts {start}..{len(prompts)} left without replies")
            return
        chunk_began = time.monotonic()
        chunk = prompts[start:start + size]
        encoded = [chat.chat_ids(p.text) for p in chunk]
        shard = ShardBuilder()
        for prompt, ids, completion in zip(chunk, encoded, generator.complete(encoded, sampling)):
            shard.add(prompt, ids, completion.token_ids, completion.stopped, settings)
        seconds = time.monotonic() - chunk_began
        shard.save(folder / f"responses-{index:05d}.pt", (start, start + len(chunk)), seconds)
        generated = shard.counts["generated_tokens"]
        log(f"replies: chunk {index} (prompts {start}..{start + len(chunk)}): {generated} tokens generated in "
            f"{seconds:.1f} s ({generated / max(seconds, 1e-9):.0f} tok/s); kept {len(shard.lengths)} replies, "
            f"{shard.counts['reply_tokens']} tokens")
        start, index = start + len(chunk), index + 1
        done, busy_seconds = done + len(chunk), busy_seconds + seconds


def chunk_size(settings: DataSettings, prompts_per_second: float | None, seconds_left: float) -> int:
    """Prompts for the next chunk: a quarter chunk first (it measures the speed), then as many
    as 90% of the time left allows, at most ``chunk_prompts``; 0 when that is too few."""
    if seconds_left <= 0:
        return 0
    if prompts_per_second is None:
        return max(1, settings.chunk_prompts // 4)
    if math.isinf(seconds_left):
        return settings.chunk_prompts
    fitting = int(prompts_per_second * seconds_left * 0.9)
    return min(settings.chunk_prompts, fitting) if fitting >= MIN_CHUNK_PROMPTS else 0


def answered_so_far(folder: Path) -> tuple[int, int]:
    """(prompts answered, shards written) by earlier runs: shards cover prompts in order."""
    shards = sorted(folder.glob(SHARD_PATTERN))
    return (int(torch.load(shards[-1])["prompt_range"][1]), len(shards)) if shards else (0, 0)


# ---- loading -------------------------------------------------------------------------------------

@dataclass
class SequenceData:
    """Every kept sequence, flat: ``tokens[offsets[i] : offsets[i] + lengths[i]]``."""

    tokens: torch.Tensor  # int64 [total]
    offsets: torch.Tensor  # int64 [n]
    lengths: torch.Tensor  # int64 [n]
    response_starts: torch.Tensor  # int64 [n]: index of the first reply token

    def __len__(self) -> int:
        return len(self.lengths)

    @staticmethod
    def from_lists(sequences: list[list[int]], response_starts: list[int]) -> "SequenceData":
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        return SequenceData(
            tokens=torch.tensor([t for s in sequences for t in s], dtype=torch.int64),
            offsets=torch.cumsum(lengths, 0) - lengths,
            lengths=lengths,
            response_starts=torch.tensor(response_starts, dtype=torch.int64),
        )

    @staticmethod
    def load(folder: str | Path) -> "SequenceData":
        shards = [torch.load(p) for p in sorted(Path(folder).glob(SHARD_PATTERN))]
        if not shards:
            raise FileNotFoundError(f"no {SHARD_PATTERN} in {folder}: run the data stage first")
        lengths = torch.cat([s["lengths"] for s in shards])
        return SequenceData(
            tokens=torch.cat([s["tokens"] for s in shards]).to(torch.int64),
            offsets=torch.cumsum(lengths, 0) - lengths,
            lengths=lengths,
            response_starts=torch.cat([s["response_starts"] for s in shards]),
        )

    def to(self, device) -> "SequenceData":
        return SequenceData(*(t.to(device) for t in (self.tokens, self.offsets, self.lengths, self.response_starts)))


def data_stats(folder: Path, prompts: list[Prompt], heldout: list[Prompt], timings: dict[str, float]) -> dict:
    shards = [torch.load(p) for p in sorted(folder.glob(SHARD_PATTERN))]
    counts = {key: sum(s["counts"][key] for s in shards) for key in COUNTS}
    sequences = sum(len(s["lengths"]) for s in shards)
    reply_seconds = sum(s["seconds"] for s in shards)
    by_source: dict[str, int] = {}
    for p in prompts:
        by_source[p.source] = by_source.get(p.source, 0) + 1
    return {
        "train_prompts": len(prompts), "heldout_prompts": len(heldout), "prompts_by_source": by_source,
        "prompts_answered": sum(s["prompt_range"][1] - s["prompt_range"][0] for s in shards),
        "sequences": sequences, **counts,
        "tokens": int(sum(int(s["lengths"].sum()) for s in shards)),
        "mean_reply_tokens": counts["reply_tokens"] / max(sequences, 1),
        "reply_seconds": reply_seconds, "generated_tokens_per_s": counts["generated_tokens"] / max(reply_seconds, 1e-9),
        **{f"{stage}_seconds": seconds for stage, seconds in timings.items()},
    }


# ---- command line ----------------------------------------------------------------------------

def tokenizer_only_target(folder: str) -> Target:
    """Tokenizer and stop ids without weights: vLLM holds the model."""
    from transformers import AutoConfig, AutoTokenizer

    from engine.target import stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return Target(model=None, tokenizer=tokenizer, name=folder,
                  stop_ids=stop_token_ids(tokenizer, AutoConfig.from_pretrained(folder)))


def open_generator(args) -> tuple[Generator, Target]:
    if args.backend == "vllm":
        chat = tokenizer_only_target(args.model)
        vllm = VllmSettings(max_num_seqs=args.vllm_max_num_seqs, enforce_eager=args.vllm_eager)
        return VllmGenerator(args.model, chat.stop_ids, args.seed, vllm), chat
    target = load_target(args.model, *device_and_dtype(args.device, args.dtype))
    return TransformersGenerator(target, args.batch_size, args.seed), target


def run(generator: Generator, chat: Target, folder: Path, settings: DataSettings, log=print,
        began: float | None = None) -> dict:
    """Prompts (reused if written before), then replies (missing shards only), then stats.
    ``settings.max_minutes`` counts from ``began`` (default: now)."""
    folder.mkdir(parents=True, exist_ok=True)
    began = time.monotonic() if began is None else began
    deadline = began + settings.max_minutes * 60 if settings.max_minutes is not None else math.inf
    timings = {}
    train_path, heldout_path = folder / "prompts.jsonl", folder / "heldout.jsonl"
    if train_path.exists() and heldout_path.exists():
        prompts, heldout = read_prompts(train_path), read_prompts(heldout_path)
        log(f"prompts: reusing {len(prompts)} training + {len(heldout)} held-out prompts from {folder}")
    else:
        prompts_began = time.monotonic()
        prompts, heldout = split_heldout(build_prompts(generator, chat, settings), settings)
        write_prompts(train_path, prompts)
        write_prompts(heldout_path, heldout)
        timings["prompts"] = time.monotonic() - prompts_began
        log(f"prompts: {len(prompts)} training + {len(heldout)} held-out in {timings['prompts']:.1f} s")
    generate_responses(generator, chat, prompts, settings, folder, deadline, log)
    stats = data_stats(folder, prompts, heldout, timings)
    (folder / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")
    log("data: " + json.dumps(stats))
    return stats


def parse_args(argv=None):
    defaults = DataSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (vLLM needs one); transformers also takes a GGUF "
                                                      "or nothing for the bundled SmolLM2")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--backend", choices=["vllm", "transformers"], default="vllm")
    parser.add_argument("--device", default="auto", help="transformers backend only")
    parser.add_argument("--dtype", default=None, help="transformers backend only (default: bf16 on CUDA, else fp32)")
    parser.add_argument("--batch-size", type=int, default=32, help="transformers backend only")
    parser.add_argument("--vllm-max-num-seqs", type=int, default=VllmSettings.max_num_seqs)
    parser.add_argument("--vllm-eager", action="store_true", help="no CUDA graphs: starts in seconds, runs slower")
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=type(value) if value is not None else float, default=value)
    args = parser.parse_args(argv)
    settings = DataSettings(**{name: getattr(args, name) for name in asdict(defaults)})
    return args, settings


def main(argv=None) -> None:
    began = time.monotonic()  # the budget includes starting the engine
    args, settings = parse_args(argv)
    generator, chat = open_generator(args)
    try:
        run(generator, chat, args.out, settings, began=began)
    finally:
        generator.close()


if __name__ == "__main__":  # vLLM starts worker processes that re-import this module
    main()
