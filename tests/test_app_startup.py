"""How the app starts: its first budget at once (the bench's record, or earlier timings, or a tree that branches
while the rest is timed in the background), and the vLLM engine's compiled step, its caches and its status line."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

import app
import engine.measure.calibration as calibration
import engine.serving.startup as startup
from engine.loop.decode import DrafterInfo
from engine.loop.settings import DecodeSettings
from engine.methods import TREE
from engine.serving.model_queue import ModelQueue
from tests.tiny import tiny_decoder
from viz.page.state import Lane, PlannedRun, RunControl, Studio, run_live


@pytest.fixture()
def decoder(monkeypatch, tmp_path):
    decoder = tiny_decoder(0)
    monkeypatch.setattr(decoder, "drafter_info", DrafterInfo("shipped", trained=True, revision="abc123"))
    monkeypatch.setenv("DDTREE_STUDIO_CACHE", str(tmp_path / "cache"))
    return decoder


def record(monkeypatch, decoder, speedups: dict[int, float]) -> None:
    entry = {"budgets": {str(b): {"tokens_per_s": 10.0, "speedup_vs_ar": s, "tau": 3.0} for b, s in speedups.items()},
             "drafter_revision": "abc123", "prompts": "fresh.jsonl", "results": "benchmarks/cpu.json"}
    monkeypatch.setattr(calibration, "measured_budgets", lambda: {calibration.machine_key(decoder): entry})


def test_a_recorded_machine_starts_at_once_at_the_largest_tree_near_the_fastest(decoder, monkeypatch, tmp_path):
    record(monkeypatch, decoder, {4: 1.53, 8: 1.53, 16: 1.46, 32: 1.26})
    monkeypatch.setattr(decoder, "run", lambda *a, **k: pytest.fail("nothing is timed when the bench decides"))
    studio = app.startup_studio(decoder, ModelQueue(), tree_budget=None)
    assert studio.budget.budget == 16 and not studio.timing_pending
    assert "not on this one (benchmarks/cpu.json)" in studio.budget_sentence()


def test_without_a_record_the_page_starts_at_a_branching_tree_and_times_the_rest_in_the_background(decoder,
                                                                                                   monkeypatch):
    monkeypatch.setattr(calibration, "measured_budgets", lambda: {})
    studio = app.startup_studio(decoder, ModelQueue(), tree_budget=None)
    assert studio.budget.budget == calibration.PROVISIONAL_BUDGET == 16 and studio.timing_pending
    assert "0 of 6 timed" in studio.budget_sentence() and "timings.json" in studio.budget_sentence()
    studio.timing.budgets, studio.timing.prompt = (2, 8), "howdoesitwork"  # a short timing the tiny model reads
    studio.time_budgets()
    assert not studio.timing_pending and studio.budget.budget in (2, 8)
    # what the timing ran is warm (compiled, on a compiled step): the page will not say it is compiling it
    assert studio.started == {"ar", "dflash", "ddtree@2", "ddtree@8"}
    assert "timed on this machine" in studio.budget_sentence()
    # every timing was kept: the next start times nothing and opens at the same budget
    kept = json.loads((calibration.cache_dir() / "timings.json").read_text())
    assert [sorted(labels) for labels in kept.values()] == [["2", "8", "ar"]]


def test_a_failed_timing_keeps_the_page_serving_and_says_so(decoder, monkeypatch):
    monkeypatch.setattr(calibration, "measured_budgets", lambda: {})
    studio = app.startup_studio(decoder, ModelQueue(), tree_budget=None)
    monkeypatch.setattr(studio.timing, "time", lambda label: (_ for _ in ()).throw(RuntimeError("out of memory")))
    studio.time_budgets()
    assert studio.budget.budget == 16 and not studio.timing_pending
    assert "failed (RuntimeError: out of memory); the page keeps this budget" in studio.budget_sentence()


@pytest.mark.parametrize("argv, compiled", [
    (["--engine", "vllm"], True),
    (["--engine", "vllm", "--no-compile-step"], False),
    (["--engine", "vllm", "--step", "readable"], False),
    ([], False),
    (["--compile-step"], True),
])
def test_the_vllm_engine_compiles_its_step_by_default(argv, compiled):
    assert startup.compiles_step(app.parse_args(argv)) is compiled


def test_compiled_steps_are_cached_where_a_restart_finds_them(monkeypatch, tmp_path):
    monkeypatch.setenv("DDTREE_STUDIO_CACHE", str(tmp_path))
    assert startup.compile_caches({}) == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torchinductor"),
                                      "VLLM_CACHE_ROOT": str(tmp_path / "vllm")}
    assert (startup.compile_caches({"VLLM_CACHE_ROOT": "/data/vllm"})
            == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torchinductor")})


def test_the_vllm_app_loads_the_compiled_fixed_step_with_its_caches_set(monkeypatch, tmp_path):
    import engine.on_vllm.vllm_engine as vllm_engine

    loaded = {}
    monkeypatch.setattr(vllm_engine, "load_vllm_decoder", lambda model, drafter, dtype, options: loaded.update(
        options=options, inductor=os.environ.get("TORCHINDUCTOR_CACHE_DIR")))
    monkeypatch.setenv("DDTREE_STUDIO_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    startup.load_studio_decoder(app.parse_args(["--engine", "vllm"]))
    # vllm_compile None: the engine decides by the target (vLLM compiles hybrids)
    assert loaded["options"].compile_step and loaded["options"].fixed_step and loaded["options"].vllm_compile is None
    assert loaded["inductor"] == str(tmp_path / "torchinductor")
    startup.load_studio_decoder(app.parse_args(["--engine", "vllm", "--vllm-compile"]))
    assert loaded["options"].vllm_compile is True
    startup.load_studio_decoder(app.parse_args(["--engine", "vllm", "--no-vllm-compile"]))
    assert loaded["options"].vllm_compile is False


def test_vllm_compile_is_refused_without_the_vllm_engine(capsys):
    with pytest.raises(SystemExit):
        app.parse_args(["--vllm-compile"])
    assert "--vllm-compile has vLLM compile its target: it needs --engine vllm" in capsys.readouterr().err


@pytest.mark.parametrize("budget", ["0", "2000"])
def test_a_tree_budget_flag_out_of_range_is_refused_with_the_budgets_sentence(capsys, budget):
    with pytest.raises(SystemExit):
        app.parse_args(["--tree-budget", budget])
    said = capsys.readouterr().err
    assert f'error: tree budget must be "auto" or a whole number from 1 to 1024, got {budget}' in said


def test_a_compiled_steps_first_run_says_it_is_compiling():
    studio = Studio(SimpleNamespace(compile_step=True, drafter_info=DrafterInfo("shipped", True)), budget=None)
    first = DecodeSettings("ddtree", tree_budget=32)
    assert studio.first_use(first).startswith("compiling the ddtree step for this budget")
    studio.started.add(first.label)
    assert studio.first_use(first) is None and studio.first_use(DecodeSettings("ddtree", tree_budget=64))
    second = SimpleNamespace(compile_step=True, drafter_info=DrafterInfo("candidate", True, tag="candidate"))
    assert studio.first_use(first, second), "a second drafter's decoder compiles its own step"
    assert Studio(SimpleNamespace(compile_step=False), budget=None).first_use(first) is None


def test_a_compiled_steps_first_run_warms_up_untimed_and_shows_only_the_run_after_it(decoder, monkeypatch):
    monkeypatch.setattr(decoder, "compile_step", True)
    runs, start = [], decoder.start
    monkeypatch.setattr(decoder, "start", lambda prompt, settings, **kwargs: runs.append(settings) or start(
        prompt, settings, **kwargs))
    studio = Studio(decoder, budget=None)
    setting = DecodeSettings("ddtree", max_new_tokens=60, tree_budget=8)
    prompt_ids = decoder.target.chat_ids("hello")

    def last_live():
        return [live for live in run_live(studio, "hello", prompt_ids, [PlannedRun(Lane(TREE), decoder, setting)],
                                          RunControl())][-1]

    shown = last_live()
    assert [r.max_new_tokens for r in runs] == [40, 60], "a short warm-up, then the run itself"
    assert shown.race.traces[0].config.max_new_tokens == 60 and studio.first_use(setting) is None
    runs.clear()
    last_live()
    assert [r.max_new_tokens for r in runs] == [60], "once built, a budget runs without a warm-up"


def test_the_open_page_follows_the_timing_and_its_budget_box_stays_auto(decoder, monkeypatch):
    monkeypatch.setattr(calibration, "measured_budgets", lambda: {})
    studio = app.startup_studio(decoder, ModelQueue())
    page = app.StudioApp(studio)
    assert page.run_view.budget.value == "auto"
    assert set(page.follow_timing()) == {page.banner}, "while timing, only the banner moves"
    studio.timing.budgets, studio.timing.prompt = (2, 8), "howdoesitwork"
    studio.time_budgets()
    done = page.follow_timing()
    assert set(done) == {page.banner, page.timing_clock} and done[page.timing_clock].active is False
    assert "timed on this machine" in done[page.banner] and 'budget "auto" sizes every step' in done[page.banner]
