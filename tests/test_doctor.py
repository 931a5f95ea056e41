"""The drafter doctor (engine.measure.doctor, engine.tools.doctor): verdicts that name the fault and the fix."""

from __future__ import annotations

import html
import json
import re
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig

from engine.errors import EngineError
from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.loading import SHIPPED_DRAFTER
from engine.loop.settings import DecodeSettings
from engine.measure.doctor import (
    CANNOT_JUDGE,
    DEFAULT_PROMPTS,
    FAULTY,
    GREEDY_STAGE,
    HEALTHY,
    MIN_JUDGED_ROOTS,
    PASSES_STAGE,
    PROBE_STAGE,
    WIRING_STAGE,
    CalibrationBin,
    DoctorReport,
    DoctorStopped,
    Pacer,
    PositionStats,
    ProbeSettings,
    diagnose,
    greedy_outputs,
    score_blocks,
    static_report,
    target_passes,
)
from engine.measure.doctor_checks import FAULT, OK, WARNING, Finding, configured_wiring, static_checks
from engine.models.drafter import DFlashDrafter, DrafterConfig, fresh_config, load_drafter, read_drafter_config
from engine.tools import doctor as doctor_cli
from engine.tools.replay import proposals_along
from tests.tiny import tiny_target
from viz.doctor_figures import calibration_figure, doctor_figures, report_markdown

pytestmark = pytest.mark.slow  # most tests probe the bundled model and its shipped drafter

SHIPPED_IDS = [1, 8, 14, 20, 27]
QWEN36_DRAFTER = "assets/shapes/qwen3.6-27b-dflash-b16"


# ---------------------------------------------------------------- the bundled pair, loaded once

@pytest.fixture(scope="module")
def bundled(bundled_decoder):
    """The bundled target, the shipped drafter (float32), and the target's passes over three prompts, shared."""
    target = bundled_decoder.target
    drafter = load_drafter(SHIPPED_DRAFTER).eval()
    decoder = Decoder(target, drafter, DrafterInfo("shipped", trained=True))
    return target, drafter, target_passes(decoder, DEFAULT_PROMPTS[:3], max_new_tokens=32)


def diagnosed(bundled, drafter: DFlashDrafter, **settings) -> DoctorReport:
    target, _, runs = bundled
    return diagnose(Decoder(target, drafter.eval(), DrafterInfo("probed", trained=True)),
                    settings=ProbeSettings(**settings), runs=runs)


def with_config(drafter: DFlashDrafter, **changes) -> DFlashDrafter:
    """The same weights under another config: what a copy with an edited config.json loads as."""
    copy = DFlashDrafter(replace(drafter.config, **changes))
    copy.load_state_dict(drafter.state_dict())
    return copy


def test_the_shipped_pair_is_healthy(bundled):
    report = diagnosed(bundled, bundled[1])
    assert report.status == HEALTHY and report.verdict.startswith("healthy"), report.lines()
    assert [p.position for p in report.positions] == list(range(1, 16))
    assert all(0 <= p.acceptance <= 1 for p in report.positions if p.acceptance is not None)
    assert all(0 < p.mean_probability <= 1 for p in report.positions)
    assert report.first_slot > 0.4 and report.positions[0].acceptance == pytest.approx(report.first_slot)
    assert report.positions[0].hit_rate > report.positions[-1].hit_rate  # later slots are harder
    assert report.tau["dflash"] > 1.8 and report.tau["ddtree@64"] > report.tau["dflash"]
    assert sum(b.count for b in report.calibration) == sum(p.blocks for p in report.positions)
    # calibrated within reason: where the drafter is sure, it is mostly right; where unsure, mostly wrong
    assert report.calibration[-1].hit_rate > 0.7 and report.calibration[0].hit_rate < 0.3
    assert sum(band.roots for band in report.confidence_bands) == report.roots - report.prompts
    assert [w.label for w in report.wirings] == ["as configured", "layer ids -1", "layer ids +1"]


