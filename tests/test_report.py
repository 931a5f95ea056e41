"""The benchmark report, from a results file built by engine.tools.bench's own code on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.settings import DecodeSettings
from engine.models.drafter import ScriptedDrafter, fresh_config
from engine.tools.bench import Job, benchmark, plan_jobs, summarize_runs
from engine.trace import SCRIPTED
from tests.tiny import tiny_drafter, tiny_target
from viz.report import headline_table, load_setting, main, per_position_acceptance

PROMPT = {"id": "p1", "prompt": "Hello,world"}  # the tiny tokenizer has no space character
MAX_NEW_TOKENS = 24
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def results_path(tmp_path_factory):
    target = tiny_target(0)
    ar = Decoder(target, tiny_drafter(target)).run(PROMPT["prompt"],
                                                   DecodeSettings("ar", max_new_tokens=MAX_NEW_TOKENS))
    config = fresh_config(target.config, num_layers=1, mask_token_id=target.config.vocab_size - 1,
                          block_size=BLOCK_SIZE, num_taps=2)
    reference = target.chat_ids(PROMPT["prompt"]) + ar.output_ids
    oracle = ScriptedDrafter(config, [reference]).initialize(0).to(torch.float64).eval()
    decoder = Decoder(target, oracle, DrafterInfo("oracle", trained=False))
    jobs = plan_jobs("ar,dflash,ddtree", "4,16")
    runs, notes, _ = benchmark(decoder, [PROMPT], jobs, DecodeSettings("ar", max_new_tokens=MAX_NEW_TOKENS),
                               progress=False)
    results = {
        "config": {"command": "python -m engine.tools.bench (test)", "model": target.name, "drafter": "oracle",
                   "drafter_trained": False, "engine": "torch", "device": "cpu", "dtype": "float64",
                   "block_size": BLOCK_SIZE, "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "seed": 0,
                   "tree_budgets": [4, 16], "prompts": "inline.jsonl", "num_prompts": 1,
                   "host": {"platform": "test-host", "torch": torch.__version__, "threads": 2}},
        "runs": runs, "summary": summarize_runs(runs, jobs), "notes": notes,
    }
    path = tmp_path_factory.mktemp("results") / "cpu-torch.json"
    path.write_text(json.dumps(results))
    return path


@pytest.fixture(scope="module")
def report(results_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("report")
    out, assets = folder / "BENCHMARKS.md", folder / "assets" / "bench"
    assert main(["--results", str(results_path), "--out", str(out), "--assets", str(assets)]) == 0
    return {"markdown": out.read_text(), "assets": assets}


def test_report_has_a_row_per_method(report):
    markdown = report["markdown"]
    for row in ("| AR | 1.00 |", "| DFlash |", "| DDTree (budget 4) |", "| DDTree (budget 16) |"):
        assert row in markdown
    assert "| baseline |" in markdown
    assert "| 1/1 |" in markdown  # identical to AR, as engine.tools.bench counts it


def test_report_says_where_and_how_it_was_measured(report):
    markdown = report["markdown"]
    for fact in ("Device: cpu", "Engine: torch, dtype float64", "drafter: oracle (untrained)", "`inline.jsonl`",
                 "up to 24 new tokens", "Command: `python -m engine.tools.bench (test)`"):
        assert fact in markdown


def test_per_position_table_matches_the_runs(report, results_path):
    setting = load_setting(results_path)
    header = "| Method | steps | " + " | ".join(f"k={k}" for k in range(1, BLOCK_SIZE)) + " |"
    assert header in report["markdown"]
    lengths = setting.acceptance_lengths("ddtree@16")
    shares = per_position_acceptance(lengths, BLOCK_SIZE - 1)
    row = f"| DDTree (budget 16) | {len(lengths)} | " + " | ".join(f"{s:.0%}" for s in shares) + " |"
    assert row in report["markdown"]
    assert max(lengths) > 1  # the oracle drafter got drafts accepted, so the table is not all zeros


def test_plots_exist_and_are_linked(report):
    for name in ("cpu-torch-budget.png", "cpu-torch-acceptance.png"):
        png = report["assets"] / name
        with Image.open(png) as image:
            assert image.width > 300 and image.height > 200
        assert f"(assets/bench/{name})" in report["markdown"]


def test_per_position_acceptance_counts_the_bonus_out():
    # lengths count the bonus: 1 accepts nothing, 3 accepts positions 1 and 2
    assert per_position_acceptance([1, 3, 2], 3) == pytest.approx([2 / 3, 1 / 3, 0.0])


def test_headline_prints_only_the_table(results_path, capsys):
    assert main(["--results", str(results_path), "--headline"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert all(line.startswith("|") for line in lines)
    assert len(lines) == 2 + 4  # header, rule, AR + DFlash + two budgets
    assert lines == headline_table([load_setting(results_path)]).splitlines()


def test_quoted_globs_are_expanded(results_path, capsys):
    assert main(["--results", str(results_path.parent / "*.json"), "--headline"]) == 0
    assert "DDTree (budget 16)" in capsys.readouterr().out


def test_a_file_that_is_not_results_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": []}))
    assert main(["--results", str(bad), "--headline"]) == 1
    assert "not an engine.tools.bench results file" in capsys.readouterr().err


def test_stage_table_is_milliseconds_per_verify_step(report, results_path):
    data = json.loads(results_path.read_text())
    ddtree = [run for run in data["runs"] if run["label"] == "ddtree@16"]
    steps = sum(run["verify_steps"] for run in ddtree)
    verify_ms = 1000 * sum(run["stage_s"]["verify"] for run in ddtree) / steps
    wall_ms = 1000 * sum(run["wall_s"] for run in ddtree) / steps
    row = next(line for line in report["markdown"].split("### Where the time goes")[1].splitlines()
               if line.startswith("| DDTree (budget 16) |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[4] == f"{verify_ms:.2f}" and cells[-1] == f"{wall_ms:.2f}"


def test_the_verify_cost_table_sets_each_tree_size_against_the_runs_ar_verify(report, results_path):
    data = json.loads(results_path.read_text())

    def verify_ms(label):
        runs = [run for run in data["runs"] if run["label"] == label]
        return 1000 * sum(run["stage_s"]["verify"] for run in runs) / sum(run["verify_steps"] for run in runs)

    section = report["markdown"].split("## Verify cost by tree size")[1].split("\n## ")[0]
    header, _, row = [line for line in section.splitlines() if line.startswith("|")][:3]
    assert header.endswith(f"| DFlash ({BLOCK_SIZE} tokens) | @4 (5) | @16 (17) |")
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    ar = verify_ms("ar")
    assert cells[1] == f"{ar:.2f}"
    assert cells[4] == f"{verify_ms('ddtree@16'):.2f} ({verify_ms('ddtree@16') / ar:.2f}×)"


def test_a_run_at_a_model_shape_gets_its_projection_and_a_single_budget_run_no_cost_row(results_path, tmp_path):
    from viz.report import build_report

    data = json.loads(results_path.read_text())
    data["config"] |= {"timing_only": True, "dtype": "bfloat16"}
    path = tmp_path / "shape.json"
    path.write_text(json.dumps(data))
    markdown = build_report([load_setting(path)], tmp_path / "B.md", tmp_path / "assets", "test")
    projection = markdown.split("### Projection (not a measurement)")[1]
    assert "| ddtree@16 |" in projection and "Projection, not measurement" in projection
    for exactness_run in ({"dtype": "float32"}, {"drafter": f"scripted ({SCRIPTED})"}):
        path.write_text(json.dumps(data | {"config": data["config"] | exactness_run}))
        assert "### Projection" not in build_report([load_setting(path)], tmp_path / "B.md", tmp_path / "assets",
                                                    "test")
    data["runs"] = [run for run in data["runs"] if run["label"] != "ddtree@4"]
    data["summary"].pop("ddtree@4")
    path.write_text(json.dumps(data))
    assert "## Verify cost by tree size" not in build_report([load_setting(path)], tmp_path / "B.md",
                                                              tmp_path / "assets", "test")


def test_native_vllm_rows_add_the_comparison_columns(results_path, tmp_path):
    """A vllm-engine file with --native runs: vLLM's own AR is the baseline of two extra columns."""
    data = json.loads(results_path.read_text())
    native = [dict(run, label="vllm-ar", method="ar", acceptance_lengths=[], stage_s={}, verify_steps=None,
                   wall_s=run["wall_s"] * 2, identical_to_vllm_ar=True)
              for run in data["runs"] if run["label"] == "ar"]
    for run in data["runs"]:
        run["identical_to_vllm_ar"] = run["label"] != "dflash"
    jobs = plan_jobs("ar,dflash,ddtree", "4,16") + [Job("vllm-ar", "ar", None)]
    data["runs"] += native
    data["summary"] = summarize_runs(data["runs"], jobs)
    path = tmp_path / "gpu-vllm.json"
    path.write_text(json.dumps(data))
    table = headline_table([load_setting(path)])
    assert "speedup vs vLLM AR | identical to vLLM AR |" in table.splitlines()[0]
    assert "| vLLM's own AR | 1.00 |" in table and table.count("| baseline |") == 2
    dflash = next(line for line in table.splitlines() if "| DFlash |" in line)
    assert dflash.endswith("| 0/1 |") and data["summary"]["ar"]["speedup_vs_vllm_ar"] == pytest.approx(2.0)


