"""engine.tools.margin_check: an engine's top-2 logit gaps against float64 teacher forcing."""

from __future__ import annotations

import json

import pytest

from engine.loop.decode import Decoder
from engine.loop.settings import DecodeSettings
from engine.tools.margin_check import check_run, exact_margins, main
from tests.tiny import tiny_drafter, tiny_target

PROMPT = "Tell,me,about,the,sea"  # the tiny tokenizer has no space character


@pytest.fixture(scope="module")
def target_and_output():
    target = tiny_target(0)
    ar = Decoder(target, tiny_drafter(target)).run(PROMPT, DecodeSettings("ar", max_new_tokens=12))
    return target, ar


def test_teacher_forcing_gives_the_gaps_the_decoder_saw_step_by_step(target_and_output):
    target, ar = target_and_output
    margins, argmax = exact_margins(target, target.chat_ids(PROMPT), ar.output_ids)
    assert margins.tolist() == pytest.approx(ar.margins[: len(ar.output_ids)], abs=1e-6)  # traces keep float32
    assert argmax.tolist() == ar.output_ids


def test_an_engine_that_computes_what_the_model_says_strays_by_nothing_and_a_perturbed_one_by_its_error(
        target_and_output):
    target, ar = target_and_output
    output = ar.output_ids
    margins, _ = exact_margins(target, target.chat_ids(PROMPT), output)
    run = {"prompt_id": "sea", "output_ids": output, "margins": margins.tolist()}
    exact = check_run(target, PROMPT, run)
    assert exact.first == exact.worst == 0.0 and exact.leaves_float64_at is None
    assert exact.prompt_tokens == len(target.chat_ids(PROMPT))
    perturbed = list(run["margins"])
    perturbed[0] += 0.01
    perturbed[5] -= 0.2
    check = check_run(target, PROMPT, run | {"margins": perturbed})
    assert check.first == pytest.approx(0.01) and check.worst == pytest.approx(0.2)


def test_an_output_that_leaves_float64s_choice_is_named_at_its_first_such_token(target_and_output):
    target, ar = target_and_output
    changed = list(ar.output_ids)
    changed[4] = (changed[4] + 1) % target.config.vocab_size
    margins, _ = exact_margins(target, target.chat_ids(PROMPT), changed)
    check = check_run(target, PROMPT, {"prompt_id": "sea", "output_ids": changed, "margins": margins.tolist()})
    assert check.leaves_float64_at == 4


def test_the_gaps_are_replayed_on_the_tokens_the_run_decoded(target_and_output):
    """A run made on another machine may have tokenized the prompt apart: replaying the text's tokens
    here would compare two different passes."""
    target, ar = target_and_output
    decoded = target.chat_ids(PROMPT)[1:]  # the run's own tokens, not this tokenizer's
    margins, _ = exact_margins(target, decoded, ar.output_ids)
    run = {"prompt_id": "sea", "output_ids": ar.output_ids, "margins": margins.tolist()}
    assert check_run(target, PROMPT, run, decoded).worst == 0.0
    assert check_run(target, PROMPT, run).first > 0.0


def test_results_without_vllms_own_ar_are_one_clear_line(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": {"prompts": "assets/prompts/smoke.jsonl"}, "runs": [{"label": "ar"}]}))
    assert main([str(path)]) == 2
    assert "no vLLM AR run with margins: bench with --engine vllm --native ar" in capsys.readouterr().err
