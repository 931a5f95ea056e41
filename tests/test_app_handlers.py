"""The page's handlers called directly on a StudioApp over the tiny models: what bad input is told, what a
refusal leaves alone, what the replay animates, and what the page keeps on disk and in the budget box."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path

import gradio as gr
import pytest

import app
import viz.page.traces
from engine.errors import EngineError
from engine.loop.settings import DecodeSettings
from engine.measure.calibration import BudgetChoice
from engine.measure.fairness import ArReference
from engine.methods import NAMES, check_budget
from engine.models.drafter import save_drafter
from tests.tiny import tiny_decoder, tiny_drafter
from viz.page.run import RUN_OUTPUTS
from viz.page.state import TRACE_FILE_NAME, RunControl, ScratchFiles, Studio, capitalized, save_traces

PROMPT = "howdoesitwork"  # the tiny tokenizer reads printable characters without spaces


@pytest.fixture(scope="module")
def page() -> app.StudioApp:
    return app.StudioApp(Studio(tiny_decoder(0), BudgetChoice(8, {}, "set by the test")))


@pytest.fixture(scope="module")
def traces(page) -> dict:
    decoder = page.studio.decoder
    return {method: decoder.run(PROMPT, DecodeSettings(method, max_new_tokens=24, tree_budget=8))
            for method in ("ar", "dflash", "ddtree")}


@pytest.fixture(scope="module")
def candidate(page, tmp_path_factory) -> str:
    """A second drafter for the tiny target, in a folder the page offers."""
    folder = tmp_path_factory.mktemp("drafters") / "candidate"
    save_drafter(tiny_drafter(page.studio.decoder.target, seed=1), folder)
    page.studio.offered_drafters = [str(folder)]
    return str(folder)


def run_once(page, max_new_tokens=4, temperature=0.0, seed=0, budget=8, methods=("ar",),
             second_drafter="") -> list[dict]:
    """Every update the Run handler streams, to the end."""
    return list(page.run_view.run(PROMPT, max_new_tokens, temperature, seed, budget, list(methods), second_drafter,
                                  RunControl(), present=page.present))


def refused(call) -> str:
    with pytest.raises(gr.Error) as error:
        call()
    return error.value.message


@pytest.mark.parametrize("field, value, message", [
    ("seed", 2**70, f"Seed must be a whole number from 0 to {2**63 - 1}, got 1180591620717411303424"),
    ("seed", -1, f"Seed must be a whole number from 0 to {2**63 - 1}, got -1"),
    ("seed", True, "Seed must be a whole number, got True"),
    ("seed", None, "Seed is empty: enter a number"),
    ("max_new_tokens", "ten", "Max new tokens must be a whole number, got 'ten'"),
    ("max_new_tokens", 2**70, "Max new tokens must be a whole number from 1 to 4096, got 1180591620717411303424"),
    ("max_new_tokens", float("inf"), "Max new tokens must be a whole number, got inf"),
    ("temperature", "hot", "Temperature must be a number, got 'hot'"),
    ("temperature", float("nan"), "Temperature must be a number, got nan"),
    ("temperature", -0.5, "Temperature must be a number from 0 to 2, got -0.5"),
    ("temperature", 1000.0, "Temperature must be a number from 0 to 2, got 1000.0"),
    ("budget", [8], 'Tree budget must be "auto" or a whole number from 1 to 1024, got [8]'),
    ("budget", "", 'Tree budget must be "auto" or a whole number from 1 to 1024, got \'\''),
    ("budget", "eight", 'Tree budget must be "auto" or a whole number from 1 to 1024, got \'eight\''),
    ("budget", -3, 'Tree budget must be "auto" or a whole number from 1 to 1024, got -3'),
])
def test_every_number_of_a_run_and_a_sweep_is_refused_with_a_sentence_before_anything_runs(page, field, value,
                                                                                           message):
    assert refused(lambda: run_once(page, **{field: value}, methods=("ar", "ddtree"))) == message
    if field != "budget":  # the sweep takes its budgets as text
        settings = dict(max_new_tokens=4, temperature=0.0, seed=0) | {field: value}
        sweep = page.sweep_view.sweep(PROMPT, settings["max_new_tokens"], settings["temperature"], settings["seed"],
                                      "2, 4", "", RunControl())
        assert refused(lambda: next(sweep)) == message


def test_a_refusal_logs_one_line_not_a_traceback(page, caplog):
    caplog.set_level(logging.INFO, logger="ddtree-studio")
    refused(lambda: run_once(page, seed=-1))
    assert [record.getMessage() for record in caplog.records] == [
        f"refused: Seed must be a whole number from 0 to {2**63 - 1}, got -1"]
    assert caplog.records[0].exc_info is None


@pytest.mark.parametrize("value, message", [
    ("ten", "Greedy tokens per prompt must be a whole number, got 'ten'"),
    (None, "Greedy tokens per prompt is empty: enter a number"),
    (2.5, "Greedy tokens per prompt must be a whole number, got 2.5"),
    (10**30, "The probe's greedy tokens per prompt must be 2 to 4096, got 1000000000000000000000000000000"),
])
def test_the_doctor_refuses_a_bad_token_count_in_its_check_and_in_its_endpoint(page, value, message):
    examine, check = (next(fn.fn for fn in page.demo.fns.values() if fn.name == name) for name in ("examine", "check"))
    assert refused(lambda: check(value, False)) == message
    assert refused(lambda: next(examine("Say hi.", value, False, RunControl()))) == message


def test_the_doctor_says_it_waits_its_turn_and_a_stop_ends_it(page):
    doctor, release, control = page.doctor_view, threading.Event(), RunControl()
    page.studio.queue.submit(release.wait)  # another visitor's run
    updates = doctor.examine("Say hi.", 8, False, control)
    assert next(updates)[doctor.verdict] == ("**Running the doctor**: waiting for the model, behind 1 other "
                                             "run(s)…")
    control.stop = True  # the tab's Stop
    release.set()
    assert list(updates)[-1][doctor.verdict] == ("**Stopped**: the doctor was stopped during the target's greedy "
                                                 "outputs. Nothing was judged.")


@pytest.mark.parametrize("step, shown", [(999, "last"), (0, 1), (-5, 1), (3.0, 3)])
def test_a_step_past_either_end_shows_the_nearest_step_and_says_which_in_the_box(page, traces, step, shown):
    inspector = page.inspector
    shown = len(traces["ddtree"].steps) if shown == "last" else shown
    update = inspector.choose_step(traces, "ddtree", step)
    assert update[inspector.step] == shown
    assert f"Step {shown}" in update[inspector.tree].layout.title.text
    assert f"Step {shown}" in update[inspector.why]


@pytest.mark.parametrize("step, message", [("x", "Step must be a whole number, got 'x'"),
                                           (None, "Step is empty: enter a number"),
                                           (2.5, "Step must be a whole number, got 2.5")])
def test_a_step_that_is_no_whole_number_is_refused_with_a_sentence(page, traces, step, message):
    assert refused(lambda: page.inspector.choose_step(traces, "ddtree", step)) == message


def test_a_method_that_is_no_name_is_refused_with_a_sentence(page, traces):
    assert refused(lambda: page.inspector.choose_step(traces, ["ddtree"], 1)) == (
        "This session has no ['ddtree'] trace; it has ar, dflash, ddtree")


def test_next_past_the_last_step_stays_on_it(page, traces):
    last = len(traces["ar"].steps)
    update = page.inspector.show_step(traces, "ar", last, delta=1)
    assert update[page.inspector.step] == last


def test_an_upload_whose_values_cannot_be_drawn_is_refused_with_a_sentence(page, traces, tmp_path, monkeypatch):
    path = tmp_path / "traces.json"
    save_traces(list(traces.values()), path)
    # a field of the wrong type that the reader lets through, as the text view first meets it
    monkeypatch.setattr(viz.page.traces, "read_trace_file", lambda _: [*traces.values()][:1])
    monkeypatch.setattr(traces["ar"].summary, "wall_s", "fast")
    message = refused(lambda: page.traces_view.load_upload(str(path), present=page.present))
    assert message.startswith("The file's traces hold a value that cannot be shown (TypeError: ")


def test_every_event_that_shows_progress_cannot_be_refused_on_its_outputs(page):
    """A failed event marks each output it shows progress on "Error", long after the toast: events that can
    refuse hide their progress, or refuse in a check without outputs that runs before them."""
    dependencies = page.demo.config["dependencies"]
    checked = {dep["id"] for before in dependencies if not before["outputs"]
               for dep in dependencies if dep.get("trigger_after") == before["id"] and dep["trigger_only_on_success"]}
    showing = {dep["api_name"] for dep in dependencies
               if dep["outputs"] and dep["show_progress"] != "hidden" and dep["id"] not in checked}
    assert showing == set(), "these can mark their outputs 'Error'"
    assert {dep["api_name"] for dep in dependencies if dep["id"] in checked} == {"video", "examine"}


def test_run_sweep_and_replay_disable_each_other_until_they_end_however_they_end(page):
    dependencies = page.demo.config["dependencies"]
    by_id = {dep["id"]: dep for dep in dependencies}
    buttons = sorted(button._id for button in page.busy_buttons)
    for name in ("run", "sweep", "replay"):
        work = next(dep for dep in dependencies if dep["api_name"] == name)
        before = by_id[work["trigger_after"]]
        after = [dep for dep in dependencies if dep.get("trigger_after") == work["id"]]
        assert not work["trigger_only_on_success"], "the work starts once the buttons are off"
        # the page runs a .then only after a success: a refused or failed run needs its .failure
        assert sorted((dep["trigger_only_on_success"], dep["trigger_only_on_failure"]) for dep in after) == [
            (False, False), (False, True)]
        assert [sorted(dep["outputs"]) for dep in (before, *after)] == [buttons] * 3
        assert {dep["api_visibility"] for dep in (before, *after)} == {"private"}
    disable, enable = (next(fn.fn for fn in page.demo.fns.values() if fn._id == dep["id"])
                       for dep in (before, after[0]))
    assert {button.interactive for button in disable().values()} == {False}
    assert {button.interactive for button in enable().values()} == {True}


def test_the_replay_animates_the_race_chart_with_its_clock(page, traces):
    frames = list(page.replay_view.replay(traces, "1", RunControl()))
    race = page.replay_view.race
    assert all(race in frame for frame in frames)
    clocks = [frame[race].layout.shapes[0].x0 for frame in frames[:-1]]
    assert clocks and clocks == sorted(clocks), "the clock line moves forward"
    assert not frames[-1][race].layout.shapes, "the finished replay shows the whole race"
    assert frames[-1][page.session.status] == "Replay finished."


@pytest.mark.parametrize("methods", [("ddtree",), ("ar",)])  # the box's budget is every run's: AR's too
def test_a_budget_over_1024_is_refused_with_the_sentence_every_entry_point_says(page, methods):
    with pytest.raises(EngineError) as engine_says:
        check_budget(2000)
    assert str(engine_says.value) == 'tree budget must be "auto" or a whole number from 1 to 1024, got 2000'
    assert refused(lambda: run_once(page, budget=2000, methods=methods)) == capitalized(str(engine_says.value))


def test_each_note_on_the_settings_is_said_once_however_many_methods_ran(page, monkeypatch):
    monkeypatch.setattr(page.studio.decoder, "fixed_step", True)  # where sampling takes the readable step instead
    status = run_once(page, temperature=0.5, max_new_tokens=2, methods=NAMES)[-1][page.session.status]
    assert status.startswith("**Done**") and status.count("sampling runs the readable step") == 1


def test_a_run_streams_every_column_as_they_take_turns_and_says_when_its_timings_were_disturbed(page, monkeypatch):
    updates = run_once(page, max_new_tokens=24, methods=NAMES)
    live = [update for update in updates if page.session.status in update and "Running" in update[page.session.status]]
    columns = [page.run_view.columns[name] for name in NAMES]  # the first drafter's: no second one is picked
    assert any(all(column in update for column in columns) for update in live), "every column streams"
    quiet = updates[-1][page.session.status]
    assert quiet.startswith("**Done**") and "(in turns, each on its own clock" in quiet and "disturbed" not in quiet
    monkeypatch.setattr(page.studio.decoder, "fixed_step", True)  # whose programs share one KV cache
    whole = run_once(page, max_new_tokens=8, methods=NAMES)[-1][page.session.status]
    assert "(one after another: the fixed step and the vLLM engine run each generation whole)" in whole
    monkeypatch.setattr(page.studio.decoder, "fixed_step", False)
    recorded = ArReference(10**6, "the test recorded", "here")
    monkeypatch.setattr(page.studio, "budget", replace(page.studio.budget, ar=recorded))
    disturbed = run_once(page, max_new_tokens=24, methods=["ar", "ddtree"])[-1][page.session.status]
    assert disturbed.startswith("**Done**") and " ⚠️ **The timings were disturbed**: AR decoded " in disturbed
    assert ("where the test recorded 1000000.0 here: something else is using the processor, which slows the methods "
            "unlike each other. Close it and run again.") in disturbed


def test_the_budget_box_opens_at_auto_and_only_traces_shown_set_it(page):
    budget, dependencies = page.run_view.budget, page.demo.config["dependencies"]
    setters = [dep for dep in dependencies if budget._id in dep["outputs"]]
    shown = {dep["id"] for dep in dependencies if dep["api_name"] in ("upload", "open_request", "open")}
    assert {dep["trigger_after"] for dep in setters} <= shown and budget.value == "auto"
    assert budget not in page.follow_timing()


def test_the_page_keeps_a_bounded_number_of_files_in_one_folder(tmp_path):
    files = ScratchFiles(keep=2)
    paths = []
    for _ in range(3):
        paths.append(files.path(TRACE_FILE_NAME))
        paths[-1].write_text("{}")
    assert [path.exists() for path in paths] == [False, True, True]
    assert {path.parent.parent for path in paths} == {Path(files.folder.name)}
    assert {path.name for path in paths} == {TRACE_FILE_NAME}, "the visitor's download keeps its name"


def test_the_public_api_names_every_endpoint_and_output(page):
    endpoints = page.demo.get_api_info()["named_endpoints"]
    assert set(endpoints) == {"/run", "/stop", "/replay", "/video", "/upload", "/select_method", "/inspect",
                              "/sweep", "/examine", "/traffic", "/open_request", "/info"}
    assert [p["parameter_name"] for p in endpoints["/run"]["parameters"]] == [
        "prompt", "max_new_tokens", "temperature", "seed", "budget", "methods", "second_drafter"]
    second = endpoints["/run"]["parameters"][-1]
    assert second["parameter_has_default"] and second["parameter_default"] == "", "a client that names none runs one"
    assert [p["parameter_name"] for p in endpoints["/examine"]["parameters"]] == [
        "prompt_text", "max_new_tokens", "check_vllm"]
    unnamed = {name: [r["label"] for r in endpoint["returns"] if r["label"].startswith("value_")]
               for name, endpoint in endpoints.items()}
    assert {name: labels for name, labels in unnamed.items() if labels} == {}
    for name in ("/run", "/upload", "/open_request"):  # what RUN_OUTPUTS names, one for one
        assert len(endpoints[name]["returns"]) == len(RUN_OUTPUTS)
    assert page.info()["run_outputs"] == list(RUN_OUTPUTS)



def test_the_served_page_keeps_a_bounded_number_of_sessions(monkeypatch):
    """Gradio keeps each session's traces and outputs until newer sessions evict it: main bounds how many."""
    launched = {}
    monkeypatch.setattr(app, "load_studio_decoder", lambda args: tiny_decoder(0))
    monkeypatch.setattr(gr.Blocks, "launch", lambda demo, **kwargs: launched.update(kwargs))
    monkeypatch.setattr("sys.argv", ["app.py", "--tree-budget", "8"])
    app.main()
    assert launched["state_session_capacity"] == app.MAX_SESSIONS < 10000  # Gradio's own default