@pytest.mark.parametrize("shift", [1, -1])
def test_a_copy_with_shifted_layer_ids_is_named_with_its_fix(bundled, shift):
    shifted = with_config(bundled[1], target_layer_ids=[i + shift for i in SHIPPED_IDS])
    report = diagnosed(bundled, shifted)
    assert report.status == FAULTY, report.lines()
    assert f"with layer ids {-shift:+d}" in report.verdict
    assert f"one layer {'late' if shift > 0 else 'early'}" in report.verdict
    assert f"set dflash_config.target_layer_ids to {SHIPPED_IDS}" in report.verdict


def test_a_random_drafter_is_untrained(bundled):
    report = diagnosed(bundled, DFlashDrafter(bundled[1].config).initialize(1))
    assert report.status == FAULTY
    assert "acceptance at chance" in report.verdict and "untrained or not for this target" in report.verdict
    assert report.first_slot < 0.05


def test_the_report_round_trips_through_json_and_draws(bundled):
    report = diagnosed(bundled, bundled[1])
    again = DoctorReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again == report
    figures = doctor_figures(again)
    assert set(figures) == {"positions", "calibration", "confidence", "wirings"}
    assert all(figure.data for figure in figures.values())
    assert report_markdown(report).startswith(f"✓ **Healthy**: {report.verdict.removeprefix('healthy: ')}\n")


def test_one_short_prompt_is_too_few_to_judge_and_names_no_fault(bundled, capsys):
    """One prompt of 8 tokens (the Doctor tab's "Hello", 8) once named the shipped drafter's wiring a fault."""
    target, drafter, _ = bundled
    report = diagnose(Decoder(target, drafter, DrafterInfo("shipped", trained=True)), ["Hello"],
                      ProbeSettings(max_new_tokens=8))
    judged = report.wirings[0].roots
    assert 0 < judged < MIN_JUDGED_ROOTS
    assert report.status == CANNOT_JUDGE, report.lines()
    assert report.verdict == (f"too few draft positions to judge ({judged} scored, need {MIN_JUDGED_ROOTS}): use "
                              "more prompts or more tokens per prompt")
    assert not any(f.severity == FAULT for f in report.findings)
    assert report.first_slot is not None and all(figure.data for figure in doctor_figures(report).values())
    assert report_markdown(report).startswith(f"○ **Not judged yet**: too few draft positions to judge ({judged} ")
    assert doctor_cli.finish(report, None) == CANNOT_JUDGE  # the CLI's exit status: neither healthy nor a fault
    assert capsys.readouterr().out.startswith(f"verdict: {report.verdict}\n")


def test_enough_short_prompts_are_judged_but_extra_prompts_past_the_probed_ones_are_not_asked_for(bundled):
    """The wiring probes score the first prompts alone (ProbeSettings.wiring_prompts): past them, only more
    tokens per prompt help, and the verdict says so."""
    target, drafter, _ = bundled
    decoder = Decoder(target, drafter, DrafterInfo("shipped", trained=True))
    runs = target_passes(decoder, DEFAULT_PROMPTS[:5], max_new_tokens=4)
    report = diagnose(decoder, settings=ProbeSettings(max_new_tokens=4), runs=runs)
    assert report.status == CANNOT_JUDGE
    assert report.verdict.endswith("use more tokens per prompt (the wiring probes score the first 4 prompts)")


def test_the_doctor_tabs_markdown_keeps_token_text_and_says_healthy_once():
    findings = [Finding(OK, "mask token", "16 = '<|im_start|>', a special token no text produces"),
                Finding(WARNING, "rope", "theta *10000* against the target's `100000` [sic]")]
    report = DoctorReport("smollm2", "smollm2-135m-dflash-b16", "torch", "healthy: first-slot hits 71.5%", HEALTHY,
                          findings)
    text = shown_text(report_markdown(report))
    assert text.splitlines()[0] == "✓ Healthy: first-slot hits 71.5%"
    assert "mask token: 16 = '<|im_start|>', a special token no text produces" in text
    assert "rope: theta *10000* against the target's `100000` [sic]" in text
    assert "Target smollm2 · drafter smollm2-135m-dflash-b16 · torch engine" in text


