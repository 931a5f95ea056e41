"""The DFlash training pipeline on tiny models: the block mask and labels, equality with the
decoder's drafting, checkpoints, the data pipeline, and that training raises acceptance."""

from __future__ import annotations

import functools
import json
import math
import random
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.settings import DecodeSettings
from engine.models.drafter import load_drafter, weights_digest
from engine.models.target import Target
from engine.training import data as data_module, objective, prompts as prompt_module
from engine.training.data import DataSettings, SequenceData, repetition_cut, user_turn_ids
from engine.training.export import export_drafter
from engine.training.generation import Sampling, TransformersGenerator, as_completion
from engine.training.objective import (
    block_loss,
    distillation_kl,
    fused_block_loss,
    target_logits,
    topk_hinge,
    within_top_k,
)
from engine.training.run import Plan
from engine.training.settings import TrainSettings
from engine.training.train import (
    Batch,
    Blocks,
    Progress,
    Trainer,
    block_labels,
    block_visibility,
    choose_loss,
    draft_hidden,
    greedy_tokens,
    learning_rate,
    load_state,
    make_batch,
    sample_anchors,
    save_state,
    target_pass,
)
from tests.tiny import STOP, VOCAB, tiny_drafter, tiny_target

COMPOSED = Path(DataSettings().composed_file)  # the shipped composed prompts

MASK = 95  # tiny_drafter's mask token: the last id of the tiny vocabulary


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, MASK) for _ in range(length)] for _ in range(count)]


def greedy_sequences(target: Target, prompts: list[list[int]], new_tokens: int) -> SequenceData:
    completions = TransformersGenerator(target, batch_size=8).complete(prompts, Sampling(new_tokens))
    return SequenceData.from_lists([p + c.token_ids for p, c in zip(prompts, completions)],
                                   [len(p) for p in prompts])


@functools.cache
def tiny_data(seed: int) -> SequenceData:
    return greedy_sequences(tiny_target(seed, dtype=torch.float32), random_prompts(16, 6, seed), new_tokens=24)


# ---- the block layout -------------------------------------------------------------------------

def test_block_sees_context_strictly_before_its_anchor_and_only_its_own_block():
    anchors = torch.tensor([[3, 7], [5, 1]])
    block_size, context = 4, 10
    mask = block_visibility(anchors, context, block_size)
    assert mask.shape == (2, 1, 8, context + 8)
    for row in range(2):
        for j in range(2):
            for slot in range(block_size):
                visible = mask[row, 0, j * block_size + slot]
                anchor = int(anchors[row, j])
                assert visible[:anchor].all(), "context before the anchor must be visible"
                assert not visible[anchor:context].any(), "the anchor's own and later features must be hidden"
                own = visible[context + j * block_size: context + (j + 1) * block_size]
                assert own.all(), "a block sees all of its slots (non-causal)"
                assert visible[context:].sum() == block_size, "a block never sees another block"


def test_slot_k_is_labelled_with_the_token_at_anchor_plus_k():
    ids = torch.arange(100, 112)[None]  # token at position p is 100 + p
    batch = Batch(ids, lengths=torch.tensor([10]), response_starts=torch.tensor([2]))
    blocks = Blocks(anchors=torch.tensor([[2, 7]]), valid=torch.tensor([[True, True]]))
    labels, valid = block_labels(batch.ids, batch.lengths, blocks, block_size=4)
    assert labels[0, 0].tolist() == [103, 104, 105]
    assert valid[0, 0].all()
    assert labels[0, 1, :2].tolist() == [108, 109]
    assert valid[0, 1].tolist() == [True, True, False], "no label past the sequence end (length 10)"


def test_greedy_labels_are_the_targets_argmax_one_position_earlier():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = torch.tensor(random_prompts(3, 12, seed=4))
    _, final_hidden = target_pass(target, drafter, ids)
    greedy = greedy_tokens(target, final_hidden, ids, rows=5)  # chunks of 5 rows, the last one short
    expected = torch.cat([ids[:, :1], target.model(input_ids=ids).logits[:, :-1].argmax(-1)], dim=1)
    assert torch.equal(greedy, expected)
    assert not torch.equal(greedy, ids), "random tokens are not the target's choices"


def test_greedy_labels_of_a_greedy_reply_are_its_own_tokens():
    data = tiny_data(0)
    target = tiny_target(0, dtype=torch.float32)
    batch = make_batch(data, torch.arange(len(data)), 768, pad_id=STOP)
    _, final_hidden = target_pass(target, tiny_drafter(target), batch.ids)
    greedy = greedy_tokens(target, final_hidden, batch.ids)
    positions = torch.arange(batch.ids.shape[1])
    reply = (positions > batch.response_starts[:, None]) & (positions < batch.lengths[:, None])
    assert torch.equal(greedy[reply], batch.ids[reply])


def test_greedy_labels_train_on_the_targets_choices_not_the_replys_tokens():
    """On greedy replies both label sources train the same weights; on replies that are not the
    target's choices they part."""
    def trained(labels: str, data: SequenceData) -> list[torch.Tensor]:
        trainer = tiny_trainer(steps=3, labels=labels, data=data)
        trainer.run()
        return list(trainer.drafter.parameters())

    for a, b in zip(trained("greedy", tiny_data(0)), trained("data", tiny_data(0))):
        torch.testing.assert_close(a, b)
    prompts = random_prompts(16, 30, seed=0)
    random_replies = SequenceData.from_lists(prompts, [6] * len(prompts))
    parted = [not torch.equal(a, b) for a, b in zip(trained("greedy", random_replies), trained("data", random_replies))]
    assert any(parted)


def test_an_unknown_label_source_is_refused():
    from engine.training.train import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--data", "d", "--out", "o", "--labels", "sampled"])


def test_anchors_lie_in_the_reply_and_leave_room_for_a_label():
    generator = torch.Generator().manual_seed(0)
    ids = torch.zeros(3, 16, dtype=torch.long)
    batch = Batch(ids, lengths=torch.tensor([16, 9, 6]), response_starts=torch.tensor([4, 5, 4]))
    blocks = sample_anchors(batch, count=6, generator=generator)
    for row in range(3):
        chosen = blocks.anchors[row][blocks.valid[row]].tolist()
        start, length = int(batch.response_starts[row]), int(batch.lengths[row])
        assert len(chosen) == len(set(chosen)) == min(6, length - 1 - start)
        assert all(start <= a and a + 1 < length for a in chosen)


