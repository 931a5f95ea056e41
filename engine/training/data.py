"""Self-distilled training data: prompts -> the target's own replies -> token files.

Prompts come from the target itself, which finishes user turns that start with a
persona and a request (sampled, so they vary), from requests about real text and
code (Python's standard library), from templates (``prompts``), and where asked for from
requests written for this project (``composed``) and a prompt set a package ships
(``packaged``). Near-duplicates of the evaluation prompts are removed by word n-gram
overlap (``overlap``). Replies
are encoded with the app's chat template (``Target.chat_ids``): most greedy, as the app
decodes by default, shares sampled at the temperatures users pick (``--reply-temperatures``).
After each chunk a second round adds follow-up turns to some conversations and hands some
replies back as text to rewrite or summarise.

Files written to the output folder (or to ``part-K/`` folders, one per worker):
  prompts.jsonl          training prompts  {"id", "prompt", "source"}
  heldout.jsonl          held-out prompts (never trained on), same fields, for the bench
  responses-NNNNN.pt     one shard per chunk of prompts: flat token ids + per-sequence
                         lengths, the offset where the trained reply begins and the temperature
                         each reply was sampled at
  data-stats.json        counts, the overlap report and timings; marks the stage as done

Workers (and later top-ups) write their prompts apart, so one prompt can be answered in several
folders: reading the data keeps the first folder's replies to it (``read_corpus``).

    python -m engine.training.data --model /tmp/smol-hf --out /tmp/dflash --backend vllm --workers 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from engine.models.target import Target, load_target, stop_token_ids
from engine.training.generation import (
    Completion,
    Generator,
    Sampling,
    TransformersGenerator,
    VllmGenerator,
    VllmSettings,
    device_and_dtype,
)
from engine.training.overlap import OverlapIndex, OverlapReport
from engine.training.packaged import chatterbot_requests
from engine.training.prompts import (
    FOLLOW_UPS,
    FORMATS,
    GENERAL_TOPICS,
    Prompt,
    arithmetic_prompts,
    code_prompts,
    composed_prompts,
    function_prompts,
    general_prompts,
    list_requests,
    listed_items,
    math_prompts,
    passage_prompts,
    polyglot_prompts,
    self_written_openers,
)
from engine.training.stdlib_text import harvest

REPO = Path(__file__).resolve().parent.parent.parent

STATS_FILE = "data-stats.json"
OVERLAP_FILE = "overlap.json"
SHARED_KV_CACHE_GIB = 16  # per engine when several share the GPU: ~700k tokens of SmolLM2-135M KV
MIN_CHUNK_PROMPTS = 64  # fewer than this left in the budget: stop
SHARD_PATTERN = "responses-*.pt"
PART_PATTERN = "part-*"
# per shard: replies that ended their turn (untrimmed), were cut at a loop, were too short; tokens;
# kept sequences that were sampled, second turns, and replies re-read as passages
COUNTS = ("stopped", "trimmed", "dropped", "generated_tokens", "reply_tokens", "sampled", "follow_ups", "rereads")


@dataclass
class DataSettings:
    num_prompts: int = 50_000
    # the mix, as fractions of num_prompts; general topic x task templates get the rest
    self_written_fraction: float = 0.36
    asked_fraction: float = 0.0  # items of question lists the target writes about a seed word
    composed_fraction: float = 0.0  # requests from ``composed_file``, written apart from these templates
    composed_file: str = str(REPO / "assets" / "training" / "composed-prompts.jsonl")
    chatterbot_fraction: float = 0.0  # first turns of the chatterbot-corpus package's conversations (packaged.py)
    code_fraction: float = 0.07
    polyglot_fraction: float = 0.08
    math_fraction: float = 0.07
    arithmetic_fraction: float = 0.03
    passage_fraction: float = 0.10
    function_fraction: float = 0.10
    heldout_fraction: float = 0.01
    min_heldout: int = 50
    max_new_tokens: int = 256
    max_prompt_tokens: int = 1536  # longer requests are skipped (vLLM's context is 2048)
    sampled_fraction: float = 0.25  # replies sampled at reply_temperature; the rest are greedy
    reply_temperature: float = 0.7
    # the whole mix instead of the two above: "temperature:share,...", e.g. "0:0.6,0.7:0.2,1.0:0.2"
    reply_temperatures: str = ""
    follow_up_fraction: float = 0.10  # finished conversations that get a second user turn
    reread_fraction: float = 0.05  # replies handed back as a passage to rewrite or summarise
    prompt_max_tokens: int = 64
    list_max_tokens: int = 192  # a list of up to ten questions
    list_temperature: float = 0.8  # at 1.0 a list strays from its seed within a few items
    items_per_list: int = 4  # about what a list keeps after filtering: count / this lists are asked for
    prompt_temperature: float = 1.0
    prompt_top_p: float = 0.95
    min_prompt_chars: int = 12
    chunk_prompts: int = 8192  # prompts per vLLM call (and shard); later chunks shrink to fit the deadline
    max_minutes: float | None = None  # the whole stage, engine start included: no new chunk that would overrun it
    ngram: int = 8
    max_ngram_repeats: int = 4
    min_response_tokens: int = 8
    eval_prompts: str = str(REPO / "assets" / "prompts" / "*.jsonl")  # kept out of training (overlap)
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
    """User turns the target writes itself, sampled from openers; now and then a format request is added."""
    if count == 0:
        return []
    openers = self_written_openers(count, rng)
    sampling = Sampling(settings.prompt_max_tokens, settings.prompt_temperature, settings.prompt_top_p)
    completions = generator.complete([user_turn_ids(chat, o) for o in openers], sampling)
    prompts = []
    for opener, completion in zip(openers, completions):
        text = (opener + chat.decode(completion.token_ids)).strip()
        if len(text) >= settings.min_prompt_chars:  # a turn cut at prompt_max_tokens gets no format request
            prompts.append(Prompt(text + (rng.choice(FORMATS) if completion.stopped else ""), "self"))
    return prompts


def vocabulary_seeds(tokenizer, min_letters: int = 5) -> list[str]:
    """Whole lowercase words of the target's own vocabulary: tokens that decode to a space and letters."""
    words = {text[1:] for text in map(tokenizer.decode, ([i] for i in range(len(tokenizer))))
             if text[:1] == " " and len(text) > min_letters and text[1:].isascii() and text[1:].isalpha()
             and text[1:].islower()}
    return sorted(words)


