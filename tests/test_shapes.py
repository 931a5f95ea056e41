"""Model shapes with random weights (timing only): loading, labels, the bench, the projection."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from engine.errors import EngineError
from engine.loop.loading import load_decoder
from engine.loop.settings import DecodeSettings
from engine.measure.projection import PAPER_QWEN3_8B, project
from engine.models.drafter import drafter_shape
from engine.tools.bench import main as bench_main, native_ar_settings
from engine.tools.projection import main as projection_main
from engine.trace import SCRIPTED, TIMING_ONLY, Trace
from viz.figures import economics_figure
from viz.report import load_setting, measurement_lines

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ROOT / "assets" / "shapes"
VOCAB = 49152  # the bundled tokenizer's ids must fit


@pytest.fixture(scope="module")
def shape(tmp_path_factory) -> tuple[Path, Path]:
    """A small Qwen3-shaped target and its DFlash drafter, config files only."""
    folder = tmp_path_factory.mktemp("shapes")
    target = json.loads((SHAPES / "qwen3-8b" / "config.json").read_text())
    target.update(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_window_layers=4, bos_token_id=None,
                  eos_token_id=None)
    drafter = json.loads((SHAPES / "qwen3-8b-dflash-b16" / "config.json").read_text())
    drafter.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, num_target_layers=4, block_size=8,
                   layer_types=["full_attention"], dflash_config={"mask_token_id": 16, "target_layer_ids": [1, 2]})
    for name, config in (("target", target), ("drafter", drafter)):
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(json.dumps(config))
    return folder / "target", folder / "drafter"


@pytest.mark.parametrize("target, drafter", [("qwen3-8b", "qwen3-8b-dflash-b16"), ("dense-27b", "dense-27b-dflash-b16"),
                                             ("qwen3.6-27b", "qwen3.6-27b-dflash-b16"),
                                             ("qwen3-1.7b", "qwen3-1.7b-dflash-b16")])
def test_the_shipped_shapes_pair_up(target, drafter):
    config, draft = AutoConfig.from_pretrained(SHAPES / target), drafter_shape(SHAPES / drafter)
    config = getattr(config, "text_config", config)  # Qwen3.6: a multimodal checkpoint around its language model
    assert draft.config.hidden_size == config.hidden_size and draft.config.vocab_size == config.vocab_size
    assert max(draft.config.target_layer_ids) < config.num_hidden_layers
    assert draft.config.num_target_layers == config.num_hidden_layers and draft.block_size == 16
    assert next(draft.parameters()).device.type == "meta", "a shape is checked without allocating its weights"


def test_a_random_weights_run_is_labelled_decodes_its_full_length_and_stays_exact(shape):
    target, drafter = shape
    decoder = load_decoder(str(target), str(drafter), random_weights=True)
    assert decoder.target.stop_ids == [] and TIMING_ONLY in decoder.drafter_info.name
    ar = decoder.run("Hello there", DecodeSettings("ar", max_new_tokens=20))
    tree = decoder.run("Hello there", DecodeSettings("ddtree", max_new_tokens=20, tree_budget=8))
    assert len(ar.output_ids) == 20 and tree.output_ids == ar.output_ids
    assert ar.config.timing_only and tree.config.model_label == f"{target} ({TIMING_ONLY})"
    assert TIMING_ONLY in tree.config.title_label
    assert TIMING_ONLY in economics_figure([ar, tree]).layout.title.text
    assert Trace.from_json(tree.to_json()).config.timing_only


def test_random_weights_need_config_folders(shape):
    target, drafter = shape  # small: the drafter's random weights are made before the missing target is found
    with pytest.raises(EngineError, match="--random-weights needs a model folder with a config.json, got None"):
        load_decoder(None, str(drafter), random_weights=True)
    with pytest.raises(EngineError, match="--random-weights takes a drafter config folder too"):
        load_decoder(str(target), None, random_weights=True)


@pytest.mark.slow
def test_the_bench_times_a_shape_and_the_projection_reads_it(shape, tmp_path, capsys):
    target, drafter = shape
    out = tmp_path / "shape.json"
    result = subprocess.run([sys.executable, "-m", "engine.tools.bench", "--prompts", "assets/prompts/smoke.jsonl",
                             "--limit", "1", "--model", str(target), "--drafter", str(drafter), "--random-weights",
                             "--methods", "ar,dflash,ddtree", "--tree-budget", "8,16", "--max-new-tokens", "16",
                             "--no-progress", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())
    assert results["config"]["timing_only"] and results["config"]["drafter_revision"] is None
    assert all(run["new_tokens"] == 16 for run in results["runs"]), "end-of-sequence is ignored"
    assert load_setting(out).title.startswith(f"target ({TIMING_ONLY}) · ")
    assert projection_main([str(out)]) == 0
    printed = capsys.readouterr().out
    assert "baseline the Studio's AR" in printed and "Projection, not measurement" in printed
    assert "| ddtree@8 |" in printed and "| ddtree@16 |" in printed
    assert "Memory, estimated from the shapes" in printed, "the drafter's name carries its tags, its folder does not"


@pytest.mark.slow
def test_the_bench_counts_its_outputs_identical_to_another_runs_ar(shape, tmp_path, capsys):
    """--compare-to: another run's AR outputs (another engine or machine), prompt by prompt, with the
    first differing token named; random weights are seeded, so a second run decodes what the first did."""
    target, drafter = shape
    common = ["--prompts", "assets/prompts/smoke.jsonl", "--limit", "2", "--model", str(target), "--drafter",
              str(drafter), "--random-weights", "--max-new-tokens", "12", "--no-progress"]
    first = tmp_path / "first.json"
    assert bench_main(common + ["--methods", "ar", "--out", str(first)]) == 0
    results = json.loads(first.read_text())
    changed = results["runs"][1]
    changed["output_ids"][3] += 1
    (tmp_path / "other.json").write_text(json.dumps(results))
    second = tmp_path / "second.json"
    assert bench_main(common + ["--methods", "ar,ddtree", "--tree-budget", "8", "--compare-to",
                                str(tmp_path / "other.json"), "--out", str(second)]) == 0
    compared = json.loads(second.read_text())
    assert compared["summary"]["ar"]["identical_to_reference"] == "1/2"
    assert compared["summary"]["ddtree@8"]["identical_to_reference"] == "1/2"
    differing = [run for run in compared["runs"] if not run["identical_to_reference"]]
    assert {run["prompt_id"] for run in differing} == {changed["prompt_id"]}
    assert all(run["reference_divergence"]["index"] == 3 for run in differing)
    notes = "\n".join(compared["notes"])
    assert f"{changed['prompt_id']} ddtree@8: differs from other.json's AR at new token 3" in notes
    assert "identical to --compare-to" in capsys.readouterr().out
    assert "Outputs identical to the AR of" in "\n".join(measurement_lines(load_setting(second)))


@pytest.mark.slow
def test_a_comparison_decodes_the_prompt_tokens_the_other_run_recorded(shape, tmp_path):
    """Two machines can tokenize one text apart (transformers 5.17 and 5.24 split a blank line differently
    for a Qwen3.5 folder): --compare-to decodes the other run's recorded tokens, and says where they differ."""
    target, drafter = shape
    common = ["--prompts", "assets/prompts/smoke.jsonl", "--limit", "2", "--model", str(target), "--drafter",
              str(drafter), "--random-weights", "--max-new-tokens", "6", "--no-progress", "--methods", "ar"]
    first = tmp_path / "first.json"
    assert bench_main(common + ["--out", str(first)]) == 0
    results = json.loads(first.read_text())
    recorded = results["config"]["prompt_ids"]
    assert set(recorded) == {run["prompt_id"] for run in results["runs"]} and all(recorded.values())
    other_id = results["runs"][1]["prompt_id"]
    ours = list(recorded[other_id])
    recorded[other_id] = ours[:-1] + [ours[-2]] + ours[-1:]  # one token more, as another tokenizer might make
    (tmp_path / "other.json").write_text(json.dumps(results))
    second = tmp_path / "second.json"
    assert bench_main(common + ["--compare-to", str(tmp_path / "other.json"), "--out", str(second)]) == 0
    compared = json.loads(second.read_text())
    assert compared["config"]["prompt_ids"] == recorded
    assert f"{other_id}: tokenized here as {len(ours)} tokens, by other.json's run as {len(ours) + 1}: decoding " \
           "that run's tokens" in compared["notes"]
    assert next(run for run in compared["runs"] if run["prompt_id"] != other_id)["identical_to_reference"]