def test_target_logits_from_final_hidden_states_equal_the_models_logits():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = torch.tensor(random_prompts(2, 12, seed=1))
    _, final_hidden = target_pass(target, drafter, ids)
    torch.testing.assert_close(target_logits(target, final_hidden), target.model(input_ids=ids).logits)


def test_distillation_compares_slot_k_with_the_targets_output_at_anchor_plus_k_minus_1():
    target = tiny_target()
    ids = torch.tensor(random_prompts(1, 12, seed=2))
    _, final_hidden = target_pass(target, tiny_drafter(target), ids)
    anchors, valid = torch.tensor([[4, 8]]), torch.ones(1, 2, 3, dtype=torch.bool)
    valid[0, 1, 2] = False
    student = torch.log_softmax(torch.randn(5, VOCAB, dtype=torch.float64), -1)
    teacher = torch.log_softmax(target.model(input_ids=ids).logits[0], -1)
    slots = [(a, k) for j, a in enumerate([4, 8]) for k in range(1, 4) if valid[0, j, k - 1]]
    expected = torch.stack([(teacher[a + k - 1].exp() * (teacher[a + k - 1] - q)).sum()
                            for (a, k), q in zip(slots, student)])
    torch.testing.assert_close(distillation_kl(target, final_hidden, anchors, valid, student), expected)


def test_training_forward_drafts_exactly_what_the_decoder_drafts():
    """Blocks at every decode step's root position, computed in one training forward over the
    finished sequence, give the decoder's own draft distributions (float64)."""
    target = tiny_target(seed=3)
    drafter = tiny_drafter(target, seed=3, block_size=8, layers=2)
    prompt = random_prompts(1, 7, seed=3)[0]
    trace = Decoder(target, drafter, DrafterInfo("random", False)).run(
        prompt_ids=prompt, settings=DecodeSettings("dflash", max_new_tokens=20))
    sequence = torch.tensor([prompt + trace.output_ids])
    starts, start = [], len(prompt)
    for step in trace.steps:
        starts.append(start)
        start += len(step.accepted)
    features, _ = target_pass(target, drafter, sequence)
    with torch.no_grad():
        hidden = draft_hidden(drafter, target, sequence, torch.tensor([starts]), features)
        probs = torch.softmax(drafter.logits(hidden, target.lm_head), -1)[0]
    for j, step in enumerate(trace.steps):
        top = probs[j].topk(len(step.draft_top_tokens[0]), dim=-1)
        assert top.indices.tolist() == step.draft_top_tokens
        torch.testing.assert_close(top.values, torch.tensor(step.draft_top_probs, dtype=torch.float64),
                                   atol=1e-6, rtol=1e-5)


def loss_and_gradients(loss, drafter, target, settings: TrainSettings, seed: int = 0):
    """One batch of tiny_data through ``loss``: its metrics and the drafter's gradients."""
    data = tiny_data(0)
    batch = make_batch(data, torch.arange(len(data)), settings.max_length, pad_id=STOP)
    features, final_hidden = target_pass(target, drafter, batch.ids)
    blocks = sample_anchors(batch, settings.blocks_per_sequence, torch.Generator().manual_seed(seed))
    labels, valid = block_labels(batch.ids, batch.lengths, blocks, drafter.block_size)
    hidden = draft_hidden(drafter, target, batch.ids, blocks.anchors, features)
    drafter.zero_grad()
    metrics = loss(drafter, target, hidden, labels, valid, blocks.anchors, final_hidden, settings)
    metrics.loss.backward()
    return metrics, [p.grad.clone() for p in drafter.parameters()]


def tiny_loss_setup(multiplier: float = 1.0, softcap: float | None = None):
    target = tiny_target(0, dtype=torch.float64)
    drafter = tiny_drafter(target, block_size=8)
    drafter.config.output_multiplier, drafter.config.final_logit_softcapping = multiplier, softcap
    return drafter, target


@pytest.mark.parametrize("distill_weight, multiplier, softcap, topk_weight, topk, topk_margin", [
    (0.5, 1.0, None, 0.0, 4, 1.0), (0.0, 1.0, None, 0.0, 4, 1.0), (1.0, 0.7, 3.0, 0.0, 4, 1.0),
    # the hinge on: k and margins where it is zero for some slots and positive for the others
    (0.5, 1.0, None, 0.4, 24, 0.5), (0.0, 0.7, 3.0, 1.0, 4, 0.05)])
def test_the_fused_loss_has_the_references_loss_metrics_and_gradients(monkeypatch, distill_weight, multiplier, softcap,
                                                                       topk_weight, topk, topk_margin):
    """Closed-form gradients, chunked (7 slots a chunk, the last one padded), against autograd
    through whole log-softmaxes: every metric and every parameter's gradient, to float32's
    precision (both take their softmaxes in float32, as training does)."""
    monkeypatch.setattr(objective, "CHUNK_ROWS", 7)
    drafter, target = tiny_loss_setup(multiplier, softcap)
    settings = TrainSettings(blocks_per_sequence=3, distill_weight=distill_weight, topk_weight=topk_weight, topk=topk,
                             topk_margin=topk_margin)
    reference, reference_grads = loss_and_gradients(block_loss, drafter, target, settings)
    fused, fused_grads = loss_and_gradients(fused_block_loss, drafter, target, settings)
    assert int(reference.counted.sum()) > 7 and int(reference.counted.sum()) % 7, "several chunks, the last padded"
    for name in ("loss", "ce", "kl", "hinge", "correct", "correct_topk", "counted", "accepted", "blocks"):
        torch.testing.assert_close(getattr(fused, name), getattr(reference, name), msg=name)
    assert float(reference.kl) > 0 or distill_weight == 0
    assert (float(reference.hinge) > 0) == (topk_weight > 0)
    assert 0 < int(reference.correct_topk.sum()) < int(reference.counted.sum())
    for a, b in zip(fused_grads, reference_grads):
        torch.testing.assert_close(a.float(), b.float())