def asked_prompts(generator: Generator, chat: Target, count: int, settings: DataSettings,
                  rng: random.Random) -> list[Prompt]:
    """User turns the target lists itself: questions and requests about a seed (a general topic or a
    word of its vocabulary), sampled; now and then a format request is added."""
    if count == 0:
        return []
    requests = list_requests(GENERAL_TOPICS + vocabulary_seeds(chat.tokenizer),
                             math.ceil(count / settings.items_per_list), rng)
    sampling = Sampling(settings.list_max_tokens, settings.list_temperature, settings.prompt_top_p)
    completions = generator.complete([chat.chat_ids(request) for request in requests], sampling)
    prompts = []
    for completion in completions:
        items = listed_items(chat.decode(completion.token_ids))
        for item in items if completion.stopped else items[:-1]:  # a list cut short ends in a cut item
            prompts.append(Prompt(item + (rng.choice(FORMATS) if item.endswith((".", "?", "!")) else ""), "asked"))
    return prompts


def read_composed(path: str) -> list[str]:
    """The requests of a composed-prompts file (JSON lines with a "prompt")."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise SystemExit(f"--composed-fraction needs --composed-file: {path} does not exist") from None
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    if not texts:
        raise SystemExit(f"{path} holds no prompts")
    return texts


def build_prompts(generator: Generator, chat: Target, settings: DataSettings) -> list[Prompt]:
    """All sources, deduplicated, in a seeded random order."""
    rng = random.Random(settings.seed)
    n = settings.num_prompts
    fractions = {"self": settings.self_written_fraction, "asked": settings.asked_fraction,
                 "composed": settings.composed_fraction, "chatterbot": settings.chatterbot_fraction,
                 "code": settings.code_fraction, "polyglot": settings.polyglot_fraction, "math": settings.math_fraction,
                 "arithmetic": settings.arithmetic_fraction, "passage": settings.passage_fraction,
                 "function": settings.function_fraction}
    counts = {name: round(n * fraction) for name, fraction in fractions.items()}
    counts["general"] = max(0, n - sum(counts.values()))
    stdlib = harvest()
    # a quarter more of the target's own user turns than needed: some are too short or repeat
    written = self_written_prompts(generator, chat, math.ceil(counts["self"] * 1.25), settings, rng)
    asked = asked_prompts(generator, chat, math.ceil(counts["asked"] * 1.25), settings, rng)
    composed = (composed_prompts(read_composed(settings.composed_file), counts["composed"], rng)
                if counts["composed"] else [])
    packaged = (composed_prompts(chatterbot_requests(), counts["chatterbot"], rng, source="chatterbot")
                if counts["chatterbot"] else [])
    prompts = deduplicated(deduplicated(written)[: counts["self"]] + deduplicated(asked)[: counts["asked"]] + composed
                           + packaged
                           + general_prompts(counts["general"], rng)
                           + code_prompts(counts["code"], rng) + polyglot_prompts(counts["polyglot"], rng)
                           + math_prompts(counts["math"], rng) + arithmetic_prompts(counts["arithmetic"], rng)
                           + passage_prompts(list(stdlib.passages), counts["passage"], rng)
                           + function_prompts(list(stdlib.functions), counts["function"], rng))
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

ReplyMix = tuple[tuple[float, float], ...]  # (temperature, share) pairs; 0 is greedy; the shares add up to 1


def reply_mix(settings: DataSettings) -> ReplyMix:
    """The replies' temperatures and shares: ``reply_temperatures``, or else ``sampled_fraction`` at
    ``reply_temperature`` and greedy for the rest, in that order: a draw under ``sampled_fraction`` samples,
    so a seed samples the prompts it sampled when these two settings were the only ones."""
    if settings.reply_temperatures:
        return parse_reply_temperatures(settings.reply_temperatures)
    return checked_mix([(settings.reply_temperature, settings.sampled_fraction),
                        (0.0, 1 - settings.sampled_fraction)], "--sampled-fraction and --reply-temperature")


def parse_reply_temperatures(text: str) -> ReplyMix:
    """``"0:0.6,0.7:0.2,1.0:0.2"`` -> ((0.0, 0.6), (0.7, 0.2), (1.0, 0.2)); a ValueError says what is wrong."""
    pairs = []
    for piece in text.split(","):
        try:
            temperature, share = (float(number) for number in piece.split(":"))
        except ValueError:
            raise ValueError(f"--reply-temperatures {text!r}: {piece.strip()!r} is not temperature:share, "
                             f"e.g. \"0:0.6,0.7:0.2,1.0:0.2\"") from None
        pairs.append((temperature, share))
    return checked_mix(pairs, f"--reply-temperatures {text!r}")


def checked_mix(pairs: list[tuple[float, float]], name: str) -> ReplyMix:
    """The pairs without zero shares, once each is a finite temperature >= 0 named once and the shares
    (each >= 0) add up to 1."""
    temperatures = [temperature for temperature, _ in pairs]
    for temperature, share in pairs:
        if not (math.isfinite(temperature) and math.isfinite(share)):
            raise ValueError(f"{name}: {temperature}:{share} is not a number")
        if temperature < 0:
            raise ValueError(f"{name}: temperature {temperature} is negative (0 is greedy)")
        if share < 0:
            raise ValueError(f"{name}: share {share} of temperature {temperature} is negative")
        if temperatures.count(temperature) > 1:
            raise ValueError(f"{name}: temperature {temperature} is named twice")
    total = sum(share for _, share in pairs)
    if abs(total - 1) > 1e-6:
        raise ValueError(f"{name}: the shares add up to {total:g}, not 1")
    return tuple((temperature, share) for temperature, share in pairs if share > 0)


def pick_temperature(mix: ReplyMix, rng: random.Random) -> float:
    """One draw: the temperature whose share it falls in, taking the shares in the mix's order."""
    roll, upto = rng.random(), 0.0
    for temperature, share in mix:
        upto += share
        if roll < upto:
            return temperature
    return mix[-1][0]  # shares that add up to a hair under 1


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
class Request:
    """One reply to generate: its prompt (text and family), the token ids it continues, how to sample."""

    prompt: Prompt
    ids: list[int]
    temperature: float = 0.0  # 0: greedy
    kind: str = "single"  # "single" | "follow_up" (a second user turn) | "reread" (a reply handed back)


