"""Lossless decoding: greedy DFlash and DDTree outputs equal AR exactly (float64)."""

import pytest
import torch

from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.settings import DecodeSettings
from engine.models.drafter import ScriptedDrafter, fresh_config
from tests.tiny import tiny_decoder, tiny_drafter, tiny_target


def prompt(seed, length, vocab):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(2, vocab - 1, (length,), generator=g).tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_random_drafter_dflash_and_ddtree_equal_ar(seed, block_size):
    decoder = tiny_decoder(seed, block_size=block_size, vocab=40)
    ids = prompt(seed, 5 + 7 * seed, 40)
    ar = decoder.run(prompt_ids=ids, settings=DecodeSettings("ar", max_new_tokens=48))
    assert ar.summary.tau == 1.0
    outputs = {"dflash": decoder.run(prompt_ids=ids, settings=DecodeSettings("dflash", max_new_tokens=48))}
    for budget in (1, 4, 16, 64):
        outputs[budget] = decoder.run(prompt_ids=ids, settings=DecodeSettings("ddtree", max_new_tokens=48,
                                                                               tree_budget=budget))
    for key, trace in outputs.items():
        assert trace.output_ids == ar.output_ids, key
        assert trace.summary.new_tokens == len(ar.output_ids)


@pytest.mark.parametrize("seed", [0, 3])
def test_flat_drafter_wide_trees_accept_siblings_and_stay_exact(seed):
    """A near-uniform drafter makes wide trees (every token at depth 1), so acceptance
    runs through siblings at depth 1 and beyond."""
    target = tiny_target(seed, vocab=12)
    drafter = tiny_drafter(target, seed)
    drafter.config.output_multiplier = 1e-3
    decoder = Decoder(target, drafter, DrafterInfo("flat", trained=False))
    ids = prompt(seed, 9, 12)
    ar = decoder.run(prompt_ids=ids, settings=DecodeSettings("ar", max_new_tokens=40))
    for budget in (16, 64, 300):
        trace = decoder.run(prompt_ids=ids, settings=DecodeSettings("ddtree", max_new_tokens=40, tree_budget=budget))
        assert trace.output_ids == ar.output_ids
        assert trace.summary.tau >= 2.0  # depth 1 holds every token, so each step accepts one draft at least
        assert any(step.accepted[1] > 1 for step in trace.steps)  # accepted a non-first sibling


@pytest.mark.parametrize("seed", [0, 1])
def test_oracle_drafts_are_accepted_deeply_and_trees_recover_demoted_tokens(seed):
    target = tiny_target(seed, vocab=48)
    ids = prompt(seed, 11, 48)
    plain = Decoder(target, tiny_drafter(target, seed), DrafterInfo("random", trained=False))
    ar = plain.run(prompt_ids=ids, settings=DecodeSettings("ar", max_new_tokens=60))
    config = fresh_config(target.config, num_layers=1, mask_token_id=47, num_taps=2)
    oracle = ScriptedDrafter(config, [ids + ar.output_ids]).initialize(seed).to(torch.float64).eval()
    decoder = Decoder(target, oracle, DrafterInfo("oracle", trained=False))
    chain = decoder.run(prompt_ids=ids, settings=DecodeSettings("dflash", max_new_tokens=60))
    tree = decoder.run(prompt_ids=ids, settings=DecodeSettings("ddtree", max_new_tokens=60, tree_budget=64))
    assert chain.output_ids == ar.output_ids
    assert tree.output_ids == ar.output_ids
    assert tree.summary.tau > chain.summary.tau >= 2.0
    assert max(tree.summary.acceptance_lengths) >= 5  # through demoted (rank-2) depths
    # the last step is clipped exactly at the token limit
    assert tree.summary.new_tokens == 60 or tree.output_ids[-1] in target.stop_ids


