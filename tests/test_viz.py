"""Figure builders on real traces from the tiny models, plus a synthetic 1024-node step."""

from __future__ import annotations

import copy
import re
import time

import pytest
import torch

import ddtree
from engine.loop.settings import DecodeSettings
from engine.trace import Step, Trace, read_trace_file
from tests.tiny import tiny_decoder
from viz.figures import (
    CORNER,
    DARK_CELL,
    TARGET_COLOUR,
    acceptance_histogram,
    draft_rank,
    economics_figure,
    economics_text,
    explain_stop,
    probability_figure,
    race_chart,
    stage_figure,
    sweep_figure,
    sweep_verdict,
)
from viz.text_view import column_html, run_stats, tokens_html
from viz.tokens import committed_origins, pieces_token_text, traces_token_text, visible
from viz.tree_figure import NODE_STYLES, tidy_layout, tree_figure, tree_height

PROMPT_IDS = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def traces() -> dict[str, Trace]:
    decoder = tiny_decoder()
    return {method: decoder.run(prompt_ids=PROMPT_IDS, settings=DecodeSettings(method, max_new_tokens=20,
                                                                             tree_budget=16))
            for method in ("ar", "dflash", "ddtree")}


def token_text(token: int) -> str:
    return f"t{token} "  # a trailing space, to check it is made visible


def node_traces(fig) -> dict[str, object]:
    """The figure's node traces by kind (edge traces carry no customdata)."""
    names = {legend: kind for kind, (legend, _, _) in NODE_STYLES.items()}
    return {names[t.name]: t for t in fig.data if t.name in names}


def drawn_nodes(fig) -> list[int]:
    return sorted(node for t in node_traces(fig).values() for node in t.customdata)


def synthetic_step(budget: int = 1024, accept_depth: int = 4, seed: int = 0) -> Step:
    """A DDTree step built with the real tree code on made-up draft distributions; the
    target follows the most probable child for ``accept_depth`` depths, then wants the
    drafter's best token at that depth that the tree did not draft there."""
    generator = torch.Generator().manual_seed(seed)
    vocab = 200
    log_probs = torch.log_softmax(torch.randn(15, vocab, generator=generator) * 3, dim=-1)
    tree = ddtree.build_tree(log_probs, budget)
    children = tree.child_maps()
    top = log_probs.topk(8, dim=-1)
    targets = []
    for node in range(tree.size + 1):
        depth = 0 if node == 0 else int(tree.depths[node - 1])
        kids = sorted(children[node].values(), key=lambda child: -float(tree.log_probs[child - 1]))
        if kids and depth < accept_depth:
            targets.append(int(tree.tokens[kids[0] - 1]))
        else:
            candidates = top.indices[min(depth, 14)].tolist() + list(range(vocab))
            targets.append(next(t for t in candidates if t not in children[node]))
    accepted, bonus = ddtree.follow_tree(tree, targets)
    path_tokens = [int(tree.tokens[node - 1]) for node in accepted[1:]]
    committed = path_tokens + [bonus]
    return Step(
        index=7, t_start=0.0, t_end=0.01, stage_s={"draft": 0.001, "verify": 0.005}, root_token=3,
        draft_top_tokens=top.indices.tolist(), draft_top_probs=top.values.exp().tolist(),
        tree_tokens=tree.tokens.tolist(), tree_parents=tree.parents.tolist(), tree_depths=tree.depths.tolist(),
        tree_node_probs=tree.log_probs.exp().tolist(), tree_path_probs=tree.path_log_probs.exp().tolist(),
        tree_ranks=tree.ranks.tolist(), target_tokens=targets, accepted=accepted, bonus_token=bonus,
        committed_ids=committed, committed_text=[token_text(t) for t in committed],
        committed_margins=[1.0] * len(committed),
    )


# ---------------------------------------------------------------- the draft tree

@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_every_node_is_drawn_once_plus_root_and_bonus(traces, method):
    for step in traces[method].steps:
        fig = tree_figure(step, token_text)
        assert drawn_nodes(fig) == list(range(step.tree_size + 2))


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_accepted_path_is_exactly_the_accepted_nodes(traces, method):
    steps = traces[method].steps
    assert max(len(step.accepted) for step in steps) >= 2, "the tiny run should accept some draft tokens"
    for step in steps:
        nodes = node_traces(tree_figure(step, token_text))
        drawn_accepted = list(nodes["accepted"].customdata) if "accepted" in nodes else []
        assert drawn_accepted == step.accepted[1:]
        assert list(nodes["root"].customdata) == [0]
        assert list(nodes["bonus"].customdata) == [step.tree_size + 1]