@dataclass
class ShardBuilder:
    """Accumulates kept sequences of one chunk and writes them as one torch file."""

    tokens: list[torch.Tensor] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    response_starts: list[int] = field(default_factory=list)
    prompt_ids: list[str] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))

    def add(self, request: Request, completion: Completion, settings: DataSettings):
        reply = completion.token_ids
        self.counts["generated_tokens"] += len(reply)
        keep = repetition_cut(reply, settings.ngram, settings.max_ngram_repeats)
        if keep < settings.min_response_tokens:
            self.counts["dropped"] += 1
            return
        self.counts["trimmed"] += keep < len(reply)
        self.counts["stopped"] += completion.stopped and keep == len(reply)
        self.counts["reply_tokens"] += keep
        self.counts["sampled"] += request.temperature > 0
        self.counts["follow_ups"] += request.kind == "follow_up"
        self.counts["rereads"] += request.kind == "reread"
        sequence = request.ids + reply[:keep]
        self.tokens.append(torch.tensor(sequence, dtype=torch.int32))
        self.lengths.append(len(sequence))
        self.response_starts.append(len(request.ids))
        self.prompt_ids.append(prompt_id(request.prompt.text))
        self.temperatures.append(request.temperature)

    def save(self, path: Path, prompt_range: tuple[int, int], seconds: float) -> None:
        torch.save({
            "tokens": torch.cat(self.tokens) if self.tokens else torch.zeros(0, dtype=torch.int32),
            "lengths": torch.tensor(self.lengths, dtype=torch.int64),
            "response_starts": torch.tensor(self.response_starts, dtype=torch.int64),
            "prompt_ids": self.prompt_ids,
            "temperatures": torch.tensor(self.temperatures, dtype=torch.float32),
            "prompt_range": prompt_range,
            "counts": self.counts,
            "seconds": seconds,
        }, path)


