"""Runs in turns (``engine.loop.race``), each on its own clock, and what says their timings were disturbed
(``engine.measure.fairness``), on the tiny models."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from engine.errors import EngineError
from engine.loop.decode import Decoder, race as race_on
from engine.loop.race import Race
from engine.loop.settings import DecodeSettings
from engine.measure.fairness import AR_FAR_BELOW, ArReference, decode_rate, disturbance, stretch_step_seconds
from tests.conftest import ROOT, busy_core
from tests.tiny import tiny_decoder, tiny_drafter

PROMPT = [40, 41, 42, 43, 44]
METHODS = ("ar", "dflash", "ddtree")
TURN_S = 0.002  # a few steps of the tiny models


@pytest.fixture(scope="module")
def decoders() -> tuple[Decoder, Decoder]:
    readable = tiny_decoder(4, block_size=8)
    return readable, Decoder(readable.target, readable.drafter, readable.drafter_info, fixed_step=True)


def settings(tokens: int = 60, **kwargs) -> list[DecodeSettings]:
    return [DecodeSettings(method, max_new_tokens=tokens, tree_budget=6, **kwargs) for method in METHODS]


def test_runs_in_turns_decode_what_they_decode_alone_each_on_its_own_clock(decoders):
    readable = decoders[0]
    alone = [readable.run(prompt_ids=PROMPT, settings=setting) for setting in settings()]
    began = time.perf_counter()
    race = readable.race("", settings(), prompt_ids=PROMPT, turn_s=TURN_S)
    took = time.perf_counter() - began
    assert race.in_turns and [trace.output_ids for trace in race.traces] == [trace.output_ids for trace in alone]
    for trace, turns in zip(race.traces, race.turns):
        assert len(turns) > 2 and sum(turns) == len(trace.steps)  # it took turns, and every step is in one
        ends = [trace.prefill.t_end] + [s.t_end for s in trace.steps]
        assert ends == sorted(ends) and trace.summary.wall_s >= ends[-1]
    # each clock counts its own turns alone: together they fill the race, none of them holds all of it
    walls = [trace.summary.wall_s for trace in race.traces]
    assert max(walls) < 0.8 * took and sum(walls) == pytest.approx(took, rel=0.3)


def test_fixed_step_runs_go_one_after_another(decoders):
    """The fixed step's programs share one KV cache, which each run writes from its prompt on: no turns."""
    readable, fixed = decoders
    race = fixed.race("", settings(), prompt_ids=PROMPT, turn_s=TURN_S)
    assert not race.in_turns and [trace.config.step for trace in race.traces] == ["fixed"] * len(METHODS)
    assert race.turns == [[len(trace.steps)] for trace in race.traces]
    assert [trace.output_ids for trace in race.traces] == [
        readable.run(prompt_ids=PROMPT, settings=setting).output_ids for setting in settings()]


class WholeRuns(Decoder):
    """A decoder that runs each generation whole elsewhere, as the vLLM engine's workers do: no run to hand out."""

    def start_prepared(self, *args, **kwargs):
        raise EngineError("no run to hand out step by step")

    def run_prepared(self, prompt, prompt_ids, settings, notes, **kwargs):
        return Decoder.start_prepared(self, prompt, prompt_ids, settings, notes, **kwargs).execute()

    def takes_turns(self, settings) -> bool:
        return False


def test_a_decoder_that_runs_generations_whole_runs_and_races_without_handing_out_a_run(decoders):
    readable = decoders[0]
    whole = WholeRuns(readable.target, readable.drafter, readable.drafter_info)
    with pytest.raises(EngineError, match="no run to hand out"):
        whole.start(prompt_ids=PROMPT, settings=settings()[0])
    expected = [readable.run(prompt_ids=PROMPT, settings=setting).output_ids for setting in settings()]
    assert [whole.run(prompt_ids=PROMPT, settings=setting).output_ids for setting in settings()] == expected
    race = whole.race("", settings(), prompt_ids=PROMPT, turn_s=TURN_S)
    assert not race.in_turns and [trace.output_ids for trace in race.traces] == expected


def test_sampled_runs_in_turns_draw_what_they_draw_alone(decoders):
    readable = decoders[0]
    sampled = settings(40, temperature=0.8, seed=7)
    alone = [readable.run(prompt_ids=PROMPT, settings=setting) for setting in sampled]
    race = readable.race("", sampled, prompt_ids=PROMPT, turn_s=TURN_S)
    assert [trace.output_ids for trace in race.traces] == [trace.output_ids for trace in alone]