@pytest.mark.parametrize("status", [HEALTHY, FAULTY, CANNOT_JUDGE])
def test_the_doctor_tabs_verdict_uses_only_glyphs_the_shipped_fonts_draw(status):
    from fontTools.ttLib import TTFont

    from viz.video import font_path

    findings = [Finding(severity, "check", "a line — with τ → its fix") for severity in (OK, "note", WARNING, FAULT)]
    report = DoctorReport("smollm2", "shipped", "torch", "a verdict", status, findings, first_slot=0.7, prompts=1,
                          roots=9, tau={"ddtree@16": 3.2}, seconds={"target": 1.0})
    fonts = [font_path(kind) for kind in ("sans", "bold")]
    if None in fonts:
        pytest.skip("needs DejaVu Sans (fonts-dejavu-core, or matplotlib's copy)")
    drawn = set.intersection(*(set(TTFont(font).getBestCmap()) for font in fonts))
    missing = {glyph for glyph in report_markdown(report) if not glyph.isspace() and ord(glyph) not in drawn}
    assert not missing, f"the shipped fonts lack {sorted(missing)}: the page would show empty boxes"


def test_the_calibration_plots_slots_by_colour_without_labels_that_overlap():
    """Fifteen slots' points crowd together; text labels beside them overlapped into an unreadable smear."""
    positions = [PositionStats(slot, 0.7 - slot / 50, 0.72 - slot / 40, 0.7 - slot / 45, 100) for slot in range(1, 16)]
    report = DoctorReport("smollm2", "shipped", "torch", "healthy", HEALTHY, [], first_slot=0.7, positions=positions,
                          calibration=[CalibrationBin(0.6, 0.7, 0.65, 0.66, 40)])
    slots = next(trace for trace in calibration_figure(report).data if trace.name == "per draft slot")
    assert slots.mode == "markers" and slots.text is None
    assert list(slots.marker.color) == list(slots.customdata) == list(range(1, 16))
    assert slots.marker.colorbar.title.text == "draft slot"
    assert list(slots.x) == [p.mean_probability for p in positions] and list(slots.y) == [p.hit_rate for p in positions]


def shown_text(markdown: str) -> str:
    """What a reader sees of ``markdown``: rendered by CommonMark (markdown-it, a Gradio dependency), tags dropped."""
    from markdown_it import MarkdownIt

    return html.unescape(re.sub(r"<[^>]+>", "", MarkdownIt().render(markdown)))


# ---------------------------------------------------------------- the command line

