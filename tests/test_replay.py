"""The replayed acceptance (engine.tools.replay) is the decoder's own, step for step."""

from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.settings import DecodeSettings
from engine.methods import DFLASH, method
from engine.models.drafter import ScriptedDrafter
from engine.tools import replay as replay_cli
from engine.tools.replay import first_slot_table, proposals_along, replay
from tests.tiny import tiny_decoder, tiny_target

PROMPTS = [[3, 14, 15, 9, 2, 6], [27, 18, 28, 18], [5, 5, 5, 5, 5, 5, 5, 5]]
METHODS = [("dflash", 0), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 48)]


def assert_replay_equals_decoding(decoder: Decoder, max_new_tokens: int) -> list[int]:
    every_length = []
    for prompt in PROMPTS:
        ar = decoder.run(prompt_ids=prompt, settings=DecodeSettings("ar", max_new_tokens=max_new_tokens))
        proposals = proposals_along(decoder, prompt, ar.output_ids, top_k=48)
        for name, budget in METHODS:
            trace = decoder.run(prompt_ids=prompt, settings=DecodeSettings(name, max_new_tokens=max_new_tokens,
                                                                           tree_budget=budget or 32))
            assert trace.output_ids == ar.output_ids
            lengths = replay(proposals, method(name), budget)
            assert lengths == trace.summary.acceptance_lengths, (prompt, name, budget)
            every_length += lengths
    return every_length


def test_replay_equals_decoding_with_a_random_drafter():
    assert_replay_equals_decoding(tiny_decoder(seed=4), max_new_tokens=20)


def knowing_decoder() -> Decoder:
    """A drafter that knows the answer, except every 3rd token, which it ranks third."""
    target = tiny_target(5)
    plain = Decoder(target, None)
    answers = [prompt + plain.run(prompt_ids=prompt, settings=DecodeSettings("ar", max_new_tokens=40)).output_ids
               for prompt in PROMPTS]
    config = tiny_decoder(seed=5).drafter.config
    scripted = ScriptedDrafter(config, answers).initialize(5).double().eval()
    return Decoder(target, scripted, DrafterInfo("scripted", trained=False))


def test_replay_equals_decoding_where_trees_are_accepted_levels_deep():
    """Chains stop at the drafter's demoted tokens and wide trees go on, so a replay that walked the
    wrong branch or lost count would show."""
    lengths = assert_replay_equals_decoding(knowing_decoder(), 40)
    # a chain stops at the next demoted token (at most 3 a step); trees went past two of them
    assert max(lengths) >= 6 and sum(lengths) / len(lengths) > 2.5


def test_the_first_slot_is_right_exactly_where_a_dflash_step_accepts_a_draft_token():
    decoder = knowing_decoder()
    outcomes = set()
    for prompt in PROMPTS:
        output = decoder.run(prompt_ids=prompt, settings=DecodeSettings("ar", max_new_tokens=40)).output_ids
        proposals = proposals_along(decoder, prompt, output, top_k=1)
        hits = proposals.first_slot_hits()
        assert len(hits) == len(output) - 1 and all(0 < confidence <= 1 for _, confidence in hits)
        j = 0
        for committed in replay(proposals, DFLASH, 0):
            if len(output) - 1 - j >= 2:  # room for a draft token before the output ends
                assert hits[j][0] == (committed >= 2), (prompt, j)
                outcomes.add(hits[j][0])
            j += committed
    assert outcomes == {True, False}


def test_the_first_slot_table_splits_hits_by_the_targets_confidence():
    lines = first_slot_table({"a": [(True, 0.9), (False, 0.2)], "b": [(True, 0.6)]})
    assert lines == [
        "| category | first slot right | mean target confidence | target 0–0.3 | target 0.3–0.5 | target 0.5–0.7 "
        "| target 0.7–0.9 | target ≥ 0.9 |",
        "|---|---|---|---|---|---|---|---|",
        "| a | 0.50 (2) | 0.55 | 0.00 (1) | – | – | – | 1.00 (1) |",
        "| b | 1.00 (1) | 0.60 | – | – | 1.00 (1) | – | – |",
        "| all | 0.67 (3) | 0.57 | 0.00 (1) | – | 1.00 (1) | – | 1.00 (1) |"]


def test_bad_input_gives_one_error_line_before_any_model_loads(tmp_path, capsys):
    assert replay_cli.main(["--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert "cannot read prompts file" in capsys.readouterr().err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Hi."}\n{"id": "b", "prompt": "Bye."}\n')
    results = tmp_path / "r.json"
    results.write_text('{"runs": [{"prompt_id": "a", "method": "ar", "output_ids": [1, 2]}]}')
    assert replay_cli.main(["--prompts", str(prompts), "--ar-outputs", str(results)]) == 2
    assert "has no AR run for b (1 prompts missing)" in capsys.readouterr().err