@pytest.mark.parametrize("loss", [block_loss, fused_block_loss])
def test_with_weight_0_the_topk_term_leaves_the_loss_and_gradients_as_they_were(loss):
    """Off, the term is not computed: CE and KL alone, bit for bit, whatever its k and margin; the
    top-k accuracy is logged all the same (top-1's at k = 1, every slot at k = the vocabulary)."""
    drafter, target = tiny_loss_setup()
    runs = [loss_and_gradients(loss, drafter, target, TrainSettings(blocks_per_sequence=3, topk=k, topk_margin=margin))
            for k, margin in [(4, 1.0), (1, 5.0), (VOCAB, 0.0)]]
    (metrics, grads), *others = runs
    assert torch.equal(metrics.loss, 0.5 * metrics.ce + 0.5 * metrics.kl) and float(metrics.hinge) == 0
    for other, other_grads in others:
        assert torch.equal(other.loss, metrics.loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, other_grads))
    assert torch.equal(runs[1][0].correct_topk, metrics.correct)
    assert torch.equal(runs[2][0].correct_topk, metrics.counted)
    assert (metrics.correct_topk >= metrics.correct).all()


def test_the_topk_hinge_is_zero_where_the_label_leads_the_kth_other_logit_by_the_margin():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]]).expand(4, 5)
    labels = torch.tensor([0, 1, 2, 4])
    hinge, rival = topk_hinge(logits, labels, k=2, margin=1.5)
    # the 2nd largest other logit: 3 for labels 0 and 1, 4 for labels 2 and 4
    assert hinge.tolist() == [0.0, 0.5, 2.5, 4.5], "0: leads by 2; 1: in the top 2 by less than the margin; 2, 4: out"
    assert rival.tolist() == [2, 2, 1, 1]
    assert within_top_k(logits, labels, 2).tolist() == [True, True, False, False]
    assert topk_hinge(logits, labels, k=2, margin=0.5)[0].tolist() == [0.0, 0.0, 1.5, 3.5]
    assert topk_hinge(logits, labels, k=1, margin=0.5)[0].tolist() == [0.0, 1.5, 2.5, 4.5], \
        "k = 1: the multiclass hinge against the strongest other logit"


def test_the_topk_term_is_set_from_the_command_line():
    from engine.training.train import parse_args

    args = parse_args(["--data", "d", "--out", "o", "--topk-weight", "0.3", "--topk", "8", "--topk-margin", "0.5"])
    assert (args.topk_weight, args.topk, args.topk_margin) == (0.3, 8, 0.5)
    defaults = parse_args(["--data", "d", "--out", "o"])
    assert defaults.topk_weight == 0.0, "off unless asked for"