def test_accepted_path_of_a_deep_synthetic_step():
    step = synthetic_step(budget=64, accept_depth=4)
    assert len(step.accepted) == 5
    nodes = node_traces(tree_figure(step, token_text))
    assert list(nodes["accepted"].customdata) == step.accepted[1:]
    layout = tidy_layout(step)
    # the bonus hangs after the last accepted node, one depth further
    assert layout.graph.nodes[layout.bonus]["parent"] == step.accepted[-1]
    assert layout.positions[layout.bonus][0] == 5


def test_hover_text_shows_token_and_probabilities(traces):
    step = next(s for s in traces["ddtree"].steps if s.tree_size)
    nodes = node_traces(tree_figure(step, token_text))
    hovers = {node: text for t in nodes.values() for node, text in zip(t.customdata, t.hovertext)}
    for node in range(1, step.tree_size + 1):
        hover = hovers[node]
        assert visible(token_text(step.tree_tokens[node - 1])) in hover
        assert "·" in hover  # the token's trailing space, made visible
        assert f"{step.tree_node_probs[node - 1]:.4f}" in hover
        assert f"path prob {step.tree_path_probs[node - 1]:.4g}" in hover
        assert f"rank at depth: {step.tree_ranks[node - 1] + 1}" in hover
        assert f"target chose here: {visible(token_text(step.target_tokens[node]))}" in hover
    assert "bonus" in hovers[step.tree_size + 1]


def test_ar_step_is_root_then_bonus(traces):
    step = traces["ar"].steps[0]
    layout = tidy_layout(step)
    assert list(layout.graph.edges) == [(0, 1)]
    assert layout.graph.nodes[1]["token"] == step.bonus_token


def test_dflash_chain_is_one_branch(traces):
    for step in traces["dflash"].steps:
        graph = tidy_layout(step).graph
        draft_nodes = range(1, step.tree_size + 1)
        assert all(len([c for c in graph.successors(n) if graph.nodes[c]["kind"] != "bonus"]) <= 1
                   for n in [0, *draft_nodes])


def test_children_ordered_by_probability_and_edges_never_cross():
    step = synthetic_step(budget=300)
    layout = tidy_layout(step)
    graph, rows = layout.graph, {n: layout.positions[n][1] for n in layout.graph}
    for parent in graph:
        kids = [k for k in graph.successors(parent) if graph.nodes[k]["kind"] != "bonus"]
        by_row = sorted(kids, key=rows.get)
        assert [graph.nodes[k]["prob"] for k in by_row] == sorted((graph.nodes[k]["prob"] for k in kids),
                                                                  reverse=True)
    edges = sorted(((rows[p], rows[c]) for p, c in graph.edges if graph.nodes[p]["depth"] == 3))
    assert [c for _, c in edges] == sorted(c for _, c in edges), "edges between two depths cross"


def test_1024_node_tree_builds_and_stays_legible():
    step = synthetic_step(budget=1024)
    assert step.tree_size == 1024
    started = time.perf_counter()
    fig = tree_figure(step, token_text, "ddtree@1024")
    fig.to_json()
    print(f"\n1024-node tree figure built and serialised in {time.perf_counter() - started:.3f} s")
    assert drawn_nodes(fig) == list(range(1026))
    labels = sum(1 for t in node_traces(fig).values() for text in t.text if text)
    assert labels < 100, "big trees label only what matters"
    assert fig.layout.height > tree_height(8)


def test_height_grows_with_rows():
    heights = [tree_height(rows) for rows in range(1, 600)]
    assert heights == sorted(heights) and heights[0] < heights[-1]


# ---------------------------------------------------------------- other figures

