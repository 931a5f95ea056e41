"""The launched app (bundled SmolLM2) driven through its API with gradio_client."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from engine.errors import EngineError
from engine.methods import NAMES, check_budget
from engine.trace import SCHEMA_VERSION, Trace
from viz.page.run import EXAMPLE_PROMPTS, RUN_OUTPUTS, named_outputs
from viz.page.state import LANE_KEYS

ALL_METHODS = list(NAMES)
PROMPT = "Name three colors."
ROOT = Path(__file__).resolve().parent.parent


def run(client: Client, prompt: str = PROMPT, max_new_tokens=12, temperature=0.0, seed=0, budget=8,
        methods=ALL_METHODS) -> dict:
    return named_outputs(client.predict(prompt, max_new_tokens, temperature, seed, budget, methods, api_name="/run"))


def plot_data(value) -> list[dict]:
    return json.loads(value["plot"])["data"]


def tree_nodes(value) -> list[int]:
    """Node ids drawn in a tree figure (node traces carry them as customdata)."""
    return sorted(node for trace in plot_data(value) for node in trace.get("customdata") or [])


@pytest.fixture(scope="module")
def client(app_url) -> Client:
    return Client(app_url, verbose=False)


@pytest.fixture(scope="module")
def full_run(client) -> dict:
    return run(client)


def test_run_gives_three_texts_and_trees(client, full_run):
    assert full_run["status"].startswith("**Done**")
    summary = full_run["summary"]
    assert set(summary) == set(ALL_METHODS)
    for method in ALL_METHODS:
        assert summary[method]["text"].strip()
        assert summary[method]["tokens"] == 12
        assert "ddt-text" in full_run[method]
    # greedy decoding: the drafts change the speed, never the text
    assert summary["dflash"]["identical_to_ar"] and summary["ddtree"]["identical_to_ar"]
    # the shipped drafter when there is one, else a random one that must say so
    assert ("untrained" in full_run["ddtree"]) == (not summary["ddtree"]["drafter_trained"])
    traces = {t.config.method: t for t in read_download(full_run["download"])}
    assert set(traces) == set(ALL_METHODS)
    for method in ALL_METHODS:
        step, tree = client.predict(method, api_name="/select_method")[:2]
        assert step["maximum"] >= 1
        first = traces[method].steps[0]
        assert tree_nodes(tree) == list(range(first.tree_size + 2))
    ddtree_first = traces["ddtree"].steps[0]
    assert 1 <= ddtree_first.tree_size <= 8
    assert tree_nodes(full_run["tree"]) == list(range(ddtree_first.tree_size + 2))


def test_run_summary_explains_the_speed_with_tau_and_step_cost(full_run):
    summary = full_run["summary"]
    assert summary["ar"]["step_cost_vs_ar"] == 1.0 and summary["ar"]["predicted_speedup"] == 1.0
    for method in ("dflash", "ddtree"):
        entry = summary[method]
        assert entry["step_cost_vs_ar"] > 0 and entry["speedup_vs_ar"] > 0
        assert entry["predicted_speedup"] == pytest.approx(entry["tau"] / entry["step_cost_vs_ar"], rel=1e-3)
        assert 0 < entry["prefill_s"] < entry["wall_s"]  # what the prediction leaves out, so a reader can weigh it
        assert entry["identical_to_ar"] and entry["divergence"] is None  # float32: where it left AR, were it to
    names = [bar["name"] for bar in plot_data(full_run["economics_plot"])]
    assert names == ["τ: tokens per step", "step cost (AR steps)"]
    assert "DFlash commits" in full_run["economics_text"] and "DDTree@8 commits" in full_run["economics_text"]


def test_inspect_moves_through_steps(client, full_run):
    client.predict("ddtree", api_name="/select_method")
    step, tree, probs, why, _ = client.predict("ddtree", 2, api_name="/inspect")
    assert step == 2 and "Step 2" in json.loads(tree["plot"])["layout"]["title"]["text"]
    assert "Step 2" in why
    assert any(trace["type"] == "heatmap" for trace in plot_data(probs))
    last = full_run["summary"]["ddtree"]["steps"]
    step, tree = client.predict("ddtree", 999, api_name="/inspect")[:2]
    assert step == last and f"Step {last}" in json.loads(tree["plot"])["layout"]["title"]["text"]
    for value, message in (("x", "Step must be a whole number, got 'x'"), (None, "Step is empty: enter a number")):
        with pytest.raises(AppError) as refused:
            client.predict("ddtree", value, api_name="/inspect")
        assert message in str(refused.value)


def read_download(path: str) -> list[Trace]:
    bundle = json.loads(Path(path).read_text())
    assert bundle["schema_version"] == SCHEMA_VERSION
    return [Trace.from_dict(item) for item in bundle["traces"]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt="   "), "prompt is empty"),
    (dict(prompt="word " * 9000), "exceeds the model's context"),
    (dict(budget=0), 'tree budget must be "auto" or a whole number from 1 to 1024, got 0'),
    (dict(max_new_tokens=0), "max new tokens must be a whole number from 1 to 4096, got 0"),
    (dict(max_new_tokens=2.5), "max new tokens must be a whole number, got 2.5"),
    (dict(budget=16.5), "tree budget must be \"auto\" or a whole number from 1 to 1024, got '16.5'"),
    (dict(budget="many"), "tree budget must be \"auto\" or a whole number from 1 to 1024, got 'many'"),
    (dict(methods=[]), "choose at least one method"),
    (dict(seed=2**70), f"seed must be a whole number from 0 to {2**63 - 1}, got 1180591620717411303424"),
    (dict(max_new_tokens="ten"), "max new tokens must be a whole number, got 'ten'"),
    (dict(temperature=None), "temperature is empty: enter a number"),
    (dict(temperature=1000.0), "temperature must be a number from 0 to 2, got 1000.0"),
])
def test_bad_input_is_refused_with_its_reason_and_the_app_keeps_serving(client, kwargs, message):
    # the API's error is the reason itself, not a status line beside {'__type__': 'update'} outputs
    with pytest.raises(AppError) as refused:
        run(client, **kwargs)
    assert message in str(refused.value).lower()
    good = run(client, max_new_tokens=3, methods=["ar"])
    assert good["status"].startswith("**Done**") and good["summary"]["ar"]["tokens"] == 3


def test_a_budget_over_1024_is_refused_with_the_sentence_every_entry_point_says(client):
    with pytest.raises(EngineError) as engine_says:
        check_budget(2000)
    assert str(engine_says.value) == 'tree budget must be "auto" or a whole number from 1 to 1024, got 2000'
    with pytest.raises(AppError) as refused:
        run(client, budget=2000, max_new_tokens=2, methods=["ddtree"])
    assert str(engine_says.value) in str(refused.value).lower()


def test_info_names_the_run_outputs_in_their_order(client):
    assert client.predict(api_name="/info")["run_outputs"] == list(RUN_OUTPUTS)


def test_corrupt_upload_is_reported(client, full_run, tmp_path):
    broken = json.loads(Path(full_run["download"]).read_text())
    del broken["traces"][2]["steps"][0]["tree_parents"][-1]  # a truncated DDTree step
    for content, message in (("{not json", "not a json trace file"),
                             ('{"foo": 1}', "not a trace file: it holds 'foo', where a trace file holds"),
                             (json.dumps({"schema_version": 1, "traces": [{"schema_version": 1, "config": {}}]}),
                              "missing or has malformed field"),
                             (json.dumps({"schema_version": 99, "traces": []}), "schema version 99"),
                             (json.dumps(broken), "step 1 of the ddtree trace is inconsistent")):
        path = tmp_path / "bad.json"
        path.write_text(content)
        with pytest.raises(AppError) as refused:
            client.predict(handle_file(str(path)), api_name="/upload")
        assert message in str(refused.value).lower(), refused.value
    assert run(client, max_new_tokens=2, methods=["ar"])["status"].startswith("**Done**")


def test_uploaded_traces_replay_and_inspect_without_running(app_url, full_run):
    fresh = Client(app_url, verbose=False)
    loaded = named_outputs(fresh.predict(handle_file(full_run["download"]), api_name="/upload"))
    assert loaded["status"].startswith("Loaded 3 trace(s)")
    assert loaded["summary"] == full_run["summary"]
    status, *replayed, race = fresh.predict("1", api_name="/replay")
    columns = dict(zip(LANE_KEYS, replayed, strict=True))  # a column each, the second drafter's too (not run)
    assert status == "Replay finished."
    assert all("ddt-text" in columns[method] for method in ALL_METHODS)
    assert [line["name"] for line in plot_data(race)] == ["ar", "dflash", "ddtree@8"]  # the whole race, last
    assert "identical to AR" in columns["ddtree"]


def test_sessions_keep_their_own_results(app_url):
    prompts = {"a": "Say hello.", "b": "Count to five."}
    clients = {name: Client(app_url, verbose=False) for name in prompts}
    results = {}

    def work(name):
        results[name] = run(clients[name], prompt=prompts[name], max_new_tokens=6, methods=["ar"])

    threads = [threading.Thread(target=work, args=(name,)) for name in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    for name, prompt in prompts.items():
        (trace,) = read_download(results[name]["download"])
        assert trace.config.prompt == prompt
        # the session's inspector shows its own run
        _, tree = clients[name].predict("ar", api_name="/select_method")[:2]
        root_hover = next(t for t in plot_data(tree) if t.get("customdata") == [0])["hovertext"][0]
        assert f"(id {trace.steps[0].root_token})" in root_hover
    assert results["a"]["summary"]["ar"]["text"] != results["b"]["summary"]["ar"]["text"]
    untouched = Client(app_url, verbose=False)  # a third session has nothing of theirs
    with pytest.raises(AppError, match="Nothing to replay yet"):
        untouched.predict("1", api_name="/replay")


def test_stop_ends_a_run_early_and_keeps_what_it_made(app_url):
    client = Client(app_url, verbose=False)
    job = client.submit(PROMPT, 300, 0.0, 0, 8, ["ar", "ddtree"], api_name="/run")
    deadline = time.monotonic() + 120
    while not any("tokens," in str(outputs[0]) for outputs in job.outputs()):
        assert time.monotonic() < deadline and not job.done(), "the run never started streaming"
        time.sleep(0.2)
    assert client.predict(api_name="/stop").startswith("Stopping")
    result = named_outputs(job.result(timeout=120))
    assert result["status"].startswith("**Stopped**")
    for method in ("ar", "ddtree"):  # they take turns: both had started, both stop at their next step
        assert 0 < result["summary"][method]["tokens"] < 300
        assert result["summary"][method]["stop_reason"] == "cancelled"
    # a stopped run says so, and is no reference: it was never compared
    assert "(stopped)" in result["ar"] and "(done)" not in result["ar"] and "reference output" not in result["ar"]


def test_budget_sweep(client):
    status, plot, table = client.predict(PROMPT, 6, 0.0, 0, "2, 4", api_name="/sweep")
    assert "Sweep finished" in status and "Best measured: budget **" in status  # the measured best, not predicted
    assert [row[0] for row in table["data"]] == [2, 4]
    assert table["headers"][5] == "± one pass's noise" and all(row[5].endswith("×") for row in table["data"])
    assert table["headers"][:5] == ["budget", "τ", "step cost (AR steps)", "predicted τ ÷ cost", "measured speed-up"]
    assert all(row[2] != "–" and row[3].endswith("×") for row in table["data"])
    names = [trace["name"] for trace in plot_data(plot)]
    assert names[:4] == ["τ (tokens per step)", "step cost (AR steps)", "predicted τ ÷ cost", "measured"]
    assert all(len(trace["x"]) == 2 for trace in plot_data(plot)[:4])
    with pytest.raises(AppError, match="Budgets must be whole numbers"):
        client.predict(PROMPT, 6, 0.0, 0, "4, many", api_name="/sweep")


def test_a_sweep_budget_over_1024_is_refused(client):
    with pytest.raises(AppError, match='Tree budget must be "auto" or a whole number from 1 to 1024, got 100000'):
        client.predict(PROMPT, 2, 0.0, 0, "100000", api_name="/sweep")


def test_video_button_renders_the_sessions_race(app_url):
    import imageio_ffmpeg

    own = Client(app_url, verbose=False)
    run(own, max_new_tokens=6)
    status, video = own.predict("1", api_name="/video")
    assert status.startswith("Video rendered: 3 columns")
    path = video["video"] if isinstance(video, dict) else video
    frames = imageio_ffmpeg.read_frames(path)
    assert next(frames)["size"] == (1280, 720)
    untouched = Client(app_url, verbose=False)
    with pytest.raises(AppError, match="Nothing to film yet"):
        untouched.predict("1", api_name="/video")


@pytest.mark.parametrize("endpoint", ["/replay", "/video"])
def test_every_speed_the_api_lists_is_accepted(app_url, endpoint):
    import ast

    fresh = Client(app_url, verbose=False)
    (speed,) = fresh.view_api(print_info=False, return_format="dict")["named_endpoints"][endpoint]["parameters"]
    listed = ast.literal_eval(speed["python_type"]["type"].removeprefix("Literal"))
    assert listed == ["0.25", "0.5", "1"]
    for value in listed:  # each reaches the handler, which says there is nothing yet
        with pytest.raises(AppError, match="Nothing to"):
            fresh.predict(value, api_name=endpoint)


def test_inspecting_before_any_run_says_why_not(app_url):
    fresh = Client(app_url, verbose=False)
    with pytest.raises(AppError, match="Nothing to inspect yet: run the methods or upload traces"):
        fresh.predict("ddtree", 1, api_name="/inspect")
    with pytest.raises(AppError, match="Nothing to inspect yet"):
        fresh.predict("ar", api_name="/select_method")


def test_the_page_opens_at_auto_and_recommends_a_fixed_budget_whose_tree_branches(client, launched_threads):
    info = client.predict(api_name="/info")
    assert info["tree_budget"] == "auto" and info["auto_budget"]  # the box's default, and the step costs it sizes by
    auto = run(client, max_new_tokens=8, budget=info["tree_budget"], methods=["ddtree"])
    assert auto["summary"]["ddtree"]["label"] == "ddtree@auto" and auto["summary"]["ddtree"]["tree_budget"] == "auto"
    budget, drafts = info["fixed_budget"], f" ({info['draft_dtype']} drafts)" if info["draft_dtype"] else ""
    machine = f"CPU, {launched_threads} threads | torch | float32{drafts} | readable step"  # the app's defaults
    record = json.loads((ROOT / "assets" / "budgets.json").read_text()).get(machine)
    if record is None:  # no bench record for this kind of machine: the budgets are timed here
        assert re.fullmatch(rf"DDTree budget {budget} (for now \(a tree that branches\)\. No bench record fits this "
                            r"machine, .*|is .*\(τ from .*; step costs timed on this machine\)\.)", info["why"], re.S)
    else:  # the largest budget within 5% of the fastest the bench measured, and the banner quotes that record
        speedups = {int(b): row["speedup_vs_ar"] for b, row in record["budgets"].items()}
        fastest = max(speedups, key=speedups.get)
        assert budget == max(b for b, speedup in speedups.items() if speedup >= 0.95 * speedups[fastest])
        at = record["budgets"][str(budget)]
        why = "the fastest" if budget == fastest else (
            f"the largest tree within 5% of the fastest (budget {fastest}, {speedups[fastest]:.2f}×), so the first "
            "page shows a tree that branches")
        assert info["why"] == (
            f"DDTree budget {budget} is {why}: the bench measured {at['speedup_vs_ar']:.2f}× AR at it "
            f"(τ {at['tau']:.2f}, {at['tokens_per_s']:.0f} tokens/s on {record['prompts']}) on another machine of "
            f"this kind ({machine}), not on this one ({record['results']}).")
    result = run(client, prompt=EXAMPLE_PROMPTS[0], max_new_tokens=16, budget=budget, methods=["ddtree"])
    (trace,) = read_download(result["download"])
    branching = [step for step in trace.steps if len(set(step.tree_parents)) < len(step.tree_parents)]
    assert branching, f"budget {budget} drew only chains"
