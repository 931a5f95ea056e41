"""Bad input gets a clear EngineError naming the cause and the fix, never a traceback."""

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.errors import EngineError
from engine.loop.decode import Decoder
from engine.loop.settings import DecodeSettings
from engine.methods import MAX_TREE_BUDGET
from engine.models.drafter import load_drafter, save_drafter
from engine.models.target import load_target
from engine.tools.bench import plan_jobs, read_prompts
from tests.tiny import tiny_decoder, tiny_drafter, tiny_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def decoder():
    return tiny_decoder(0, vocab=40)


def test_empty_prompt(decoder):
    with pytest.raises(EngineError, match="prompt is empty"):
        decoder.run("   ", DecodeSettings("ar"))


def test_prompt_beyond_context(decoder):
    with pytest.raises(EngineError, match="exceeds the model's context of 512 tokens"):
        decoder.run(prompt_ids=[3] * 500, settings=DecodeSettings("ddtree", max_new_tokens=20))



def test_prepared_settings_run_as_they_are(decoder, monkeypatch):
    """Settings are checked against the models once: the vLLM engine's workers and the API's queued runs take
    what was prepared (``Decoder.run_prepared``) and check nothing again."""
    settings, _ = decoder.prepare(DecodeSettings("ddtree", max_new_tokens=4, tree_budget=4), 2)
    expected = decoder.run(prompt_ids=[3, 4], settings=settings)
    monkeypatch.setattr(decoder, "prepare", lambda *args: pytest.fail("prepared settings are checked again"))
    trace = decoder.run_prepared("", [3, 4], settings, ["a note from the driver"])
    assert trace.output_ids == expected.output_ids and trace.config.notes == ["a note from the driver"]


BUDGET_SENTENCE = 'tree budget must be "auto" or a whole number from 1 to {high}, got {got}'


@pytest.mark.parametrize("budget", [0, -3, MAX_TREE_BUDGET + 1, 10**9, 2.5, True, "many", None])
def test_a_budget_outside_auto_and_1_to_1024_is_refused_where_the_settings_are_made(budget):
    with pytest.raises(EngineError) as refused:
        DecodeSettings("ddtree", tree_budget=budget)
    assert str(refused.value) == BUDGET_SENTENCE.format(high=MAX_TREE_BUDGET, got=repr(budget))
    assert refused.value.field == "tree_budget"


@pytest.mark.parametrize("typed, budget", [("auto", "auto"), (" AUTO ", "auto"), ("16", 16), (1, 1), (1024, 1024)])
def test_a_budget_is_auto_or_a_whole_number(typed, budget):
    assert DecodeSettings("ddtree", tree_budget=typed).tree_budget == budget


@pytest.mark.parametrize("field, value, sentence", [
    ("method", "medusa", "unknown method 'medusa'; choose from ar, dflash, ddtree"),
    ("max_new_tokens", 0, "max new tokens must be a whole number from 1 to 4096, got 0"),
    ("max_new_tokens", 64.0, "max new tokens must be a whole number from 1 to 4096, got 64.0"),
    ("temperature", 2.5, "temperature must be a number from 0 to 2, got 2.5"),
    ("temperature", float("nan"), "temperature must be a number from 0 to 2, got nan"),
    ("seed", 2**64, f"seed must be a whole number from 0 to {2**63 - 1}, got {2**64}"),
    ("seed", -1, f"seed must be a whole number from 0 to {2**63 - 1}, got -1"),
    ("trace_detail", "some", "trace detail must be one of full, tokens, got 'some'"),
])
def test_each_bad_setting_is_one_sentence_naming_its_field(field, value, sentence):
    values = {"method": "ddtree", field: value}
    with pytest.raises(EngineError) as refused:
        DecodeSettings(**values)
    assert str(refused.value) == sentence
    assert refused.value.field == field


def test_temperature_two_is_the_highest_allowed(decoder):
    assert decoder.run(prompt_ids=[3, 4],
                       settings=DecodeSettings("ar", max_new_tokens=2, temperature=2.0)).config.notes == []


@pytest.mark.parametrize("block_size", [1, 17])
def test_block_size_unsupported_by_drafter(decoder, block_size):
    with pytest.raises(EngineError, match=f"block size {block_size} is not supported by this drafter: choose 2..16"):
        decoder.run(prompt_ids=[3, 4], settings=DecodeSettings("dflash", block_size=block_size))