def test_a_comparison_without_every_prompts_ar_is_one_clear_line_before_any_model_loads(tmp_path, capsys):
    results = {"config": {}, "runs": [{"prompt_id": "nobody-asked", "label": "ar", "output_ids": [1]}], "summary": {}}
    (tmp_path / "other.json").write_text(json.dumps(results))
    assert bench_main(["--prompts", "assets/prompts/smoke.jsonl", "--model", "no/such-model", "--compare-to",
                       str(tmp_path / "other.json")]) == 2
    assert "no ar run for 3 of these prompts" in capsys.readouterr().err


def test_the_projection_divides_tau_by_the_step_cost():
    results = {"config": {"model": "qwen3-8b", "timing_only": True},
               "runs": [{"label": "vllm-ar", "wall_s": 1.0, "new_tokens": 100}],  # 10 ms per token
               "summary": {"ar": {"step_ms": 9.0}, "dflash": {"step_ms": 15.0}, "ddtree@16": {"step_ms": 20.0},
                           "ddtree@16:tokens": {"step_ms": 18.0}, "ddtree@512": {"step_ms": 40.0}}}
    name, ar_ms, rows = project(results, {"dflash": 2.2, "ddtree": {"16": 2.9}})
    assert name == "vLLM's own AR" and ar_ms == pytest.approx(10.0)
    dflash, b16, b512 = rows
    assert [row.label for row in rows] == ["dflash", "ddtree@16", "ddtree@512"]
    assert dflash.cost == pytest.approx(1.5) and dflash.speedup_ours == pytest.approx(2.2 / 1.5)
    assert b16.speedup_ours == pytest.approx(2.9 / 2.0) and b16.speedup_paper == pytest.approx(8.61 / 2.0)
    assert b512.speedup_ours is None and b512.tau_paper == PAPER_QWEN3_8B["tau"][512]
    assert b512.paper_speedup == PAPER_QWEN3_8B["speedup"][512]


