"""The Studio opening a server's traffic (``python app.py --server URL``): a page without a model lists the
requests a real server answered through the ``openai`` client, and opens any of them in every view."""

from __future__ import annotations

import json
import re

import gradio as gr
import pytest

import app
from engine.errors import EngineError
from engine.measure.calibration import BudgetChoice
from engine.serving.traffic import recent_requests, request_traces, server_url
from tests.test_serve import BUDGET, client, serving
from tests.tiny import tiny_decoder
from viz.page.state import RunControl, Studio

PROMPTS = ["Hello!", "Why?"]


@pytest.fixture(scope="module")
def served():
    """A server on the tiny model that has answered a DDTree chat and an AR completion; its URL and the answers."""
    with serving(tiny_decoder(0), tree_budget=BUDGET) as url:
        api = client(url)
        chat = api.chat.completions.create(model="tiny-llama", max_tokens=12,
                                           messages=[{"role": "user", "content": PROMPTS[0]}])
        completion = api.completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=6,
                                            extra_body={"method": "ar"})
        yield url.removesuffix("/v1"), chat, completion


@pytest.fixture()
def page(served) -> app.StudioApp:
    url = served[0]
    return app.StudioApp(Studio(None, BudgetChoice(16, {}, "no model loaded"), server=url))


def test_the_listing_names_each_request_newest_first(served):
    url, chat, completion = served
    listed = recent_requests(url)
    assert [r.id for r in listed] == [completion.model_extra["ddtree"]["trace_id"],
                                      chat.model_extra["ddtree"]["trace_id"]]
    assert [(r.endpoint, r.method, r.tree_budget) for r in listed] == [("completions", "ar", None),
                                                                        ("chat.completions", "ddtree", BUDGET)]
    assert listed[0].tokens == completion.usage.completion_tokens and listed[0].tau == 1.0
    assert PROMPTS[0] in listed[1].prompt  # the chat's prompt as the template wrote it


def test_a_page_without_a_model_lists_the_traffic_and_opens_a_request_in_every_view(served, page):
    url, chat, _ = served
    listing = page.traffic_view.refresh(url + "/v1/")  # a client's base URL works too
    rows, ids = listing[page.traffic_view.table], listing[page.traffic_view.listed]
    chat_id = chat.model_extra["ddtree"]["trace_id"]
    assert ids[1] == chat_id and [row[2] for row in rows] == ["ar", f"ddtree@{BUDGET}"]
    shown = page.traffic_view.open(url, chat_id)
    trace = shown[page.session.traces]["ddtree"]
    assert trace.text == chat.choices[0].message.content and trace.config.tree_budget == BUDGET
    assert shown[page.session.status].startswith(f"Opened request {chat_id}")
    first = trace.steps[0]
    tree = json.loads(shown[page.inspector.tree].to_json())["data"]
    nodes = sorted(node for part in tree for node in part.get("customdata") or [])
    assert nodes == list(range(first.tree_size + 2))  # root, every drafted node, the bonus
    # every node and top-k cell in words, tokens the request never wrote too: the trace carries their texts
    assert trace.shown_ids - set(trace.output_ids)
    probs = json.loads(shown[page.inspector.probs].to_json())["data"]
    labels = [label for part in tree for label in [*(part.get("text") or []), *(part.get("hovertext") or [])]]
    cells = [cell for row in probs[0]["customdata"] for cell in row] + probs[-1]["text"]
    assert len(cells) == 2 * len(first.draft_top_tokens) * len(first.draft_top_tokens[0])
    assert not any(re.search(r"#\d+", label) for label in labels + cells)
    assert "ddt-text" in shown[page.run_view.columns["ddtree"]]
    assert page.traffic_view.pick_row(ids, gr.SelectData(None, {"index": [1, 0], "value": ""})) == chat_id


def test_an_open_panel_refreshes_the_list_itself_keeping_the_request_picked(served, page):
    url, chat, _ = served
    traffic, chat_id = page.traffic_view, chat.model_extra["ddtree"]["trace_id"]
    followed = traffic.follow(url, chat_id)
    assert followed[traffic.request].value == chat_id, "a refresh keeps the visitor's pick"
    assert page.session.status not in followed, "nor does it talk over the status line"
    gone = traffic.follow("http://127.0.0.1:9", chat_id)
    assert gone[traffic.clock].active is False and "stopped refreshing" in gone[page.session.status]
    assert traffic.watch(True).active and not traffic.watch(False).active
    dependencies = page.demo.config["dependencies"]
    ticks = [dep for dep in dependencies if (traffic.clock._id, "tick") in map(tuple, dep["targets"])]
    panel = [dep for dep in dependencies if {tuple(t) for t in dep["targets"]} & {(traffic.panel._id, "expand"),
                                                                                (traffic.panel._id, "collapse")}]
    assert len(ticks) == 1 and [dep["outputs"] for dep in panel] == [[traffic.clock._id]] * 2


def test_what_the_traffic_cannot_open_is_refused_with_its_reason(served, page):
    url = served[0]
    with pytest.raises(gr.Error, match="answered 404: no trace 'trace-nope'"):
        page.traffic_view.open(url, "trace-nope")
    with pytest.raises(gr.Error, match="Choose a request to open"):
        page.traffic_view.open(url, None)
    with pytest.raises(gr.Error, match="No Studio server answers at http://127.0.0.1:9"):
        page.traffic_view.refresh("http://127.0.0.1:9")
    with pytest.raises(EngineError, match="is not a server address"):
        server_url("localhost:8000")
    with pytest.raises(gr.Error, match="This page loads no model: it opens the traffic of"):
        list(page.run_view.run("Hi", 4, 0.0, 0, 4, ["ar"], "", RunControl(), present=page.present))
    with pytest.raises(gr.Error, match="This page loads no model"):
        next(page.doctor_view.examine("Hi", 4, False, RunControl()))
    assert request_traces(url, recent_requests(url)[0].id)  # the server still answers


def test_the_server_flag_is_checked_before_the_page_starts():
    with pytest.raises(SystemExit):
        app.parse_args(["--server", "localhost:8000"])
    assert app.parse_args(["--server", "http://127.0.0.1:8000/"]).server == "http://127.0.0.1:8000/"
