"""The vLLM engine on a GPU: tree verification, exactness against vLLM's own AR, acceptance
agreement with the torch engine, tensor parallelism. Skipped without CUDA and vLLM.

    DDTREE_VLLM_MODEL=... DDTREE_VLLM_DRAFTER=... python -m pytest -q -m gpu tests/test_vllm_engine.py

(defaults: the bundled SmolLM2 and the shipped drafter; ``engine/tools/vllm_device.sh`` runs this.)
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

import ddtree
from engine.errors import EngineError
from engine.loop.settings import DecodeSettings
from tests.test_fixed_step_gpu import ONCE_PER_RUN

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                       reason="needs a CUDA GPU and vLLM (requirements-gpu.txt)"),
]

ROOT = Path(__file__).resolve().parent.parent
MODEL = os.environ.get("DDTREE_VLLM_MODEL")
DRAFTER = os.environ.get("DDTREE_VLLM_DRAFTER")
NEW_TOKENS = 48


def prompts(count: int) -> list[str]:
    lines = (ROOT / "assets" / "prompts" / "heldout.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:count]]


@pytest.fixture(scope="module")
def studio():
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the tests send functions to the workers
    from engine.on_vllm.vllm_engine import load_vllm_decoder

    return load_vllm_decoder(MODEL, DRAFTER, dtype="float32")


@pytest.fixture(scope="module")
def readable(studio):
    """The same engine with the readable step (host-side tree, walk and compaction)."""
    from engine.on_vllm.vllm_engine import VllmOptions, load_vllm_decoder

    return load_vllm_decoder(MODEL, DRAFTER, dtype="float32",
                             options=VllmOptions(fixed_step=False, gpu_memory_utilization=0.2))


@pytest.fixture(scope="module")
def torch_engine(studio):
    """The torch engine on the same GPU, same float32 weights (the folder vLLM loaded)."""
    from engine.loop.decode import Decoder
    from engine.models.drafter import load_drafter
    from engine.models.target import load_target
    from engine.on_vllm.vllm_engine import model_folder

    target = load_target(model_folder(MODEL), device="cuda", dtype="float32")
    drafter = load_drafter(studio.drafter_path).to(device="cuda", dtype=torch.float32).eval()
    return Decoder(target, drafter, studio.drafter_info)


def first_difference(ours: list[int], theirs: list[int]) -> int:
    """Where two outputs part (0: the prompt's pass already chose another first token)."""
    return next((index for index, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def verify_in_worker(worker, prompt_ids, tree_fields, accepted, next_token):
    """Runs inside a vLLM worker: prefill, verify a tree, commit a path, decode one more token."""
    import torch

    import ddtree

    target = worker.studio.target
    tree = ddtree.DraftTree(**{name: torch.tensor(values) for name, values in tree_fields.items()})
    cache, past = target.new_cache(), len(prompt_ids) - 1
    target.forward(torch.tensor([prompt_ids[:-1]], device=target.device),
                   torch.arange(past, device=target.device)[None], cache)
    inputs = ddtree.compile_tree(tree, prompt_ids[-1], past)
    tree_logits, _ = target.forward(inputs.input_ids.to(target.device), inputs.position_ids.to(target.device), cache,
                                    target.tree_bias(inputs.visible, cache.length))
    target.commit(cache, past, accepted)
    start = past + len(accepted)
    next_logits, _ = target.forward(torch.tensor([[next_token]], device=target.device),
                                    torch.tensor([[start]], device=target.device), cache)
    return tree_logits.float().cpu().tolist(), next_logits.float().cpu().tolist()


def test_tree_verify_and_compaction_match_the_torch_engine(studio, torch_engine):
    prompt_ids = torch_engine.target.chat_ids(prompts(1)[0])
    generator = torch.Generator().manual_seed(0)
    tree = ddtree.build_tree(torch.log_softmax(torch.randn(6, 50, generator=generator) * 3, dim=-1), 12)
    children = tree.child_maps()
    accepted = [0]
    while children[accepted[-1]]:  # a path that leaves the tree's first nodes, so rows must move
        accepted.append(max(children[accepted[-1]].values()))
    assert ddtree.compaction_moves(0, accepted)[0].numel(), "the test path needs rows to move"
    tree_fields = {name: getattr(tree, name).tolist() for name in
                   ("tokens", "parents", "depths", "log_probs", "path_log_probs", "ranks")}
    next_token = 42
    tree_logits, next_logits = studio.llm.collective_rpc(
        verify_in_worker, args=(prompt_ids, tree_fields, accepted, next_token))[0]

    target = torch_engine.target
    past = len(prompt_ids) - 1
    cache = target.new_cache()
    target.forward(torch.tensor([prompt_ids[:-1]], device="cuda"), torch.arange(past, device="cuda")[None], cache)
    inputs = ddtree.compile_tree(tree, prompt_ids[-1], past)
    expected_tree, _ = target.forward(inputs.input_ids.cuda(), inputs.position_ids.cuda(), cache,
                                      target.tree_bias(inputs.visible, past))
    target.commit(cache, past, accepted)
    expected_next, _ = target.forward(torch.tensor([[next_token]], device="cuda"),
                                      torch.tensor([[past + len(accepted)]], device="cuda"), cache)
    # Triton's float32 dot products run in TF32, so logits agree to ~0.05, not to 1e-5; a wrong
    # mask, position or compacted row moves them by whole units
    for got, expected in ((tree_logits, expected_tree), (next_logits, expected_next)):
        error = (torch.tensor(got) - expected.cpu()).abs()
        assert error.max() < 0.15 and error.mean() < 0.05, (error.max(), error.mean())


def prompt_logits_in_worker(worker, prompt_ids):
    """Runs inside a vLLM worker: a prompt's pass with every row's logits, then with its last row's alone."""
    import torch

    target = worker.studio.target
    ids = torch.tensor([prompt_ids], device=target.device)
    positions = torch.arange(len(prompt_ids), device=target.device)[None]
    every, _ = target.forward(ids, positions, target.new_cache())
    last, _ = target.forward(ids, positions, target.new_cache(), last_logits=True)
    return every.float().cpu().tolist(), last.float().cpu().tolist()


def test_a_prompt_s_pass_with_its_last_row_alone_gives_that_row(studio):
    """The prompt is padded to its bucket's length (a CUDA graph's): the row kept is the prompt's last token's,
    not the padding's."""
    prompt_ids = studio.target.chat_ids(prompts(1)[0])
    if not len(prompt_ids) & (len(prompt_ids) - 1):  # a bucket's own length (a power of two) pads nothing
        prompt_ids = prompt_ids[:-1]
    every, last = studio.llm.collective_rpc(prompt_logits_in_worker, args=(prompt_ids,))[0]
    every, last = torch.tensor(every), torch.tensor(last)
    assert every.shape[0] == len(prompt_ids) and last.shape[0] == 1
    torch.testing.assert_close(last[0], every[-1], rtol=0, atol=1e-3)  # one row through the LM head, or all of them


def batch_prompt_passes_in_worker(worker, prompts_ids):
    """Runs inside a vLLM worker: each prompt's last-row logits through the single request's pass, then through a
    batch's cache: the first prompt in row 0, the second in row 1 beside it, then, once the first has left and the
    second moved into row 0, the first again in row 1 (in blocks the first request held)."""
    import torch

    target = worker.studio.target

    def single(ids):
        cache = target.new_cache()
        logits, _ = target.forward(torch.tensor([ids], device=target.device),
                                   torch.arange(len(ids), device=target.device)[None], cache, last_logits=True)
        return logits[-1].float().cpu()

    expected = [single(ids) for ids in prompts_ids]
    kv = target.batch_kv(2, 0)
    kv.reserve(2, 0)

    def in_row(row, ids):
        chunk = kv.prompt(row, 0, len(ids))
        logits, _ = target.forward(torch.tensor([ids], device=target.device),
                                   torch.arange(len(ids), device=target.device)[None], chunk, last_logits=True)
        return logits[-1].float().cpu()

    got = [in_row(0, prompts_ids[0]), in_row(1, prompts_ids[1])]
    kv.release(0, 1, len(prompts_ids[1]))  # row 1's request moves into row 0
    kv.reserve(2, 0)
    got.append(in_row(1, prompts_ids[0]))
    kv.release(0, 1, len(prompts_ids[0]))
    kv.release(0, 0, 0)
    return [((g - e).abs().max().item(), int(g.argmax()), int(e.argmax()))
            for g, e in zip(got, [expected[0], expected[1], expected[0]])]


def test_a_batchs_prompt_pass_gives_the_single_requests_logits(studio):
    """A batch's prompt chunk (``PagedBatchKV.prompt``; on a hybrid a prefill from the request's own state blocks) is
    the single request's prompt pass, in any row and in blocks another request held before."""
    ids = [studio.target.chat_ids(text) for text in prompts(2)]
    for index, (gap, got, expected) in enumerate(studio.llm.collective_rpc(batch_prompt_passes_in_worker,
                                                                           args=(ids,))[0]):
        assert got == expected and gap < 0.15, f"pass {index}: {gap=} chose {got} for {expected}"


def test_greedy_dflash_and_ddtree_equal_vllm_ar_in_float32(studio, readable, torch_engine):
    from engine.on_vllm.vllm_engine import native_generate, native_llm

    native = native_llm(MODEL, "float32", options=studio.options, enforce_eager=True)
    for prompt in prompts(3):
        prompt_ids = studio.target.chat_ids(prompt)
        reference = native_generate(native, prompt_ids, NEW_TOKENS, studio.target.stop_ids).output_ids
        for settings in (DecodeSettings("ar", NEW_TOKENS), DecodeSettings("dflash", NEW_TOKENS),
                         DecodeSettings("ddtree", NEW_TOKENS, tree_budget=32),
                         DecodeSettings("ddtree", NEW_TOKENS, tree_budget=64, trace_detail="tokens")):
            for decoder in (studio, readable):
                trace = decoder.run(prompt, settings)
                step = "fixed" if decoder is studio else "readable"
                assert trace.output_ids == reference, f"{settings.method} ({step} step) left vLLM's AR output"
                assert trace.config.engine == "vllm" and f"{step} step" in trace.config.notes[-1]
        assert torch_engine.run(prompt, DecodeSettings("ar", NEW_TOKENS)).output_ids == reference
    del native


def test_the_fixed_step_accepts_what_the_readable_step_accepts(studio, readable):
    for prompt in prompts(3):
        settings = DecodeSettings("ddtree", NEW_TOKENS, tree_budget=32)
        fixed, reference = studio.run(prompt, settings), readable.run(prompt, settings)
        assert [len(s.accepted) for s in fixed.steps] == [len(s.accepted) for s in reference.steps]
        assert [s.committed_ids for s in fixed.steps] == [s.committed_ids for s in reference.steps]
        assert fixed.steps[1].tree_size == 32 and len(fixed.steps[1].target_tokens) == 33


def test_kernels_are_counted_per_stage_in_the_workers(studio, readable):
    prompt_ids = studio.target.chat_ids(prompts(1)[0])
    settings = DecodeSettings("ddtree", 32, tree_budget=16)
    fixed, before = (decoder.kernel_profile(prompt_ids, settings).counts for decoder in (studio, readable))
    assert (set(fixed) == {"draft", "verify"} | ONCE_PER_RUN
            and set(before) >= {"draft", "tree_build", "verify", "commit"})
    assert fixed["draft"] > 20 and fixed["verify"] > 100, fixed


def test_dflash_acceptance_agrees_with_the_torch_engine(studio, torch_engine):
    ours, theirs = [], []
    for prompt in prompts(4):
        settings = DecodeSettings("dflash", NEW_TOKENS)
        ours += studio.run(prompt, settings).summary.acceptance_lengths
        theirs += torch_engine.run(prompt, settings).summary.acceptance_lengths
    tau, reference = sum(ours) / len(ours), sum(theirs) / len(theirs)
    assert reference > 1.5, "the drafter should accept well on its own engine"
    assert abs(tau - reference) / reference < 0.05, (tau, reference)


def test_the_trace_carries_what_the_inspector_reads(studio, readable):
    for decoder, stages in ((studio, {"draft", "verify", "commit"}), (readable, {"draft", "tree_build", "verify"})):
        trace = decoder.run(prompts(1)[0], DecodeSettings("ddtree", 24, tree_budget=16))
        step = trace.steps[0]
        assert len(step.tree_tokens) == 16 and len(step.draft_top_tokens) == decoder.drafter.block_size - 1
        assert step.accepted[0] == 0 and set(step.stage_s) >= stages
        assert trace.summary.new_tokens == len(trace.output_ids)


def test_a_batch_in_the_workers_gives_every_request_its_solo_ar_output_in_float32(studio):
    """The batched step in vLLM's workers (``engine.loop.remote_batch``): eight requests of every method on the
    paged cache, each through its own blocks, two joining a few rounds late and one leaving mid-way; each request's
    output is its own AR run's, its steps streamed round by round; a run of its own waits while the batch holds the
    cache, and goes once the batch is done."""
    texts = prompts(8)
    ids = [studio.target.chat_ids(text) for text in texts]
    solo = [studio.run(text, DecodeSettings("ar", NEW_TOKENS)).output_ids for text in texts]
    kinds = [DecodeSettings("ar", NEW_TOKENS), DecodeSettings("dflash", NEW_TOKENS),
             DecodeSettings("ddtree", NEW_TOKENS, tree_budget=16), DecodeSettings("ddtree", NEW_TOKENS, tree_budget=64),
             DecodeSettings("ddtree", NEW_TOKENS, tree_budget="auto"), DecodeSettings("dflash", NEW_TOKENS,
                                                                                      tree_budget="auto")]
    batch = studio.remote_batch(studio.budgeting)
    streamed: dict[str, int] = {}
    left = {"gone": False}

    def admit(index: int, **hooks):
        settings, notes = studio.prepare(kinds[index % len(kinds)], len(ids[index]))
        return batch.admit_prepared(texts[index], ids[index], settings, notes, name=f"r{index}", **hooks)

    def count(trace, step):
        streamed[trace.config.method] = streamed.get(trace.config.method, 0) + 1

    requests = [admit(index, on_step=count) for index in range(5)]
    requests.append(admit(5, should_stop=lambda: left["gone"]))
    finished = batch.advance() + batch.advance()
    with pytest.raises(Exception, match="the server's batch holds this worker's KV cache"):
        studio.run(texts[0], DecodeSettings("ar", 4))
    requests += [admit(6, on_step=count), admit(7, on_step=count)]
    left["gone"] = True
    while not batch.idle:
        finished += batch.advance()
    assert len(finished) == 8 and requests[5].trace.summary.stop_reason == "cancelled"
    for index, request in enumerate(requests):
        if index != 5:
            assert request.trace.output_ids == solo[index], (
                f"{request.trace.config.label} (request {index}) left its solo AR output at its token "
                f"{first_difference(request.trace.output_ids, solo[index])}")
    assert sum(streamed.values()) == sum(len(r.trace.steps) for i, r in enumerate(requests) if i != 5)
    assert max(step.batch.size for step in requests[0].trace.steps) >= 6
    assert studio.run(texts[0], DecodeSettings("ar", 4)).summary.new_tokens == 4


@pytest.mark.skipif(os.environ.get("DDTREE_BATCH_STEP") != "fixed",
                    reason="the vLLM engine's batch takes the fixed step where DDTREE_BATCH_STEP=fixed "
                           "(gpu_session.sh fixed-batch)")
def test_a_fixed_batch_in_the_workers_gives_every_request_its_solo_ar_output_in_float32(studio):
    """The batched step as fixed-shape programs in vLLM's workers (``engine.loop.fixed_batch``, its pass
    ``PagedTarget.verify_slots``): greedy requests of every method at fixed budgets, two joining late; each request's
    output is its own AR run's, and every step it took was the fixed one."""
    texts = prompts(8)
    ids = [studio.target.chat_ids(text) for text in texts]
    solo = [studio.run(text, DecodeSettings("ar", NEW_TOKENS)).output_ids for text in texts]
    kinds = [DecodeSettings("ar", NEW_TOKENS), DecodeSettings("dflash", NEW_TOKENS),
             DecodeSettings("ddtree", NEW_TOKENS, tree_budget=16), DecodeSettings("ddtree", NEW_TOKENS, tree_budget=64)]
    batch = studio.remote_batch(studio.budgeting)

    def admit(index: int):
        settings, notes = studio.prepare(kinds[index % len(kinds)], len(ids[index]))
        return batch.admit_prepared(texts[index], ids[index], settings, notes, name=f"r{index}")

    requests = [admit(index) for index in range(6)]
    batch.advance()
    batch.advance()
    requests += [admit(6), admit(7)]
    while not batch.idle:
        batch.advance()
    for index, request in enumerate(requests):
        trace = request.trace
        assert trace.output_ids == solo[index], f"{trace.config.label} left its solo AR output"
        assert trace.config.step == "batched fixed" and all(set(step.stage_s) == {"draft", "verify", "commit"}
                                                            for step in trace.steps)


@pytest.mark.skipif(os.environ.get("DDTREE_BATCH_STEP") != "fixed",
                    reason="the vLLM engine's batch takes the fixed step where DDTREE_BATCH_STEP=fixed "
                           "(gpu_session.sh fixed-batch)")
def test_a_fixed_batch_in_the_workers_whose_drafts_stop_and_start_gives_each_request_its_solo_ar_output(studio):
    """Step costs under which drafts pay for a few requests but not for a crowd: while the AR requests are in, the
    fixed step in vLLM's workers drafts nothing and verifies roots, reading the "auto" requests' accepted rows into
    the drafter's context (``FixedBatchProgram(keeps_context=True)``); once they leave, it drafts again. Each request's
    output is its own AR run's."""
    from ddtree.allocate import StepCost
    from engine.loop.budgeting import Budgeting

    texts = prompts(6)
    ids = [studio.target.chat_ids(text) for text in texts]
    kinds = [DecodeSettings("ddtree", NEW_TOKENS, tree_budget="auto"),
             DecodeSettings("dflash", NEW_TOKENS, tree_budget="auto")] + [DecodeSettings("ar", 8)] * 4
    solo = [studio.run(text, DecodeSettings("ar", settings.max_new_tokens)).output_ids
            for text, settings in zip(texts, kinds)]
    crowded = StepCost(fixed_s=0.05, per_request_s=0.001, per_node_s=0.001, per_draft_s=0.02)
    batch = studio.remote_batch(Budgeting(crowded, follow_steps=False))
    requests = []
    for index, (text, own_ids, settings) in enumerate(zip(texts, ids, kinds)):
        prepared, notes = studio.prepare(settings, len(own_ids))
        requests.append(batch.admit_prepared(text, own_ids, prepared, notes, name=f"r{index}"))
    while not batch.idle:
        batch.advance()
    for request, own in zip(requests, solo):
        assert request.trace.output_ids == own, f"{request.trace.config.label} left its solo AR output"
    resumed = 0
    for request in requests[:2]:
        skipped = [step.batch.reason.startswith("auto: not drafted") for step in request.trace.steps]
        resumed += any(skip and later.tree_tokens for skip, later in zip(skipped, request.trace.steps[1:]))
    assert resumed  # a step without drafts, then one with


def test_bad_settings_fail_in_the_driver_and_the_engine_keeps_serving(studio):
    with pytest.raises(EngineError, match="block size 99"):
        studio.run(prompts(1)[0], DecodeSettings("dflash", 8, block_size=99))
    assert studio.run(prompts(1)[0], DecodeSettings("ar", 4)).summary.new_tokens == 4


def test_the_row_check_runs_in_the_workers(studio):
    """``engine.tools.row_invariance --engine vllm``: the check on vLLM's own model and kernels, in its worker."""
    from engine.measure.row_check import RowCheck

    ids = studio.target.chat_ids(prompts(1)[0])
    found = [RowCheck(**c) for c in studio.llm.collective_rpc("studio_rows", args=([("p", ids)], [1, 5]))[0]]
    assert [(c.shape, c.rows, c.compared_rows) for c in found] == [("chain", 1, 1), ("chain", 5, 5), ("tree", 5, 2)]
    assert found[0].equal_rows == 1 and found[0].first_row is None  # one row is AR's own step
    assert studio.run(prompts(1)[0], DecodeSettings("ar", 4)).summary.new_tokens == 4  # and the engine serves on


def test_in_bf16_every_verified_row_is_ar_s_step_bit_for_bit(studio):
    """The row invariance the tree attention (``engine.on_vllm.path_attention``) exists for: chains and trees of
    1 to 65 rows, each row on AR's path against AR's one-token step of its token, in the dtype the GPU serves."""
    from engine.measure.row_check import RowCheck
    from engine.on_vllm.vllm_engine import VllmOptions, load_vllm_decoder

    bf16 = load_vllm_decoder(MODEL, DRAFTER, dtype="bfloat16", options=VllmOptions(gpu_memory_utilization=0.15))
    try:
        found = [RowCheck(**c) for prompt in prompts(2) for c in bf16.llm.collective_rpc(
            "studio_rows", args=([("p", bf16.target.chat_ids(prompt))], [1, 17, 65]))[0]]
    finally:
        bf16.close()
    assert len(found) == 2 * 5
    left = [(c.shape, c.rows, c.first_row, c.first_module) for c in found if c.equal_rows != c.compared_rows]
    assert not left, f"rows leaving AR's steps: {left}"


def test_a_target_vllm_compiled_verifies_as_its_one_token_steps(studio):
    """--vllm-compile: vLLM's inductor graph runs without dynamo's guards, so the Studio must feed it what vLLM
    traced it with (int32 ids: int64 ones were read as pairs of words, every pass past one token wrong, 0 of 10
    DDTree outputs equal to AR's on the H200). DFlash and DDTree verify many rows a pass, AR one."""
    from engine.on_vllm.vllm_engine import VllmOptions, load_vllm_decoder

    compiled = load_vllm_decoder(MODEL, DRAFTER, dtype="bfloat16",
                                 options=VllmOptions(vllm_compile=True, gpu_memory_utilization=0.15))
    try:
        for prompt in prompts(3):
            reference = compiled.run(prompt, DecodeSettings("ar", NEW_TOKENS)).output_ids
            for settings in (DecodeSettings("dflash", NEW_TOKENS),
                             DecodeSettings("ddtree", NEW_TOKENS, tree_budget=16)):
                assert compiled.run(prompt, settings).output_ids == reference, settings.method
    finally:
        compiled.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_ddtree_equals_one_gpu(studio):
    """Both runs use the same weights: for 2 GPUs the bundled SmolLM2 is served as its equivalent
    12-head copy (``model_folder``), since its own 9 heads do not split over 2."""
    from engine.on_vllm.vllm_engine import VllmOptions, load_vllm_decoder, model_folder

    split_weights = model_folder(MODEL, tensor_parallel_size=2)
    cases = [(prompt, DecodeSettings("ddtree", NEW_TOKENS, tree_budget=32)) for prompt in prompts(3)]
    outputs = {}
    for size in (1, 2):
        decoder = load_vllm_decoder(split_weights, studio.drafter_path, dtype="float32",
                                    options=VllmOptions(tensor_parallel_size=size, gpu_memory_utilization=0.15))
        traces = [decoder.run(prompt, settings) for prompt, settings in cases]
        ar = [decoder.run(prompt, DecodeSettings("ar", NEW_TOKENS)).output_ids for prompt, _ in cases]
        assert [t.output_ids for t in traces] == ar, f"DDTree left AR at tensor parallel {size}"
        assert sum(t.summary.tau for t in traces) / len(traces) > 1.5, "the drafter should accept on the copy too"
        outputs[size] = ar
        del decoder
    assert outputs[2] == outputs[1]