@pytest.mark.slow
def test_choosing_the_loss_trains_ordinary_steps_with_each_and_keeps_one():
    """The reference, the fused and the compiled loss, three steps each (a warm-up and two timed turns,
    interleaved), then the fastest: the weights equal ten steps of the reference alone (float32)."""
    chosen, straight = tiny_trainer(steps=10), tiny_trainer(steps=10)
    straight.loss = block_loss
    lines = []
    chosen.log = lines.append
    best = choose_loss(chosen, ["reference", "fused", "compiled"], steps=1, rounds=2)
    assert chosen.progress.step == 9
    chosen.run()
    straight.run()
    assert best in ("reference", "fused", "compiled") and chosen.progress.step == straight.progress.step == 10
    timed = next(line for line in lines if "median of 2 interleaved turns of 1): reference" in line)
    assert "fused" in timed and f"training on with '{best}'" in timed
    assert "compiled" in timed or any("loss 'compiled' failed" in line for line in lines), \
        "timed, or left out where this machine cannot compile"
    for a, b in zip(chosen.drafter.parameters(), straight.drafter.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ---- schedule, batches, checkpoints, export ------------------------------------------------------

def test_learning_rate_warms_up_then_decays_to_the_floor():
    settings = TrainSettings(lr=1e-3, warmup_fraction=0.1, min_lr_ratio=0.1)
    assert learning_rate(settings, 0.05) == pytest.approx(5e-4)
    assert learning_rate(settings, 0.1) == pytest.approx(1e-3)
    assert learning_rate(settings, 1.0) == pytest.approx(1e-4)
    assert learning_rate(settings, 0.55) == pytest.approx(1e-4 + 0.9e-3 * 0.5)


def test_batches_cut_long_sequences_and_pad_short_ones():
    data = SequenceData.from_lists([[5] * 70, [6] * 10], [3, 4])
    batch = make_batch(data, torch.tensor([0, 1]), max_length=66, pad_id=1, multiple=64)
    assert batch.ids.shape == (2, 66)
    assert batch.lengths.tolist() == [66, 10]
    assert batch.ids[1, :10].eq(6).all() and batch.ids[1, 10:].eq(1).all()


def tiny_trainer(seed: int = 0, steps: int = 8, labels: str = "data", data: SequenceData | None = None) -> Trainer:
    target = tiny_target(seed, dtype=torch.float32)
    settings = TrainSettings(batch_size=4, blocks_per_sequence=4, lr=3e-3, log_every=1000, seed=seed, labels=labels)
    return Trainer.new(tiny_drafter(target, seed, block_size=8), target, tiny_data(seed) if data is None else data,
                       settings, Progress(schedule_steps=steps), log=lambda line: None)


def test_a_resumed_run_continues_exactly_where_it_stopped(tmp_path):
    straight = tiny_trainer()
    straight.run()
    first = tiny_trainer()
    first.run(max_seconds=0.0)
    assert first.progress.step == 0, "no time: the loop stops at once"
    first.run(max_steps=5)  # crosses into the second epoch (4 batches of 4)
    save_state(first, tmp_path / "state.pt")
    state = load_state(tmp_path / "state.pt", "cpu")
    resumed = tiny_trainer()
    resumed.drafter.load_state_dict(state["drafter"])
    resumed.optimizer.load_state_dict(state["optimizer"])
    resumed.progress = state["progress"]
    resumed.run()
    assert resumed.progress.step == straight.progress.step == 8
    for a, b in zip(resumed.drafter.parameters(), straight.drafter.parameters()):
        torch.testing.assert_close(a, b)


def test_profiled_steps_are_ordinary_training_steps_and_report_the_costliest_operators():
    from engine.training.train import profiled_steps

    profiled, straight = tiny_trainer(), tiny_trainer()
    table = profiled_steps(profiled, steps=3)
    straight.run(max_steps=5)
    assert profiled.progress.step == straight.progress.step == 5, "two warm-up steps, then the three profiled"
    assert "profile of 3 steps" in table and "aten::" in table
    for a, b in zip(profiled.drafter.parameters(), straight.drafter.parameters()):
        torch.testing.assert_close(a, b)


def start_from_an_export(tmp_path, *flags: str):
    """A 2-layer drafter exported, and training started from it with ``flags``: (target, drafter, start's result)."""
    from engine.training.train import parse_args, start

    target = tiny_target()
    drafter = tiny_drafter(target, seed=3, layers=2)
    drafter.config.acceptance = {"dflash": 2.5}
    export_drafter(drafter, tmp_path / "drafter", shard_mb=None)
    args = parse_args(["--data", str(tmp_path), "--out", str(tmp_path / "out"),
                       "--init-from", str(tmp_path / "drafter"), "--schedule-steps", "10", *flags])
    return target, drafter, start(args, target)


def test_training_can_start_from_an_exported_drafter(tmp_path):
    _, drafter, (started, settings, progress, optimizer_state) = start_from_an_export(tmp_path, "--num-layers", "4")
    assert started.config.num_hidden_layers == 2, "the checkpoint's shape, not --num-layers"
    assert started.config.acceptance == {}, "the start's measured τ is not the trained drafter's"
    assert optimizer_state is None and progress.step == 0 and progress.schedule_steps == 10
    for name, value in started.state_dict().items():
        assert value.dtype == torch.float32, "trained in float32 whatever the export's dtype"
        torch.testing.assert_close(value, drafter.state_dict()[name].to(torch.bfloat16).float())


def learning_rates(log: Path) -> list[tuple[int, float]]:
    return [(line["step"], line["lr"]) for line in map(json.loads, log.read_text().splitlines())]


def logged_trainer(tmp_path, name: str, steps: int) -> Trainer:
    """tiny_trainer, logging every step's learning rate to ``tmp_path/name.jsonl``."""
    trainer = tiny_trainer(steps=steps)
    trainer.settings.log_every, trainer.log_path = 1, tmp_path / f"{name}.jsonl"
    return trainer


def a_later_session(tmp_path, *flags: str):
    """start() on a fresh machine from the first session's exported drafter, with tiny_trainer's settings."""
    from engine.training.train import parse_args, start

    args = parse_args(["--data", str(tmp_path), "--out", str(tmp_path / "later"), "--init-from",
                       str(tmp_path / "first" / "drafter"), "--lr", "3e-3", "--batch-size", "4",
                       "--blocks-per-sequence", "4", "--log-every", "1", *flags])
    return start(args, tiny_target(0, dtype=torch.float32))


def test_a_later_session_continues_the_learning_rate_schedule_of_the_exported_drafter(tmp_path, capsys):
    """Three steps of an eight-step schedule, exported; a later session from the export alone (a new
    optimizer) trains the other five at the learning rates of one uninterrupted run, warmup not repeated."""
    from engine.training.train import SCHEDULE_FILE, save_outputs

    straight = logged_trainer(tmp_path, "straight", steps=8)
    straight.run()
    first = logged_trainer(tmp_path, "first-log", steps=8)
    first.run(max_steps=3)
    (tmp_path / "first").mkdir()
    save_outputs(first, tmp_path / "first", shard_mb=None)
    record = json.loads((tmp_path / "first" / "drafter" / SCHEDULE_FILE).read_text())
    assert (record["kind"], record["planned"], record["steps"]) == ("steps", 8, 3)
    assert record["tokens"] == first.progress.tokens > 0
    drafter, settings, progress, optimizer_state = a_later_session(tmp_path, "--schedule-steps", "3")
    assert optimizer_state is None and (progress.step, progress.schedule_steps) == (3, 8), \
        "the schedule's own length, not this session's plan"
    assert "its learning rate jumps" not in capsys.readouterr().out, "the same curve"
    later = Trainer.new(drafter, tiny_target(0, dtype=torch.float32), tiny_data(0), settings, progress,
                        log=lambda line: None, log_path=tmp_path / "later.jsonl")
    later.run()
    assert later.progress.step == 8
    rates = learning_rates(tmp_path / "first-log.jsonl") + learning_rates(tmp_path / "later.jsonl")
    assert rates == learning_rates(tmp_path / "straight.jsonl")
    line = json.loads((tmp_path / "later.jsonl").read_text().splitlines()[-1])
    assert all(k >= one for k, one in zip(line["slot_topk_accuracy"], line["slot_accuracy"]))


def test_without_its_schedule_file_an_exported_drafter_starts_a_new_schedule(tmp_path, capsys):
    """The shipped drafters and folders put together by hand have no schedule file: a new schedule, as before.
    A schedule that is complete is refused unless a longer plan is given; another learning rate is pointed out."""
    from engine.training.train import SCHEDULE_FILE, save_outputs

    first = tiny_trainer(steps=3)
    first.run()
    (tmp_path / "first").mkdir()
    save_outputs(first, tmp_path / "first", shard_mb=None)
    with pytest.raises(SystemExit, match="is complete"):
        a_later_session(tmp_path, "--schedule-steps", "5")
    *_, progress, _ = a_later_session(tmp_path, "--planned-minutes", "2", "--lr", "1e-3")
    assert progress.step == 3 and progress.schedule_steps is None and progress.schedule_seconds == 120
    assert progress.trained_seconds == pytest.approx(first.progress.trained_seconds)
    assert "its learning rate jumps" in capsys.readouterr().out
    (tmp_path / "first" / "drafter" / SCHEDULE_FILE).unlink()
    *_, progress, _ = a_later_session(tmp_path, "--schedule-steps", "5")
    assert (progress.step, progress.tokens, progress.schedule_steps) == (0, 0, 5)


def test_export_splits_weights_into_small_bf16_shards_that_load_back(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target, layers=2)
    files = export_drafter(drafter, tmp_path, shard_mb=0.1, extra={"training": {"steps": 1}})
    assert len(files) > 1 and all(f.stat().st_size <= 0.1 * 2**20 for f in files)
    assert not (tmp_path / "model.safetensors").exists()
    assert all(t.dtype == torch.bfloat16 for f in files for t in load_file(f).values())
    loaded = load_drafter(tmp_path)
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name].double(), tensor.to(torch.bfloat16).double())
    export_drafter(drafter, tmp_path, shard_mb=None)  # one file again: the old shards must go
    assert [f.name for f in tmp_path.glob("*.safetensors")] == ["model.safetensors"]


