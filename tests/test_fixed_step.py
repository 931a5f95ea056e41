"""The fixed-shape step (engine.fixed_step) against AR and against the readable step."""

from __future__ import annotations

import pytest

from engine.decode import DecodeSettings, Decoder
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
        ours, theirs = fixed.run(prompt_ids=prompt, settings=settings), readable.run(prompt_ids=prompt, settings=settings)
        assert ours.output_ids == ar.output_ids
        assert [s.accepted for s in ours.steps] == [s.accepted for s in theirs.steps]
        for mine, reference in zip(ours.steps, theirs.steps):
            assert token_paths(mine.tree_tokens, mine.tree_parents) == token_paths(reference.tree_tokens,
                                                                                    reference.tree_parents)
            assert mine.committed_ids == reference.committed_ids and mine.bonus_token == reference.bonus_token
            assert mine.committed_margins == pytest.approx(reference.committed_margins, abs=1e-9)
        assert set(ours.steps[1].stage_s) == {"draft", "verify", "commit"}


def test_a_trained_drafter_goes_deep_through_the_fixed_step(decoders):
    """A drafter that knows the answer (the oracle) is accepted many levels deep: the compaction
    and the drafter's next context must then be right for the output to stay AR's."""
    from tests.tiny import OracleDrafter

    readable, _ = decoders
    prompt = PROMPTS[1]
    ar = readable.run(prompt_ids=prompt, settings=DecodeSettings("ar", max_new_tokens=48))
    oracle = OracleDrafter(readable.drafter.config, prompt + ar.output_ids).initialize(0).double().eval()
    fixed = Decoder(readable.target, oracle, readable.drafter_info, fixed_step=True)
    trace = fixed.run(prompt_ids=prompt, settings=DecodeSettings("ddtree", max_new_tokens=48, tree_budget=12))
    assert trace.output_ids == ar.output_ids
    assert trace.summary.tau > 3


def test_sampling_keeps_the_readable_step_and_says_so(decoders):
    _, fixed = decoders
    trace = fixed.run(prompt_ids=PROMPTS[0], settings=DecodeSettings("ddtree", max_new_tokens=8, temperature=0.8))
    assert "sampling runs the readable step" in " ".join(trace.config.notes)
    assert "tree_build" in trace.steps[0].stage_s