def test_probability_figure_marks_accepted_and_target_tokens():
    step = synthetic_step(budget=64, accept_depth=2)
    fig = probability_figure(step, token_text)
    marks = {t.name: list(zip(t.x, t.y)) for t in fig.data if t.type == "scatter"}
    accepted_cells = [(depth, draft_rank(step, depth, step.tree_tokens[node - 1])[0] + 1)
                      for depth, node in enumerate(step.accepted[1:], start=1)]
    assert marks["accepted draft token"] == accepted_cells
    rank, _ = draft_rank(step, 3, step.bonus_token)  # in the top-k, though not in the tree
    dx, dy = CORNER  # in the cell's corner
    assert marks["target's choice"] == [(1 + dx, accepted_cells[0][1] + dy), (2 + dx, accepted_cells[1][1] + dy),
                                        (3 + dx, rank + 1 + dy)]
    # the target's choice is what was committed, not a rejection: no red cross marks it
    choice = next(t for t in fig.data if t.name == "target's choice").marker
    assert choice.symbol == "diamond" and choice.color != TARGET_COLOUR
    heatmap = fig.data[0]
    assert len(heatmap.z) == 8 and len(heatmap.z[0]) == len(step.draft_top_tokens)


def test_the_top_k_tokens_stay_readable_under_the_marks_on_dark_cells():
    step = synthetic_step(budget=64, accept_depth=2)
    fig = probability_figure(step, token_text)
    words = fig.data[-1]  # the tokens are drawn last, over every mark
    assert words.mode == "text" and len(words.text) == len(step.draft_top_tokens) * 8
    probs = {(d, r): step.draft_top_probs[d - 1][r - 1] for d, r in zip(words.x, words.y)}
    colours = dict(zip(zip(words.x, words.y), words.textfont.color))
    dark = [cell for cell, p in probs.items() if p >= DARK_CELL]
    assert dark and all(colours[cell] == "white" for cell in dark)
    assert all(colours[cell] != "white" for cell, p in probs.items() if p < DARK_CELL)
    # nothing solid sits on a cell's centre, where its token is written: the accepted mark is a hollow frame
    for mark in fig.data[1:-1]:
        centred = [(x, y) for x, y in zip(mark.x, mark.y) if float(x).is_integer() and float(y).is_integer()]
        assert not centred or mark.marker.symbol == "square-open", mark.name


def test_the_inspector_counts_steps_from_one_as_the_video_does(traces):
    from viz.video import PRESETS, Scene

    first = traces["ddtree"].steps[0]
    assert first.index == 0 and first.number == 1
    assert "Step 1:" in tree_figure(first, token_text).layout.title.text
    assert "Step 1:" in probability_figure(first, token_text).layout.title.text
    assert explain_stop(first, token_text).startswith("**Step 1**")
    assert "step 1:" in Scene(list(traces.values()), PRESETS["small"])._tree_caption(first)


def test_probability_figure_says_when_the_target_token_is_not_in_top_k(traces):
    step = next(s for s in traces["ddtree"].steps
                if draft_rank(s, len(s.accepted), s.bonus_token) is None and len(s.accepted) <= len(s.draft_top_tokens))
    fig = probability_figure(step, token_text)
    (said,) = [a.text for a in fig.layout.annotations if "not in the drafter's top-" in a.text]
    assert "✗" not in said


def test_probability_figure_for_ar_explains_there_is_no_draft(traces):
    fig = probability_figure(traces["ar"].steps[0], token_text)
    assert "AR" in fig.layout.annotations[0].text


def test_explain_stop_names_depth_wanted_token_and_its_draft_rank(traces):
    step = synthetic_step(budget=64, accept_depth=2)
    text = explain_stop(step, token_text)
    assert "First rejected depth: **3**" in text
    assert visible(token_text(step.bonus_token)) in text
    rank, prob = draft_rank(step, 3, step.bonus_token)
    assert f"**rank {rank + 1}** (p={prob:.4f})" in text
    # real steps: the target's token outside the drafter's top-8, and inside it
    real = [s for s in traces["ddtree"].steps if s.tree_size]
    missed = next(s for s in real if draft_rank(s, len(s.accepted), s.bonus_token) is None)
    assert explain_stop(missed, token_text).endswith(
        f"In the drafter's distribution at depth {len(missed.accepted)}, `{visible(token_text(missed.bonus_token))}` "
        "is **not in the top-8**: the drafter did not see it coming.")
    ranked = next(s for s in real if draft_rank(s, len(s.accepted), s.bonus_token) is not None)
    rank, prob = draft_rank(ranked, len(ranked.accepted), ranked.bonus_token)
    assert explain_stop(ranked, token_text).endswith(
        f"In the drafter's distribution at depth {len(ranked.accepted)}, `{visible(token_text(ranked.bonus_token))}` "
        f"was **rank {rank + 1}** (p={prob:.4f}), but the tree held no branch for it below this path.")
    ar = traces["ar"].steps[0]
    assert explain_stop(ar, token_text) == (f"**Step 1** drafts nothing (AR): the target produced "
                                            f"`{visible(token_text(ar.bonus_token))}`.")