def test_the_mtp_row_counts_steps_by_accepted_drafts_and_caps_the_published_tau():
    from engine.measure.projection import PUBLISHED_MTP, format_projection, project_mtp

    results = {"config": {"model": "qwen3.6-27b", "drafter": "d", "timing_only": True, "vllm_mtp_tokens": 3},
               "runs": [{"label": "vllm-ar", "wall_s": 1.0, "new_tokens": 100},  # 10 ms per token
                        {"label": "vllm-mtp", "wall_s": 1.2, "new_tokens": 80, "accepted": 20}],  # 60 steps
               "summary": {"dflash": {"step_ms": 15.0}}}
    mtp = project_mtp(results, 10.0)
    assert mtp.step_ms == pytest.approx(20.0) and mtp.cost == pytest.approx(2.0)
    assert PUBLISHED_MTP["tau"] > 4 and mtp.tau == 4  # 3 drafted tokens accept at most 4 a step
    assert mtp.speedup == pytest.approx(2.0)
    name, ar_ms, rows = project(results, {})
    assert "| vllm-mtp (3 drafted) | 20.00 | 2.00 | – | – | 4.00 (published) | 2.00× | – |" in \
        format_projection(results, name, ar_ms, rows, "a curve")
    assert project_mtp({"config": {}, "runs": []}, 10.0) is None


def test_a_projection_without_a_baseline_is_one_clear_line(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"config": {}, "runs": [], "summary": {"ddtree@16": {"step_ms": 2.0}}}))
    assert projection_main([str(path)]) == 2
    assert capsys.readouterr().err.strip() == ("error: the results hold no AR baseline: bench with --methods ar "
                                               "(and --native ar on the vLLM engine)")


def test_the_memory_estimate_counts_qwen3_8b_as_published():
    from engine.measure.projection import memory_plan, parameter_count

    target = json.loads((SHAPES / "qwen3-8b" / "config.json").read_text())
    drafter = json.loads((SHAPES / "qwen3-8b-dflash-b16" / "config.json").read_text())
    assert parameter_count(target) == 8_190_735_360  # Qwen3-8B's published parameter count
    plan = memory_plan(target, drafter, gpu_gib=141, utilization=0.9, budgets=(16, 1024))
    assert plan.kv_bytes_per_token == 2 * (36 + 5) * 8 * 128 * 2
    assert plan.context_tokens[16] > plan.context_tokens[1024] > plan.model_context == 40960
    assert "the model's own context limit binds first" in plan.sentence()
    tight = memory_plan(target, drafter, gpu_gib=24, utilization=0.9, budgets=(16,))
    assert tight.context_tokens[16] < 40960 and "the KV cache (the context) runs out first" in tight.sentence()


