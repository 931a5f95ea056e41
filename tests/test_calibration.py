"""The start-up choice of the DDTree budget: τ from the drafter's curve, step cost timed here."""

from __future__ import annotations

import pytest
import torch

from engine.loop.decode import Decoder, DrafterInfo
from engine.measure.calibration import (
    FALLBACK_BUDGET,
    PROVISIONAL_BUDGET,
    BudgetChoice,
    StartupTiming,
    pick_budget,
)
from engine.measure.economics import Economics
from engine.measure.fairness import ArReference
from engine.serving.startup import opening_budget
from engine.training.export import acceptance_record
from tests.tiny import tiny_decoder


@pytest.fixture(scope="module")
def decoder() -> Decoder:
    return tiny_decoder(0)


@pytest.fixture
def start(decoder, tmp_path, monkeypatch):
    """A start on this machine: ``opening_budget``, then its timing (where it has one) run to the end, as the page
    runs it in the background. The cache is a fresh folder; the calibration prompt is one the tiny target reads."""
    monkeypatch.setenv("DDTREE_STUDIO_CACHE", str(tmp_path / "cache"))
    ids = decoder.target.chat_ids("howdoesitwork")
    monkeypatch.setattr(decoder.target, "chat_ids", lambda prompt: ids)

    def opened_and_timed() -> BudgetChoice:
        choice, timing = opening_budget(decoder)
        if timing is None:
            return choice
        assert choice.budget == PROVISIONAL_BUDGET and timing.missing() == timing.labels
        for label in timing.missing():
            timing.time(label)
        return timing.choice()

    return opened_and_timed


def test_the_chosen_budget_has_the_best_predicted_speedup_and_its_tau_is_the_drafters(decoder, start, monkeypatch):
    curve = {"4": 1.5, "8": 2.5, "16": 2.9, "32": 3.0, "64": 3.1}
    monkeypatch.setattr(decoder.drafter.config, "acceptance", {"ddtree": curve})
    choice = start()
    assert set(choice.table) == {4, 8, 16, 32, 64} and choice.tau_source == "the drafter's acceptance curve"
    for budget, entry in choice.table.items():
        assert entry.tau == curve[str(budget)]
        assert entry.step_cost_vs_ar > 0 and entry.predicted_speedup == pytest.approx(entry.tau / entry.step_cost_vs_ar)
    assert choice.budget == pick_budget({b: e.predicted_speedup for b, e in choice.table.items()})
    assert f"DDTree budget {choice.budget} is the " in choice.sentence()
    assert "timed on this machine" in choice.sentence()


def test_without_a_curve_the_calibration_runs_give_tau_and_a_restart_opens_at_their_choice(decoder, start,
                                                                                              monkeypatch):
    monkeypatch.setattr(decoder.drafter.config, "acceptance", {})
    choice = start()
    assert choice.tau_source == "the timing runs" and all(e.tau >= 1 for e in choice.table.values())
    assert opening_budget(decoder) == (choice, None)  # every timing kept: nothing left to time


def test_a_set_budget_says_where_it_came_from(decoder):
    assert opening_budget(decoder, 12) == (BudgetChoice(12, {}, "set with --tree-budget"), None)
    assert BudgetChoice(12, {}, "set with --tree-budget").sentence() == "DDTree budget 12 (set with --tree-budget)."
    assert opening_budget(Decoder(decoder.target)) == (BudgetChoice(FALLBACK_BUDGET, {}, "no drafter to time"), None)
    entry = Economics(tau=3.0, step_ms=10.0, step_cost_vs_ar=1.5, predicted_speedup=2.0, speedup_vs_ar=1.9)
    assert "τ 3.00 ÷ step cost 1.50 AR steps = 2.00×" in BudgetChoice(8, {8: entry}, "x").sentence()


def test_a_bench_result_becomes_the_drafters_recorded_curve():
    results = {"config": {"prompts": "assets/prompts/fresh.jsonl", "max_new_tokens": 64, "dtype": "float32"},
               "summary": {"ar": {"tau": 1.0}, "dflash": {"tau": 2.123}, "ddtree@8": {"tau": 2.91},
                           "ddtree@32": {"tau": 3.4567}}}
    record = acceptance_record(results)
    assert record == {"prompts": "assets/prompts/fresh.jsonl", "max_new_tokens": 64, "dtype": "float32",
                      "ddtree": {"8": 2.91, "32": 3.457}, "dflash": 2.123}
    results["config"]["draft_dtype"] = "bfloat16"
    assert acceptance_record(results)["draft_dtype"] == "bfloat16"


def bench_results(path, budgets: dict[int, float], **config) -> str:
    """A bench results file with DDTree at ``budgets`` (budget -> speed-up over AR)."""
    import json

    config = {"device": "cpu", "engine": "torch", "dtype": "float64", "prompts": "fresh.jsonl",
              "drafter_revision": "abc123", "host": {"threads": torch.get_num_threads()}} | config
    summary = {f"ddtree@{b}": {"tokens_per_s": 20.0 * s, "speedup_vs_ar": s, "tau": 2.0 + b / 100}
               for b, s in budgets.items()}
    runs = [{"label": "ar", "wall_s": 2.1, "prefill_s": 0.1, "verify_steps": 40}]  # AR decodes 20 tokens/s
    path.write_text(json.dumps({"config": config, "runs": runs, "summary": {"ar": {"speedup_vs_ar": 1.0}} | summary}))
    return str(path)