def test_explain_stop_when_the_whole_path_was_accepted():
    step = synthetic_step(budget=64, accept_depth=99)  # the target agrees down to a leaf
    last = step.accepted[-1]
    assert last not in step.tree_parents
    text = explain_stop(step, token_text)
    assert "Nothing was rejected" in text
    assert ("the draft block ends here" in text) == (step.tree_depths[last - 1] == len(step.draft_top_tokens))


def test_the_acceptance_histogram_shows_the_drafting_runs_as_shares_of_their_steps(traces):
    """AR's one-token steps (every step, one tall bar) would swamp the drafting runs' shapes: left out."""
    histogram = acceptance_histogram(list(traces.values()))
    drafting = [traces["dflash"], traces["ddtree"]]
    assert [bar.name for bar in histogram.data] == ["dflash", "ddtree@16"]
    for bar, trace in zip(histogram.data, drafting):
        lengths = [step.acceptance_length for step in trace.steps]
        assert list(bar.x) == sorted(set(lengths))
        assert list(bar.y) == [pytest.approx(lengths.count(n) / len(lengths)) for n in bar.x]
        assert [count for count, _ in bar.customdata] == [lengths.count(n) for n in bar.x]
    only_ar = acceptance_histogram([traces["ar"]])
    assert not only_ar.data and "AR commits one token every step" in only_ar.layout.annotations[0].text


def test_stage_and_run_figures(traces):
    runs = list(traces.values())
    stages = stage_figure({t.config.label: t.summary.stage_s for t in runs}, "run")
    verify = next(bar for bar in stages.data if bar.name == "verify")
    assert list(verify.y) == ["ar", "dflash", "ddtree@16"]
    assert verify.x[0] == pytest.approx(traces["ar"].summary.stage_s["verify"] * 1e3)
    race = race_chart(runs)
    assert [line.y[-1] for line in race.data] == [t.summary.new_tokens for t in runs]
    sweep = sweep_figure([traces["ddtree"]], traces["ar"])
    assert list(sweep.data[0].y) == [traces["ddtree"].summary.tau]
    ar_step = (traces["ar"].summary.wall_s - traces["ar"].summary.time_to_first_token_s) / traces["ar"].summary.steps
    tree = traces["ddtree"].summary
    cost = (tree.wall_s - tree.time_to_first_token_s) / tree.steps / ar_step
    assert list(sweep.data[1].y) == [pytest.approx(cost)] and list(sweep.data[2].y) == [pytest.approx(tree.tau / cost)]
    bars = economics_figure(runs)
    assert [bar.name for bar in bars.data] == ["τ: tokens per step", "step cost (AR steps)"]
    assert list(bars.data[1].y)[0] == pytest.approx(1.0), "AR costs one AR step"
    assert list(bars.data[1].y)[2] == pytest.approx(cost)
    predicted, verdict = tree.tau / cost, "faster" if tree.tau / cost >= 1 else "slower"
    measured = (tree.new_tokens / tree.wall_s) / (traces["ar"].summary.new_tokens / traces["ar"].summary.wall_s)
    assert economics_text(runs).splitlines()[1] == (
        f"- DDTree@16 commits {tree.tau:.2f} tokens per step and a step costs {cost:.2f} AR steps: {tree.tau:.2f} ÷ "
        f"{cost:.2f} = {predicted:.2f}× ({verdict} than AR, measured {measured:.2f}×).")
    assert "AR steps" in economics_figure([traces["ddtree"]]).layout.annotations[0].text


def test_a_replay_frame_of_the_race_draws_each_line_up_to_its_clock_on_the_whole_races_axes(traces):
    runs = list(traces.values())
    ddtree = traces["ddtree"]
    clock = (ddtree.steps[1].t_end + ddtree.steps[2].t_end) / 2  # after DDTree's second step, before its third
    frame = race_chart(runs, until=clock)
    line = frame.data[2]
    committed = 1 + ddtree.steps[0].acceptance_length + ddtree.steps[1].acceptance_length
    assert list(line.x[-2:]) == [ddtree.steps[1].t_end, clock] and list(line.y[-2:]) == [committed, committed]
    assert all(max(drawn.x) == clock for drawn in frame.data), "every line runs up to the clock"
    assert [shape.x0 for shape in frame.layout.shapes] == [clock]
    whole = max(t.steps[-1].t_end for t in runs)
    assert frame.layout.xaxis.range[1] >= whole, "the frame shows the whole race's time axis"
    assert frame.layout.yaxis.range[1] >= max(t.summary.new_tokens for t in runs)
    assert not race_chart(runs).layout.shapes, "the finished race has no clock"