def answer(generator: Generator, requests: list[Request], settings: DataSettings) -> list[Completion]:
    """Every request's reply: one batch per temperature, greedy first."""
    completions: list[Completion | None] = [None] * len(requests)
    for temperature in sorted({request.temperature for request in requests}):
        chosen = [i for i, request in enumerate(requests) if request.temperature == temperature]
        sampling = Sampling(settings.max_new_tokens, temperature)
        for i, completion in zip(chosen, generator.complete([requests[i].ids for i in chosen], sampling)):
            completions[i] = completion
    return completions


def next_turn_ids(chat: Target, text: str, stop_id: int) -> list[int]:
    """What follows an assistant reply that ended with ``stop_id``: the template's turn break, a
    user turn saying ``text`` and the start of the next reply (so ids can be concatenated)."""
    marker = "\x00REPLY\x00"
    rendered = chat.tokenizer.apply_chat_template(
        [{"role": "user", "content": "."}, {"role": "assistant", "content": marker}, {"role": "user", "content": text}],
        tokenize=False, add_generation_prompt=True)
    after = rendered[rendered.index(marker) + len(marker):].removeprefix(chat.tokenizer.convert_ids_to_tokens(stop_id))
    return chat.tokenizer(after, add_special_tokens=False)["input_ids"]


