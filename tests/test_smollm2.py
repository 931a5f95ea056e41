"""The bundled SmolLM2-135M, offline: chat template, stopping, exactness, and the bench CLI."""

import json
import os
import subprocess
import sys

import pytest

from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.loading import random_drafter
from engine.loop.run import TextStream
from engine.loop.settings import DecodeSettings

pytestmark = pytest.mark.slow  # the bundled model: each test loads it or decodes with it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def decoder(bundled_decoder):
    """The bundled target beside a seeded random drafter (what ``load_decoder(drafter="random")`` loads)."""
    target = bundled_decoder.target
    return Decoder(target, random_drafter(target, 0).to(bundled_decoder.drafter.dtype).eval(),
                   DrafterInfo("random (untrained, seed 0)", trained=False))


def test_chat_prompt_uses_template_and_stops_at_end_of_turn(decoder):
    ids = decoder.target.chat_ids("Say hi.")
    assert decoder.target.tokenizer.decode(ids).endswith("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n")
    trace = decoder.run("Say hi.", DecodeSettings("ar", max_new_tokens=64))
    assert trace.summary.stop_reason == "eos"
    assert trace.output_ids[-1] == decoder.target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert trace.text.strip() and "<|im_end|>" not in trace.text


@pytest.mark.parametrize("prompt", ["Write a Python function that adds two numbers.", "Name three colours."])
def test_random_drafter_outputs_equal_ar_in_float32(decoder, prompt):
    ar = decoder.run(prompt, DecodeSettings("ar", max_new_tokens=24))
    for settings in (DecodeSettings("dflash", max_new_tokens=24),
                     DecodeSettings("ddtree", max_new_tokens=24, tree_budget=16)):
        assert decoder.run(prompt, settings).output_ids == ar.output_ids


def test_the_fixed_step_with_the_shipped_drafter_equals_ar_in_float32(bundled_decoder):
    shipped = bundled_decoder
    assert shipped.drafter_info.trained, "the shipped drafter"
    fixed = Decoder(shipped.target, shipped.drafter, shipped.drafter_info, fixed_step=True)
    for prompt in ("Write a Python function that adds two numbers.", "Why do cats purr?"):
        ar = shipped.run(prompt, DecodeSettings("ar", max_new_tokens=32))
        for settings in (DecodeSettings("dflash", max_new_tokens=32), DecodeSettings("ddtree", max_new_tokens=32,
                                                                                      tree_budget=16)):
            trace = fixed.run(prompt, settings)
            assert trace.output_ids == ar.output_ids
            assert trace.summary.tau > 1.5, "a trained drafter is accepted through the fixed step too"


def test_bench_cli_on_default_model(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "colours", "prompt": "Name three colours."}) + "\n")
    out = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, "-m", "engine.tools.bench", "--prompts", str(prompts), "--methods", "ar,dflash,ddtree",
         "--tree-budget", "4,16", "--max-new-tokens", "12", "--device", "cpu", "--out", str(out),
         "--traces", str(tmp_path / "traces"), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert set(data["summary"]) == {"ar", "dflash", "ddtree@4", "ddtree@16"}
    assert data["summary"]["ar"]["tau"] == 1.0 and data["summary"]["ar"]["speedup_vs_ar"] == 1.0
    assert all(data["summary"][k]["identical_to_ar"] == "1/1" for k in ("dflash", "ddtree@4", "ddtree@16"))
    run = data["runs"][0]
    assert {"prompt_id", "method", "tree_budget", "output_ids", "text", "new_tokens", "verify_steps",
            "acceptance_lengths", "tau", "wall_s", "tokens_per_s"} <= run.keys()
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "colours.ar.json", "colours.ddtree@16.json", "colours.ddtree@4.json", "colours.dflash.json"]
    assert "| ddtree@16 |" in result.stdout


def test_text_pieces_join_to_the_full_decode_even_for_split_characters(decoder):
    tokenizer = decoder.target.tokenizer
    text = "naïve café — 日本語のテキスト ✓ " * 3 + "and a long ASCII tail " * 5
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(decoder.target.decode)
    pieces = [stream.push(token) for token in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert "\ufffd" not in "".join(pieces)


def test_a_tokens_text_is_decoded_once_and_kept(decoder, monkeypatch):
    """A finished trace carries the text of every token it shows (``Target.token_text``): a special token written
    out, and each token decoded once, however many traces show it."""
    target = decoder.target
    end = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain = target.text_ids("Hello")[0]
    expected = {token: target.tokenizer.decode([token], skip_special_tokens=False) for token in (end, plain)}
    target.token_texts.clear()
    decoded = []
    decode = target.tokenizer.decode
    monkeypatch.setattr(target.tokenizer, "decode", lambda ids, **kw: decoded.append(ids) or decode(ids, **kw))
    assert [target.token_text(token) for token in (end, plain, end, plain)] == [expected[end], expected[plain]] * 2
    assert expected[end] == "<|im_end|>" and decoded == [[end], [plain]]