def test_missing_drafter_folder(tmp_path):
    with pytest.raises(EngineError, match="does not exist; pass a DFlash checkpoint folder or 'random'"):
        load_drafter(tmp_path / "nope")


def test_corrupt_drafter_weights(tmp_path):
    save_drafter(tiny_drafter(tiny_target()), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(EngineError, match="unreadable \\(corrupt or truncated\\?\\)"):
        load_drafter(tmp_path)


def test_not_a_dflash_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(EngineError, match="this is not a DFlash drafter checkpoint"):
        load_drafter(tmp_path)


def test_drafter_for_another_model(tmp_path):
    from engine.loop.decode import Decoder

    other = tiny_drafter(tiny_target())
    other.config.target_layer_ids = [0, 9]
    with pytest.raises(EngineError, match="it was trained for another model"):
        Decoder(tiny_target(), other)


def test_drafter_round_trip_is_exact(tmp_path):
    drafter = tiny_drafter(tiny_target())
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path).double()
    for name, tensor in drafter.state_dict().items():
        assert loaded.state_dict()[name].equal(tensor), name


def test_unreadable_prompts_file(tmp_path):
    with pytest.raises(EngineError, match="cannot read prompts file"):
        read_prompts(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "ok"}\nnot json\n')
    with pytest.raises(EngineError, match="bad.jsonl:2 is not valid JSON"):
        read_prompts(str(bad))


def test_unknown_method():
    with pytest.raises(EngineError, match="unknown method"):
        plan_jobs("ar,medusa", "32")


def test_model_id_that_cannot_be_fetched(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EngineError, match="model hub is unreachable \\(offline\\).*pass its folder"):
        load_target("some-org/gated-model")


