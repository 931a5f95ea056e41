"""Reading trace files back (engine.trace.read_trace_file): every shape the Studio writes, and bad files refused
with a sentence that says what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.loop.batch import Batch
from engine.loop.budgeting import Budgeting
from engine.loop.decode import Decoder
from engine.loop.loading import SHIPPED_DRAFTER, display_name
from engine.loop.settings import DecodeSettings
from engine.models.target import BUNDLED_MODEL
from engine.trace import SCHEMA_VERSION, Step, Trace, TraceError, read_trace_file, write_trace_file
from tests.tiny import STOP, tiny_decoder


@pytest.fixture(scope="module")
def traces() -> list[Trace]:
    decoder = tiny_decoder()
    return [decoder.run(prompt_ids=[5, 6, 7, 8], settings=DecodeSettings(method, max_new_tokens=8, tree_budget=8))
            for method in ("ar", "dflash", "ddtree")]


def test_every_shape_the_studio_writes_reads_back(traces, tmp_path):
    download = write_trace_file(tmp_path / "download.json", traces)
    single = tmp_path / "one.json"
    traces[2].save(single)
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([t.to_dict() for t in traces]))
    assert read_trace_file(download) == traces
    assert read_trace_file(single) == traces[2:]
    assert read_trace_file(listed) == traces


def test_a_step_and_a_trace_cross_between_processes_as_the_checked_reading_reads_them():
    decoder = tiny_decoder()
    traces = Batch(decoder, Budgeting()).run([([5, 6, 7], DecodeSettings("ddtree", max_new_tokens=8, tree_budget=6)),
                                             ([9, 8], DecodeSettings("ar", max_new_tokens=4))])
    checked = 0
    for trace in traces:
        for step in trace.steps:
            sent = json.loads(json.dumps(step.plain()))  # what a worker's answer carries
            assert Step.from_plain(sent) == step
            assert Step.from_plain(sent) == Trace.from_dict(trace.to_dict() | {"steps": [sent]}).steps[0]
            checked += step.batch is not None and len(step.tree_tokens) > 0
    assert checked, "some step of a batch verified a tree"
    for trace in traces:
        trace.carry_token_texts(str)
        sent = json.loads(json.dumps(trace.plain()))  # token ids as keys become strings on the way
        assert Trace.from_plain(sent) == trace == Trace.from_dict(trace.to_dict()) and trace.summary is not None
        assert Trace.from_plain(trace.plain()) == trace


@pytest.mark.parametrize("nesting", ["[" * 100_000 + "]" * 100_000, '{"traces": ' * 100_000 + "1" + "}" * 100_000])
def test_deeply_nested_json_is_a_trace_error(tmp_path, nesting):
    path = tmp_path / "deep.json"
    path.write_text(nesting)
    with pytest.raises(TraceError, match="^not a JSON trace file: it nests deeper than any trace"):
        read_trace_file(path)


@pytest.mark.parametrize(("where", "value", "message"), [
    (("summary", "wall_s"), "fast", 'summary.wall_s must be a number, got "fast"'),
    (("steps", 0, "tree_tokens"), 5, "steps[0].tree_tokens must be a list of integers, got 5"),
    (("steps", 1, "draft_top_probs"), [["x"]], "steps[1].draft_top_probs must be a list of lists of numbers, got list"),
    (("config", "tree_budget"), "8", 'config.tree_budget must be an integer, "auto" or null, got "8"'),
    (("config", "tree_budget"), 2.5, 'config.tree_budget must be an integer or a string or null, got 2.5'),
    (("prefill", "first_token"), True, "prefill.first_token must be an integer, got true"),
    (("steps",), {}, "steps must be a list, got dict"),
])
def test_a_wrong_typed_field_is_named_when_read(traces, tmp_path, where, value, message):
    raw = traces[2].to_dict()
    parent = raw
    for key in where[:-1]:
        parent = parent[key]
    parent[where[-1]] = value
    path = tmp_path / "typed.json"
    path.write_text(json.dumps({"schema_version": 1, "traces": [raw]}))
    with pytest.raises(TraceError) as refused:
        read_trace_file(path)
    assert str(refused.value) == f"trace is missing or has malformed field: {message}"


def test_a_missing_field_and_a_broken_tree_are_named(traces, tmp_path):
    raw = traces[2].to_dict()
    del raw["summary"]["tau"]
    path = tmp_path / "missing.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(TraceError, match=r"^trace is missing or has malformed field: summary\.tau is missing$"):
        read_trace_file(path)
    raw = traces[2].to_dict()
    raw["steps"][0]["tree_parents"].pop()
    path.write_text(json.dumps(raw))
    with pytest.raises(TraceError, match="^step 1 of the ddtree trace is inconsistent: its tree lists differ in len"):
        read_trace_file(path)


@pytest.mark.parametrize("step", ["readable", "fixed", "batched"])
def test_a_runs_trace_carries_the_text_of_every_token_it_shows(step):
    """Tree nodes, the target's choices, the drafter's top-k, roots, bonuses and committed tokens: a page without the
    model shows each as the tokenizer writes it alone, special tokens too (the tiny model's stop token)."""
    decoder = tiny_decoder(2, block_size=8)
    settings = [DecodeSettings(method, max_new_tokens=12, tree_budget=6) for method in ("ar", "ddtree")]
    if step == "batched":
        traces = Batch(decoder, Budgeting()).run([([5, 6, 7, 8], setting) for setting in settings])
    else:
        runner = decoder if step == "readable" else Decoder(decoder.target, decoder.drafter, decoder.drafter_info,
                                                            fixed_step=True)
        traces = [runner.run(prompt_ids=[5, 6, 7, 8], settings=setting) for setting in settings]
    ar, ddtree = traces
    assert ddtree.config.step.startswith(step)
    drafted = {token for s in ddtree.steps for token in s.tree_tokens + [t for depth in s.draft_top_tokens
                                                                          for t in depth]}
    assert drafted - set(ddtree.output_ids)  # tokens no run committed, which an old trace could only show as #id
    for trace in traces:
        shown = trace.shown_ids
        assert shown >= set(trace.output_ids) | {s.bonus_token for s in trace.steps}
        assert trace.token_texts == {token: decoder.target.token_text(token) for token in shown}
    assert decoder.target.token_text(STOP) != decoder.target.decode([STOP]) == ""


def test_token_texts_read_back_and_a_version_1_file_still_reads(traces, tmp_path):
    path = write_trace_file(tmp_path / "download.json", traces)
    written = json.loads(path.read_text())
    assert written["schema_version"] == SCHEMA_VERSION == 2
    assert all(isinstance(key, str) for key in written["traces"][2]["token_texts"])  # JSON keys are strings
    assert [trace.token_texts for trace in read_trace_file(path)] == [trace.token_texts for trace in traces]
    old = {"schema_version": 1, "traces": [trace.to_dict() for trace in traces]}
    for raw in old["traces"]:
        del raw["token_texts"]
        raw["schema_version"] = 1
        for step in raw["steps"]:
            del step["batch"]
    path.write_text(json.dumps(old))
    assert [trace.token_texts for trace in read_trace_file(path)] == [{}, {}, {}]
    old["traces"][0]["token_texts"] = {"x": "a"}
    path.write_text(json.dumps(old))
    with pytest.raises(TraceError, match="token_texts must be an object of strings keyed by token ids"):
        read_trace_file(path)
    path.write_text(json.dumps({"schema_version": 3, "traces": []}))
    with pytest.raises(TraceError, match=r"^trace file schema version 3 is not supported \(expected 1 or 2\)$"):
        read_trace_file(path)


def test_the_bench_writes_one_prompts_runs_to_a_trace_file_and_refuses_several(capsys):
    from engine.tools.bench import main

    assert main(["--prompts", "assets/prompts/smoke.jsonl", "--trace-file", "never.json"]) == 2
    assert capsys.readouterr().err == ("error: --trace-file holds one prompt's runs, as the app's download; the "
                                       "prompts give 3: pick one with --limit 1 or a one-prompt file\n")


# ---------------------------------------------------------------- the shipped examples (assets/traces/)

EXAMPLES = sorted(Path("assets/traces").glob("*.json"))


def test_there_is_a_shipped_example():
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_a_shipped_example_names_the_bundled_pair_and_every_method_writes_ars_text(path):
    """Names that resolve to the bundled model and the shipped drafter let the app label tree nodes with the
    tokenizer's text (not ``#4421``); an example whose drafting runs leave AR's output shows a near-tie, not
    speculative decoding."""
    traces = read_trace_file(path)
    ar, dflash, ddtree = traces
    assert [t.config.method for t in traces] == ["ar", "dflash", "ddtree"]
    assert {t.config.model for t in traces} == {BUNDLED_MODEL}
    assert dflash.config.drafter == ddtree.config.drafter == display_name(str(SHIPPED_DRAFTER))
    assert dflash.config.drafter_trained and ddtree.config.drafter_trained
    assert dflash.output_ids == ddtree.output_ids == ar.output_ids and dflash.text == ddtree.text == ar.text
    assert ddtree.summary.tokens_per_s > 1.5 * ar.summary.tokens_per_s  # the example shows a real speed-up