def test_the_sweep_marks_its_best_budget_inside_the_log_axis(traces):
    import math

    budgets = (2, 4, 16)
    decoder = tiny_decoder()
    runs = [decoder.run(prompt_ids=PROMPT_IDS, settings=DecodeSettings("ddtree", max_new_tokens=8, tree_budget=b))
            for b in budgets]
    fig = sweep_figure(runs, traces["ar"])
    (best,) = [a for a in fig.layout.annotations if a.text.startswith("best: ")]
    budget = int(best.text.removeprefix("best: "))
    # a log axis places annotations by exponent: x = log10(budget), inside the axis' log10(2)..log10(16)
    assert best.x == pytest.approx(math.log10(budget))
    assert math.log10(min(budgets)) <= best.x <= math.log10(max(budgets))


def test_the_sweeps_best_is_the_measured_best_and_it_says_how_noisy_one_pass_is(traces):
    decoder = tiny_decoder()
    runs = {b: decoder.run(prompt_ids=PROMPT_IDS, settings=DecodeSettings("ddtree", max_new_tokens=8, tree_budget=b))
            for b in (2, 4, 16)}
    predicted = sweep_figure(list(runs.values()), traces["ar"]).data[2].y
    # a slow prefill: the steps, and so the prediction, are the same; what was measured is slower
    slowed = max(runs, key=lambda b: predicted[list(runs).index(b)])
    late = copy.deepcopy(runs[slowed])
    late.summary.time_to_first_token_s += 100.0
    late.summary.wall_s += 100.0
    runs[slowed] = late
    fig = sweep_figure(list(runs.values()), traces["ar"])
    measured = dict(zip(runs, fig.data[3].y))
    (best,) = [a.text for a in fig.layout.annotations if a.text.startswith("best: ")]
    assert best == f"best: {max(measured, key=measured.get)}" != f"best: {slowed}"
    assert all(width > 0 for width in fig.data[3].error_y.array), "every measured point says its noise"
    assert "measured: one pass, ± " in fig.layout.title.text and "2 standard errors" in fig.layout.title.text
    said = sweep_verdict(list(runs.values()), traces["ar"])
    assert said.startswith(f"Best measured: budget **{max(measured, key=measured.get)}**, ") and "± " in said


def test_drafting_run_alone_says_its_tau_and_asks_for_ar_for_the_cost(traces):
    text = economics_text([traces["ddtree"]])
    assert "no verify steps" not in text
    assert text == (f"- DDTree@16 commits {traces['ddtree'].summary.tau:.2f} tokens per step; whether that is faster "
                    "than AR depends on what a step costs, counted in AR steps: run AR with it to measure that.")


# ---------------------------------------------------------------- text, stats, token text

def test_text_view_colours_draft_and_target_tokens(traces):
    trace = traces["ddtree"]
    page = tokens_html(trace)
    drafted = sum(origin == "draft" for step in trace.steps for origin in committed_origins(step))
    assert page.count(": draft'") == drafted >= 1
    assert page.count(": target'") == trace.summary.new_tokens - drafted
    column = column_html("ddtree", trace, traces["ar"], all_done=True)
    assert "identical to AR" in column and "untrained" in column


@pytest.mark.parametrize("gap, verdict", [(0.01, "≈ leaves AR at token {n} on a near-tie: the target's top two were "
                                                  "0.01 logits apart"),
                                          (3.0, "✗ leaves AR at token {n}, where the target's top two were 3 logits "
                                                "apart: not rounding, a bug to report")])
def test_the_verdict_says_where_a_run_leaves_ar_and_whether_the_target_was_at_a_near_tie(traces, gap, verdict):
    ar, ddtree = copy.deepcopy(traces["ar"]), copy.deepcopy(traces["ddtree"])
    step = ddtree.steps[1]
    step.committed_ids = [step.committed_ids[0] + 1] + step.committed_ids[1:]
    index = 1 + len(ddtree.steps[0].committed_ids)  # the prefill's token, then the first step's
    ar.steps[index - 1].committed_margins = [gap]  # AR commits one token a step, after the prefill's
    column = column_html("ddtree", ddtree, ar, all_done=True)
    assert verdict.format(n=index + 1) in column.replace("&#x27;", "'")
    assert "identical to AR" not in column