def test_the_memory_estimates_of_the_shipped_shapes_print_as_one_table(capsys):
    pairs = [("qwen3-8b", "qwen3-8b-dflash-b16"), ("qwen3.6-27b", "qwen3.6-27b-dflash-b16")]
    argv = [arg for target, drafter in pairs for arg in ("--memory", str(SHAPES / target), str(SHAPES / drafter))]
    assert projection_main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| qwen3")]
    assert rows[0].startswith("| qwen3-8b | 17.2 | 164 | 0 | ") and rows[0].endswith("| 40,960 | the model's limit |")
    assert rows[1].startswith("| qwen3.6-27b | ") and "| 262,144 |" in rows[1] and "| 0 |" not in rows[1]
    assert projection_main([]) == 2 and "give a results JSON, or --memory TARGET DRAFTER" in capsys.readouterr().err


def test_the_memory_estimate_of_the_qwen3_6_hybrid_grows_with_its_attention_layers_only():
    """48 of its 64 layers are Gated DeltaNets: a fixed state per request, no KV per token."""
    from engine.measure.projection import memory_plan, parameter_count

    target = json.loads((SHAPES / "qwen3.6-27b" / "config.json").read_text())
    drafter = json.loads((SHAPES / "qwen3.6-27b-dflash-b16" / "config.json").read_text())
    assert 26.5e9 < parameter_count(target) < 27.5e9  # "27B" (the vision tower left out)
    plan = memory_plan(target, drafter, gpu_gib=141, utilization=0.9, budgets=(16, 512))
    # 16 attention layers of 4 KV heads of 256; the drafter's one full-attention layer (its 4 others slide)
    assert plan.kv_bytes_per_token == 2 * 16 * 4 * 256 * 2 + 2 * 1 * 8 * 128 * 2
    linear = (2 * 2048 + 6144) * 3 * 2 + 48 * 128 * 128 * 4  # conv window (bf16) + float32 recurrent state
    sliding = 2 * 2048 * 8 * 128 * 2
    assert plan.state_bytes == 48 * linear + 4 * sliding
    assert "MiB of fixed state per request" in plan.sentence()