def test_cli_another_hidden_size_is_one_line_and_exit_2(tmp_path, capsys):
    raw = json.loads((SHIPPED_DRAFTER / "config.json").read_text()) | {"hidden_size": 768}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert doctor_cli.main(["--drafter", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1
    assert err.startswith("error: the drafter is for another target: its hidden size is 768, the target's 576")


def test_cli_taps_outside_the_target_exit_1_without_a_probe(tmp_path, capsys, monkeypatch, bundled_decoder):
    # the bundled target the CLI would load (float32), already loaded for the session
    monkeypatch.setattr(doctor_cli, "load_target", lambda model, dtype: bundled_decoder.target)
    raw = json.loads((SHIPPED_DRAFTER / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [i + 3 for i in SHIPPED_IDS]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert doctor_cli.main(["--drafter", str(tmp_path), "--out", str(tmp_path / "report.json")]) == 1
    out = capsys.readouterr().out
    assert "reach outside the target's 30 layers (0–29): [30]" in out.splitlines()[0]
    assert json.loads((tmp_path / "report.json").read_text())["status"] == 1


def test_cli_static_on_the_qwen36_shapes_names_vllms_windows_and_taps(capsys):
    code = doctor_cli.main(["--model", "assets/shapes/qwen3.6-27b", "--drafter", QWEN36_DRAFTER,
                            "--engine", "vllm", "--static"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("verdict: healthy"), out
    assert "aux hidden states [2, 17, 32, 47, 62] (dflash_config.target_layer_ids + 1)" in out
    assert "layers [0, 1, 2, 3] (window 2048) run as full, non-causal attention" in out


def test_probe_settings_refuse_a_probe_without_tokens():
    with pytest.raises(EngineError, match="greedy tokens per prompt must be 2 to"):
        ProbeSettings(max_new_tokens=1)


def test_a_static_report_draws_placeholders_and_its_verdict():
    findings = static_checks(smollm_like_config(num_hidden_layers=20), None, read_drafter_config(SHIPPED_DRAFTER))
    report = static_report("small", "shipped", "torch", findings)
    assert report.status == FAULTY and "reach outside the target's 20 layers (0–19): [20, 27]" in report.verdict
    assert all(not figure.data for figure in doctor_figures(report).values())
    assert "✗ **Fault**" in report_markdown(report)


def test_cli_bad_input_is_one_line(capsys):
    assert doctor_cli.main(["--drafter", "/no/such/folder"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# ---------------------------------------------------------------- static checks

def smollm_like_config(**changes) -> LlamaConfig:
    return LlamaConfig(**{"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152,
                          "rope_theta": 100000.0} | changes)


def test_vllm_reads_eagle_ids_as_they_are_and_the_doctor_says_so():
    config = read_drafter_config(SHIPPED_DRAFTER)
    raw = {"eagle_aux_hidden_state_layer_ids": SHIPPED_IDS}  # z-lab's ids where vLLM wants aux ids: one layer early
    findings = static_checks(smollm_like_config(), None, config, "vllm", raw)
    taps = next(f for f in findings if f.check == "vLLM taps")
    assert taps.severity == FAULT
    assert "the outputs of layers [0, 7, 13, 19, 26], where the Studio reads [1, 8, 14, 20, 27]" in taps.line
    assert "set eagle_aux_hidden_state_layer_ids to [2, 9, 15, 21, 28]" in taps.line
    plain = static_checks(smollm_like_config(), None, config, "vllm", {})
    assert next(f for f in plain if f.check == "vLLM taps").severity == OK


def test_static_checks_name_rope_and_the_mask_token():
    config = read_drafter_config(SHIPPED_DRAFTER)
    findings = static_checks(smollm_like_config(rope_theta=10000.0), None, replace(config, mask_token_id=60000))
    by_check = {f.check: f for f in findings}
    assert by_check["rope"].severity == WARNING and "set rope_parameters.rope_theta to 10000" in by_check["rope"].line
    assert by_check["mask token"].severity == FAULT


# ---------------------------------------------------------------- the batched probe and the window probe

def tiny_config(target, **changes) -> DrafterConfig:
    """A drafter of the Qwen3.6-27B drafter's layout (four causal sliding-window layers, then one full),
    at the tiny target's width and with a window of 8 instead of 2048, so short prompts cross it."""
    layout = read_drafter_config(QWEN36_DRAFTER)
    config = fresh_config(target.config, num_layers=layout.num_hidden_layers,
                          mask_token_id=target.config.vocab_size - 1, target_layer_ids=[0, 2])
    return replace(config, layer_types=list(layout.layer_types), sliding_window=8, **changes)


TINY_PROMPTS = ["Count:abcdefghij", "Hello!World;", "x=y+z*2;print(x)"]


def test_the_batched_probe_drafts_what_the_decoder_drafts():
    """Many blocks a pass, each behind its own root, with causal, windowed and full layers: the same
    log-probabilities as the decoder's one pass per step with its growing context cache."""
    target = tiny_target(3)
    drafter = DFlashDrafter(tiny_config(target)).initialize(3).double().eval()
    decoder = Decoder(target, drafter, DrafterInfo("random", trained=False))
    run = target_passes(decoder, TINY_PROMPTS[:1], max_new_tokens=24)[0]
    anchors = list(range(run.prompt_length, len(run.ids)))
    batched = score_blocks(decoder, run, configured_wiring(drafter), anchors, top_k=4)
    stepwise = proposals_along(decoder, run.ids[:run.prompt_length].tolist(), run.ids[run.prompt_length:].tolist(), 4)
    assert torch.equal(batched.tokens, stepwise.tokens)
    assert torch.allclose(batched.log_probs, stepwise.log_probs.to(batched.log_probs.dtype), atol=1e-5)


def test_the_doctor_says_each_stage_with_the_time_it_has_left_and_a_stop_ends_it():
    target = tiny_target(3)
    decoder = Decoder(target, DFlashDrafter(tiny_config(target)).initialize(3).double().eval(),
                      DrafterInfo("random", trained=False))
    heard = []
    diagnose(decoder, TINY_PROMPTS, ProbeSettings(max_new_tokens=8, budgets=(4,)), pacer=Pacer(heard.append))
    assert list(dict.fromkeys(p.stage for p in heard)) == [GREEDY_STAGE, PASSES_STAGE, PROBE_STAGE, WIRING_STAGE]
    assert all(p.left_s is None for p in heard if p.done == 0), "a stage's pace is known after its first tick"
    greedy, probe, wirings = ([p for p in heard if p.stage == stage and p.done]
                              for stage in (GREEDY_STAGE, PROBE_STAGE, WIRING_STAGE))
    assert not greedy[0].foreseen and str(greedy[0]).endswith(
        "left in this stage (the drafter's probes are timed when they start)")
    # the configured probe foresees the miswiring probes after it: they score its blocks again on fewer roots
    assert all(p.foreseen for p in probe) and probe[-1].left_s > 0
    assert (wirings[-1].done, wirings[-1].left_s) == (wirings[-1].total, 0)
    with pytest.raises(DoctorStopped, match="stopped during the target's greedy outputs"):
        diagnose(decoder, TINY_PROMPTS, ProbeSettings(max_new_tokens=8), pacer=Pacer(should_stop=lambda: True))


def test_greedy_outputs_in_one_batch_are_ar_outputs():
    """Prompts of different lengths left-padded into one batch decode what AR decodes for each alone."""
    target = tiny_target(5)
    decoder = Decoder(target, DFlashDrafter(tiny_config(target)).initialize(0).double().eval())
    prompt_ids = [target.chat_ids(prompt) for prompt in TINY_PROMPTS]
    alone = [decoder.run(settings=DecodeSettings("ar", max_new_tokens=40), prompt_ids=ids).output_ids
             for ids in prompt_ids]
    assert greedy_outputs(decoder, prompt_ids, 40) == alone
    assert len({len(ids) for ids in prompt_ids}) > 1 and all(len(output) > 1 for output in alone)


class WindowedAnswers(DFlashDrafter):
    """Right only where its sliding windows are honoured: the stand-in for a drafter trained with windows.

    A drafter trained with sliding-window layers never learned to read keys older than its window; shown
    them (an engine that runs those layers as full attention) its drafts degrade. This one makes that
    dependence total and plain, without training: it knows the target's greedy continuations (as
    ``ScriptedDrafter`` does) and proposes them for a block only if, in every layer its *trained* layout
    makes sliding (``trained``), no query of the block was shown a key ``window`` or more positions
    behind it, read from the very masks the probe hands its layers; otherwise it proposes the token after
    the right one. Its network runs as any drafter's; only its logits are scripted. The probe's batched
    pass only (it reads the per-layer mask list)."""

    def __init__(self, config: DrafterConfig, sequences: list[list[int]], trained: list[int | None]):
        super().__init__(config)
        self.sequences, self.trained = sequences, trained
        self.roots: list[int] = []
        self.anchors: list[int] = []
        self.honoured = torch.ones(0, dtype=torch.bool)

    def embed(self, ids, embedding):
        self.roots = ids[0, ::self.block_size].tolist()
        return super().embed(ids, embedding)

    def forward(self, block_embeddings, context_features, block_positions, context_positions, cache=None,
                mask=None, context_count=None):
        queries = block_positions[0]
        behind = queries[:, None] - torch.cat([context_positions[0], queries])[None, :]
        blocks = len(queries) // self.block_size
        honoured = torch.ones(blocks, dtype=torch.bool)
        for layer_mask, window in zip(mask, self.trained):
            if window is not None:
                shown_old = (layer_mask[0, 0] & (behind >= window)).view(blocks, -1).any(dim=1)
                honoured &= ~shown_old.cpu()
        self.anchors, self.honoured = queries[::self.block_size].tolist(), honoured
        return super().forward(block_embeddings, context_features, block_positions, context_positions, cache,
                               mask, context_count)

    def logits(self, hidden, lm_head):
        vocab = lm_head.shape[0]
        logits = torch.zeros(*hidden.shape[:-1], vocab, dtype=hidden.dtype)
        for row, (anchor, root, honoured) in enumerate(zip(self.anchors, self.roots, self.honoured.tolist())):
            known = next((s for s in self.sequences if len(s) > anchor and s[anchor] == root), [])
            for slot, position in enumerate(range(anchor + 1, min(anchor + hidden.shape[1] + 1, len(known)))):
                logits[row, slot, (known[position] + (0 if honoured else 1)) % vocab] = 20.0
        return logits.to(hidden.device)


@pytest.fixture(scope="module")
def windowed():
    """The tiny target, its greedy passes over three prompts, and a maker of window-trained drafters."""
    target = tiny_target(7)
    config = tiny_config(target)
    plain = Decoder(target, DFlashDrafter(config).initialize(0).double().eval(), DrafterInfo("random", trained=False))
    runs = target_passes(plain, TINY_PROMPTS, max_new_tokens=32)
    trained = [config.sliding_window if t == "sliding_attention" else None for t in config.layer_types]

    def probe(engine: str = "torch", **config_changes) -> DoctorReport:
        drafter = WindowedAnswers(replace(config, **config_changes), [r.ids.tolist() for r in runs], trained)
        decoder = Decoder(target, drafter.initialize(0).double().eval(), DrafterInfo("window-trained", trained=True))
        return diagnose(decoder, settings=ProbeSettings(engine=engine, budgets=(4,)), runs=runs)

    return probe


def wiring(report: DoctorReport, label: str):
    return next(w for w in report.wirings if w.label == label)


def test_the_window_probe_sees_a_drafter_that_needs_its_windows(windowed):
    report = windowed()
    assert report.status == HEALTHY, report.lines()
    assert report.first_slot == 1.0
    assert wiring(report, "sliding-window layers as full attention").first_slot == 0.0
    assert wiring(report, "full-attention layers as sliding-window (8)").first_slot == 1.0  # the last layer: no matter


def test_the_vllm_engine_is_named_for_running_the_windows_as_full_attention(windowed):
    report = windowed(engine="vllm")
    assert report.status == FAULTY
    assert "as vLLM 0.23's own DFlash runs it: 0.0% first-slot hits" in report.verdict
    assert "it runs every drafter layer as full attention, the sliding-window ones too" in report.verdict


def test_a_config_that_lost_its_windows_is_named_with_the_fix(windowed):
    report = windowed(layer_types=["full_attention"] * 5)
    assert report.status == FAULTY
    assert "with full-attention layers as sliding-window (8): 100.0% first-slot hits" in report.verdict
    assert "set layer_types of layers [0, 1, 2, 3, 4] to sliding_attention" in report.verdict


def test_the_final_norm_is_probed_where_the_last_layer_is_tapped(windowed):
    report = windowed(target_layer_ids=[0, 3])
    assert "the last layer read before the final norm" in [w.label for w in report.wirings]