def test_a_tensor_parallel_setting_says_how_many_gpus(results_path, tmp_path):
    results = json.loads(results_path.read_text())
    results["config"] |= {"engine": "vllm", "tensor_parallel_size": 2, "host": {"gpu": "NVIDIA H200"}}
    path = tmp_path / "tp2.json"
    path.write_text(json.dumps(results))
    assert load_setting(path).title == ("tiny-llama · 2× NVIDIA H200, tensor parallel · vllm engine · float64 · "
                                        "inline (1) prompts")
    results["config"]["tensor_parallel_size"] = 1
    path.write_text(json.dumps(results))
    assert load_setting(path).title == "tiny-llama · NVIDIA H200 · vllm engine · float64 · inline (1) prompts"


@pytest.mark.parametrize("model", ["smollm2", "/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf"])
def test_a_title_names_the_target_unless_it_is_the_bundled_smollm2(results_path, tmp_path, model):
    results = json.loads(results_path.read_text())
    results["config"] |= {"model": model}
    path = tmp_path / "bundled.json"
    path.write_text(json.dumps(results))
    assert load_setting(path).title.startswith("cpu · torch engine")
    results["config"] |= {"model": "/tmp/tiny-qwen3.5-attention"}
    path.write_text(json.dumps(results))
    assert load_setting(path).title.startswith("tiny-qwen3.5-attention · cpu · torch engine")