def test_the_vllm_engine_refuses_unfit_pairs_before_it_starts(shape, tmp_path, monkeypatch):
    """Checked before vLLM is imported or the GPU used, so with CUDA said to be there this runs anywhere."""
    import torch

    from engine.on_vllm.vllm_engine import VllmOptions, load_vllm_decoder
    from tests.hybrid_models import save_tiny_hybrid

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    timing = VllmOptions(random_weights=True)
    with pytest.raises(EngineError, match="drafter hidden size 5120 does not match the target's 4096"):
        load_vllm_decoder(str(SHAPES / "qwen3-8b"), str(SHAPES / "dense-27b-dflash-b16"), options=timing)
    target, drafter = shape
    deep = tmp_path / "deep-drafter"
    deep.mkdir()
    config = json.loads((drafter / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 9]
    (deep / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match=r"drafter taps target layers \[1, 9\] but the target has 4 layers"):
        load_vllm_decoder(str(target), str(deep), options=timing)
    text_only = save_tiny_hybrid(tmp_path / "hybrid", seed=1)  # vLLM serves Qwen3.5 only as its multimodal class
    with pytest.raises(EngineError, match="Qwen3_5ForCausalLM is a hybrid .linear-attention. target the vLLM engine "
                                          "cannot run: it forks Gated DeltaNet states for Qwen3NextForCausalLM"):
        load_vllm_decoder(str(text_only), None)
    with pytest.raises(EngineError, match="model folder '.*' has no config.json"):
        load_vllm_decoder(str(tmp_path), None)


def test_a_qwen3_5_hybrid_passes_the_vllm_preflight_only_with_a_drafter_that_fits(tmp_path, monkeypatch):
    import torch

    from engine.models.drafter import drafter_shape, fresh_config, write_scripted_drafter
    from engine.models.target import shape_config
    from engine.on_vllm.vllm_engine import (
        VllmOptions,
        compiles_target,
        llm_settings,
        load_vllm_decoder,
        native_settings,
        preflight,
    )
    from tests.hybrid_models import save_tiny_hybrid

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before vLLM or the GPU is touched
    folder = save_tiny_hybrid(tmp_path / "qwen3.5", vllm_shape=True)
    config = shape_config(str(folder)).text_config
    fits_config = fresh_config(config, num_layers=1, mask_token_id=0, num_taps=2)
    fits = write_scripted_drafter(tmp_path / "fits", fits_config, [])
    preflight(str(folder), drafter_shape(fits))  # no error
    # the Studio sends text: the multimodal checkpoint runs its language model alone
    # and a hybrid's workers import engine.on_vllm.vllm_gdn before the model is built (its float32 prefill)
    assert llm_settings(str(folder), studio=True) == {
        "additional_config": {"gdn_prefill_backend": "triton"}, "language_model_only": True,
        "worker_extension_cls": "engine.on_vllm.hybrid_worker.HybridStudioWorker"}
    native = llm_settings(str(folder), studio=False)
    assert native["worker_extension_cls"] == "engine.on_vllm.vllm_gdn.HybridPrefill"
    # one state block per sequence: vLLM's default 1,024 do not fit at 27B
    assert native_settings(str(folder), VllmOptions())["max_num_seqs"] == 8
    assert llm_settings(str(SHAPES / "qwen3.6-27b"), studio=False)["language_model_only"] is True
    assert llm_settings(str(SHAPES / "qwen3-8b"), studio=False) == {}
    assert native_settings(str(SHAPES / "qwen3-8b"), VllmOptions()) == {"max_num_seqs": 8}  # fastest for one request
    assert native_settings(str(SHAPES / "qwen3-8b"), VllmOptions(native_max_seqs=0)) == {}  # vLLM's as it ships
    assert native_settings(str(folder), VllmOptions(native_max_seqs=2))["max_num_seqs"] == 2
    # and the results say which the baseline ran
    assert native_ar_settings(None).endswith("max_num_seqs 8") and native_ar_settings(2).endswith("max_num_seqs 2")
    assert native_ar_settings(0).endswith("vLLM's default max_num_seqs")
    assert llm_settings(str(SHAPES / "qwen3-8b"), studio=True) == {
        "worker_extension_cls": "engine.on_vllm.vllm_worker.StudioWorker"}
    # vLLM compiles a hybrid unless told not to, a dense target only when told
    assert compiles_target(str(folder), None) and compiles_target(str(SHAPES / "qwen3.6-27b"), None)
    assert not compiles_target(str(folder), False) and not compiles_target(str(SHAPES / "qwen3-8b"), None)
    assert compiles_target(str(SHAPES / "qwen3-8b"), True)
    narrow = fresh_config(config, num_layers=1, mask_token_id=0, num_taps=2)
    narrow.hidden_size = 128
    with pytest.raises(EngineError, match="drafter hidden size 128 does not match the target's 256"):
        load_vllm_decoder(str(folder), str(write_scripted_drafter(tmp_path / "narrow", narrow, [])))
    deep = fresh_config(config, num_layers=1, mask_token_id=0, target_layer_ids=[1, 7])
    with pytest.raises(EngineError, match=r"drafter taps target layers \[1, 7\] but the target has 4 layers"):
        load_vllm_decoder(str(folder), str(write_scripted_drafter(tmp_path / "deep", deep, [])))
    long_blocks = fresh_config(config, num_layers=1, mask_token_id=0, num_taps=2, block_size=48)
    with pytest.raises(EngineError, match="a hybrid target's trees at most 32 tokens deep; this drafter drafts blocks "
                                          "of 48"):
        load_vllm_decoder(str(folder), str(write_scripted_drafter(tmp_path / "long", long_blocks, [])))


@pytest.mark.slow
def test_a_scripted_drafter_from_a_runs_own_outputs_goes_deep_on_random_weights(shape, tmp_path):
    """Random weights are seeded, so a second run decodes what the first did: a drafter scripted
    with the first run's outputs (``engine.tools.scripted``) is accepted levels deep, and exactness then
    means something at any shape."""
    from engine.tools import bench
    from engine.tools.scripted import main as scripted_main

    target, drafter = shape
    common = ["--prompts", str(ROOT / "assets" / "prompts" / "smoke.jsonl"), "--model", str(target), "--random-weights",
              "--max-new-tokens", "24", "--no-progress"]
    first = tmp_path / "ar.json"
    assert bench.main(common + ["--drafter", str(drafter), "--methods", "ar", "--out", str(first)]) == 0
    assert scripted_main([str(first), "--shape", str(drafter), "--out", str(tmp_path / "scripted")]) == 0
    second = tmp_path / "deep.json"
    assert bench.main(common + ["--drafter", str(tmp_path / "scripted"), "--methods", "ar,dflash,ddtree",
                                "--tree-budget", "16", "--out", str(second)]) == 0
    results = json.loads(second.read_text())
    assert SCRIPTED in results["config"]["drafter"] and not results["config"]["drafter_trained"]
    assert TIMING_ONLY in results["config"]["drafter"]
    summary = results["summary"]
    for label in ("dflash", "ddtree@16"):
        assert summary[label]["identical_to_ar"] == "3/3" and summary[label]["tau"] >= 3.0, (label, summary[label])
    assert scripted_main([str(first), "--shape", str(drafter), "--out", str(tmp_path / "x"), "--label", "vllm-ar"]) == 2
