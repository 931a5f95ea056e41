"""The start-up choice of the DDTree budget: τ from the drafter's curve, step cost timed here."""

from __future__ import annotations

import pytest
import torch

from engine.loop.calibration import BudgetChoice, choose_budget
from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.economics import Economics
from engine.training.export import acceptance_record
from tests.tiny import tiny_decoder


@pytest.fixture(scope="module")
def decoder() -> Decoder:
    return tiny_decoder(0)


def test_the_chosen_budget_has_the_best_predicted_speedup_and_its_tau_is_the_drafters(decoder, monkeypatch):
    curve = {"4": 1.5, "8": 2.5, "16": 2.9}
    monkeypatch.setattr(decoder.drafter.config, "acceptance", {"ddtree": curve})
    choice = choose_budget(decoder, budgets=(4, 8, 16), prompt="howdoesitwork", tokens=8)
    assert set(choice.table) == {4, 8, 16} and choice.tau_source == "the drafter's acceptance curve"
    for budget, entry in choice.table.items():
        assert entry.tau == curve[str(budget)]
        assert entry.step_cost_vs_ar > 0 and entry.predicted_speedup == pytest.approx(entry.tau / entry.step_cost_vs_ar)
    assert choice.budget == max(choice.table, key=lambda b: choice.table[b].predicted_speedup)
    assert f"DDTree budget {choice.budget} is the fastest here" in choice.sentence()


def test_without_a_curve_the_calibration_runs_give_tau(decoder, monkeypatch):
    monkeypatch.setattr(decoder.drafter.config, "acceptance", {})
    choice = choose_budget(decoder, budgets=(2, 8), prompt="howdoesitwork", tokens=8)
    assert choice.tau_source == "the calibration runs" and all(e.tau >= 1 for e in choice.table.values())


def test_a_set_budget_says_where_it_came_from():
    assert BudgetChoice(12, {}, "set with --tree-budget", 0.0).sentence() == "DDTree budget 12 (set with --tree-budget)."
    entry = Economics(tau=3.0, step_ms=10.0, step_cost_vs_ar=1.5, predicted_speedup=2.0, speedup_vs_ar=1.9)
    assert "τ 3.00 ÷ step cost 1.50 AR steps = 2.00×" in BudgetChoice(8, {8: entry}, "x", 1.0).sentence()


def test_a_bench_result_becomes_the_drafters_recorded_curve():
    results = {"config": {"prompts": "assets/prompts/fresh.jsonl", "max_new_tokens": 64, "dtype": "float32"},
               "summary": {"ar": {"tau": 1.0}, "dflash": {"tau": 2.123}, "ddtree@8": {"tau": 2.91},
                           "ddtree@32": {"tau": 3.4567}}}
    record = acceptance_record(results)
    assert record == {"prompts": "assets/prompts/fresh.jsonl", "max_new_tokens": 64, "dtype": "float32",
                      "ddtree": {"8": 2.91, "32": 3.457}, "dflash": 2.123}
    results["config"]["draft_dtype"] = "bfloat16"
    assert acceptance_record(results)["draft_dtype"] == "bfloat16"


def test_a_recorded_bench_best_is_the_default_on_its_machine_and_drafter(decoder, tmp_path, monkeypatch):
    import json

    import engine.loop.calibration as calibration

    results = tmp_path / "cpu-fresh.json"
    results.write_text(json.dumps({
        "config": {"device": "cpu", "engine": "torch", "dtype": "float64", "prompts": "fresh.jsonl",
                   "drafter_revision": "abc123", "host": {"threads": torch.get_num_threads()}},
        "best": {"label": "ddtree@6", "tree_budget": 6, "tokens_per_s": 21.26, "speedup_vs_ar": 1.2345, "tau": 2.6}}))
    table = tmp_path / "budgets.json"
    monkeypatch.setattr(calibration, "MEASURED_BUDGETS", table)
    key, entry = calibration.record_best(str(results), table)
    assert key == calibration.machine_key(decoder) == f"CPU, {torch.get_num_threads()} threads | torch | float64 | readable step"
    monkeypatch.setattr(calibration, "measured_budgets", lambda: json.loads(table.read_text()))
    monkeypatch.setattr(decoder, "drafter_info", DrafterInfo("shipped", trained=True, revision="abc123"))
    choice = choose_budget(decoder, budgets=(2, 8), prompt="howdoesitwork", tokens=8)
    assert choice.budget == 6 and set(choice.table) == {2, 8}, "the start-up timing still runs (and warms up)"
    assert choice.sentence() == ("DDTree budget 6 is the fastest here: the bench on this machine measured 21 tokens/s "
                                 f"at it, 1.23× AR (τ 2.60; fresh.jsonl, {results}).")
    monkeypatch.setattr(decoder, "drafter_info", DrafterInfo("another", trained=True, revision="def456"))
    assert choose_budget(decoder, budgets=(2, 8), prompt="howdoesitwork", tokens=8).measured is None, \
        "a bench of other weights does not decide"


def test_a_compiled_fixed_step_is_recorded_apart_from_the_plain_one(tmp_path):
    import json

    import engine.loop.calibration as calibration

    table = tmp_path / "budgets.json"
    keys = []
    for compiled, budget in ((False, 32), (True, 16)):
        results = tmp_path / f"gpu-{compiled}.json"
        results.write_text(json.dumps({
            "config": {"device": "cuda", "engine": "vllm", "dtype": "bfloat16", "prompts": "fresh.jsonl",
                       "step": "fixed", "compile_step": compiled, "drafter_revision": "abc123",
                       "host": {"threads": 16, "gpu": "NVIDIA H200"}},
            "best": {"label": f"ddtree@{budget}", "tree_budget": budget, "tokens_per_s": 1.0, "speedup_vs_ar": 1.0,
                     "tau": 3.0}}))
        keys.append(calibration.record_best(str(results), table)[0])
    assert keys == ["NVIDIA H200 | vllm | bfloat16 | fixed step", "NVIDIA H200 | vllm | bfloat16 | compiled fixed step"]
    assert {key: entry["tree_budget"] for key, entry in json.loads(table.read_text()).items()} == dict(zip(keys, (32, 16)))


def test_recording_a_result_without_a_best_budget_is_one_clear_line(tmp_path, capsys):
    import json

    from engine.loop.calibration import main

    results = tmp_path / "r.json"
    results.write_text(json.dumps({"config": {}, "best": None}))
    assert main(["record", str(results)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {results} has no best DDTree budget: bench DDTree at one budget or more"