def test_one_race_runs_each_setting_once(decoders):
    twins = [DecodeSettings("ddtree", tree_budget=6), DecodeSettings("ar"), DecodeSettings("ddtree", tree_budget=6)]
    with pytest.raises(EngineError, match="^ddtree@6 asked for twice: the runs of one race must differ"):
        decoders[0].race("", twins, prompt_ids=PROMPT)
    details = [DecodeSettings("ddtree", tree_budget=6), DecodeSettings("ddtree", tree_budget=6, trace_detail="tokens")]
    assert len(decoders[1].race("", details, prompt_ids=PROMPT).traces) == 2


def test_two_drafters_on_one_target_take_turns_in_one_race_each_run_its_own(decoders):
    """A second drafter's decoder beside the first, on the same target object: the same settings once each, in
    turns, each run drafting with its own drafter (exact either way: greedy output is AR's)."""
    first = decoders[0]
    info = replace(first.drafter_info, name="candidate", tag="candidate")
    second = Decoder(first.target, tiny_drafter(first.target, seed=9, block_size=8), info)
    entries = [(decoder, setting) for setting in settings(tokens=30) for decoder in (first, second)]
    raced = race_on(entries, "", prompt_ids=PROMPT, turn_s=TURN_S)
    assert [trace.config.label for trace in raced.traces] == [
        "ar", "ar", "dflash", "dflash+candidate", "ddtree@6", "ddtree@6+candidate"]
    assert len({tuple(trace.output_ids) for trace in raced.traces}) == 1
    assert all(len(turns) > 1 for turns in raced.turns), "every run took several turns"


@pytest.fixture(scope="module")
def race(decoders) -> Race:
    return decoders[0].race("", settings(), prompt_ids=PROMPT, turn_s=TURN_S)


def test_a_quiet_race_is_not_called_disturbed(race):
    ar = race.traces[0]
    assert disturbance(race.traces, None) == []
    assert disturbance(race.traces, ArReference(decode_rate(ar), "the test recorded", "here")) == []


def test_ar_far_below_its_record_is_said_with_both_figures(race):
    rate = decode_rate(race.traces[0])
    recorded = rate / AR_FAR_BELOW * 2
    reference = ArReference(recorded, "the bench recorded", "on this kind of machine (tiny)")
    (finding,) = disturbance(race.traces, reference)
    assert finding == (f"AR decoded {rate:.1f} tokens/s (the prompt's pass left out), where the bench recorded "
                       f"{recorded:.1f} on this kind of machine (tiny): something else is using the processor, "
                       "which slows the methods unlike each other. Close it and run again")


def test_a_stretch_far_slower_than_another_is_said_with_its_figures(race):
    ddtree = copy.deepcopy(race.traces[2])
    clock = ddtree.prefill.t_end
    for step, seconds in zip(ddtree.steps, [0.3] * 8 + [0.9] * 4 + [0.3] * len(ddtree.steps)):
        step.t_start, clock = clock, clock + seconds
        step.t_end = clock
    assert stretch_step_seconds(ddtree)[:4] == pytest.approx([0.3, 0.3, 0.9, 0.9])
    assert disturbance([ddtree], None) == [
        "DDTree's steps took 900 ms at its slowest and 300 ms at its fastest (1 s of its own time each): the "
        "machine's load changed while it ran. Run again once it is quiet"]
    assert disturbance(race.traces, None) == []  # the tiny runs last under a stretch: nothing to compare


@pytest.mark.slow
def test_the_bench_in_turns_under_load_keeps_its_speed_up_or_records_the_disturbance(tmp_path):
    """``engine.tools.bench --interleave`` on the bundled pair, quiet and beside a busy core: DDTree's speed-up over
    AR stays within 15% of the quiet run's, or the results say what disturbed it."""
    def bench(name: str) -> dict:
        out = tmp_path / f"{name}.json"
        subprocess.run([sys.executable, "-m", "engine.tools.bench", "--prompts", "assets/prompts/smoke.jsonl",
                        "--limit", "2", "--methods", "ar,ddtree", "--tree-budget", "16", "--max-new-tokens", "48",
                        "--interleave", "--no-progress", "--out", str(out)], cwd=ROOT, check=True,
                       capture_output=True)
        return json.loads(out.read_text())

    quiet = bench("quiet")
    with busy_core():
        loaded = bench("loaded")
    assert quiet["config"]["interleave"] and all(len(run["turns"]) > 1 for run in quiet["runs"])
    speedups = [results["summary"]["ddtree@16"]["speedup_vs_ar"] for results in (quiet, loaded)]
    if abs(speedups[1] / speedups[0] - 1) > 0.15:
        assert loaded["disturbance"], speedups
        assert all("Close it and run again" in finding or "Run again once it is quiet" in finding
                   for finding in loaded["disturbance"])