def exported(tmp_path, name: str, seed: int, layers: int = 2, **extra):
    target = tiny_target()
    drafter = tiny_drafter(target, seed=seed, layers=layers)
    export_drafter(drafter, tmp_path / name, shard_mb=None, extra=extra or None)
    return tmp_path / name, load_drafter(tmp_path / name)


def test_averaged_drafter_holds_the_mean_of_every_weight_and_names_its_sources(tmp_path):
    from engine.training.average import main

    folders, drafters = zip(*(exported(tmp_path, f"d{seed}", seed, training={"steps": seed}, acceptance={"dflash": 2.0})
                              for seed in (1, 2, 3)))
    assert drafters[0].config.acceptance == {"dflash": 2.0}
    assert main([str(tmp_path / "mean"), *map(str, folders)]) == 0
    mean = load_drafter(tmp_path / "mean")
    for name, tensor in mean.state_dict().items():
        expected = sum(d.state_dict()[name].float() for d in drafters) / 3
        torch.testing.assert_close(tensor.float(), expected.to(torch.bfloat16).float(), rtol=0, atol=0)
    config = json.loads((tmp_path / "mean" / "config.json").read_text())
    assert [source["weights"] for source in config["average_of"]] == [weights_digest(f) for f in folders]
    assert [source["training"] for source in config["average_of"]] == [{"steps": 1}, {"steps": 2}, {"steps": 3}]
    assert "acceptance" not in config, "the sources' measurements are not the mean's"


def test_averaging_drafters_of_different_shapes_is_refused_with_one_line(tmp_path, capsys):
    from engine.training.average import main

    two, _ = exported(tmp_path, "two", 1, layers=2)
    three, _ = exported(tmp_path, "three", 2, layers=3)
    assert main([str(tmp_path / "mean"), str(two), str(three)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "num_hidden_layers" in error and error.count("\n") == 1
    assert not (tmp_path / "mean").exists(), "nothing written"
    assert main([str(tmp_path / "mean"), str(two)]) == 2
    assert "at least two" in capsys.readouterr().err


# ---- data ------------------------------------------------------------------------------------------

def test_repetition_cut_keeps_the_first_repeats_of_a_loop():
    loop = [7, 8, 9]
    reply = [1, 2, 3, 4] + loop * 10
    keep = repetition_cut(reply, n=3, max_repeats=4)
    assert reply[:keep] == [1, 2, 3, 4] + loop * 4, "cut where (7, 8, 9) starts a fifth time"
    assert repetition_cut(list(range(50)), n=8, max_repeats=1) == 50
    assert repetition_cut([1, 2], n=8, max_repeats=1) == 2


def test_completions_end_at_and_keep_the_first_stop_token():
    assert as_completion([5, 6, 2, 7, 2], stop_ids=[2]).token_ids == [5, 6, 2]
    assert as_completion([5, 6, 2, 7, 2], stop_ids=[2]).stopped
    assert not as_completion([5, 6], stop_ids=[2]).stopped


class TextTokenizer:
    """Every printable character gets its own id in 2..94 of the tiny vocabulary (0: unknown)."""

    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) - 30 if 32 <= ord(c) <= 124 else 0 for c in text]}

    def __len__(self):
        return VOCAB

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i + 30) for i in ids if 2 <= i <= 94)


@pytest.mark.slow
def test_data_pipeline_writes_split_prompts_and_replies_that_load(tmp_path):
    tiny = tiny_target(seed=1, dtype=torch.float32)
    chat = Target(model=tiny.model, tokenizer=TextTokenizer(), name="tiny", stop_ids=[STOP])
    settings = DataSettings(num_prompts=120, min_heldout=4, max_new_tokens=12, prompt_max_tokens=16,
                            min_prompt_chars=4, chunk_prompts=64, min_response_tokens=2, asked_fraction=0.1,
                            list_max_tokens=16, composed_fraction=0.05, composed_file=str(COMPOSED))
    generator = TransformersGenerator(chat, batch_size=16)
    stats = data_module.run(generator, chat, tmp_path, settings, log=lambda line: None)
    train_prompts = data_module.read_prompts(tmp_path / "prompts.jsonl")
    heldout = data_module.read_prompts(tmp_path / "heldout.jsonl")
    assert len(heldout) >= 4 and not {p.text for p in heldout} & {p.text for p in train_prompts}
    assert {"self", "general", "code", "polyglot", "math", "passage", "function", "composed"} <= \
        {p.source for p in train_prompts}
    assert stats["overlap"]["checked"] == len(train_prompts) + len(heldout) + stats["overlap"]["removed"]
    ranges = [tuple(torch.load(p)["prompt_range"]) for p in sorted(tmp_path.glob("responses-*.pt"))]
    assert ranges[0] == (0, 16) and ranges[-1][1] == len(train_prompts), "a quarter-size first chunk, then all"
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    data = SequenceData.load(tmp_path)
    assert len(data) == stats["sequences"] > 0
    first = data.tokens[: data.lengths[0]].tolist()
    by_id = {data_module.prompt_id(p.text): p for p in train_prompts}
    first_prompt = by_id[torch.load(tmp_path / "responses-00000.pt")["prompt_ids"][0]]
    assert first[: data.response_starts[0]] == chat.chat_ids(first_prompt.text)
    # a second run reuses everything on disk
    assert data_module.run(generator, chat, tmp_path, settings, log=lambda line: None)["sequences"] == len(data)


@functools.cache
def smollm2_chat() -> Target:
    """The bundled SmolLM2's tokenizer (read from its GGUF, a few seconds), without weights."""
    from transformers import AutoTokenizer

    from engine.models.target import bundled_gguf

    gguf = bundled_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return Target(model=None, tokenizer=tokenizer, name="smollm2", stop_ids=[2])


class EchoGenerator:
    """Replies with the prompt's last ten tokens reversed, then ends its turn."""

    def complete(self, prompts, sampling):
        return [as_completion(p[-10:][::-1] + [STOP], [STOP]) for p in prompts]

    def close(self):
        pass


