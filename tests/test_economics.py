"""Step economics: τ, step cost in AR steps, predicted (τ ÷ cost) and measured speed-up."""

from __future__ import annotations

import pytest

from engine.loop.settings import DecodeSettings
from engine.measure.economics import Timing, economics, explain, speed_noise
from engine.tools.bench import Job, best_budget, per_category, read_prompts, summarize_runs
from engine.trace import Summary, Trace
from tests.tiny import tiny_decoder


def summary(wall: float, prefill: float, lengths: list[int]) -> Summary:
    new = 1 + sum(lengths)
    return Summary(new, len(lengths), lengths, sum(lengths) / len(lengths), wall, new / wall, prefill, "eos", {})


def test_step_cost_is_the_mean_step_time_over_ars_and_predicts_the_speedup():
    ar = Timing.of([summary(1.1, 0.1, [1] * 10)])  # 0.1 s a step
    tree = Timing.of([summary(0.5, 0.1, [3, 2]), summary(0.5, 0.1, [2, 3])])  # 0.2 s a step, 2.5 tokens a step
    result = economics({"ar": ar, "ddtree@8": tree})
    assert result["ar"].step_cost_vs_ar == pytest.approx(1.0) and result["ar"].predicted_speedup == pytest.approx(1.0)
    entry = result["ddtree@8"]
    assert entry.tau == pytest.approx(2.5) and entry.step_ms == pytest.approx(200.0)
    assert entry.step_cost_vs_ar == pytest.approx(2.0) and entry.predicted_speedup == pytest.approx(1.25)
    # measured: tokens per second over AR's on whole wall times, prefill included (12 tokens in 1.0 s
    # against 11 in 1.1 s); a wall-time ratio would say 1.1 and miss that the tree made more tokens
    assert entry.speedup_vs_ar == pytest.approx((12 / 1.0) / (11 / 1.1))
    assert "2.50 tokens per step" in explain("DDTree@8", entry) and "faster than AR" in explain("DDTree@8", entry)


def test_without_an_ar_run_there_is_no_cost_to_compare():
    result = economics({"dflash": Timing.of([summary(1.0, 0.2, [2, 2])])})
    assert result["dflash"].tau == 2 and result["dflash"].step_cost_vs_ar is None
    assert result["dflash"].predicted_speedup is None
    # it had steps: say its τ, and what is missing to compare (issue #44: it said "no verify steps to measure")
    assert explain("DFlash", result["dflash"]) == (
        "DFlash commits 2.00 tokens per step; whether that is faster than AR depends on what a step costs, counted "
        "in AR steps: run AR with it to measure that.")


def test_on_identical_outputs_the_prediction_is_the_decode_time_speedup():
    """τ ÷ cost is AR's decode time over the method's when both commit the same tokens:
    the prediction is the measured speed-up with the prefill left out, nothing else."""
    decoder = tiny_decoder(0)
    prompt = [5, 9, 14, 3]
    ar = decoder.run(prompt_ids=prompt, settings=DecodeSettings("ar", max_new_tokens=24))
    tree = decoder.run(prompt_ids=prompt, settings=DecodeSettings("ddtree", max_new_tokens=24, tree_budget=8))
    assert tree.output_ids == ar.output_ids
    entry = economics({"ar": Timing.of([ar.summary]), "ddtree": Timing.of([tree.summary])})["ddtree"]
    decode = lambda s: s.wall_s - s.time_to_first_token_s  # noqa: E731
    assert entry.predicted_speedup == pytest.approx(decode(ar.summary) / decode(tree.summary), rel=1e-9)


def test_the_bench_summary_carries_the_economics_categories_and_the_best_budget():
    def record(label, method, budget, category, wall, lengths):
        return {"prompt_id": category, "category": category, "method": method, "label": label, "tree_budget": budget,
                "prefill_s": 0.1, "new_tokens": 1 + sum(lengths), "verify_steps": len(lengths),
                "acceptance_lengths": lengths, "wall_s": wall, "stage_s": {}}

    runs = [record("ar", "ar", None, "math", 1.1, [1] * 10), record("ar", "ar", None, "code", 1.1, [1] * 10)]
    runs += [record("ddtree@8", "ddtree", 8, "math", 0.5, [4, 6]), record("ddtree@8", "ddtree", 8, "code", 0.5, [2, 3])]
    runs += [record("ddtree@32", "ddtree", 32, "math", 0.7, [5, 6]),
             record("ddtree@32", "ddtree", 32, "code", 0.7, [3, 3])]
    jobs = [Job("ar", "ar", None), Job("ddtree@8", "ddtree", 8), Job("ddtree@32", "ddtree", 32)]
    summary = summarize_runs(runs, jobs)
    assert summary["ddtree@8"]["tau_by_category"] == {"code": 2.5, "math": 5.0}
    assert summary["ddtree@8"]["step_cost_vs_ar"] == pytest.approx(2.0)
    assert summary["ddtree@8"]["predicted_speedup"] == pytest.approx(3.75 / 2.0)
    assert best_budget(summary)["label"] == "ddtree@8" and best_budget(summary)["tree_budget"] == 8