def test_a_second_drafter_runs_beside_the_first_in_every_view_on_the_same_target(page, candidate, tmp_path):
    final = run_once(page, max_new_tokens=6, methods=NAMES, second_drafter=candidate)[-1]
    traces = final[page.session.traces]
    assert list(traces) == ["ar", "dflash", "dflash_2", "ddtree", "ddtree_2"]
    assert [trace.config.label for trace in traces.values()] == [
        "ar", "dflash", "dflash+candidate", "ddtree@8", "ddtree@8+candidate"]
    second = traces["ddtree_2"]
    assert second.config.drafter == candidate and second.text == traces["ar"].text  # greedy: either drafter is exact
    assert page.studio.second_decoders[candidate].target is page.studio.decoder.target, "the target loads once"
    column = final[page.run_view.columns["ddtree_2"]]
    assert "second drafter" in column and "identical to AR" in column
    # its columns show while it is picked, or while the traces shown hold its runs
    assert {update.visible for update in page.run_view.show_second(traces, candidate).values()} == {True}
    assert {update.visible for update in page.run_view.show_second(traces, "").values()} == {True}
    ar_only = {"ar": traces["ar"]}
    assert {update.visible for update in page.run_view.show_second(ar_only, "").values()} == {False}
    assert ("DDTree@8 · candidate", "ddtree_2") in final[page.inspector.method].choices
    assert [line.name for line in final[page.replay_view.race].data] == [t.config.label for t in traces.values()]
    assert final[page.traces_view.summary]["dflash_2"]["label"] == "dflash+candidate"
    # the download opens again in the same columns
    path = tmp_path / "two-drafters.json"
    save_traces(list(traces.values()), path)
    uploaded = page.traces_view.load_upload(str(path), present=page.present)
    assert list(uploaded[page.session.traces]) == list(traces)