def test_stop_token_ends_generation_inside_an_accepted_path():
    target = tiny_target(4, vocab=30)
    ids = prompt(4, 8, 30)
    plain = Decoder(target, tiny_drafter(target, 4), DrafterInfo("random", trained=False))
    ar = plain.run(prompt_ids=ids, settings=DecodeSettings("ar", max_new_tokens=40))
    stop_at = ar.output_ids[len(ar.output_ids) // 2]
    target.stop_ids = [stop_at]
    ar = plain.run(prompt_ids=ids, settings=DecodeSettings("ar", max_new_tokens=40))
    config = fresh_config(target.config, num_layers=1, mask_token_id=29, num_taps=2)
    oracle = ScriptedDrafter(config, [ids + ar.output_ids + [0] * 40], demote_every=1000).initialize(0).double().eval()
    tree = Decoder(target, oracle, DrafterInfo("oracle", trained=False)).run(
        prompt_ids=ids, settings=DecodeSettings("ddtree", max_new_tokens=40, tree_budget=32))
    assert tree.output_ids == ar.output_ids
    assert tree.output_ids[-1] == stop_at and tree.summary.stop_reason == "eos"


def test_trace_records_every_step_consistently():
    decoder = tiny_decoder(5, vocab=12)
    decoder.drafter.config.output_multiplier = 1e-3
    trace = decoder.run(prompt_ids=prompt(5, 6, 12),
                        settings=DecodeSettings("ddtree", max_new_tokens=30, tree_budget=20))
    assert trace.summary.new_tokens == len(trace.output_ids) == 1 + sum(trace.summary.acceptance_lengths)
    for step in trace.steps:
        assert len(step.target_tokens) == step.tree_size + 1
        assert step.tree_size <= 20
        assert step.committed_ids[: len(step.accepted) - 1] == [step.tree_tokens[i - 1] for i in step.accepted[1:]]
        assert step.committed_ids[-1] == step.bonus_token or len(step.committed_ids) < len(step.accepted)
        assert len(step.draft_top_tokens) == 15 and len(step.draft_top_probs[0]) == 8
        assert set(step.stage_s) == {"draft", "tree_build", "tree_compile", "verify", "commit"}
        assert step.t_end >= step.t_start
    assert "".join(trace.text_pieces) == trace.text



def test_a_bf16_drafter_beside_a_float32_target_drafts_in_bf16_and_decodes_what_ar_decodes():
    target = tiny_target(5, vocab=48, dtype=torch.float32)
    ids = prompt(5, 9, 48)
    ar = Decoder(target).run(prompt_ids=ids, settings=DecodeSettings("ar", max_new_tokens=48))
    config = fresh_config(target.config, num_layers=1, mask_token_id=47, num_taps=2)
    oracle = ScriptedDrafter(config, [ids + ar.output_ids]).initialize(5).to(torch.bfloat16).eval()
    readable = Decoder(target, oracle, DrafterInfo("oracle", trained=False))
    embedding, lm_head = readable.draft_weights
    assert embedding.dtype == lm_head.dtype == torch.bfloat16 and lm_head is embedding, "tied: one bf16 copy"
    assert target.embedding.dtype == torch.float32
    assert readable.draft_dtype == "bfloat16" and Decoder(target).draft_dtype is None, "what results and the page name"
    fixed = Decoder(target, oracle, DrafterInfo("oracle", trained=False), fixed_step=True)
    for decoder in (readable, fixed):
        for settings in (DecodeSettings("dflash", max_new_tokens=48), DecodeSettings("ddtree", max_new_tokens=48,
                                                                                      tree_budget=16)):
            trace = decoder.run(prompt_ids=ids, settings=settings)
            assert trace.output_ids == ar.output_ids, (decoder.step_kind, settings.method)
            assert trace.summary.tau >= 2.5, "the bf16 drafts are the script's: accepted levels deep"


def test_a_prompt_s_pass_computes_the_last_row_s_logits_alone():
    """The prompt's pass needs its last row only (the first token); the LM head then runs on one row, as vLLM's and
    transformers' own prompt passes do, and that row is the full pass's."""
    target = tiny_target()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    positions = torch.arange(5)[None]
    with torch.inference_mode():
        full, _ = target.forward(ids, positions, target.new_cache())
        last, _ = target.forward(ids, positions, target.new_cache(), last_logits=True)
    assert full.shape == (5, target.config.vocab_size) and last.shape == (1, target.config.vocab_size)
    torch.testing.assert_close(last[0], full[-1], rtol=0, atol=1e-5)