@pytest.mark.parametrize("interleave", [False, True])
def test_reduced_traces_time_the_same_decoding_and_the_best_budget_keeps_full_traces(tmp_path, interleave):
    """One after another or in turns (``--interleave``, twins each on buffers of their own), the same tokens."""
    from engine.tools.bench import benchmark, plan_jobs, with_reduced_traces

    decoder = tiny_decoder(0)
    jobs = with_reduced_traces(plan_jobs("ar,ddtree", "4,8"))
    assert [job.label for job in jobs] == ["ar", "ar:tokens", "ddtree@4", "ddtree@4:tokens", "ddtree@8",
                                           "ddtree@8:tokens"]
    prompts = [{"id": "p", "prompt": "ABCDEFG", "category": None}]
    runs, _, disturbance = benchmark(decoder, prompts, jobs, DecodeSettings("ar", max_new_tokens=12), tmp_path,
                                     progress=False, interleave=interleave)
    assert ("turns" in runs[0]) == interleave and isinstance(disturbance, list)
    by_label = {run["label"]: run for run in runs}
    for label in ("ar", "ddtree@4", "ddtree@8"):
        assert by_label[label + ":tokens"]["output_ids"] == by_label[label]["output_ids"]
        assert by_label[label + ":tokens"]["acceptance_lengths"] == by_label[label]["acceptance_lengths"]
    lean = Trace.load(tmp_path / "p.ddtree@8:tokens.json")
    assert all(step.tree_size == 0 for step in lean.steps)
    assert any(step.tree_size for step in Trace.load(tmp_path / "p.ddtree@8.json").steps)
    summary = summarize_runs(runs, jobs)
    summary["ddtree@4:tokens"]["tokens_per_s"] = 1e9  # a faster lean row is not the app's best budget
    assert best_budget(summary)["label"] in ("ddtree@4", "ddtree@8")


def test_a_short_run_per_category_spans_every_category_of_the_fresh_set():
    prompts = read_prompts("assets/prompts/fresh.jsonl")
    categories = {p["category"] for p in prompts}
    chosen = per_category(prompts, 3)
    assert {p["category"] for p in chosen} == categories and len(categories) >= 8
    assert all(sum(p["category"] == c for p in chosen) == min(3, sum(q["category"] == c for q in prompts))
               for c in categories)
    assert [p["id"] for p in chosen] == [p["id"] for p in prompts if p in chosen]  # file order kept
    assert per_category(prompts, None) == prompts


def test_the_bench_counts_outputs_identical_to_ar_and_which_others_left_it_at_a_near_tie():
    from engine.tools.bench import format_summary

    def record(label, method, divergence):
        return {"prompt_id": "p", "category": None, "method": method, "label": label, "tree_budget": None,
                "prefill_s": 0.1, "new_tokens": 3, "verify_steps": 2, "acceptance_lengths": [1, 1], "wall_s": 1.0,
                "stage_s": {}, "divergence": divergence}

    tie, real = {"index": 4, "ar_margin": 0.1, "near_tie": True}, {"index": 2, "ar_margin": 3.0, "near_tie": False}
    runs = [record("ar", "ar", None)] + [record("dflash", "dflash", d) for d in (None, tie, tie, real)]
    summary = summarize_runs(runs, [Job("ar", "ar", None), Job("dflash", "dflash", None)])
    assert summary["dflash"]["identical_to_ar"] == "1/4" and summary["dflash"]["near_ties_vs_ar"] == 2
    assert "| 1/4 (2 at near-ties) |" in format_summary(summary)


@pytest.mark.parametrize("steps, noise", [
    ([(1, 0.1)] * 10, 0.0),  # every step at one pace: nothing to stray
    ([(1, 0.1), (1, 0.3)], 0.5),  # rate 5: residuals ±0.5, spread 0.5, standard error 0.5 of a mean token of 1
    ([(3, 0.1)], None),  # one step says nothing of its spread
])
def test_one_pass_noise_is_the_standard_error_of_its_tokens_per_second_over_its_steps(steps, noise):
    assert speed_noise(steps) == (pytest.approx(noise) if noise is not None else None)