def test_replies_stop_at_the_deadline_and_a_later_run_continues(tmp_path):
    chat = Target(model=None, tokenizer=TextTokenizer(), name="text", stop_ids=[STOP])
    prompts = [data_module.Prompt(f"prompt number {i}", "math") for i in range(100)]
    settings = DataSettings(chunk_prompts=40)
    data_module.generate_responses(EchoGenerator(), chat, prompts, settings, tmp_path, deadline=time.monotonic(),
                                   log=lambda line: None)
    assert not list(tmp_path.glob("responses-*.pt")), "no time left: no chunk starts"
    data_module.generate_responses(EchoGenerator(), chat, prompts, settings, tmp_path, log=lambda line: None)
    ranges = [tuple(torch.load(p)["prompt_range"]) for p in sorted(tmp_path.glob("responses-*.pt"))]
    assert ranges == [(0, 10), (10, 50), (50, 90), (90, 100)]
    data = SequenceData.load(tmp_path)
    assert len(data) == 100
    last = data.tokens[data.offsets[-1]: data.offsets[-1] + data.lengths[-1]].tolist()
    assert last[data.response_starts[-1]:] == TextTokenizer()("prompt number 99")["input_ids"][-10:][::-1] + [STOP]


def test_chunks_shrink_to_fit_the_time_left():
    settings = DataSettings(chunk_prompts=8192)
    assert data_module.chunk_size(settings, None, 100.0) == 2048, "the first chunk measures the speed"
    assert data_module.chunk_size(settings, 100.0, 10.0) == 900
    assert data_module.chunk_size(settings, 100.0, 1000.0) == 8192
    assert data_module.chunk_size(settings, 100.0, math.inf) == 8192
    assert data_module.chunk_size(settings, 100.0, 0.5) == 0, "time for too few prompts: stop"
    assert data_module.chunk_size(settings, None, -1.0) == 0


def test_user_turn_ids_stop_where_the_users_text_begins():
    chat = smollm2_chat()
    ids = user_turn_ids(chat, "Tell me")
    text = chat.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>user\nTell me")
    assert chat.chat_ids("Tell me about bees")[: len(ids)] == ids, "the same tokens as the app's encoding"


def test_a_follow_up_turn_continues_the_conversation_token_for_token():
    chat = smollm2_chat()
    first = chat.chat_ids("Name a fruit.")
    reply = chat.tokenizer("A pear.", add_special_tokens=False)["input_ids"] + [2]  # 2: <|im_end|>
    ids = first + reply + data_module.next_turn_ids(chat, "And a vegetable?", stop_id=2)
    whole = chat.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A pear."},
         {"role": "user", "content": "And a vegetable?"}], add_generation_prompt=True, tokenize=True)
    assert ids == list(whole["input_ids"] if hasattr(whole, "keys") else whole)


class RecordingGenerator:
    """Replies with 30 distinct words (so replies can be re-read as passages) and records how it was asked."""

    def __init__(self, chat: Target):
        words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa " \
                "quebec romeo sierra tango uniform victor whiskey xray yankee zulu red green blue white"
        self.reply = chat.tokenizer(words, add_special_tokens=False)["input_ids"] + [2]
        self.calls: list[tuple[int, Sampling]] = []

    def complete(self, prompts, sampling):
        self.calls.append((len(prompts), sampling))
        return [as_completion(list(self.reply), [2]) for _ in prompts]

    def close(self):
        pass


def test_replies_are_partly_sampled_and_a_second_round_follows_up_or_rereads(tmp_path):
    chat = smollm2_chat()
    prompts = [data_module.Prompt(f"Tell me about the number {i}.", "general") for i in range(400)]
    settings = DataSettings(chunk_prompts=1600, sampled_fraction=0.25, follow_up_fraction=0.1, reread_fraction=0.05)
    generator = RecordingGenerator(chat)
    data_module.generate_responses(generator, chat, prompts, settings, tmp_path, log=lambda line: None)
    (greedy_count, greedy), (sampled_count, sampled), (again_count, again) = generator.calls
    assert greedy.temperature == 0 and sampled.temperature == settings.reply_temperature and again.temperature == 0
    assert greedy_count + sampled_count == 400 and 60 <= sampled_count <= 140, "about a quarter sampled"
    counts = torch.load(tmp_path / "responses-00000.pt")["counts"]
    assert counts["sampled"] == sampled_count
    assert counts["follow_ups"] + counts["rereads"] == again_count and 20 <= counts["follow_ups"] <= 60
    assert 5 <= counts["rereads"] <= 40
    data = SequenceData.load(tmp_path)
    sequences = [data.tokens[o: o + n].tolist() for o, n in zip(data.offsets, data.lengths)]
    follow_ups = [(seq, start) for seq, start in zip(sequences, data.response_starts.tolist())
                  if seq[:start].count(2) >= 3]  # system and user turn ends, then the first reply's
    assert len(follow_ups) == counts["follow_ups"]
    for seq, start in follow_ups:
        context = chat.tokenizer.decode(seq[:start], skip_special_tokens=False)
        assert context.count("<|im_start|>user") == 2 and context.endswith("<|im_start|>assistant\n")
        assert seq[start:] == generator.reply, "only the second reply is trained on"
    rereads = [seq for seq, start in zip(sequences, data.response_starts.tolist())
               if seq[:start].count(2) < 3 and "whiskey xray yankee" in chat.tokenizer.decode(seq[:start])]
    assert len(rereads) == counts["rereads"]


def test_listed_items_are_the_numbered_lines_of_a_list_or_its_numbered_runs():
    from engine.training.prompts import listed_items

    text = ('Sure! Here are some questions:\n1. What do bees eat?\n2) "Why do bees buzz?" [2]\n3. Bees?\n'
            '4. How do bees find their way home?\nI hope these help.')
    assert listed_items(text) == ["What do bees eat?", "Why do bees buzz?", "How do bees find their way home?"]
    one_line = "1. What's a perfect recipe? 2. Can you add another recipe? 3. How to cook it?"
    assert listed_items(one_line) == ["What's a perfect recipe?", "Can you add another recipe?", "How to cook it?"]
    assert listed_items("It costs 5. Then 12 more.\nNo list here.") == []
    assert listed_items("1. " + "word " * 60) == [], "longer than a request"


class ListWritingGenerator:
    """Writes the same numbered list for every request: whole for even requests, cut short (no end of
    turn) for odd ones."""

    def __init__(self, chat: Target, text: str):
        self.ids = chat.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.requests: list[str] = []
        self.chat = chat

    def complete(self, prompts, sampling):
        self.requests += [self.chat.tokenizer.decode(p) for p in prompts]
        self.sampling = sampling
        return [as_completion(self.ids + ([2] if i % 2 == 0 else []), [2]) for i in range(len(prompts))]


