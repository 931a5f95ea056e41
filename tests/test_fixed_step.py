"""The fixed-shape step (engine.loop.fixed_step) against AR and against the readable step."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.loop.decode import Decoder
from engine.loop.fixed_step import padded_prompt, prefill_bucket
from engine.loop.settings import DecodeSettings
from tests.test_fixed import token_paths
from tests.tiny import tiny_decoder

PROMPTS = [[5, 9, 14, 3], [40, 41, 42, 43, 44, 45, 46], [7] * 12]


@pytest.fixture(scope="module")
def decoders() -> tuple[Decoder, Decoder]:
    readable = tiny_decoder(3, block_size=8)
    fixed = Decoder(readable.target, readable.drafter, readable.drafter_info, fixed_step=True)
    return readable, fixed


@pytest.mark.parametrize("method, budget", [("dflash", 32), ("ddtree", 1), ("ddtree", 6), ("ddtree", 40)])
def test_the_fixed_step_decodes_what_ar_decodes_and_what_the_readable_step_drafts(decoders, method, budget):
    readable, fixed = decoders
    for prompt in PROMPTS:
        settings = DecodeSettings(method, max_new_tokens=40, tree_budget=budget)
        ar = readable.run(prompt_ids=prompt, settings=DecodeSettings("ar", max_new_tokens=40))
        ours = fixed.run(prompt_ids=prompt, settings=settings)
        theirs = readable.run(prompt_ids=prompt, settings=settings)
        assert ours.output_ids == ar.output_ids
        assert [s.accepted for s in ours.steps] == [s.accepted for s in theirs.steps]
        for mine, reference in zip(ours.steps, theirs.steps):
            assert token_paths(mine.tree_tokens, mine.tree_parents) == token_paths(reference.tree_tokens,
                                                                                    reference.tree_parents)
            assert mine.committed_ids == reference.committed_ids and mine.bonus_token == reference.bonus_token
            assert mine.committed_margins == pytest.approx(reference.committed_margins, abs=1e-9)
            assert mine.draft_top_tokens == reference.draft_top_tokens
            assert sum(mine.draft_top_probs, []) == pytest.approx(sum(reference.draft_top_probs, []), abs=1e-9)
            assert mine.target_tokens[0] == reference.target_tokens[0] and len(mine.target_tokens) == mine.tree_size + 1
        assert set(ours.steps[1].stage_s) == {"draft", "verify", "commit"}
        # the prefill says where its time went, and the fixed program's start is part of it
        assert set(ours.prefill.stage_s) == {"target", "context", "start"}
        assert set(theirs.prefill.stage_s) == {"target", "context"}
        assert sum(ours.prefill.stage_s.values()) <= ours.prefill.t_end


def test_ar_through_the_fixed_step_is_the_readable_ar(decoders):
    readable, fixed = decoders
    for prompt in PROMPTS:
        ours = fixed.run(prompt_ids=prompt, settings=DecodeSettings("ar", max_new_tokens=20))
        theirs = readable.run(prompt_ids=prompt, settings=DecodeSettings("ar", max_new_tokens=20))
        assert ours.output_ids == theirs.output_ids
        assert sum((s.committed_margins for s in ours.steps), []) == pytest.approx(
            sum((s.committed_margins for s in theirs.steps), []))
        assert all(s.tree_size == 0 and s.accepted == [0] for s in ours.steps)
        assert set(ours.steps[0].stage_s) == {"verify", "commit"}
        assert set(ours.prefill.stage_s) == {"target", "start"}  # AR has no drafter context


@pytest.mark.parametrize("fixed_step", [False, True])
def test_a_tokens_only_trace_keeps_the_output_and_drops_the_tree(decoders, fixed_step):
    decoder = decoders[fixed_step]
    full = decoder.run(prompt_ids=PROMPTS[1], settings=DecodeSettings("ddtree", max_new_tokens=30, tree_budget=6))
    lean = decoder.run(prompt_ids=PROMPTS[1], settings=DecodeSettings("ddtree", max_new_tokens=30, tree_budget=6,
                                                                     trace_detail="tokens"))
    assert lean.output_ids == full.output_ids
    assert [s.accepted for s in lean.steps] == [s.accepted for s in full.steps]
    assert [s.committed_margins for s in lean.steps] == [s.committed_margins for s in full.steps]
    assert all(s.tree_size == 0 and s.draft_top_tokens == [] and s.target_tokens == [] for s in lean.steps)
    assert any(s.tree_size for s in full.steps)


def test_an_unknown_trace_detail_is_refused(decoders):
    from engine.errors import EngineError

    with pytest.raises(EngineError, match="trace detail must be one of full, tokens, got 'some'"):
        decoders[0].run(prompt_ids=PROMPTS[0], settings=DecodeSettings("ar", trace_detail="some"))


def test_a_trained_drafter_goes_deep_through_the_fixed_step(decoders):
    """A drafter that knows the answer (the oracle) is accepted many levels deep: the compaction
    and the drafter's next context must then be right for the output to stay AR's."""
    from engine.models.drafter import ScriptedDrafter

    readable, _ = decoders
    prompt = PROMPTS[1]
    ar = readable.run(prompt_ids=prompt, settings=DecodeSettings("ar", max_new_tokens=48))
    oracle = ScriptedDrafter(readable.drafter.config, [prompt + ar.output_ids]).initialize(0).double().eval()
    fixed = Decoder(readable.target, oracle, readable.drafter_info, fixed_step=True)
    trace = fixed.run(prompt_ids=prompt, settings=DecodeSettings("ddtree", max_new_tokens=48, tree_budget=12))
    assert trace.output_ids == ar.output_ids
    assert trace.summary.tau > 3


def test_sampling_keeps_the_readable_step_and_says_so(decoders):
    _, fixed = decoders
    trace = fixed.run(prompt_ids=PROMPTS[0], settings=DecodeSettings("ddtree", max_new_tokens=8, temperature=0.8))
    assert "sampling runs the readable step" in " ".join(trace.config.notes)
    assert "tree_build" in trace.steps[0].stage_s and trace.config.step == "readable"
    assert fixed.run(prompt_ids=PROMPTS[0], settings=DecodeSettings("ddtree", max_new_tokens=8)).config.step == "fixed"



def test_the_programs_share_one_kv_cache_that_grows_when_a_run_needs_more_rows(decoders, monkeypatch):
    """A sweep holds one KV cache, not one a budget. A longer run grows it (the programs let go of the smaller one
    and its graphs), and a program made for the smaller one decodes as before on the larger."""
    import engine.loop.decode

    monkeypatch.setattr(engine.loop.decode, "FIXED_CAPACITY_STEP", 32)
    readable, shared = decoders
    fixed = Decoder(readable.target, readable.drafter, readable.drafter_info, fixed_step=True)

    def same_as_readable(settings: DecodeSettings) -> None:
        ours = fixed.run(prompt_ids=PROMPTS[0], settings=settings)
        assert ours.output_ids == readable.run(prompt_ids=PROMPTS[0], settings=settings).output_ids
        assert all(program.kv in (None, fixed._fixed_kv) for program in fixed._programs.values())

    chain, tree = DecodeSettings("dflash", max_new_tokens=8), DecodeSettings("ddtree", max_new_tokens=8, tree_budget=6)
    for settings in (tree, chain):  # 4 prompt tokens, 8 new, a block of 8 and the tree's nodes: within 32 rows
        same_as_readable(settings)
    assert fixed._fixed_capacity == 32 and [p.kv for p in fixed._programs.values()] == [fixed._fixed_kv] * 2
    small = fixed._fixed_kv
    same_as_readable(DecodeSettings("ddtree", max_new_tokens=40, tree_budget=6))  # 60 rows
    assert fixed._fixed_capacity == 64 and fixed._fixed_kv is not small and len(fixed._programs) == 2
    chain_program = next(p for key, p in fixed._programs.items() if key[0] == "dflash")
    assert chain_program.kv is None  # let go of the smaller cache; takes the larger one at its next run
    same_as_readable(chain)
    assert chain_program.kv is fixed._fixed_kv and chain_program.prompt_rows == 32  # its own context: still enough
    same_as_readable(DecodeSettings("dflash", max_new_tokens=40))
    assert chain_program.prompt_rows == 64 and fixed._fixed_capacity == 64

class _HostWork(TorchDispatchMode):
    """Records what a CUDA graph cannot hold: host reads (``.item()``, ``.tolist()``),
    data-dependent shapes, and Python scalars written by index (copied from the host)."""

    HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                  torch.ops.aten.is_nonzero.default, torch.ops.aten.nonzero.default,
                  torch.ops.aten.masked_select.default}

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.HOST_READS:
            self.found.append(str(func))
        if func.overloadpacket in (torch.ops.aten.index_put_, torch.ops.aten.index_put) and args[2].dim() == 0:
            self.found.append(f"{func} of a scalar")
        return func(*args, **kwargs)


@pytest.mark.parametrize("method, budget", [("ar", None), ("dflash", None), ("ddtree", 12)])
def test_the_step_programs_do_nothing_a_cuda_graph_cannot_replay(decoders, method, budget):
    readable, fixed = decoders
    run = fixed.run(prompt_ids=PROMPTS[0], settings=DecodeSettings(method, max_new_tokens=12, tree_budget=budget or 32))
    program = next(p for key, p in fixed._programs.items() if key[0] == method)
    assert run.steps, "the run made the program"
    with torch.inference_mode(), _HostWork() as host:
        if program.drafter is not None:
            program.draft()
        program.advance()
    assert host.found == []


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 17])
def test_the_pipelined_loop_stops_where_the_readable_one_does_and_wastes_at_most_a_step(decoders, max_new_tokens,
                                                                                      monkeypatch):
    readable, fixed = decoders
    settings = DecodeSettings("ddtree", max_new_tokens=max_new_tokens, tree_budget=6)
    expected = readable.run(prompt_ids=PROMPTS[1], settings=settings)
    fixed.run(prompt_ids=PROMPTS[1], settings=settings)  # makes the program
    program = next(p for key, p in fixed._programs.items() if key[0] == "ddtree" and key[1] == 6)
    launches = []
    advance = program.advance
    monkeypatch.setattr(program, "advance", lambda: launches.append(1) or advance())
    trace = fixed.run(prompt_ids=PROMPTS[1], settings=settings)
    assert trace.output_ids == expected.output_ids and len(trace.output_ids) == max_new_tokens
    assert [s.committed_ids for s in trace.steps] == [s.committed_ids for s in expected.steps]
    assert len(trace.steps) <= len(launches) <= len(trace.steps) + 1
    assert [s.index for s in trace.steps] == list(range(len(trace.steps)))
    assert all(s.t_end >= s.t_start for s in trace.steps)


def test_under_the_profiler_each_stage_is_marked(decoders):
    from torch.profiler import ProfilerActivity, profile

    from engine.gpu.profiling import STAGE_MARK

    _, fixed = decoders
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        trace = fixed.run(prompt_ids=PROMPTS[0], settings=DecodeSettings("ddtree", max_new_tokens=10, tree_budget=6))
    marked = [event.name for event in profiler.events() if event.name.startswith(STAGE_MARK)]
    launched = marked.count(STAGE_MARK + "verify")  # a step launched ahead of an end-of-sequence is dropped
    assert launched == marked.count(STAGE_MARK + "draft") and len(trace.steps) <= launched <= len(trace.steps) + 1


@pytest.mark.slow
def test_the_compiled_step_decodes_what_the_readable_step_decodes(decoders):
    """``compile_step``: the draft pass, the tree and the walk through torch.compile (inductor on the CPU
    here, Triton kernels on a GPU) change no token and no tree."""
    readable, _ = decoders
    compiled = Decoder(readable.target, readable.drafter, readable.drafter_info, fixed_step=True, compile_step=True)
    settings = DecodeSettings("ddtree", max_new_tokens=24, tree_budget=6)
    ours, theirs = (decoder.run(prompt_ids=PROMPTS[1], settings=settings) for decoder in (compiled, readable))
    assert ours.output_ids == theirs.output_ids
    for mine, reference in zip(ours.steps, theirs.steps):
        assert token_paths(mine.tree_tokens, mine.tree_parents) == token_paths(reference.tree_tokens,
                                                                                reference.tree_parents)
        assert mine.committed_ids == reference.committed_ids


@pytest.mark.parametrize("size", [1, 4, 7, 16, 17, 40])
def test_a_prompt_padded_to_its_bucket_scores_its_own_rows_as_it_would_alone(decoders, size):
    """The vLLM engine replays a prompt's pass as a CUDA graph at a padded length: causal attention
    keeps the padding out of the prompt's rows, so its logits and hidden states are the unpadded ones."""
    bucket = prefill_bucket(size)
    assert bucket >= max(size, 16) and bucket < 2 * max(size, 16) and bucket & (bucket - 1) == 0
    target = decoders[0].target
    ids = torch.arange(size) % 50 + 3
    positions = torch.arange(size)
    padded_ids, padded_positions = padded_prompt(ids, positions, bucket)
    assert padded_ids[:size].tolist() == ids.tolist() and padded_positions.tolist() == list(range(bucket))
    alone, alone_hidden = target.forward(ids[None], positions[None], target.new_cache(), hidden_states=True)
    padded, padded_hidden = target.forward(padded_ids[None], padded_positions[None], target.new_cache(),
                                           hidden_states=True)
    assert torch.allclose(padded[:size], alone, rtol=0, atol=1e-12)
    assert all(torch.allclose(mine[:, :size], theirs, rtol=0, atol=1e-12)
               for mine, theirs in zip(padded_hidden, alone_hidden))
