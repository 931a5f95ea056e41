"""The training corpus: replies at a mix of temperatures, one reply per prompt across generation workers,
and prompts from a package's prompt set."""

from __future__ import annotations

import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine.models.target import Target
from engine.training import data as data_module, packaged
from engine.training.data import (
    DataSettings,
    Request,
    SequenceData,
    ShardBuilder,
    parse_reply_temperatures,
    pick_temperature,
    reply_mix,
)
from engine.training.generation import as_completion
from engine.training.overlap import OverlapReport
from engine.training.prompts import Prompt
from engine.training.stdlib_text import Harvest

STOP = 1


class CharTokenizer:
    """A character's id is its code point; no chat template: prompts are their own text."""

    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != STOP)


CHAT = Target(model=None, tokenizer=CharTokenizer(), name="chars", stop_ids=[STOP])


class RecordingGenerator:
    """Replies with the prompt's last five tokens, then ends its turn; records each call's temperature."""

    def __init__(self):
        self.calls: list[tuple[float, int]] = []

    def complete(self, prompts, sampling):
        self.calls.append((sampling.temperature, len(prompts)))
        return [as_completion(p[-5:] + [STOP], [STOP]) for p in prompts]

    def close(self):
        pass


# ---- the reply mix -------------------------------------------------------------------------------

def test_a_reply_mix_is_read_as_temperature_share_pairs():
    assert parse_reply_temperatures("0:0.6,0.7:0.2,1.0:0.2") == ((0.0, 0.6), (0.7, 0.2), (1.0, 0.2))
    assert parse_reply_temperatures(" 0 : 0.5 , 1.2:0.5 ") == ((0.0, 0.5), (1.2, 0.5))
    assert parse_reply_temperatures("0:1,0.7:0") == ((0.0, 1.0),), "a zero share is no temperature"


@pytest.mark.parametrize("text, message", [
    ("0:0.6,0.7:0.3", "add up to 0.9, not 1"),
    ("0:0.5,0.7:0.6", "add up to 1.1, not 1"),
    ("-0.5:0.5,0.7:0.5", "temperature -0.5 is negative"),
    ("0:1.2,0.7:-0.2", "share -0.2 of temperature 0.7 is negative"),
    ("0.7:0.5,0.7:0.5", "temperature 0.7 is named twice"),
    ("0.7", "'0.7' is not temperature:share"),
    ("0:0.5;0.7:0.5", "is not temperature:share"),
    ("0:0.5:1", "'0:0.5:1' is not temperature:share"),
    ("greedy:1", "'greedy:1' is not temperature:share"),
    ("0:1,", "'' is not temperature:share"),
    ("nan:1", "is not a number"),
])
def test_a_bad_reply_mix_is_refused_with_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_reply_temperatures(text)


def test_the_data_command_refuses_a_bad_mix_before_starting(capsys):
    with pytest.raises(SystemExit):
        data_module.parse_args(["--out", "/tmp/unused", "--reply-temperatures", "0:0.5,1:0.4"])
    assert "--reply-temperatures '0:0.5,1:0.4': the shares add up to 0.9, not 1" in capsys.readouterr().err
    _, settings = data_module.parse_args(["--out", "/tmp/unused", "--reply-temperatures", "0:0.5,1:0.5"])
    assert reply_mix(settings) == ((0.0, 0.5), (1.0, 0.5))


def test_the_default_mix_is_a_quarter_at_0_7_drawn_as_before_it_was_a_setting():
    assert reply_mix(DataSettings()) == ((0.7, 0.25), (0.0, 0.75))
    assert reply_mix(DataSettings(sampled_fraction=0.1, reply_temperature=0.9)) == ((0.9, 0.1), (0.0, 0.9))
    picks, before = random.Random("3-0"), random.Random("3-0")
    chosen = [pick_temperature(reply_mix(DataSettings()), picks) for _ in range(2000)]
    assert chosen == [0.7 if before.random() < 0.25 else 0.0 for _ in range(2000)], "the same prompts sampled"
    with pytest.raises(ValueError, match="--sampled-fraction and --reply-temperature: share -0.5"):
        reply_mix(DataSettings(sampled_fraction=1.5))


