"""The serve benchmark's rounds: a method's runs at one concurrency merged into one, and the report's table; what
it refuses before any server starts."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from engine.errors import EngineError
from engine.tools.serve_bench import Answer, Run, continued, judged, main, merged, parse_args, save
from viz.report import serve_table


def answer(prompt: str, sent: float, first: float, done: float, tokens: int = 5) -> dict:
    return asdict(Answer(prompt, "text", tokens, sent, first, done, 2.0))


def test_rounds_merge_to_the_median_rate_with_every_requests_times_and_identical_count():
    rounds = [Run("batched", "ddtree@auto", 2, rate, 0, 0, 0, 0, tau, same, [answer("a", 0, first, first + 4)])
              for rate, tau, same, first in ((30.0, 3.0, "16/16 (the reference)", 1.0), (10.0, 2.0, "15/16", 2.0),
                                             (20.0, 1.0, "16/16", 3.0))]
    run = merged(rounds)
    assert run.tokens_per_s == 20.0 and run.round_tokens_per_s == [30.0, 10.0, 20.0]
    assert run.identical == "47/48 (the reference)"
    assert run.tau == 2.0 and len(run.answers) == 3
    assert (run.ttft_p50_s, run.tpot_p50_s) == (2.0, 1.0)  # first texts at 1, 2, 3 s; 4 s over 4 more tokens each
    assert "| batched | DDTree (auto budget) | 2 | 20.0 (30.0, 10.0, 20.0) |" in serve_table([asdict(run)])


def test_a_single_round_reads_as_before():
    run = merged([Run("one-at-a-time", "ar", 1, 12.5, 0, 0, 0, 0, 1.0, "-", [answer("a", 0, 0.5, 2.5)])])
    assert run.identical == "-" and run.round_tokens_per_s == [12.5]
    assert "| one-at-a-time | AR | 1 | 12.5 | 0.50 / 0.50 | 500 / 500 |" in serve_table([asdict(run)])


@pytest.mark.parametrize("native, server_args", [("mtp", "--engine vllm"), ("dflash", "--engine vllm")])
def test_vllms_own_methods_are_ar_and_dflash_with_the_servers_drafter(native, server_args, tmp_path):
    """Refused before any server starts: vLLM's own DFlash needs the drafter the Studio's server runs."""
    args = parse_args(["--native", native, "--server-args", server_args, "--out", str(tmp_path / "out.json")])
    with pytest.raises(EngineError, match=f"--native takes ar and dflash .*got '{native}'"):
        main(args)
    assert not (tmp_path / "out.json").exists()


def earlier_part(tmp_path, prompt_ids: list[str], max_tokens: int = 128):
    """A first part's results on disk: AR at 1 client (the reference) and DDTree at 2 over three rounds."""
    reference = Run("batched", "ar", 1, 30.0, 0, 0, 0, 0, 1.0, "2/2 (the reference)",
                    [asdict(Answer(pid, f"text of {pid}", 5, 0, 1, 2, 1.0)) for pid in prompt_ids])
    tree = merged([Run("batched", "ddtree@auto", 2, rate, 0, 0, 0, 0, 3.0, "2/2",
                       [asdict(Answer(pid, f"text of {pid}", 5, 0, 1, 2, 3.0)) for pid in prompt_ids])
                   for rate in (40.0, 50.0, 60.0)])  # three rounds: every prompt's answer three times
    path = tmp_path / "part1.json"
    save(parse_args(["--max-tokens", str(max_tokens), "--out", str(path)]), [{"id": p} for p in prompt_ids],
         [reference, tree])
    return path


def test_a_later_part_takes_the_earlier_parts_reference_and_keeps_its_runs(tmp_path):
    path = earlier_part(tmp_path, ["p1", "p2"])
    runs, reference = continued(path, [{"id": "p1"}, {"id": "p2"}], 128)
    assert reference == {"p1": "text of p1", "p2": "text of p2"}
    assert [(run.label, run.concurrency, run.tokens_per_s) for run in runs] == [("ar", 1, 30.0),
                                                                                ("ddtree@auto", 2, 50.0)]


@pytest.mark.parametrize("prompt_ids, max_tokens", [(["p1", "p3"], 128), (["p1", "p2"], 64)])
def test_a_part_of_other_prompts_or_length_is_refused_before_any_server_starts(tmp_path, prompt_ids, max_tokens):
    path = earlier_part(tmp_path, prompt_ids)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "p1", "prompt": "a"}\n{"id": "p2", "prompt": "b"}\n')
    args = parse_args(["--prompts", str(prompts), "--limit", "2", "--max-tokens", str(max_tokens),
                       "--continue-from", str(path), "--out", str(tmp_path / "out.json")])
    with pytest.raises(EngineError, match=f"--continue-from .*part1.json: it ran 2 prompts at 128 tokens, not these "
                                          f"2 at {max_tokens}"):
        main(args)
    assert not (tmp_path / "out.json").exists()


def test_an_earlier_parts_runs_are_held_to_the_reference_a_later_part_ran():
    answers = [asdict(Answer(pid, text, 5, 0, 1, 2, 3.0)) for pid, text in (("p1", "one"), ("p2", "other"))]
    earlier = Run("batched", "ddtree@auto", 16, 50.0, 0, 0, 0, 0, 3.0, "-", answers)
    assert judged(earlier, {"p1": "one", "p2": "two"}).identical == "1/2"
    assert judged(earlier, None).identical == "-"
    measured = replace(earlier, identical="2/2")
    assert judged(measured, {"p1": "one", "p2": "two"}) is measured