def test_a_sweep_with_a_second_drafter_runs_each_budget_with_both(page, candidate):
    sweep = page.sweep_view
    final = list(sweep.sweep(PROMPT, 6, 0.0, 0, "2, 4", candidate, RunControl()))[-1]
    rows = final[sweep.table]
    assert [(row[0], row[-1]) for row in rows] == [(2, "random"), (4, "random"), (2, candidate), (4, candidate)]
    assert "With candidate, best measured: budget" in final[sweep.status]


def test_a_second_drafter_the_page_does_not_offer_is_refused(page, candidate):
    assert refused(lambda: run_once(page, methods=NAMES, second_drafter="/etc")) == (
        f"Second drafter '/etc' is not one this page offers; choose from {candidate} (python app.py --second-drafter "
        "FOLDER adds one)")


def test_an_upload_puts_its_prompt_and_settings_in_the_form_for_the_next_run_or_sweep(page, traces, tmp_path):
    path = tmp_path / "uploaded.json"
    save_traces(list(traces.values()), path)
    shown = page.traces_view.load_upload(str(path), present=page.present)
    run = page.run_view
    form = run.filled_from(shown[page.session.traces])
    assert [form[box] for box in run.form] == [PROMPT, 24, 0.0, 0, "8", ["ar", "dflash", "ddtree"]]
    dependencies = page.demo.config["dependencies"]
    upload = next(dep for dep in dependencies if dep["api_name"] == "upload")
    filled = [dep for dep in dependencies if dep.get("trigger_after") == upload["id"]]
    assert [sorted(dep["outputs"]) for dep in filled] == [sorted(box._id for box in run.form)]
    assert filled[0]["trigger_only_on_success"]


