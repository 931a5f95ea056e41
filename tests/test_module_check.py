"""engine.tools.module_check: each decoder module of a float32 engine replayed in float64 on the engine's own
inputs. Here the "engine" is the transformers twin itself in float32, captured through the same hooks
the vLLM capture installs, so its modules stray by float32 rounding alone; one of them then gets a
deliberate error, and the check must name that module and no other."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.models.target import load_target
from engine.tools.module_check import MODULE, install_hooks, main, module_errors
from tests.hybrid_models import LAYER_TYPES, save_tiny_hybrid

PROMPTS = ["Tell me about the sea.", "Write a short poem about a fox that learns to fly over the mountains at night."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_hybrid(tmp_path_factory.mktemp("module-check") / "tiny-qwen3.5", vllm_shape=True))


def capture_passes(engine) -> list[dict]:
    """What ``engine.tools.module_check capture`` records, from a transformers model in place of vLLM's."""
    records, expected = {}, [0]
    hooked = install_hooks(SimpleNamespace(model_runner=SimpleNamespace(model=engine.model)), records, expected)
    assert hooked == 4 * len(LAYER_TYPES)  # two norms, a token mixer and an MLP per layer
    passes = []
    for prompt in PROMPTS:
        ids = engine.chat_ids(prompt)
        records.clear()
        expected[0] = len(ids)
        with torch.no_grad():
            engine.model(torch.tensor([ids]))
        passes.append({"prompt_id": prompt[:8], "tokens": len(ids), "modules": dict(records)})
    return passes


def test_a_float32_engine_strays_by_rounding_only_and_the_one_broken_module_is_named(folder):
    exact = load_target(folder, dtype="float64").model
    engine = load_target(folder, dtype="float32")
    errors = module_errors(exact, capture_passes(engine))
    mixers = {f"layers.{i}.{'linear_attn' if kind == 'linear_attention' else 'self_attn'}"
              for i, kind in enumerate(LAYER_TYPES)}
    assert mixers <= set(errors) and len(errors) == 4 * len(LAYER_TYPES)
    assert max(e for row in errors.values() for e in row) < 1e-4  # relative: float32 rounding

    broken = "layers.1.self_attn"  # the full-attention layer: its output projection off by 1e-2
    dict(engine.model.named_modules())["model." + broken].o_proj.weight.data += 1e-2
    errors = module_errors(exact, capture_passes(engine))
    assert min(errors[broken]) > 1e-3
    assert max(e for name, row in errors.items() if name != broken for e in row) < 1e-4  # errors do not carry


def test_the_compare_command_prints_a_row_per_module_and_refuses_what_is_not_a_capture(folder, tmp_path, capsys):
    capture = tmp_path / "capture.pt"
    torch.save({"model": folder, "passes": capture_passes(load_target(folder, dtype="float32"))}, capture)
    assert main(["compare", str(capture)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if MODULE.search(line.split(" | ")[0].strip("| "))]
    assert len(rows) == 4 * len(LAYER_TYPES)
    (tmp_path / "junk.pt").write_text("not a capture")
    assert main(["compare", str(tmp_path / "junk.pt"), "--model", folder]) == 2
    assert "not a capture of engine.tools.module_check" in capsys.readouterr().err