def test_temperatures_follow_the_shares_and_the_seed():
    mix = parse_reply_temperatures("0:0.6,0.7:0.2,1.0:0.2")

    def draws(seed):
        rng = random.Random(seed)
        return [pick_temperature(mix, rng) for _ in range(20_000)]

    counts = Counter(draws("0-0"))
    assert set(counts) == {0.0, 0.7, 1.0}
    for temperature, share in mix:
        assert abs(counts[temperature] / 20_000 - share) < 0.015
    assert draws("0-0") == draws("0-0") and draws("0-0") != draws("1-0")


def test_replies_are_generated_recorded_and_counted_at_each_temperature(tmp_path):
    prompts = [Prompt(f"question number {i}", "general") for i in range(300)]
    settings = DataSettings(reply_temperatures="0:0.6,0.7:0.2,1.0:0.2", follow_up_fraction=0, reread_fraction=0,
                            min_response_tokens=2)
    generator = RecordingGenerator()
    data_module.generate_responses(generator, CHAT, prompts, settings, tmp_path, log=lambda line: None)
    shards = [torch.load(path) for path in sorted(tmp_path.glob("responses-*.pt"))]
    recorded = Counter(t for shard in shards for t in shard["temperatures"].tolist())
    called = Counter()
    for temperature, count in generator.calls:
        called[round(temperature, 6)] += count
    assert {round(t, 6): n for t, n in recorded.items()} == called and sum(called.values()) == 300
    first_chunk = [t for t, _ in generator.calls[:3]]
    assert first_chunk == sorted(first_chunk) and first_chunk[0] == 0, "one batch per temperature, greedy first"
    assert sum(shard["counts"]["sampled"] for shard in shards) == 300 - called[0.0]
    stats = data_module.data_stats(tmp_path, prompts, [], {}, OverlapReport())
    assert stats["replies_by_temperature"] == {"0": called[0.0], "0.7": called[0.7], "1": called[1.0]}
    assert 130 <= called[0.0] <= 230 and stats["sequences"] == 300


# ---- one reply per prompt across workers ---------------------------------------------------------

def write_part(folder: Path, prompts: list[str], heldout: list[str], answered: list[Prompt]) -> None:
    """A worker's folder: its prompts, its held-out prompts and one shard of replies to ``answered``."""
    folder.mkdir(parents=True)
    data_module.write_prompts(folder / "prompts.jsonl", [Prompt(text, "general") for text in prompts])
    data_module.write_prompts(folder / "heldout.jsonl", [Prompt(text, "general") for text in heldout])
    shard = ShardBuilder()
    for prompt in answered:
        ids = CHAT.chat_ids(prompt.text)
        shard.add(Request(prompt, ids), as_completion(ids[:4] + [STOP], [STOP]), DataSettings(min_response_tokens=2))
    shard.save(folder / "responses-00000.pt", (0, len(prompts)), 1.0)
    (folder / data_module.STATS_FILE).write_text("{}")
    (folder / data_module.OVERLAP_FILE).write_text("{}")


def two_parts(out: Path) -> None:
    """part-0 and part-1 both answer "Tell me about bees." (in other case and spacing in part-1) and the same follow-up;
    part-1 answers a prompt that part-0 holds out; both hold out a lake."""
    bees, follow_up = Prompt("Tell me about bees.", "general"), Prompt("Tell me about bees.\n\nWhy?", "follow_up")
    write_part(out / "part-0", ["Tell me about bees.", "What is two plus two?"], ["Name a river.", "Name a lake."],
               [bees, Prompt("What is two plus two?", "math"), follow_up])
    write_part(out / "part-1", ["tell me  about BEES.", "Write a haiku.", "Name a river."],
               ["name a lake.", "Name a mountain."],
               [Prompt("tell me  about BEES.", "general"), Prompt("Write a haiku.", "general"),
                Prompt("Name a river.", "general"), follow_up, Prompt("Tell me about bees.\n\nHow?", "follow_up")])


def sequences_of(data: SequenceData) -> list[str]:
    return [CHAT.decode(data.tokens[o: o + n].tolist()) for o, n in zip(data.offsets, data.lengths)]


def test_training_reads_each_prompt_once_across_parts_and_nothing_held_out_in_any(tmp_path):
    two_parts(tmp_path)
    data = SequenceData.load(tmp_path)
    texts = sequences_of(data)
    assert [t for t in texts if "bees" in t.lower() and "\n\n" not in t] == ["Tell me about bees.Tell"], \
        "the first part's reply is kept"
    assert "Write a haiku.Writ" in texts and not any(t.startswith("Name a river.") for t in texts)
    second_turns = [t for t in texts if "\n\n" in t]
    assert second_turns == ["Tell me about bees.\n\nWhy?Tell", "Tell me about bees.\n\nHow?Tell"], \
        "a second-round turn is the same only when its whole text is"
    assert len(data) == 5 and (data.response_starts < data.lengths).all()
    again = SequenceData.load(tmp_path)
    assert torch.equal(again.tokens, data.tokens) and torch.equal(again.lengths, data.lengths)