def second_round(chat: Target, answered: list[tuple[Request, Completion]], settings: DataSettings,
                 rng: random.Random, keep_out: OverlapIndex | None) -> list[Request]:
    """Follow-up turns for some finished conversations (the first reply stays as context; only
    the second is trained on), and some replies handed back as a passage to rewrite."""
    requests = []
    for request, completion in answered:
        roll = rng.random()
        if request.kind != "single" or not completion.stopped:
            continue
        if roll < settings.follow_up_fraction and chat.tokenizer.chat_template is not None:
            text = rng.choice(FOLLOW_UPS)
            ids = request.ids + completion.token_ids + next_turn_ids(chat, text, completion.token_ids[-1])
            requests.append(Request(Prompt(f"{request.prompt.text}\n\n{text}", "follow_up"), ids, kind="follow_up"))
        elif roll < settings.follow_up_fraction + settings.reread_fraction:
            passage = chat.decode(completion.token_ids).strip()
            if 20 <= len(passage.split()) <= 200:
                prompt = passage_prompts([passage], 1, rng, source="reread")[0]
                if keep_out is None or keep_out.match(prompt.text) is None:
                    requests.append(Request(prompt, chat.chat_ids(prompt.text), kind="reread"))
    return requests


def generate_responses(generator: Generator, chat: Target, prompts: list[Prompt], settings: DataSettings,
                       folder: Path, deadline: float = math.inf, log=print,
                       keep_out: OverlapIndex | None = None) -> None:
    """Replies, one shard per chunk of prompts (its second round included), continuing after the
    shards already on disk. The first chunk (a quarter size) measures the speed; later chunks are
    sized so they end before ``deadline`` (``time.monotonic()`` seconds): a chunk cannot be cut short."""
    start, index = answered_so_far(folder)
    done, busy_seconds = 0, 0.0
    mix = reply_mix(settings)
    while start < len(prompts):
        size = min(chunk_size(settings, done / busy_seconds if done else None, deadline - time.monotonic()),
                   len(prompts) - start)
        if size == 0:
            log(f"replies: time budget reached; prompts {start}..{len(prompts)} left without replies")
            return
        chunk_began = time.monotonic()
        rng = random.Random(f"{settings.seed}-{index}")  # a chunk's choices do not depend on earlier runs
        requests = [Request(p, chat.chat_ids(p.text), temperature=pick_temperature(mix, rng))
                    for p in prompts[start:start + size]]
        requests = [r for r in requests if len(r.ids) <= settings.max_prompt_tokens]
        answered = list(zip(requests, answer(generator, requests, settings)))
        again = [r for r in second_round(chat, answered, settings, rng, keep_out)
                 if len(r.ids) <= settings.max_prompt_tokens]
        answered += zip(again, answer(generator, again, settings))
        shard = ShardBuilder()
        for request, completion in answered:
            shard.add(request, completion, settings)
        seconds = time.monotonic() - chunk_began
        shard.save(folder / f"responses-{index:05d}.pt", (start, start + size), seconds)
        counts = shard.counts
        log(f"replies: chunk {index} (prompts {start}..{start + size}, +{len(again)} second-round): "
            f"{counts['generated_tokens']} tokens generated in {seconds:.1f} s "
            f"({counts['generated_tokens'] / max(seconds, 1e-9):.0f} tok/s); kept {len(shard.lengths)} replies, "
            f"{counts['reply_tokens']} tokens ({counts['sampled']} sampled, {counts['follow_ups']} follow-ups, "
            f"{counts['rereads']} re-read)")
        start, index = start + size, index + 1
        done, busy_seconds = done + size, busy_seconds + seconds


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
    def from_lists(sequences: list[list[int]], response_starts: list[int]) -> SequenceData:
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        return SequenceData(
            tokens=torch.tensor([t for s in sequences for t in s], dtype=torch.int64),
            offsets=torch.cumsum(lengths, 0) - lengths,
            lengths=lengths,
            response_starts=torch.tensor(response_starts, dtype=torch.int64),
        )

    @staticmethod
    def load(folder: str | Path) -> SequenceData:
        """Every sequence the shards under ``folder`` hold, less those ``read_corpus`` drops."""
        corpus = read_corpus(Path(folder))
        if not corpus.shards:
            raise FileNotFoundError(f"no {SHARD_PATTERN} in {folder}: run the data stage first")
        pairs = list(zip(corpus.shards, corpus.keep))
        lengths = torch.cat([s["lengths"][keep] for s, keep in pairs])
        return SequenceData(
            tokens=torch.cat([s["tokens"][torch.repeat_interleave(keep, s["lengths"])] for s, keep in pairs])
            .to(torch.int64),
            offsets=torch.cumsum(lengths, 0) - lengths,
            lengths=lengths,
            response_starts=torch.cat([s["response_starts"][keep] for s, keep in pairs]),
        )

    def to(self, device) -> SequenceData:
        return SequenceData(*(t.to(device) for t in (self.tokens, self.offsets, self.lengths, self.response_starts)))