def test_cli_reports_errors_without_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "engine.tools.bench", "--prompts", str(tmp_path / "none.jsonl")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: cannot read prompts file")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("budgets", ["0", "-4", "8,0", "x", "8,,"])
def test_a_tree_budget_below_one_or_not_a_number_is_one_clear_line(budgets):
    result = subprocess.run([sys.executable, "-m", "engine.tools.bench", "--prompts", "assets/prompts/smoke.jsonl",
                             "--tree-budget", budgets], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --tree-budget"), result.stderr
    assert budgets in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
@pytest.mark.parametrize("extra, message", [
    (["--engine", "vllm"], "error: the vLLM engine needs a CUDA GPU; on this machine use --engine torch"),
    (["--native", "ar"], "error: --native times vLLM's own decoding: it needs --engine vllm (or --device cuda)"),
    (["--count-kernels"], "error: --count-kernels counts CUDA kernels: it needs --engine vllm or --device cuda"),
    (["--vllm-compile"], "error: --vllm-compile has vLLM compile the target it serves: it needs --engine vllm"),
    (["--native-max-seqs", "8"], "error: --native-max-seqs sets vLLM's own runs: it needs --native and a count (0: "
                                 "vLLM's default), got 8 without --native"),
])
def test_vllm_engine_without_a_gpu_is_a_clear_error(extra, message):
    result = subprocess.run([sys.executable, "-m", "engine.tools.bench", "--prompts", "assets/prompts/smoke.jsonl",
                             *extra], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == message


def test_the_app_and_the_torch_engine_never_import_vllm():
    code = "import sys, app, engine.tools.bench, engine.loop.loading; assert 'vllm' not in sys.modules, 'vllm imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_mtp_needs_a_target_with_its_own_mtp_layers():
    from engine.on_vllm.vllm_engine import check_mtp_layers

    assert check_mtp_layers("assets/shapes/qwen3.6-27b") == 1  # Qwen3.6-27B ships one MTP layer
    with pytest.raises(EngineError, match=r"^--native mtp times the target's own multi-token-prediction layers: "
                                          r"assets/shapes/dense-27b's config names none \(mtp_num_hidden_layers or "
                                          r"num_nextn_predict_layers\)$"):
        check_mtp_layers("assets/shapes/dense-27b")
    with pytest.raises(EngineError, match="the bundled GGUF has none"):
        check_mtp_layers(None)


def test_a_baseline_vllm_refuses_to_start_becomes_a_note(decoder, monkeypatch):
    """The bench times vLLM's own decoders after ours: one vLLM will not start must not lose the rest."""
    import argparse

    import engine.on_vllm.vllm_engine
    from engine.tools.bench import benchmark_native, plan_native_jobs

    max_seqs, asked = [], []

    def refuse(model, dtype, drafter, drafted, **kwargs):
        max_seqs.append(kwargs["options"].native_max_seqs)
        asked.append((drafter is not None, drafted, kwargs["mtp"], kwargs["cuda_graphs"]))
        raise ValueError("1 validation error for SpeculativeConfig\n  Value error, heads (9) must divide by 2")

    monkeypatch.setattr(engine.on_vllm.vllm_engine, "native_llm", refuse)
    args = argparse.Namespace(model=None, drafter="drafter", seed=0, max_new_tokens=4, native_max_seqs=2,
                              native_mtp_tokens=3)
    prompts = [{"id": "p", "prompt": "hello"}]
    runs, notes = benchmark_native(decoder, prompts, plan_native_jobs("mtp,ar,dflash,ar-graphless"), args,
                                   "float32", progress=False)
    assert runs == [] and max_seqs == [2, 2, 2, 2]  # --native-max-seqs reaches each of vLLM's own engines
    # AR drafts nothing (ar-graphless: without vLLM's CUDA graphs); DFlash a block less its anchor with our drafter;
    # MTP --native-mtp-tokens with its own layers
    assert asked == [(False, 0, False, True), (False, 0, False, False),
                     (True, decoder.drafter.block_size - 1, False, True), (False, 3, True, True)]
    assert notes == [f"{label} not timed: vLLM did not start it: "
                     "1 validation error for SpeculativeConfig Value error, heads (9) must divide by 2"
                     for label in ("vllm-ar", "vllm-ar-graphless", "vllm-dflash", "vllm-mtp")]


def test_an_unknown_native_decoder_is_named_before_any_run():
    from engine.tools.bench import plan_native_jobs

    with pytest.raises(EngineError, match=r"^--native takes ar, ar-graphless, dflash and/or mtp, got 'ar,graphless'$"):
        plan_native_jobs("ar,graphless")


def test_vllm_own_engine_starts_only_after_the_studio_gave_the_gpu_back(decoder, monkeypatch):
    """At 27B the Studio's engine and vLLM's own do not fit side by side: the bench closes the Studio's
    decoder (its programs and graphs go) before vLLM's own engine starts."""
    import argparse

    import engine.on_vllm.vllm_engine
    from engine.tools.bench import benchmark_native, plan_native_jobs

    fixed = Decoder(decoder.target, decoder.drafter, decoder.drafter_info, fixed_step=True)
    settings = DecodeSettings("ddtree", max_new_tokens=6, tree_budget=8)
    before = fixed.run(prompt_ids=[3, 4], settings=settings).output_ids
    programs_at_start = []

    def start(*args, **kwargs):
        programs_at_start.append((len(fixed._programs), kwargs["options"].native_max_seqs))
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(engine.on_vllm.vllm_engine, "native_llm", start)
    args = argparse.Namespace(model=None, drafter="drafter", seed=0, max_new_tokens=4, native_max_seqs=None)
    _, notes = benchmark_native(fixed, [{"id": "p", "prompt": "hello"}], plan_native_jobs("ar"), args, "float32",
                                progress=False)
    assert programs_at_start == [(0, 8)] and notes == ["vllm-ar not timed: vLLM did not start it: no GPU here"]
    assert fixed.run(prompt_ids=[3, 4], settings=settings).output_ids == before  # a closed torch decoder runs again


def test_the_studios_vllm_engine_core_runs_in_its_process_unless_the_environment_places_it(monkeypatch):
    """The Studio's ``vllm.LLM`` is made with vLLM's engine core in this process (no hop a round), and the switch is
    put back afterwards so that vLLM's own runs keep vLLM's default; a place the environment names stands."""
    from engine.on_vllm.vllm_engine import ENGINE_CORE_PROCESS, engine_core_here

    monkeypatch.delenv(ENGINE_CORE_PROCESS, raising=False)
    with engine_core_here():
        assert os.environ[ENGINE_CORE_PROCESS] == "0"
    assert ENGINE_CORE_PROCESS not in os.environ
    monkeypatch.setenv(ENGINE_CORE_PROCESS, "1")
    with engine_core_here():
        assert os.environ[ENGINE_CORE_PROCESS] == "1"
    assert os.environ[ENGINE_CORE_PROCESS] == "1"