def test_the_merged_stats_count_what_was_dropped(tmp_path, monkeypatch):
    """``run_workers`` (its workers faked: each writes its part) reports the repeats and held-out prompts
    dropped, and writes every part's held-out prompts once."""
    parts = tmp_path / "made"
    two_parts(parts)
    out = tmp_path / "out"

    class FakeWorker:
        def __init__(self, command, env):
            part = f"part-{command[command.index('--part') + 1]}"
            shutil.copytree(parts / part, out / part)

        def wait(self):
            return 0

    monkeypatch.setattr(data_module.subprocess, "Popen", FakeWorker)
    stats = data_module.run_workers(["--out", str(out)], out, workers=2, log=lambda line: None)
    assert stats["cross_part_repeats"] == 2, "the bees prompt and its identical follow-up"
    assert stats["held_out_elsewhere"] == 1 and stats["sequences"] == 5 == len(SequenceData.load(out))
    assert stats["replies_by_temperature"] == {"0": 5} and stats["workers"] == 2
    assert [p.text for p in data_module.read_prompts(out / "heldout.jsonl")] == \
        ["Name a river.", "Name a lake.", "Name a mountain."]


def test_shards_put_together_without_prompt_ids_keep_every_sequence(tmp_path):
    for part in ("part-0", "part-1"):
        builder = ShardBuilder(tokens=[torch.tensor([5, 6, 7], dtype=torch.int32)], lengths=[3], response_starts=[1])
        (tmp_path / part).mkdir()
        builder.save(tmp_path / part / "responses-00000.pt", (0, 1), 1.0)
    assert len(SequenceData.load(tmp_path)) == 2


# ---- prompts a package ships ----------------------------------------------------------------------

def test_chatterbot_requests_are_the_first_turns_of_its_conversations(tmp_path):
    (tmp_path / "ai.yml").write_text(
        "categories:\n- ai\nconversations:\n- - What is machine learning?\n  - A field of AI.\n  - Statistics.\n"
        "- - What is machine learning?\n  - Again.\n- - Hello\n  - Hi\n- - WHAT IS BASEBALL\n  - A sport.\n")
    (tmp_path / "coding.yml").write_text(
        "conversations:\n- - can you write bubble sort?\n  - |\n    Sure:\n    def sort(a): ...\n- []\n")
    assert packaged.chatterbot_requests(tmp_path) == ["What is machine learning?", "can you write bubble sort?"]


def test_without_the_package_its_share_asks_for_it(monkeypatch):
    monkeypatch.setattr(packaged, "PACKAGE", "no_package_of_this_name")
    with pytest.raises(SystemExit, match="pip install chatterbot-corpus"):
        packaged.chatterbot_requests()


def test_the_packaged_family_takes_its_share_of_the_prompts_and_none_by_default(monkeypatch):
    texts = [f"Can you tell me fact number {i}?" for i in range(40)]
    monkeypatch.setattr(data_module, "chatterbot_requests", lambda: texts)
    monkeypatch.setattr(data_module, "harvest", lambda: Harvest((), ()))
    settings = DataSettings(num_prompts=200, self_written_fraction=0, chatterbot_fraction=0.3)
    prompts = data_module.build_prompts(RecordingGenerator(), CHAT, settings)
    chosen = [p.text for p in prompts if p.source == "chatterbot"]
    assert len(chosen) == 60 and set(texts) <= set(chosen), "each as written, then again with a format request"
    default = data_module.build_prompts(RecordingGenerator(), CHAT,
                                        DataSettings(num_prompts=200, self_written_fraction=0))
    assert not [p for p in default if p.source == "chatterbot"]


def test_the_installed_chatterbot_corpus_gives_english_requests():
    pytest.importorskip("chatterbot_corpus")
    texts = packaged.chatterbot_requests()
    assert len(texts) > 300 and len(set(texts)) == len(texts)
    assert all(len(text.split()) >= packaged.MIN_WORDS and not text.isupper() for text in texts)