def test_every_font_face_the_page_declares_draws_every_letter():
    """Gradio ships semibold faces of a few dozen glyphs: a bold "AR" drew its "A" from one and its "R" from a
    fallback font, as two words. The page's theme declares only faces that hold every letter and digit."""
    import re

    from fontTools.ttLib import TTFont

    frontend = Path(gr.__file__).parent / "templates" / "frontend"
    faces = [frontend / url for font in (*app.THEME._font, *app.THEME._font_mono) if hasattr(font, "stylesheet")
             for url in re.findall(r"url\('([^']+)'\)", font.stylesheet()["css"] or "")]
    assert len(faces) == 4
    wanted = {ord(c) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"}
    thin = [face.name for face in faces if not wanted <= set(TTFont(face).getBestCmap())]
    assert not thin, f"these faces lack letters: {thin}"


def test_beside_an_engine_that_holds_one_drafter_a_second_is_refused_before_any_folder_is_read(page, monkeypatch):
    monkeypatch.setattr(page.studio.decoder, "engine", "vllm")
    assert refused(lambda: run_once(page, methods=NAMES, second_drafter="/anywhere")) == (
        "A second drafter runs beside a first on the torch engine: the vLLM engine's workers hold one drafter")
    assert not app.startup_studio(page.studio.decoder, page.studio.queue).offered_drafters, "nor offered"
