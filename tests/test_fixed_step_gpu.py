"""The fixed-shape step on a GPU: captured as CUDA graphs and replayed, it still decodes AR's text.
Skipped without CUDA (run on the GPU machine: ``python3 -m pytest -q -m gpu tests/test_fixed_step_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from engine.decode import DecodeSettings
from engine.models import load_decoder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPTS = ["Write a Python function that checks whether a number is prime.", "Why do cats purr?",
           "Summarize the plot of Romeo and Juliet in three sentences."]


def test_graph_replayed_steps_decode_what_ar_decodes_in_float32():
    decoder = load_decoder(device="cuda", dtype="float32", fixed_step=True, cuda_graphs=True)
    for prompt in PROMPTS:
        ar = decoder.run(prompt, DecodeSettings("ar", max_new_tokens=48))
        for settings in (DecodeSettings("dflash", max_new_tokens=48),
                         DecodeSettings("ddtree", max_new_tokens=48, tree_budget=32)):
            trace = decoder.run(prompt, settings)
            assert trace.output_ids == ar.output_ids, (prompt, settings.method)
            assert trace.summary.tau > 1.5
    captured = [set(program._graphs) for program in decoder._programs.values()]
    assert captured and all(names == {"draft", "advance"} for names in captured), "both parts replay as graphs"