def shard_paths(folder: Path) -> list[Path]:
    """Every shard under the folder: its own, its workers' (``part-K/``), later top-ups' (``more-K/part-J/``)."""
    return sorted(folder.rglob(SHARD_PATTERN))


@dataclass
class Corpus:
    """The shards under a data folder and which of their sequences training reads. Each folder of shards
    (a worker's ``part-K/``, a top-up's) wrote its prompts apart from the others, so a prompt can be answered
    in several (kept in the first only) or held out in one and answered in another (dropped: held-out prompts
    are never trained on). Within one folder everything is kept: its prompts were deduplicated when written."""

    shards: list[dict]
    keep: list[torch.Tensor]  # per shard, bool [its sequences]
    repeats: int  # sequences dropped: an earlier folder answered their prompt
    held_out: int  # sequences dropped: another folder holds their prompt out


def read_corpus(folder: Path) -> Corpus:
    """Every shard under ``folder``, in ``shard_paths`` order; a prompt answered in several folders is kept
    in the first of them in that order, so the same files always give the same sequences."""
    paths = shard_paths(folder)
    shards = [torch.load(path) for path in paths]
    folders = list(dict.fromkeys(path.parent for path in paths))
    held_out = {key for f in folders for key in text_keys(f / "heldout.jsonl").values()}
    answered: set[str] = set()
    keep: list[list[bool]] = [[] for _ in paths]
    repeats = held = 0
    for f in folders:
        keys, here = text_keys(f / "prompts.jsonl"), set()
        for index in (i for i, path in enumerate(paths) if path.parent == f):
            for key in sequence_keys(shards[index], keys):
                keep[index].append(key not in held_out and key not in answered)
                held += key in held_out
                repeats += key in answered and key not in held_out
                if key is not None:
                    here.add(key)
        answered |= here
    return Corpus(shards, [torch.tensor(flags, dtype=torch.bool) for flags in keep], repeats, held)


def text_keys(path: Path) -> dict[str, str]:
    """For the prompts a folder wrote: prompt id -> the id of its text with case and spacing ignored."""
    if not path.exists():
        return {}
    return {prompt_id(p.text): prompt_id(normalized(p.text)) for p in read_prompts(path)}


def sequence_keys(shard: dict, keys: dict[str, str]) -> list[str | None]:
    """What each sequence of a shard is a reply to: its prompt's text key where the folder's prompts list it,
    else (a follow-up or a re-read, written in the second round) the id of its exact text; None for a shard
    put together without prompt ids."""
    ids = shard["prompt_ids"]
    if len(ids) != len(shard["lengths"]):
        return [None] * len(shard["lengths"])
    return [keys.get(i, i) for i in ids]


def reply_temperature_counts(corpus: Corpus) -> dict[str, int]:
    """Kept sequences by the temperature their reply was sampled at (0: greedy), where the shard records it."""
    counts = Counter(f"{temperature:g}" for shard, keep in zip(corpus.shards, corpus.keep)
                     if len(temperatures := shard.get("temperatures", torch.zeros(0))) == len(keep)
                     for temperature in temperatures[keep].tolist())
    return dict(sorted(counts.items(), key=lambda item: float(item[0])))


