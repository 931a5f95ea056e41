"""The comparison video, rendered from real tiny-model traces and decoded back."""

from __future__ import annotations

import math
import random
from pathlib import Path

import imageio_ffmpeg
import numpy as np
import pytest
import torch

from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.settings import DecodeSettings
from engine.models.drafter import ScriptedDrafter, fresh_config
from engine.trace import read_trace_file, write_trace_file
from tests.tiny import tiny_drafter, tiny_target
from viz.video import (
    HOLD_S,
    INTRO_S,
    PRESETS,
    THEME,
    Column,
    Scene,
    Timeline,
    VideoError,
    column_states,
    load_font,
    main,
    pick_traces,
    render_video,
    visible_lines,
    wrap_text,
)

PROMPT_IDS = [5, 6, 7, 8, 9, 10]
MAX_NEW_TOKENS = 24
FPS = 10


@pytest.fixture(scope="module")
def traces():
    """AR, DFlash and DDTree on one prompt; an oracle drafter makes the drafting runs accept real paths."""
    target = tiny_target(0)
    ar = Decoder(target, tiny_drafter(target)).run(prompt_ids=PROMPT_IDS,
                                                   settings=DecodeSettings("ar", max_new_tokens=MAX_NEW_TOKENS))
    config = fresh_config(target.config, num_layers=1, mask_token_id=target.config.vocab_size - 1, block_size=8,
                          num_taps=2)
    oracle = ScriptedDrafter(config, [PROMPT_IDS + ar.output_ids]).initialize(0).to(torch.float64).eval()
    decoder = Decoder(target, oracle, DrafterInfo("oracle", trained=False))
    drafted = [decoder.run(prompt_ids=PROMPT_IDS, settings=DecodeSettings(method, max_new_tokens=MAX_NEW_TOKENS,
                                                                          tree_budget=16))
               for method in ("dflash", "ddtree")]
    return [ar, *drafted]


@pytest.fixture(scope="module")
def slowdown(traces):
    """Stretch the few-millisecond tiny runs to about a second of video."""
    return 1.0 / max(t.summary.wall_s for t in traces)


def decoded(path: Path) -> dict:
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    width, height = meta["size"]
    return {"path": path, "meta": meta, "frames": [np.frombuffer(raw, np.uint8).reshape(height, width, 3)
                                                   for raw in reader]}


@pytest.fixture(scope="module")
def video(traces, slowdown, tmp_path_factory):
    calls = []
    path = render_video(traces, tmp_path_factory.mktemp("video") / "comparison.mp4", preset="small", fps=FPS,
                        slowdown=slowdown, progress=lambda done, total: calls.append((done, total)))
    return decoded(path) | {"progress": calls}


def badge_patch_colour(frame: np.ndarray, scene: Scene, column: int) -> np.ndarray:
    """Mean colour of a patch at the badge's left end: inside its rounded corner, left of its centred text."""
    box = scene.layout.columns[column].badge
    x0 = box.x0 + scene.preset.px(10) + 1
    x1 = box.x0 + box.width // 8
    y_mid = (box.y0 + box.y1) // 2
    return frame[y_mid - 2:y_mid + 3, x0:x1].reshape(-1, 3).mean(axis=0)


def test_video_decodes_with_the_expected_frames(traces, slowdown, video):
    scene = Scene(traces, PRESETS["small"], slowdown)
    timeline = Timeline(scene.race_s, FPS, slowdown)
    expected = round(INTRO_S * FPS) + math.ceil(scene.race_s * slowdown * FPS) + 1 + round(HOLD_S * FPS)
    assert timeline.frame_count == expected
    assert video["meta"]["size"] == (640, 360)
    assert video["meta"]["codec"] == "h264"
    assert len(video["frames"]) == expected
    assert video["progress"][-1] == (expected, expected)


def test_first_and_last_frames_differ(video):
    first, last = video["frames"][0].astype(int), video["frames"][-1].astype(int)
    assert np.abs(first - last).mean() > 5  # the prompt card against the finished race