def test_drafts_in_another_dtype_than_the_target_are_another_setting(results_path, tmp_path):
    results = json.loads(results_path.read_text())
    results["config"] |= {"dtype": "float32", "draft_dtype": "bfloat16"}
    path = tmp_path / "bf16-drafts.json"
    path.write_text(json.dumps(results))
    assert load_setting(path).title.endswith(" · float32 (bfloat16 drafts) · inline (1) prompts")


def test_a_gpu_setting_names_its_step_and_shows_kernels_and_lean_rows(results_path, tmp_path):
    from engine.tools.bench import native_ar_settings, with_reduced_traces
    from viz.report import build_report

    data = json.loads(results_path.read_text())
    data["config"] |= {"engine": "vllm", "step": "fixed", "host": {"gpu": "NVIDIA H200"}}
    lean = [dict(run, label=run["label"] + ":tokens") for run in data["runs"]]
    data["runs"] += lean
    jobs = with_reduced_traces(plan_jobs("ar,dflash,ddtree", "4,16"))
    data["summary"] = summarize_runs(data["runs"], jobs)
    data["summary"]["ddtree@16"]["kernels_per_step"] = {"draft": 41.0, "verify": 380.0, "commit": 0.0}
    data["summary"]["ddtree@16"]["slowest_kernels"] = {"verify": [["sm90_gemm", 812.5], ["attention", 96.0]]}
    path = tmp_path / "gpu-fixed.json"
    path.write_text(json.dumps(data))
    setting = load_setting(path)
    assert setting.title == "tiny-llama · NVIDIA H200 · vllm engine · fixed-shape step · float64 · inline (1) prompts"
    data["config"]["compile_step"] = True  # a compiled step is another setting: its title says so
    path.write_text(json.dumps(data))
    assert load_setting(path).title == ("tiny-llama · NVIDIA H200 · vllm engine · fixed-shape step (compiled) · "
                                        "float64 · inline (1) prompts")
    data["config"]["compile_step"], data["config"]["vllm_compile"] = False, True  # --vllm-compile: so is vLLM's
    path.write_text(json.dumps(data))
    assert load_setting(path).title == ("tiny-llama · NVIDIA H200 · vllm engine · fixed-shape step (target compiled by "
                                        "vLLM) · float64 · inline (1) prompts")
    data["config"]["compile_step"], data["config"]["vllm_compile"] = True, False
    data["config"]["vllm_ar_settings"] = native_ar_settings(0)  # vLLM's own AR at another setting: another setting
    path.write_text(json.dumps(data))
    assert load_setting(path).title.endswith("(compiled) · vLLM AR: vLLM's default max_num_seqs · float64 · inline (1) "
                                             "prompts")
    data["config"]["vllm_ar_settings"] = None
    data["config"]["native_pending"] = True  # the bench's file written before vLLM's own AR ran, and nothing after
    path.write_text(json.dumps(data))
    assert load_setting(path).title == ("tiny-llama · NVIDIA H200 · vllm engine · fixed-shape step (compiled) · "
                                        "cut off before vLLM's own AR · float64 · inline (1) prompts")
    data["config"]["kernels_pending"] = True  # written before the kernel counts too
    path.write_text(json.dumps(data))
    assert "cut off before its kernel counts and vLLM's own AR · float64" in load_setting(path).title
    markdown = build_report([setting], tmp_path / "B.md", tmp_path / "assets", "test")
    assert "| DDTree (budget 16) | 41 | 380 | 0 | 421 |" in markdown
    assert "| DDTree (budget 16) | verify | `sm90_gemm` | 812.5 |" in markdown.split("### Slowest kernels per step")[1]
    assert "| DDTree (budget 16), tokens-only trace |" in markdown
    assert "### The prefill" in markdown and "| target | context | start | prefill per run (ms) |" in markdown
    labels = setting.labels
    assert labels.index("ddtree@16:tokens") == labels.index("ddtree@16") + 1


