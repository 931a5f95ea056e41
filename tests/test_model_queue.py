"""The model's one owner (engine.serving.model_queue) and the app's handlers racing on it: every pair of
model-using handlers started together finishes, in either order (a lock taken inside the model's thread
once froze Run and the doctor for every visitor)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

import app
import engine.measure.calibration as calibration
from engine.measure.calibration import BudgetChoice, StartupTiming
from engine.serving.model_queue import ModelQueue
from tests.tiny import tiny_decoder
from viz.page.state import RunControl, Studio

RACE_TIMEOUT_S = 120
PROMPT = "howdoesitwork"


# ---------------------------------------------------------------- the queue alone

def test_jobs_run_one_at_a_time_in_the_order_asked():
    queue, order, gate = ModelQueue(), [], threading.Event()
    first = queue.submit(gate.wait)
    while not first.running():
        time.sleep(0.01)
    jobs = [queue.submit(order.append, n) for n in range(5)]
    assert [queue.ahead_of(job) for job in jobs] == [0, 1, 2, 3, 4]
    gate.set()
    for job in jobs:
        job.result(timeout=5)
    assert first.result() is True and order == [0, 1, 2, 3, 4]
    assert queue.ahead_of(jobs[0]) == 0


def test_a_queued_job_can_be_dropped_and_a_running_one_cannot():
    queue, gate, ran = ModelQueue(), threading.Event(), []
    running = queue.submit(gate.wait)
    while not running.running():
        time.sleep(0.01)
    dropped, kept = queue.submit(ran.append, "dropped"), queue.submit(ran.append, "kept")
    assert not queue.cancel(running)
    assert queue.cancel(dropped) and queue.ahead_of(kept) == 0
    gate.set()
    kept.result(timeout=5)
    assert ran == ["kept"] and dropped.cancelled()


def test_a_job_that_waits_for_another_job_is_refused_not_frozen():
    queue = ModelQueue()
    with pytest.raises(RuntimeError, match="may not wait for another model job"):
        queue.run(queue.run, len, "abc")


# ---------------------------------------------------------------- the handlers racing

@pytest.fixture(scope="module")
def page(tmp_path_factory) -> app.StudioApp:
    studio = Studio(tiny_decoder(0), BudgetChoice(4, {}, "set for the test"))
    return app.StudioApp(studio)


def drained(generator) -> list:
    return list(generator)


def handler_calls(page: app.StudioApp, tmp_path) -> dict:
    """Each model-using handler as a call that runs it to the end, as a visitor's click or an API call does."""
    studio = page.studio

    def run():
        updates = drained(page.run_view.run(PROMPT, 6, 0.0, 0, 4, ["ar", "dflash", "ddtree"], "", RunControl(),
                                            present=page.present))
        return updates[-1][page.session.status]

    def sweep():
        updates = drained(page.sweep_view.sweep(PROMPT, 6, 0.0, 0, "2, 4", "", RunControl()))
        return updates[-1][page.sweep_view.status]

    def doctor():
        return list(page.doctor_view.examine(PROMPT, 4, False, RunControl()))[-1][page.doctor_view.verdict]

    def timing():
        studio.timing = StartupTiming(studio.decoder, budgets=(2,), prompt=PROMPT, tokens=4,
                                      path=tmp_path / f"timings-{threading.get_ident()}.json")
        studio.timing_error = None
        studio.time_budgets()
        return studio.timing_error or "timed"

    return {"run": run, "sweep": sweep, "doctor": doctor, "timing": timing}


RACES = [pair for pair in itertools.combinations_with_replacement(["run", "sweep", "doctor", "timing"], 2)
         if pair != ("timing", "timing")]  # the start-up timing runs once an app


@pytest.mark.parametrize("first,second", RACES)
def test_every_pair_of_model_handlers_started_together_finishes(page, tmp_path, monkeypatch, first, second):
    monkeypatch.setattr(calibration, "measured_budgets", lambda: {})
    calls = handler_calls(page, tmp_path)
    results: dict[str, object] = {}

    def call(slot: str, name: str):
        try:
            results[slot] = calls[name]()
        except Exception as exc:  # reported below with the pair's name
            results[slot] = exc

    threads = [threading.Thread(target=call, args=(slot, name), daemon=True)
               for slot, name in (("first", first), ("second", second))]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # the second arrives while the first holds the model
    for thread in threads:
        thread.join(RACE_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), f"{first} + {second} froze: {results}"
    for slot, name in (("first", first), ("second", second)):
        outcome = results[slot]
        assert not isinstance(outcome, Exception), f"{name} failed beside {first if slot == 'second' else second}"
        expected = {"run": "**Done**", "sweep": "Sweep finished.", "timing": "timed"}.get(name)
        if expected:
            assert expected in outcome, (name, outcome)
        else:
            assert "internal error" not in outcome and outcome.strip(), (name, outcome)


# ---------------------------------------------------------------- served requests beside the page's runs

def test_a_batch_of_served_requests_and_a_page_run_take_turns_and_both_finish():
    """The server's rounds (engine.serving.batcher) are jobs on the same queue as the page's runs: a run asked for
    while requests are in flight starts between two rounds, and every request still finishes with its solo text."""
    from engine.loop.settings import DecodeSettings
    from engine.serving.batcher import Batcher

    decoder, twin = tiny_decoder(0), tiny_decoder(0)
    queue = ModelQueue()
    batcher = Batcher(decoder, queue)
    prompts = [decoder.target.text_ids(text) for text in ("abc", "hello", "why?")]
    settings = DecodeSettings("ddtree", max_new_tokens=40, tree_budget=8)
    futures = [batcher.submit(f"request-{n}", "", ids, *decoder.prepare(settings, len(ids)))
               for n, ids in enumerate(prompts)]
    steps_when_the_page_ran = []

    def page_run():
        steps_when_the_page_ran.append(batcher.batch.steps_taken)
        return decoder.run(prompt_ids=prompts[0], settings=DecodeSettings("ar", max_new_tokens=40))

    page = queue.submit(page_run)
    traces = [future.result(timeout=RACE_TIMEOUT_S) for future in futures]
    assert page.result(timeout=RACE_TIMEOUT_S).output_ids == twin.run(
        prompt_ids=prompts[0], settings=DecodeSettings("ar", max_new_tokens=40)).output_ids
    assert steps_when_the_page_ran[0] < batcher.batch.steps_taken, "the page's run went between two rounds"
    for ids, trace in zip(prompts, traces):
        assert trace.output_ids == twin.run(prompt_ids=ids, settings=settings).output_ids
    assert batcher.in_flight == 0