def test_final_frame_shows_every_column_finished(traces, slowdown, video):
    scene = Scene(traces, PRESETS["small"], slowdown)
    timeline = Timeline(scene.race_s, FPS, slowdown)
    race_start = video["frames"][timeline.intro_frames]
    final = video["frames"][-1]
    for column in range(3):
        assert np.abs(badge_patch_colour(final, scene, column) - THEME.badge).max() < 30
        assert np.abs(badge_patch_colour(race_start, scene, column) - THEME.badge).max() > 60  # no badge yet


def test_column_state_at_the_end_and_the_start(traces):
    columns = [Column.from_trace(trace) for trace in traces]
    end = max(column.wall_s for column in columns)
    final = column_states(columns, end)
    assert all(state.finished for state in final)
    assert [state.tokens for state in final] == [trace.summary.new_tokens for trace in traces]
    assert [state.chars for state in final] == [len(column.text) for column in columns]
    start = column_states(columns, 0.0)
    assert not any(state.finished for state in start)
    assert all(state.tokens == 0 and state.in_prefill for state in start)


def test_text_at_time_t_follows_the_trace(traces):
    trace = traces[2]
    column = Column.from_trace(trace)
    for step in trace.steps:
        t = step.t_end
        expected = trace.prefill.first_text + "".join(
            "".join(s.committed_text) for s in trace.steps if s.t_end <= t)
        assert column.text[:column.state_at(t).chars] == expected
        assert column.step_at(t) is step


def test_columns_are_ordered_and_labelled(traces):
    shuffled = traces[:]
    random.Random(0).shuffle(shuffled)
    scene = Scene(shuffled, PRESETS["small"])
    assert [c.trace.config.method for c in scene.columns] == ["ar", "dflash", "ddtree"]
    assert scene.columns[0].speedup == pytest.approx(1.0)
    assert scene.tree_column is scene.columns[2]
    assert "Drafter: oracle (untrained)" in scene.card_facts()


def test_a_second_drafters_columns_stand_beside_the_firsts_with_its_tag_and_shade(traces, tmp_path):
    import copy

    from viz.video import method_title, print_rgb

    seconds = [copy.deepcopy(trace) for trace in traces[1:]]
    for trace in seconds:
        trace.config.drafter_tag, trace.config.drafter = "candidate", "candidate-folder"
    scene = Scene([*traces, *seconds], PRESETS["small"])
    assert [method_title(c.trace) for c in scene.columns] == [
        "AR", "DFlash", "DFlash · candidate", "DDTree · budget 16", "DDTree · budget 16 · candidate"]
    colours = [print_rgb(c.trace.config.method_row, c.trace.config.drafter_tag) for c in scene.columns]
    assert len(set(colours)) == 5, "each column its own colour: a drafter's shade of its method's"
    assert "Drafter: candidate-folder (untrained)" in scene.card_facts()
    render_video([*traces, *seconds], tmp_path / "two-drafters.mp4", preset="small", fps=2, slowdown=1.0)


def test_traces_of_different_prompts_are_refused(traces):
    other = Decoder(tiny_target(0)).run(prompt_ids=[7, 8, 9], settings=DecodeSettings("ar", max_new_tokens=4))
    with pytest.raises(VideoError, match="different prompts"):
        Scene([traces[0], other], PRESETS["small"])


def test_wrapping_fits_the_width_and_keeps_every_character():
    font = load_font("sans", 16)
    text = "first paragraph with some words\n\nA" + "x" * 80 + " tail words here"
    lines = wrap_text(text, font, 150)
    for line in lines:
        assert font.getlength(text[line.start:line.end].rstrip()) <= 150
    rebuilt = "".join(text[line.start:line.end] for line in lines)
    assert rebuilt.replace(" ", "") == text.replace("\n", "").replace(" ", "")
    blank = next(line for line in lines if line.start == line.end)
    assert blank.appears_at == text.index("\n\n") + 1  # the blank line shows once its newline is out
    assert len(visible_lines(lines, len(text), max_lines=2)) == 2  # scrolled to the newest lines