def corpus_counts(corpus: Corpus) -> dict:
    """What training reads (sequences, tokens, replies by temperature) and what it leaves out."""
    lengths = [s["lengths"][keep] for s, keep in zip(corpus.shards, corpus.keep)]
    starts = [s["response_starts"][keep] for s, keep in zip(corpus.shards, corpus.keep)]
    sequences = sum(len(n) for n in lengths)
    return {
        "sequences": sequences, "cross_part_repeats": corpus.repeats, "held_out_elsewhere": corpus.held_out,
        "replies_by_temperature": reply_temperature_counts(corpus),
        "tokens": sum(int(n.sum()) for n in lengths),
        "mean_reply_tokens": sum(int((n - start).sum()) for n, start in zip(lengths, starts)) / max(sequences, 1),
    }


def data_stats(folder: Path, prompts: list[Prompt], heldout: list[Prompt], timings: dict[str, float],
               overlap: OverlapReport) -> dict:
    """The shards' counters describe what was generated; ``corpus_counts`` what training reads."""
    corpus = read_corpus(folder)
    shards = corpus.shards
    counts = {key: sum(s["counts"][key] for s in shards) for key in COUNTS}
    reply_seconds = sum(s["seconds"] for s in shards)
    by_source: dict[str, int] = {}
    for p in prompts:
        by_source[p.source] = by_source.get(p.source, 0) + 1
    return {
        "train_prompts": len(prompts), "heldout_prompts": len(heldout), "prompts_by_source": by_source,
        "prompts_answered": sum(s["prompt_range"][1] - s["prompt_range"][0] for s in shards),
        **counts, **corpus_counts(corpus),
        "reply_seconds": reply_seconds, "generated_tokens_per_s": counts["generated_tokens"] / max(reply_seconds, 1e-9),
        "overlap": asdict(overlap),
        **{f"{stage}_seconds": seconds for stage, seconds in timings.items()},
    }


# ---- command line ----------------------------------------------------------------------------