def test_asked_prompts_are_the_items_of_lists_the_target_writes_about_seed_words():
    chat = smollm2_chat()
    seeds = data_module.vocabulary_seeds(chat.tokenizer)
    assert len(seeds) > 10_000 and {"garden", "umbrella", "bicycle"} <= set(seeds)
    assert all(w.isascii() and w.isalpha() and w.islower() and len(w) >= 5 for w in seeds)
    generator = ListWritingGenerator(chat, "1. What do bees eat?\n2. Why do bees buzz?\n3. How do bees fly?")
    settings = DataSettings(items_per_list=3)
    prompts = data_module.asked_prompts(generator, chat, 12, settings, random.Random(0))
    assert len(generator.requests) == 4 and all("Number them." in r and "<|im_start|>assistant" in r
                                                for r in generator.requests)
    assert generator.sampling.temperature == settings.list_temperature
    assert {p.source for p in prompts} == {"asked"}
    texts = [p.text for p in prompts]
    assert len(texts) == 2 * 3 + 2 * 2, "a list cut short loses its last, maybe cut, item"
    assert all(t.startswith(("What do bees eat?", "Why do bees buzz?", "How do bees fly?")) for t in texts)
    assert sum(t.startswith("How do bees fly?") for t in texts) == 2
    assert data_module.asked_prompts(generator, chat, 0, settings, random.Random(0)) == []


def test_composed_prompts_come_each_as_written_then_again_with_a_format_request(tmp_path):
    texts = ["How do bees fly?", "Should I learn the piano at 40?", "Write a haiku about rain."]
    prompts = prompt_module.composed_prompts(texts, 8, random.Random(0))
    assert len(prompts) == 8 and {p.source for p in prompts} == {"composed"}
    assert sorted(p.text for p in prompts[:3]) == sorted(texts)
    repeats = [p.text for p in prompts[3:]]
    assert all(any(r.startswith(t) and r != t for t in texts) for r in repeats)
    assert all(r[len(t):] in prompt_module.FORMATS for r in repeats for t in texts if r.startswith(t))
    assert [p.text for p in prompt_module.composed_prompts(texts, 2, random.Random(0))] == [p.text for p in prompts[:2]]
    path = tmp_path / "composed.jsonl"
    path.write_text("".join(json.dumps({"prompt": t, "category": "x"}) + "\n" for t in texts))
    assert data_module.read_composed(str(path)) == texts
    with pytest.raises(SystemExit, match="does not exist"):
        data_module.read_composed(str(tmp_path / "missing.jsonl"))


def test_a_round_of_composed_requests_adds_only_what_is_new_and_far_from_evaluation_prompts(tmp_path):
    from engine.training.composed import add

    def write(path, texts, category="question"):
        path.write_text("".join(json.dumps({"prompt": t, "category": category}) + "\n" for t in texts))
        return path

    evals = write(tmp_path / "fresh.jsonl", ["Why do onions make people cry when they cut them?"])
    out = tmp_path / "composed.jsonl"
    first = write(tmp_path / "round1.jsonl", ["How do bees fly?", "how do  BEES fly?", "Is a tomato a fruit?"])
    assert add([first], out, str(evals))[0] == 2
    second = write(tmp_path / "round2.jsonl", ["Is a tomato a fruit?",
                                               "why do onions make people cry when you cut them",
                                               "Write a haiku about rain."], category="creative")
    added, report = add([second], out, str(evals))
    assert added == 1 and report.removed == 1 and report.eval_prompts_hit == {"fresh": [0]}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt"], r["category"]) for r in rows] == [("How do bees fly?", "question"),
                                                           ("Is a tomato a fruit?", "question"),
                                                           ("Write a haiku about rain.", "creative")]
    assert data_module.read_composed(str(out)) == [r["prompt"] for r in rows]


def test_near_duplicates_of_evaluation_prompts_are_removed_and_reported():
    from engine.training.overlap import OverlapIndex

    index = OverlapIndex({"fresh": ["Why do cats purr?", "Write a Python function that returns the second largest "
                                                         "number in a list."],
                          "heldout": ["Explain photosynthesis in simple terms. Keep it brief."]})
    prompts = [data_module.Prompt(text, "x") for text in [
        "why do cats purr",  # the same words
        "Write a Python function to find the second largest number in a list. Use type hints.",  # a sibling
        "explain photosynthesis in simple terms - keep it brief!",  # a copy of an in-distribution prompt
        "Explain photosynthesis in simple terms.",  # its sibling: held-out prompts are template siblings by design
        "Why do dogs bark at night?", "Write a Python function that reverses a string.", "Explain gravity simply.",
    ]]
    kept, report = index.filter(prompts)
    assert kept == prompts[3:]
    assert report.removed == 3 and report.checked == 7
    assert report.eval_prompts_hit == {"fresh": [0, 1], "heldout": [0]}
    twice = report.merge(index.filter(prompts[:2])[1])
    assert twice.eval_prompts_hit == {"fresh": [0, 1], "heldout": [0]}, "the same prompts hit twice count once"
    assert twice.removed == 5 and twice.train_removed_by_set == {"fresh": 4, "heldout": 1}
    assert report.train_removed_by_set == {"fresh": 2, "heldout": 1}
    assert any("fresh (50% shared either way): 2/2 evaluation prompts" in line for line in report.lines())


def test_stdlib_harvest_gives_prose_paragraphs_and_functions():
    from engine.training.stdlib_text import harvest, prose_paragraphs

    found = harvest()
    assert len(found.passages) > 500 and len(found.functions) > 2000
    assert all(">>>" not in p and len(p) >= 160 for p in found.passages)
    assert all(f.source.lstrip().startswith(("def ", "async def ", "@")) for f in found.functions)
    assert all(f.source.startswith(f.head.rstrip("\n")) for f in found.functions[:500])
    assert prose_paragraphs("Short.\n\n>>> f(1)\n2") == []


# ---- run planning ----------------------------------------------------------------------------------

def test_plan_leaves_training_the_rest_of_the_call_and_schedules_the_later_calls():
    plan = Plan(deadline_minutes=9.0, later_minutes=8.5, data_minutes=5.5, min_train_minutes=1.5, save_minutes=0.3)
    assert plan.data_budget(elapsed_minutes=1.0) == 5.5
    assert plan.data_budget(elapsed_minutes=3.0) == pytest.approx(9.0 - 3.0 - 1.5 - 0.3)
    assert plan.train_budget(elapsed_minutes=6.0) == pytest.approx(2.7)
    assert plan.schedule_minutes(elapsed_minutes=6.0) == pytest.approx(2.7 + 8.5)