def test_the_page_opens_at_the_largest_tree_within_five_percent_of_the_fastest():
    # the shipped drafter's CPU bench (benchmarks/cpu-fresh-bf16-drafts.json): 4 is fastest, 16 draws a tree
    assert pick_budget({4: 1.533, 8: 1.530, 16: 1.461, 32: 1.260, 64: 0.939}) == 16
    assert pick_budget({16: 1.521, 32: 1.619, 64: 1.662, 128: 1.608}) == 128
    assert pick_budget({4: 2.0, 8: 1.5}) == 4


def test_a_recorded_bench_decides_without_timing_anything_and_says_where_it_was_measured(decoder, tmp_path,
                                                                                           monkeypatch):
    import json

    import engine.measure.calibration as calibration

    results = bench_results(tmp_path / "cpu-fresh.json", {4: 1.50, 8: 1.49, 16: 1.44, 32: 1.2})
    table = tmp_path / "budgets.json"
    key, _ = calibration.record_best(results, table)
    assert key == calibration.machine_key(decoder) == (f"CPU, {torch.get_num_threads()} threads | torch | float64 | "
                                                       "readable step")
    monkeypatch.setattr(calibration, "measured_budgets", lambda: json.loads(table.read_text()))
    monkeypatch.setattr(decoder, "drafter_info", DrafterInfo("shipped", trained=True, revision="abc123"))

    def no_timing(*args, **kwargs):
        raise AssertionError("a recorded bench decides: nothing is timed at start-up")

    monkeypatch.setattr(decoder, "run", no_timing)
    choice, timing = opening_budget(decoder)
    assert choice.budget == 16 and choice.table == {} and timing is None
    assert choice.sentence() == (
        "DDTree budget 16 is the largest tree within 5% of the fastest (budget 4, 1.50×), so the first page shows a "
        "tree that branches: the bench measured 1.44× AR at it (τ 2.16, 29 tokens/s on fresh.jsonl) on another "
        f"machine of this kind ({key}), not on this one ({results}).")
    # what a disturbed page measures AR against (engine.measure.fairness)
    assert choice.ar == ArReference(20.0, "the bench recorded", f"on this kind of machine ({key})")
    monkeypatch.setattr(decoder, "drafter_info", DrafterInfo("another", trained=True, revision="def456"))
    monkeypatch.setenv("DDTREE_STUDIO_CACHE", str(tmp_path / "cache"))
    choice, timing = opening_budget(decoder)  # a bench of other weights: opens for now, its timing left to run
    assert choice.budget == PROVISIONAL_BUDGET and timing.missing() == timing.labels


def test_startup_timing_keeps_every_timing_and_a_restart_times_only_what_is_missing(decoder, tmp_path, monkeypatch):
    cache = tmp_path / "timings.json"
    first = StartupTiming(decoder, (2, 8), "howdoesitwork", 8, cache)
    assert first.missing() == ["ar", "2", "8"] and first.progress() == "0 of 3 timed"
    first.time("ar")
    first.time("2")  # the start is cut short here
    timed = []
    monkeypatch.setattr(StartupTiming, "time", lambda self, label: timed.append(label) or
                        self.timings.setdefault(label, self.timings["2"]))
    second = StartupTiming(decoder, (2, 8), "howdoesitwork", 8, cache)
    assert second.timings == first.timings and second.progress() == "2 of 3 timed"
    for label in second.missing():
        second.time(label)
    assert timed == ["8"]
    assert set(second.choice().table) == {2, 8}
    assert second.choice().ar == ArReference(1 / first.timings["ar"].step_s, "the start-up timing measured",
                                             "on this machine")


def test_a_compiled_fixed_step_is_recorded_apart_from_the_plain_one(tmp_path):
    import json

    import engine.measure.calibration as calibration

    table = tmp_path / "budgets.json"
    keys = []
    for compiled, budget in ((False, 32), (True, 16)):
        results = bench_results(tmp_path / f"gpu-{compiled}.json", {budget: 1.0}, device="cuda", engine="vllm",
                                dtype="bfloat16", step="fixed", compile_step=compiled,
                                host={"threads": 16, "gpu": "NVIDIA H200"})
        keys.append(calibration.record_best(results, table)[0])
    assert keys == ["NVIDIA H200 | vllm | bfloat16 | fixed step", "NVIDIA H200 | vllm | bfloat16 | compiled fixed step"]
    assert {key: list(entry["budgets"]) for key, entry in json.loads(table.read_text()).items()} == \
        dict(zip(keys, (["32"], ["16"])))


def test_recording_a_result_without_a_best_budget_is_one_clear_line(tmp_path, capsys):
    import json

    from engine.measure.calibration import main

    results = tmp_path / "r.json"
    results.write_text(json.dumps({"config": {}, "summary": {"ar": {}}}))
    assert main(["record", str(results)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {results} has no best DDTree budget: "
                                               "bench DDTree at one budget or more")