def test_a_stopped_run_says_so_and_is_compared_with_nothing(traces):
    stopped_ar = copy.deepcopy(traces["ar"])
    stopped_ar.summary.stop_reason = "cancelled"
    column = column_html("AR (target only)", stopped_ar, stopped_ar, all_done=True)
    assert "(stopped)" in column and "stopped before its end" in column
    assert "(done)" not in column and "reference output" not in column
    after = column_html("DDTree (tree)", traces["ddtree"], stopped_ar, all_done=True)
    assert "(done)" in after and not any(verdict in after for verdict in ("identical to AR", "differs", "leaves AR"))


def test_run_stats_as_of_a_moment(traces):
    trace = traces["dflash"]
    middle = trace.steps[len(trace.steps) // 2]
    stats = run_stats(trace, until=middle.t_end)
    assert stats.steps == middle.index + 1 and not stats.done
    assert stats.tokens == 1 + sum(s.acceptance_length for s in trace.steps[: middle.index + 1])
    assert run_stats(trace).done and run_stats(trace).tokens == trace.summary.new_tokens


def test_token_text_from_trace_pieces(traces):
    trace = traces["ar"]
    text = pieces_token_text([trace])
    step = trace.steps[0]
    assert text(step.committed_ids[0]) == step.committed_text[0]
    assert text(10**6) == "#1000000"


def test_figures_show_every_token_as_text_without_a_tokenizer(traces):
    """The texts a trace carries label every tree node, hover and top-k cell (no ``#id``) where no model is loaded;
    a trace without them (schema version 1) knows only what it committed."""
    runs = list(traces.values())
    text = traces_token_text(runs)
    unknown = re.compile(r"#\d+")
    for step in traces["ddtree"].steps:
        tree = tree_figure(step, text)
        shown = [label for kind in node_traces(tree).values() for label in [*kind.text, *kind.hovertext]]
        heatmap = probability_figure(step, text)
        cells = [cell for row in heatmap.data[0].customdata for cell in row] + list(heatmap.data[-1].text)
        assert not any(unknown.search(label) for label in shown + cells + [explain_stop(step, text)])
    drafted = traces["ddtree"].steps[0].draft_top_tokens[0][-1]
    assert text(drafted) == traces["ddtree"].token_texts[drafted]
    assert traces_token_text(runs, tokenizer=lambda token: "?")(10**6) == "?"  # what no trace carries
    old = copy.deepcopy(traces["ddtree"])
    old.token_texts = {}
    assert traces_token_text([old])(drafted) == (f"#{drafted}" if drafted not in old.output_ids else text(drafted))


def test_visible_whitespace():
    assert visible(" a\nb\t") == "·a⏎b⇥"
    assert visible("") == "∅"
    assert visible("\x80") == "\\x80"


# ---------------------------------------------------------------- traces from the vLLM engine

# recorded on an H200 (engine.tools.bench --traces)
VLLM_SAMPLE = "benchmarks/traces/h200-vllm-heldout-f664308deb20.json"


def test_vllm_engine_traces_open_in_the_inspector_unchanged():
    traces = read_trace_file(VLLM_SAMPLE)  # what the app's upload does
    assert [t.config.method for t in traces] == ["ar", "dflash", "ddtree"]
    assert {t.config.engine for t in traces} == {"vllm"}
    text = pieces_token_text(traces)
    for trace in traces:
        for step in trace.steps:
            tree = ddtree.DraftTree(tokens=torch.tensor(step.tree_tokens, dtype=torch.long),
                                    parents=torch.tensor(step.tree_parents, dtype=torch.long),
                                    depths=torch.tensor(step.tree_depths, dtype=torch.long),
                                    log_probs=torch.tensor(step.tree_node_probs).log(),
                                    path_log_probs=torch.tensor(step.tree_path_probs).log(),
                                    ranks=torch.tensor(step.tree_ranks, dtype=torch.long))
            # the GPU walk agrees with the pure one on the recorded tree and target tokens
            assert ddtree.follow_tree(tree, step.target_tokens) == (step.accepted, step.bonus_token)
            assert drawn_nodes(tree_figure(step, text)) == list(range(step.tree_size + 2))
        assert trace.summary.new_tokens == len(trace.output_ids)
    assert max(len(step.tree_tokens) for step in traces[2].steps) == traces[2].config.tree_budget