def test_the_recorded_command_names_the_triton_precision_it_ran_under(monkeypatch):
    from engine.tools import bench
    monkeypatch.setattr(bench.sys, "argv", ["bench.py", "--dtype", "float32"])
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert bench._command() == "python -m engine.tools.bench --dtype float32"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    assert bench._command() == "TRITON_F32_DEFAULT=ieee python -m engine.tools.bench --dtype float32"


def test_a_bench_file_written_before_its_kernel_counts_and_native_ar_says_so(results_path, tmp_path, capsys):
    """The bench writes its runs before what may outlast a device call (kernel counts, vLLM's own AR): the file
    says which of those is still pending, and the tables wait for the end."""
    from engine.tools.bench import Measured, report as bench_report

    data = json.loads(results_path.read_text())
    jobs = plan_jobs("ar,dflash,ddtree", "4,16")
    measured = Measured(jobs, data["runs"], data["notes"], {})
    out = tmp_path / "cut.json"
    bench_report(str(out), data["config"], 0.0, measured, ("kernels", "native"))
    written = json.loads(out.read_text())
    assert (written["config"]["kernels_pending"], written["config"]["native_pending"]) == (True, True)
    assert len(written["runs"]) == len(data["runs"])
    printed = capsys.readouterr().out
    assert "the kernel counts and vLLM's own decoding follow" in printed and "| method |" not in printed
    bench_report(str(out), data["config"], 0.0, measured)
    written = json.loads(out.read_text())
    assert (written["config"]["kernels_pending"], written["config"]["native_pending"]) == (False, False)
    assert "| ddtree@16 |" in capsys.readouterr().out


def test_appended_sections_come_last_as_written(results_path, tmp_path):
    from engine.tools.gdn_bench import table

    kernels = tmp_path / "gdn.md"
    kernels.write_text(table({"model": "shape", "linear_layers": 2, "dtype": "bfloat16", "timings": [
        {"method": "fused", "tree": "ar", "nodes": 1, "step_us": 20.0, "layer_us": 10.0, "same_bits": None},
        {"method": "variant", "tree": "ar", "nodes": 1, "step_us": 18.0, "layer_us": 9.0, "same_bits": False}]}))
    out = tmp_path / "report.md"
    assert main(["--results", str(results_path), "--out", str(out), "--assets", str(tmp_path / "a"),
                 "--append", str(tmp_path / "*.md")]) == 0
    text = out.read_text()
    assert text.rstrip().endswith("| variant | 9.0, OTHER BITS |")
    assert text.index("## Gated DeltaNet verify and commit: shape") > text.index("## Headline")


def test_the_gdn_table_names_each_program_s_registers_once_per_size():
    from engine.tools.gdn_bench import table

    timing = {"method": "fused", "nodes": 65, "step_us": 9.0, "layer_us": 4.5, "same_bits": None,
              "programs": "verify_kernel 232 registers, 0 spills"}
    text = table({"model": "shape", "linear_layers": 2, "dtype": "bfloat16",
                  "timings": [timing | {"tree": "ddtree@64"}, timing | {"tree": "flat@64"}]})
    assert text.count("verify_kernel 232 registers") == 1 and text.endswith("- fused, 65 nodes: verify_kernel 232 "
                                                                           "registers, 0 spills")