def test_cli_renders_a_folder_of_traces(traces, tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    for trace in traces:
        trace.save(folder / f"p1.{trace.config.label}.json")
    out = tmp_path / "cli.mp4"
    assert main(["--traces", str(folder), "--out", str(out), "--preset", "small", "--fps", "5"]) == 0
    video, frames = decoded(out), Timeline(Scene(traces, PRESETS["small"]).race_s, 5).frame_count
    assert (video["meta"]["size"], video["meta"]["fps"]) == ((640, 360), 5)
    assert len(video["frames"]) == frames
    assert video["meta"]["duration"] == pytest.approx(frames / 5, abs=1 / 5)
    traces[0].save(folder / "p2.ar.json")
    with pytest.raises(VideoError, match="--prompt"):
        pick_traces(folder, None, None)
    assert [t.config.label for t in pick_traces(folder, "p1", ["ar", "ddtree@16"])] == ["ar", "ddtree@16"]


def test_the_video_draws_each_tree_as_the_inspector_lays_it_out(traces):
    """One layout for both (viz.tree_figure.tidy_layout): a node's row in the video is its row in the app."""
    from viz.tree_figure import tidy_layout
    from viz.video import Box, layout_tree

    box = Box(0, 0, 800, 400)
    for step in traces[2].steps:
        drawing, layout = layout_tree(step, box, columns=10), tidy_layout(step)
        rows = [round(y / drawing.row_height) - 1 for _, y in drawing.points]
        assert rows == [layout.positions[node][1] for node in range(step.tree_size + 1)]
        assert [round(x / drawing.depth_width - 0.5) for x, _ in drawing.points] == \
            [layout.positions[node][0] for node in range(step.tree_size + 1)]


def assert_renders_every_run(source: Path, traces, out: Path, fps: int, slowdown: float = 1.0) -> None:
    """``python -m viz.video --traces source`` writes the whole race: every frame at 640x360, every column's
    finish badge on the last one."""
    assert main(["--traces", str(source), "--out", str(out), "--preset", "small", "--fps", str(fps),
                 "--slowdown", str(slowdown)]) == 0
    scene = Scene(traces, PRESETS["small"], slowdown)
    video = decoded(out)
    assert video["meta"]["size"] == (640, 360)
    assert len(video["frames"]) == Timeline(scene.race_s, fps, slowdown).frame_count
    for column in range(len(traces)):
        assert np.abs(badge_patch_colour(video["frames"][-1], scene, column) - THEME.badge).max() < 30


def test_cli_renders_the_apps_download(traces, slowdown, tmp_path):
    download = write_trace_file(tmp_path / "ddtree-traces.json", traces)  # what viz.page.state.save_traces writes
    assert_renders_every_run(download, traces, tmp_path / "download.mp4", FPS, slowdown)
    with pytest.raises(VideoError, match="--prompt picks among a folder's trace sets"):
        pick_traces(download, "p1", None)


@pytest.mark.parametrize("path", sorted(Path("assets/traces").glob("*.json")), ids=lambda path: path.name)
def test_cli_renders_every_shipped_example_trace(path, tmp_path):
    traces = read_trace_file(path)
    assert [t.config.method for t in traces] == ["ar", "dflash", "ddtree"]
    assert_renders_every_run(path, traces, tmp_path / "example.mp4", fps=2)


def test_a_folder_of_mixed_trace_files_is_picked_by_prompt(traces, tmp_path):
    write_trace_file(tmp_path / "download.json", traces)
    for trace in traces:
        trace.save(tmp_path / f"p1.{trace.config.label}.json")
    with pytest.raises(VideoError, match="holds traces of 2 prompts; choose one with --prompt: download, p1"):
        pick_traces(tmp_path, None, None)
    assert pick_traces(tmp_path, "download", None) == traces
    assert pick_traces(tmp_path, "p1", ["ddtree@16", "ar"]) == [traces[2], traces[0]]