def test_a_resumed_call_tops_the_data_up_with_new_prompts_that_training_reads(tmp_path, monkeypatch):
    """With the data made, ``--more-data-minutes`` runs the data stage again into more-1/ with
    another seed, then resumes training; training loads the top-up's shards beside the first."""
    from engine.training import run as run_module
    from engine.training.data import STATS_FILE, ShardBuilder

    def shard(folder, sequences):
        builder = ShardBuilder()
        for sequence in sequences:
            builder.tokens.append(torch.tensor(sequence, dtype=torch.int32))
            builder.lengths.append(len(sequence))
            builder.response_starts.append(1)
        folder.mkdir(parents=True, exist_ok=True)
        builder.save(folder / "responses-00000.pt", (0, len(sequences)), 1.0)

    shard(tmp_path / "part-0", [[5, 6, 7]])
    (tmp_path / STATS_FILE).write_text("{}")
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "train-state.pt").write_text("")
    commands = []

    def fake_stage(name, command, timeout_minutes):
        commands.append(command)
        if "engine.training.data" in command:
            shard(Path(command[command.index("--out") + 1]) / "part-0", [[8, 9], [10, 11, 12, 13]])
            (Path(command[command.index("--out") + 1]) / STATS_FILE).write_text("{}")
        return 1.0

    monkeypatch.setattr(run_module, "run_stage", fake_stage)
    run_module.run_all(*run_module.parse_args(["--out", str(tmp_path), "--data-seed", "3", "--more-data-minutes", "2",
                                               "--deadline-minutes", "9", "--backend", "transformers"]))
    data_stage, train_stage = commands
    assert data_stage[data_stage.index("--out") + 1] == str(tmp_path / "more-1")
    assert data_stage[data_stage.index("--seed") + 1] == "1003", "another seed: other prompts"
    assert float(data_stage[data_stage.index("--max-minutes") + 1]) == 2.0
    assert "engine.training.train" in train_stage and "--resume" in train_stage
    data = SequenceData.load(tmp_path)
    assert sorted(data.lengths.tolist()) == [2, 3, 4], "the first data and the top-up"
    run_module.run_all(*run_module.parse_args(["--out", str(tmp_path), "--data-seed", "3", "--more-data-minutes", "2",
                                               "--deadline-minutes", "9", "--backend", "transformers"]))
    assert commands[2][commands[2].index("--out") + 1] == str(tmp_path / "more-2")


def test_a_data_only_call_makes_its_data_with_every_minute_and_trains_nothing(tmp_path, monkeypatch):
    import engine.training.run as run_module

    commands = []

    def fake_stage(name, command, timeout_minutes):
        commands.append(command)
        return 1.0

    monkeypatch.setattr(run_module, "run_stage", fake_stage)
    run_module.run_all(*run_module.parse_args(["--out", str(tmp_path), "--data-only", "--deadline-minutes", "9",
                                               "--data-minutes", "8.7", "--backend", "transformers"]))
    (data_stage,) = commands
    assert "engine.training.data" in data_stage
    assert float(data_stage[data_stage.index("--max-minutes") + 1]) == pytest.approx(8.7, abs=0.02)


# ---- training works --------------------------------------------------------------------------------

def mean_tau(target: Target, drafter, prompts: list[list[int]], method: str) -> float:
    decoder = Decoder(target, drafter, DrafterInfo("tiny", True))
    taus = [decoder.run(prompt_ids=p, settings=DecodeSettings(method, max_new_tokens=32, tree_budget=16)).summary.tau
            for p in prompts]
    return sum(taus) / len(taus)


@pytest.mark.slow
def test_training_on_the_targets_own_outputs_raises_acceptance():
    target = tiny_target(seed=5, dtype=torch.float32)
    prompts = random_prompts(24, 6, seed=5)
    data = greedy_sequences(target, prompts, new_tokens=40)
    drafter = tiny_drafter(target, seed=5, block_size=8)
    before = {m: mean_tau(target, drafter.eval(), prompts[:8], m) for m in ("dflash", "ddtree")}
    settings = TrainSettings(batch_size=8, blocks_per_sequence=8, lr=3e-3, warmup_fraction=0.05, log_every=1000)
    Trainer.new(drafter, target, data, settings, Progress(schedule_steps=300), log=lambda line: None).run()
    after = {m: mean_tau(target, drafter.eval(), prompts[:8], m) for m in ("dflash", "ddtree")}
    print(f"tau before {before}, after {after}")
    assert after["dflash"] > before["dflash"] + 0.5
    assert after["ddtree"] > before["ddtree"] + 0.5


def test_a_grown_drafter_drafts_what_it_grew_from_and_then_learns_in_its_new_layers(tmp_path):
    from engine.training.train import parse_args, start

    target, _, (grown, *_) = start_from_an_export(tmp_path, "--grow-layers", "1")
    assert grown.config.num_hidden_layers == 3 and len(grown.config.layer_types) == 3
    loaded = load_drafter(tmp_path / "drafter").float()
    prompt = torch.randint(0, target.config.vocab_size, (1, 12))
    with torch.no_grad():
        hidden = target.model(input_ids=prompt, output_hidden_states=True).hidden_states
        features = loaded.context_features(hidden).float()
        embeddings = target.model.get_input_embeddings().weight.float()
        block = loaded.embed(torch.full((1, 4), loaded.mask_token_id), embeddings)
        positions, context_positions = torch.arange(12, 16)[None], torch.arange(12)[None]
        torch.testing.assert_close(grown(block, features, positions, context_positions),
                                   loaded(block, features, positions, context_positions), rtol=0, atol=0)
    new_layer = grown.layers[2]
    (grown(block, features, positions, context_positions) ** 2).sum().backward()
    assert new_layer.self_attn.o_proj.weight.grad.abs().sum() > 0
    assert new_layer.mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(SystemExit, match="--grow-layers grows a drafter given with --init-from"):
        start(parse_args(["--data", str(tmp_path), "--out", str(tmp_path / "o"), "--grow-layers", "1",
                          "--schedule-steps", "10"]), target)
