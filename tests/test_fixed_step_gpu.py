"""The fixed-shape step on a GPU: captured as CUDA graphs and replayed, it still decodes AR's text.
Skipped without CUDA (run on the GPU machine: ``python3 -m pytest -q -m gpu tests/test_fixed_step_gpu.py``;
``DDTREE_VLLM_MODEL`` / ``DDTREE_VLLM_DRAFTER`` name other weights, as for ``tests/test_vllm_engine.py``)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from engine.loop.loading import load_decoder as load_any_decoder
from engine.loop.settings import DecodeSettings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MODEL, DRAFTER = os.environ.get("DDTREE_VLLM_MODEL"), os.environ.get("DDTREE_VLLM_DRAFTER")
PROMPTS = ["Write a Python function that checks whether a number is prime.", "Why do cats purr?",
           "Summarize the plot of Romeo and Juliet in three sentences."]


# stages run once per generation (the prefill, the drafter's first context, the step program's start),
# their kernels spread over its steps; the host's commit launches none
ONCE_PER_RUN = {"target", "context", "start"}
load_decoder = functools.partial(load_any_decoder, MODEL, DRAFTER)


def test_graph_replayed_steps_decode_what_ar_decodes_in_float32():
    decoder = load_decoder(device="cuda", dtype="float32", fixed_step=True, cuda_graphs=True)
    taus = {"dflash": [], "ddtree": []}
    for prompt in PROMPTS:
        ar = decoder.run(prompt, DecodeSettings("ar", max_new_tokens=48))
        for settings in (DecodeSettings("dflash", max_new_tokens=48),
                         DecodeSettings("ddtree", max_new_tokens=48, tree_budget=32)):
            trace = decoder.run(prompt, settings)
            assert trace.output_ids == ar.output_ids, (prompt, settings.method)
            taus[settings.method].append(trace.summary.tau)
    # a trained drafter is accepted through the replayed graphs, and the tree beats the chain
    assert sum(taus["ddtree"]) > sum(taus["dflash"]) > 1.3 * len(PROMPTS), taus
    captured = {key[0]: set(program._graphs) for key, program in decoder._programs.items()}
    # the first draft reads the whole prompt: one graph per prompt-length bucket
    first_drafts = {method: {name for name in names if name.startswith("first draft ")}
                    for method, names in captured.items()}
    assert captured["ar"] == {"advance"} and not first_drafts["ar"]
    for method in ("dflash", "ddtree"):
        assert first_drafts[method] and captured[method] - first_drafts[method] == {"draft", "advance"}, captured


def test_kernels_are_counted_per_stage():
    decoder = load_decoder(device="cuda", dtype="bfloat16", fixed_step=True, cuda_graphs=True)
    prompt_ids = decoder.target.chat_ids(PROMPTS[0])
    settings = DecodeSettings("ddtree", max_new_tokens=32, tree_budget=16)
    decoder.run(prompt_ids=prompt_ids, settings=settings)  # captures the graphs
    profile = decoder.kernel_profile(prompt_ids, settings)
    counts = profile.counts
    assert set(counts) == {"draft", "verify"} | ONCE_PER_RUN
    assert counts["draft"] > 20 and counts["verify"] > counts["draft"], counts
    times = [micros for _, micros in profile.slowest["verify"]]
    assert times and times == sorted(times, reverse=True) and times[0] > 0, profile.slowest


def test_a_compiled_step_decodes_the_same_with_fewer_kernels():
    plain = load_decoder(device="cuda", dtype="float32", fixed_step=True, cuda_graphs=True)
    fused = load_decoder(device="cuda", dtype="float32", fixed_step=True, cuda_graphs=True, compile_step=True)
    prompt_ids = plain.target.chat_ids(PROMPTS[1])
    settings = DecodeSettings("ddtree", max_new_tokens=48, tree_budget=32)
    ar = plain.run(prompt_ids=prompt_ids, settings=DecodeSettings("ar", max_new_tokens=48))
    assert fused.run(prompt_ids=prompt_ids, settings=settings).output_ids == ar.output_ids
    before, after = (decoder.kernel_profile(prompt_ids, settings).counts for decoder in (plain, fused))
    assert after["draft"] < before["draft"] and after["verify"] < before["verify"], (before, after)


def test_a_batchs_fixed_step_launches_without_waiting_for_the_device():
    """Once its graphs are recorded, a batch's fixed step is launched while the one before still runs: no copy or
    read in its launch makes the host wait for the device (a plain copy from the host would, and the pipelined
    step would then run in lock step)."""
    from collections import Counter

    from ddtree.allocate import StepCost
    from engine.gpu.copies import waits_counted
    from engine.loop.batch import Batch
    from engine.loop.budgeting import Budgeting

    decoder = load_decoder(device="cuda", dtype="bfloat16", fixed_step=True, cuda_graphs=True)
    trees_pay = StepCost(fixed_s=0.01, per_request_s=0.001, per_node_s=0.0001, per_draft_s=0.001)
    batch = Batch(decoder, Budgeting(trees_pay, follow_steps=False), cache="paged")
    jobs = [(decoder.target.chat_ids(prompt), DecodeSettings(method, max_new_tokens=40, **budget))
            for prompt in PROMPTS for method, budget in (("ddtree", {"tree_budget": 16}), ("ar", {}))]
    batch.run(jobs)  # records every shape the second run takes
    census: Counter = Counter()
    launch = batch.launch_fixed

    def counted(*args, **kwargs):
        with waits_counted(census):
            return launch(*args, **kwargs)

    batch.launch_fixed = counted
    traces = batch.run(jobs)
    assert all(trace.output_ids for trace in traces) and not census, census
