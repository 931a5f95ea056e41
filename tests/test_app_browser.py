"""The launched app in headless Chromium (Debian's package), driven by Playwright."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from engine.loop.loading import SHIPPED_DRAFTER
from engine.serving.traffic import request_traces
from tests.conftest import busy_core, launched_app
from tests.test_serve import client, serving
from tests.tiny import tiny_decoder
from viz.page.state import LANE_KEYS

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = Path("/tmp/app.png")
RUN_TIMEOUT_MS = 240_000

if not CHROMIUM.exists():
    pytest.skip("needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install playwright)")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def open_page(browser, app_url, width: int = 1400):
    page = browser.new_context(viewport={"width": width, "height": 1000}).new_page()
    page.goto(app_url)
    page.locator("#run-button").wait_for()
    return page


def start_run(page, prompt: str, max_new_tokens: int = 10, budget: int = 16) -> None:
    page.locator("#prompt textarea").fill(prompt)
    page.locator("#max-new-tokens input").fill(str(max_new_tokens))
    page.locator("#budget input").fill(str(budget))
    page.locator("#run-button").click()


def wait_until_done(page) -> None:
    page.wait_for_function("document.querySelector('#status')?.innerText.startsWith('Done')",
                           timeout=RUN_TIMEOUT_MS)


def column_texts(page) -> dict[str, str]:
    return {method: page.locator(f"#column-{method} .ddt-text").inner_text() for method in ("ar", "dflash", "ddtree")}


def tree_title(page) -> str:
    return page.locator("#tree-plot .gtitle").text_content()


def test_run_shows_three_outputs_and_a_tree_and_the_slider_steps(browser, app_url):
    page = open_page(browser, app_url)
    start_run(page, "Name three colors.")
    wait_until_done(page)
    texts = column_texts(page)
    assert all(text.strip() for text in texts.values()), texts
    assert texts["ar"] == texts["dflash"] == texts["ddtree"]  # greedy: identical output
    assert page.locator(".ddt-verdict", has_text="identical to AR").count() == 2
    banner = page.locator("#model-banner").inner_text()
    trained = "untrained" not in banner
    assert "DDTree budget" in banner and "fastest" in banner, banner
    assert page.locator("#column-ddtree", has_text="untrained").count() == (0 if trained else 1)
    page.locator("#tree-plot .js-plotly-plot").wait_for()
    assert page.locator("#tree-plot .js-plotly-plot .point").count() >= 3  # root, drafts, bonus
    assert "Step 1" in tree_title(page)  # counted from 1, as the video counts

    slider = page.locator("#step-slider input[type=range]")
    slider.focus()
    slider.press("ArrowRight")
    page.wait_for_function("document.querySelector('#tree-plot .gtitle')?.textContent.includes('Step 2')")
    page.get_by_role("button", name="Next ▶").click()
    page.wait_for_function("document.querySelector('#tree-plot .gtitle')?.textContent.includes('Step 3')")
    assert "Step 3" in page.locator("#why-stopped").inner_text()
    # the step economics: τ and step cost bars per method, and the sentence behind the speed-up
    page.locator("#economics-plot .js-plotly-plot").wait_for()
    assert "speed-up = τ ÷ step cost" in page.locator("#economics-plot .gtitle").text_content()
    assert page.locator("#economics-plot .legendtext", has_text="step cost (AR steps)").count() == 1
    assert page.locator("#economics-plot .annotation-text", has_text="τ ÷ cost").count() == 3
    assert "tokens per step and a step costs" in page.locator("#economics-text").inner_text()
    page.screenshot(path=str(SCREENSHOT), full_page=True)


def test_two_sessions_at_once_keep_their_own_results(browser, app_url):
    first, second = open_page(browser, app_url), open_page(browser, app_url)
    start_run(first, "Say hello.", max_new_tokens=8)
    start_run(second, "Count to five.", max_new_tokens=8)
    wait_until_done(first)
    wait_until_done(second)
    assert column_texts(first)["ar"] != column_texts(second)["ar"]
    third = open_page(browser, app_url)
    assert "not run" in third.locator("#column-ar").inner_text()


@pytest.fixture(scope="module")
def shifted_drafter(tmp_path_factory) -> Path:
    """The shipped drafter reading the target one layer late: its weights, its config's target_layer_ids + 1."""
    folder = tmp_path_factory.mktemp("drafters") / "layers-plus-one"
    shutil.copytree(SHIPPED_DRAFTER, folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [layer + 1 for layer in config["dflash_config"]["target_layer_ids"]]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_two_drafters_race_side_by_side_and_the_shifted_one_keeps_fewer_drafts(browser, shifted_drafter, tmp_path):
    with launched_app(["--second-drafter", str(shifted_drafter)], tmp_path / "app.log") as url:
        page = open_page(browser, url, width=1440)
        assert page.locator("#budget input").input_value() == "auto", "the budget box opens at auto"
        assert page.locator("#second-drafter input").input_value() == str(shifted_drafter)
        start_run(page, "Explain what a hash table is in two sentences.", max_new_tokens=48)
        wait_until_done(page)
        texts = {key: page.locator(f"#column-{key} .ddt-text").inner_text() for key in LANE_KEYS}
        assert len(set(texts.values())) == 1, texts  # greedy: either drafter's output is AR's
        assert page.locator("#column-ddtree_2 .ddt-heading").inner_text() == (
            "DDTree (tree) · second drafter · budget 16")
        assert str(shifted_drafter) in page.locator("#column-ddtree_2").inner_text()
        assert "drafter smollm2-135m-dflash-b16" in page.locator("#column-ddtree").inner_text()
        tops = {round(page.locator(f"#column-{key}").bounding_box()["y"]) for key in LANE_KEYS}
        assert len(tops) == 1, "five columns side by side on a laptop's screen"
        # the same weights reading the wrong layers keep fewer drafted tokens a step (the doctor names the fault)
        tau = {key: float(re.search(r"τ ([\d.]+)", page.locator(f"#column-{key} .ddt-stats").inner_text())[1])
               for key in LANE_KEYS}
        assert tau["dflash"] + tau["ddtree"] > tau["dflash_2"] + tau["ddtree_2"], tau
        legend = page.locator("#race-plot .legendtext").all_text_contents()
        assert legend == ["ar", "dflash", "dflash+layers-plus-one", "ddtree@16", "ddtree@16+layers-plus-one"]
        page.get_by_label("DDTree@16 · layers-plus-one").check()
        page.wait_for_function("document.querySelector('#tree-plot .gtitle')?.textContent"
                               ".startsWith('ddtree@16+layers-plus-one')")
        page.screenshot(path=str(SCREENSHOT.with_name("app-two-drafters.png")), full_page=True)


def test_the_doctor_while_a_run_runs_both_finish_and_the_doctor_renders_its_verdict(browser, app_url):
    """Run, then "Run the doctor" while it runs: once the two waited on each other for every visitor."""
    page = open_page(browser, app_url)
    start_run(page, "Name three colors.", max_new_tokens=24)
    page.get_by_role("tab", name="Doctor").click()
    page.locator("#doctor-prompts textarea").fill("Write a Python function that adds two numbers.")
    page.locator("#doctor-tokens input").fill("24")
    page.locator("#doctor-button").click()
    page.wait_for_function("/Healthy|Fault|Not judged/.test(document.querySelector('#doctor-verdict')?.innerText"
                           " ?? '')", timeout=RUN_TIMEOUT_MS)
    verdict = page.locator("#doctor-verdict").inner_text()
    # one prompt scores too few draft positions to call a wiring faulty (test_doctor holds the shipped pair healthy)
    assert verdict.startswith("○ Not judged yet: too few draft positions to judge"), verdict
    assert "layer ids" in verdict and "mask token: " in verdict
    page.locator("#doctor-positions .js-plotly-plot").wait_for()
    assert "Acceptance per draft position" in page.locator("#doctor-positions .gtitle").text_content()
    assert page.locator("#doctor-wirings .ytick", has_text="layer ids +1").count() == 1
    page.get_by_role("tab", name="Run & inspect").click()
    wait_until_done(page)
    texts = column_texts(page)
    assert texts["ar"].strip() and texts["ar"] == texts["dflash"] == texts["ddtree"]
    # the doctor again, stopped: it says where it stopped and judges nothing
    page.get_by_role("tab", name="Doctor").click()
    page.locator("#doctor-button").click()
    page.wait_for_function("document.querySelector('#doctor-verdict')?.innerText.startsWith('Running the doctor')",
                           timeout=RUN_TIMEOUT_MS)
    page.locator("#doctor-stop").click()
    page.wait_for_function("document.querySelector('#doctor-verdict')?.innerText.startsWith('Stopped')",
                           timeout=RUN_TIMEOUT_MS)
    assert "Nothing was judged" in page.locator("#doctor-verdict").inner_text()


def test_a_servers_traffic_opens_in_the_inspector(browser, tmp_path):
    """Serve, ask through the openai client, open the Studio on the server's traffic (no model), open the request
    and see its tree."""
    # a long prompt (the tiny tokenizer reads no spaces), which must not push the numbers after it out of view
    prompt = "Please-tell-me-a-long-story-about-a-dragon-who-guards-a-castle-by-the-sea,at-night!"
    with serving(tiny_decoder(0), tree_budget=8) as api_url:
        answer = client(api_url).chat.completions.create(model="tiny-llama", max_tokens=12,
                                                          messages=[{"role": "user", "content": prompt}])
        trace_id = answer.model_extra["ddtree"]["trace_id"]
        with launched_app(["--server", api_url.removesuffix("/v1")], tmp_path / "app.log") as app_url:
            page = browser.new_context(viewport={"width": 1440, "height": 1000}).new_page()
            page.goto(app_url)
            assert page.locator("#run-button").is_hidden()  # no model: nothing to run
            page.locator("#traffic-table", has_text="ddtree@8").wait_for()
            assert "No model loaded" in page.locator("#model-banner").inner_text()
            # every column in view, none scrolled out of it
            assert page.evaluate(OVERFLOWING, "#traffic-table") == []
            table = page.locator("#traffic-table").bounding_box()
            for header in ("τ", "tokens/s", "finish"):
                cell = page.locator("#traffic-table th", has_text=header).first.bounding_box()
                assert cell["x"] + cell["width"] <= table["x"] + table["width"], header
            # a request served while the panel is open shows up without a click
            client(api_url).completions.create(model="tiny-llama", prompt="Later", max_tokens=4,
                                               extra_body={"method": "ar"})
            page.locator("#traffic-table [role=gridcell]", has_text="Later").wait_for(timeout=30_000)
            page.locator("#traffic-table [role=gridcell]", has_text="ddtree@8").first.click()
            page.wait_for_function("document.querySelector('#status')?.innerText.startsWith('Opened request')",
                                   timeout=RUN_TIMEOUT_MS)
            assert trace_id in page.locator("#status").inner_text()
            assert page.locator("#column-ddtree .ddt-text").inner_text() == answer.choices[0].message.content
            page.locator("#tree-plot .js-plotly-plot").wait_for()
            assert page.locator("#tree-plot .js-plotly-plot .point").count() >= 3  # root, drafts, bonus
            assert "Step 1" in tree_title(page)
            # words in every tree node and top-k cell, for tokens the answer never wrote too: the served trace
            # carries their texts, and this page has no tokenizer
            (trace,) = request_traces(api_url.removesuffix("/v1"), trace_id)
            first = trace.steps[0]
            assert {token for depth in first.draft_top_tokens for token in depth} - set(trace.output_ids)
            page.locator("#probs-plot .js-plotly-plot").wait_for()
            nodes = page.locator("#tree-plot .textpoint").all_text_contents()
            cells = page.locator("#probs-plot .textpoint").all_text_contents()
            assert len(nodes) == first.tree_size + 2  # root, every drafted node, the bonus
            assert len(cells) == len(first.draft_top_tokens) * len(first.draft_top_tokens[0])
            assert all(text and not re.search(r"#\d+", text) for text in nodes + cells), nodes + cells


# the elements under a selector that scroll sideways: their content is wider than they show
OVERFLOWING = """selector => [...document.querySelectorAll(`${selector}, ${selector} *`)]
    .filter(e => e.scrollWidth > e.clientWidth + 1 && ['auto', 'scroll'].includes(getComputedStyle(e).overflowX))
    .map(e => e.className)"""
# every visible "Error" outside a toast: the pills Gradio puts on the outputs of a failed event
ERROR_PILLS = """[...document.querySelectorAll('body *')].filter(e => e.children.length === 0
    && e.textContent.trim() === 'Error' && e.checkVisibility({opacityProperty: true, visibilityProperty: true})
    && !e.closest('[data-testid="toast-body"], .toast-body')).length"""


def race_on_page(page) -> tuple[float, str]:
    """AR, DFlash and DDTree on the page: DDTree's speed-up over AR as its column says it, and the status line."""
    start_run(page, "Write a Python function that reverses a string.", max_new_tokens=48, budget=16)
    page.wait_for_function("document.querySelector('#status')?.innerText.startsWith('Running')")  # not the last one's
    wait_until_done(page)
    stats = page.locator("#column-ddtree .ddt-stats").inner_text()
    return float(re.search(r"([\d.]+)× vs AR", stats).group(1)), page.locator("#status").inner_text()


@pytest.mark.slow
def test_a_race_under_load_keeps_its_speed_up_or_says_it_was_disturbed(browser, app_url):
    """A process keeps a core busy while the methods run: they take turns, so a load falls on all alike, and
    DDTree's speed-up over AR stays within 15% of the quiet run's, or the page says the timings were disturbed,
    with the figures and what to do."""
    page = open_page(browser, app_url)
    quiet, said = race_on_page(page)
    assert "(in turns, each on its own clock" in said
    with busy_core():
        loaded, said = race_on_page(page)
    if abs(loaded / quiet - 1) > 0.15:
        assert "The timings were disturbed" in said, (quiet, loaded, said)
        assert re.search(r"AR decoded [\d.]+ tokens/s \(the prompt's pass left out\), where .* [\d.]+ on this .*"
                         r"Close it and run again", said) or "at its slowest" in said, (quiet, loaded, said)


def test_a_refusal_says_its_sentence_once_and_leaves_the_outputs_unmarked(browser, app_url):
    page = open_page(browser, app_url)
    columns = [page.locator(f"#column-{method} .ddt-column") for method in ("ar", "dflash", "ddtree")]
    before = [column.inner_html() for column in columns]
    page.locator("#max-new-tokens input").fill("0")
    page.locator("#run-button").click()
    toast = page.locator('[data-testid="toast-body"]',
                         has_text="Max new tokens must be a whole number from 1 to 4096, got 0")
    toast.wait_for()
    assert toast.count() == 1
    page.wait_for_function("!document.querySelector('#run-button').disabled")  # the refused run has ended
    assert page.evaluate(ERROR_PILLS) == 0
    assert [column.inner_html() for column in columns] == before


def test_run_is_disabled_while_a_run_goes_and_the_replay_moves_the_race_chart(browser, app_url):
    page = open_page(browser, app_url)
    start_run(page, "Count to five.", max_new_tokens=24)
    page.wait_for_function("document.querySelector('#run-button').disabled")
    assert page.locator("#replay-button").is_disabled()
    wait_until_done(page)
    page.wait_for_function("!document.querySelector('#run-button').disabled")
    page.get_by_label("1× (real time)").check()
    page.locator("#replay-button").click()
    # the clock line of a replay frame, then the finished race without it
    page.wait_for_function("document.querySelectorAll('#race-plot .shapelayer path').length > 0")
    page.wait_for_function("document.querySelector('#status')?.innerText.startsWith('Replay finished')",
                           timeout=RUN_TIMEOUT_MS)
    page.wait_for_function("document.querySelectorAll('#race-plot .shapelayer path').length === 0")


def test_a_phone_wide_page_stacks_the_output_columns(browser, app_url):
    page = open_page(browser, app_url, width=390)
    boxes = [page.locator(f"#column-{method}").bounding_box() for method in ("ar", "dflash", "ddtree")]
    assert all(box["width"] > 300 for box in boxes), boxes
    assert boxes[0]["y"] + boxes[0]["height"] <= boxes[1]["y"] and boxes[1]["y"] + boxes[1]["height"] <= boxes[2]["y"]


def test_a_budget_typed_at_once_is_kept(browser, app_url):
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    page.goto(app_url)
    box = page.locator("#budget input")
    box.fill("40")
    page.wait_for_timeout(3000)  # longer than a load event or a tick of the timing clock takes
    assert box.input_value() == "40"