def tokenizer_only_target(folder: str) -> Target:
    """Tokenizer and stop ids without weights: vLLM holds the model."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return Target(model=None, tokenizer=tokenizer, name=folder,
                  stop_ids=stop_token_ids(tokenizer, AutoConfig.from_pretrained(folder)))


def run(generator: Generator, chat: Target, folder: Path, settings: DataSettings, log=print,
        began: float | None = None) -> dict:
    """Prompts (reused if written before), then replies (missing shards only), then stats.
    ``settings.max_minutes`` counts from ``began`` (default: now)."""
    folder.mkdir(parents=True, exist_ok=True)
    began = time.monotonic() if began is None else began
    deadline = began + settings.max_minutes * 60 if settings.max_minutes is not None else math.inf
    timings = {}
    keep_out = OverlapIndex.from_files(settings.eval_prompts)
    train_path, heldout_path = folder / "prompts.jsonl", folder / "heldout.jsonl"
    if train_path.exists() and heldout_path.exists():
        prompts, heldout = read_prompts(train_path), read_prompts(heldout_path)
        overlap = OverlapReport(**json.loads((folder / OVERLAP_FILE).read_text()))
        log(f"prompts: reusing {len(prompts)} training + {len(heldout)} held-out prompts from {folder}")
    else:
        prompts_began = time.monotonic()
        prompts, overlap = keep_out.filter(build_prompts(generator, chat, settings))
        prompts, heldout = split_heldout(prompts, settings)
        write_prompts(train_path, prompts)
        write_prompts(heldout_path, heldout)
        (folder / OVERLAP_FILE).write_text(json.dumps(asdict(overlap), indent=1) + "\n")
        timings["prompts"] = time.monotonic() - prompts_began
        log(f"prompts: {len(prompts)} training + {len(heldout)} held-out in {timings['prompts']:.1f} s")
        for line in overlap.lines():
            log(line)
    generate_responses(generator, chat, prompts, settings, folder, deadline, log, keep_out)
    stats = data_stats(folder, prompts, heldout, timings, overlap)
    (folder / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")
    log("data: " + json.dumps(stats))
    return stats


def run_workers(argv: list[str], out: Path, workers: int, log=print) -> dict:
    """The data stage as ``workers`` processes sharing the GPU, each with its own prompts (another
    seed) in ``out/part-K``: a small target leaves vLLM bound by its host-side scheduling, so
    several engines side by side generate several times faster than one. Then merged stats (a prompt
    that several parts answered counts once: ``read_corpus``) and held-out prompts."""
    children = []
    for part in range(workers):
        env = os.environ | {"VLLM_CACHE_ROOT": os.path.join(os.environ.get("VLLM_CACHE_ROOT", "/tmp/vcache"),
                                                            f"part-{part}")}
        command = [sys.executable, "-m", "engine.training.data", *argv, "--part", str(part)]
        children.append(subprocess.Popen(command, env=env))
    failed = [part for part, child in enumerate(children) if child.wait() != 0]
    parts = sorted(p for p in out.glob(PART_PATTERN) if (p / STATS_FILE).exists())
    if not parts:
        raise SystemExit(f"data: every worker failed ({failed})")
    if failed:
        log(f"data: workers {failed} failed; keeping the other {len(parts)}")
    prompts = [p for part in parts for p in read_prompts(part / "prompts.jsonl")]
    heldout = deduplicated([p for part in parts for p in read_prompts(part / "heldout.jsonl")])
    write_prompts(out / "heldout.jsonl", heldout)
    overlap = OverlapReport()
    for part in parts:
        overlap = overlap.merge(OverlapReport(**json.loads((part / OVERLAP_FILE).read_text())))
    timings = {"prompts": max(json.loads((part / STATS_FILE).read_text()).get("prompts_seconds", 0) for part in parts)}
    stats = data_stats(out, prompts, heldout, timings, overlap) | {"workers": len(parts)}
    (out / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")
    for line in overlap.lines():
        log(line)
    log("data: " + json.dumps(stats))
    return stats


def parse_args(argv=None):
    defaults = DataSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (vLLM needs one); transformers also takes a GGUF "
                                                      "or nothing for the bundled SmolLM2")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--backend", choices=["vllm", "transformers"], default="vllm")
    parser.add_argument("--workers", type=int, default=1, help="processes generating side by side (vLLM)")
    parser.add_argument("--part", type=int, default=None, help=argparse.SUPPRESS)  # set by run_workers
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
    try:
        reply_mix(settings)  # refused here, before an engine starts
    except ValueError as error:
        parser.error(str(error))
    return args, settings


def open_generator(args) -> tuple[Generator, Target]:
    if args.backend == "vllm":
        chat = tokenizer_only_target(args.model)
        shared = args.workers > 1  # engines side by side: a fixed share each
        vllm = VllmSettings(max_num_seqs=args.vllm_max_num_seqs, enforce_eager=args.vllm_eager,
                            gpu_memory_utilization=(0.8 / args.workers if shared
                                                    else VllmSettings.gpu_memory_utilization),
                            kv_cache_gib=SHARED_KV_CACHE_GIB if shared else None)
        return VllmGenerator(args.model, chat.stop_ids, args.seed, vllm), chat
    target = load_target(args.model, *device_and_dtype(args.device, args.dtype))
    return TransformersGenerator(target, args.batch_size, args.seed), target


def main(argv=None) -> None:
    began = time.monotonic()  # the budget includes starting the engine
    argv = sys.argv[1:] if argv is None else argv
    args, settings = parse_args(argv)
    if args.workers > 1 and args.part is None:
        run_workers(argv, args.out, args.workers)
        return
    if args.part is not None:
        args.out = args.out / f"part-{args.part}"
        settings = replace(settings, seed=settings.seed * 1000 + args.part)
    generator, chat = open_generator(args)
    try:
        run(generator, chat, args.out, settings, began=began)
    finally:
        generator.close()


if __name__ == "__main__":  # vLLM starts worker processes that re-import this module
    main()
