"""The DFlash training objective and loop.

One step, for a batch of self-distilled sequences (prompt + the target's greedy reply):

1. The frozen target runs once over each whole sequence. Its tapped layers give the
   context features (``drafter.context_features``); its final hidden states give, if
   distilling, its own next-token distribution.
2. Up to ``blocks_per_sequence`` anchors ``a`` are drawn inside each reply. A block is
   ``[token a, mask, ..., mask]`` at positions ``a .. a+B-1``, exactly what decoding
   drafts after committing token ``a``.
3. All blocks of the batch go through the drafter in one call. Block j sees the context
   features at positions ``< a_j`` (never ``a_j`` itself: at inference the anchor token's
   features do not exist yet) and its own B slots, nothing else.
4. Slot k (1..B-1) predicts the token at position ``a + k`` (same-position labels), with
   weight ``exp(-(k-1)/gamma)``: early slots decide most of the acceptance length. The
   loss mixes cross-entropy on the label (the reply's token, or with ``--labels greedy`` the
   target's own argmax, what greedy decoding accepts) with KL to the target's distribution
   at position ``a + k - 1`` (``--distill-weight``).

The target's embedding and lm_head are shared and frozen; only the drafter learns.
Training is time-bounded (``--max-minutes``) and resumable (``--resume``), so it can be
carried over several short GPU calls; the learning-rate schedule runs on trained time
(or steps) stored in the checkpoint. The exported drafter's folder also gets ``schedule.json``
(how far the schedule got, its length): ``--init-from`` a folder with it continues that schedule
on a fresh machine, where only the folder came back.

    python -m engine.training.train --model /tmp/smol-hf --data /tmp/dflash --out /tmp/dflash/train \\
        --max-minutes 8 --schedule-minutes 11
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.models.drafter import (
    DFlashDrafter,
    DrafterConfig,
    block_inputs,
    block_visibility,
    fresh_config,
    load_drafter,
    parameter_count,
)
from engine.models.target import Target, load_target
from engine.training.data import SequenceData
from engine.training.export import export_drafter
from engine.training.generation import device_and_dtype
from engine.training.objective import StepMetrics, block_loss, chunk_terms, fused_block_loss, target_logits
from engine.training.settings import TrainSettings

STATE_FILE = "train-state.pt"
LOG_FILE = "train-log.jsonl"
EXPORT_FOLDER = "drafter"
SCHEDULE_FILE = "schedule.json"  # in the exported drafter's folder: it travels back with the weights
SCHEDULE_SHAPE = ("lr", "warmup_fraction", "min_lr_ratio")  # the settings that draw the learning-rate curve
LABEL_SOURCES = ("data", "greedy")


@dataclass
class Progress:
    """Where training stands; saved with the checkpoint, so a resumed run continues the schedule."""

    step: int = 0
    trained_seconds: float = 0.0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens: int = 0
    schedule_seconds: float | None = None  # the schedule runs on trained time ...
    schedule_steps: int | None = None  # ... or, if set, on steps (deterministic: tests)

    def fraction(self) -> float:
        if self.schedule_steps:
            return self.step / self.schedule_steps
        return self.trained_seconds / self.schedule_seconds


@dataclass
class ScheduleState:
    """How far a learning-rate schedule got, for a later session to continue it. A GPU session's machine
    starts bare and only the exported drafter comes back (the checkpoint with Adam's moments is too big),
    so without this every session would warm up and decay again from the start of its own schedule."""

    kind: str  # "minutes" (the schedule runs on trained time) or "steps"
    planned: float  # the schedule's whole length over every session, in minutes or steps
    steps: int  # trained so far, over every session
    tokens: int
    trained_minutes: float
    shape: dict  # SCHEDULE_SHAPE's settings: a continuation drawn with others is told it changes the curve

    @staticmethod
    def of(progress: Progress, settings: TrainSettings) -> ScheduleState:
        kind = "steps" if progress.schedule_steps else "minutes"
        planned = progress.schedule_steps if kind == "steps" else progress.schedule_seconds / 60
        return ScheduleState(kind, planned, progress.step, progress.tokens, progress.trained_seconds / 60,
                             {name: getattr(settings, name) for name in SCHEDULE_SHAPE})

    def progress(self, planned_minutes: float | None = None) -> Progress:
        """A new run's progress at this point of the schedule (its data from the first batch: a new session
        brings new data); ``planned_minutes`` replaces the length, e.g. for more sessions than first planned."""
        progress = Progress(step=self.steps, trained_seconds=self.trained_minutes * 60, tokens=self.tokens)
        if planned_minutes:
            progress.schedule_seconds = planned_minutes * 60
        elif self.kind == "steps":
            progress.schedule_steps = int(self.planned)
        else:
            progress.schedule_seconds = self.planned * 60
        return progress


def learning_rate(settings: TrainSettings, fraction: float) -> float:
    """Linear warmup, then cosine decay to ``lr * min_lr_ratio`` at fraction 1."""
    if fraction < settings.warmup_fraction:
        return settings.lr * max(fraction / settings.warmup_fraction, 0.01)
    t = min(1.0, (fraction - settings.warmup_fraction) / (1 - settings.warmup_fraction))
    return settings.lr * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ---- batches ---------------------------------------------------------------------------------

@dataclass
class Batch:
    ids: torch.Tensor  # [b, S], padded past each length
    lengths: torch.Tensor  # [b]
    response_starts: torch.Tensor  # [b]


def usable_sequences(data: SequenceData, max_length: int) -> torch.Tensor:
    """Indices of sequences with at least one anchor and its label inside ``max_length``."""
    return torch.nonzero(data.response_starts.cpu() + 2 <= data.lengths.cpu().clamp(max=max_length)).flatten()


def epoch_batches(usable: torch.Tensor, lengths: torch.Tensor, batch_size: int, epoch: int,
                  seed: int) -> list[torch.Tensor]:
    """A seeded shuffle cut into batches of similar lengths (less padding), in random order."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    shuffled = usable[torch.randperm(len(usable), generator=generator)]
    batches = []
    for group in shuffled.split(batch_size * 32):
        batches += list(group[torch.argsort(lengths[group], stable=True)].split(batch_size))
    return [batches[i] for i in torch.randperm(len(batches), generator=generator)]


def make_batch(data: SequenceData, indices: torch.Tensor, max_length: int, pad_id: int, multiple: int = 64) -> Batch:
    """Sequences cut to ``max_length`` and right-padded to a multiple of ``multiple`` (few distinct shapes)."""
    indices = indices.to(data.lengths.device)
    lengths = data.lengths[indices].clamp(max=max_length)
    width = min(max_length, -(-int(lengths.max()) // multiple) * multiple)
    positions = torch.arange(width, device=lengths.device)
    inside = positions < lengths[:, None]
    flat = (data.offsets[indices, None] + positions).clamp(max=len(data.tokens) - 1)
    ids = torch.where(inside, data.tokens[flat], pad_id)
    return Batch(ids, lengths, data.response_starts[indices])


# ---- the objective -------------------------------------------------------------------------------

@dataclass
class Blocks:
    anchors: torch.Tensor  # [b, n]: position of each block's first token
    valid: torch.Tensor  # [b, n]: False for filler blocks of sequences with fewer reply positions than n


def sample_anchors(batch: Batch, count: int, generator: torch.Generator) -> Blocks:
    """Distinct random anchors ``a`` with ``response_start <= a`` and ``a + 1 < length``:
    at inference the first block starts at the first reply token (prefill produced it),
    and a block needs at least one label."""
    b, width = batch.ids.shape
    positions = torch.arange(width, device=batch.ids.device)
    allowed = (positions >= batch.response_starts[:, None]) & (positions + 1 < batch.lengths[:, None])
    scores = torch.rand(b, width, generator=generator, device=batch.ids.device)
    top, anchors = torch.where(allowed, scores, -1.0).topk(min(count, width), dim=1)
    valid = top >= 0
    return Blocks(torch.where(valid, anchors, 0), valid)


def block_labels(label_ids: torch.Tensor, lengths: torch.Tensor, blocks: Blocks,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot k of a block at ``a`` predicts the token at ``a + k`` of ``label_ids`` (the batch's
    ids or ``greedy_tokens``): labels and validity ``[b, n, B-1]``."""
    b, n = blocks.anchors.shape
    positions = blocks.anchors[:, :, None] + torch.arange(1, block_size, device=label_ids.device)
    valid = (positions < lengths[:, None, None]) & blocks.valid[:, :, None]
    labels = label_ids.gather(1, positions.clamp(max=label_ids.shape[1] - 1).view(b, -1)).view(b, n, -1)
    return labels, valid


@torch.no_grad()
def target_pass(target: Target, drafter: DFlashDrafter, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Context features ``[b, S, taps*H]`` and the final (normed) hidden states ``[b, S, H]``.
    Right padding needs no attention mask: causal attention keeps it out of real positions."""
    out = target.model.base_model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return drafter.context_features(out.hidden_states), out.last_hidden_state


@torch.no_grad()
def greedy_tokens(target: Target, final_hidden: torch.Tensor, ids: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """``ids`` with every token after the first replaced by the target's greedy choice there (its
    argmax one position earlier): what greedy decoding accepts, where a sampled reply's token is
    one draw. Chunked: a whole batch's logits would be [b*S, vocab]."""
    flat = final_hidden[:, :-1].reshape(-1, final_hidden.shape[-1])
    choices = torch.cat([target_logits(target, part).argmax(-1) for part in flat.split(rows)])
    return torch.cat([ids[:, :1], choices.view(len(ids), -1).to(ids.dtype)], dim=1)


def draft_hidden(drafter: DFlashDrafter, target: Target, ids: torch.Tensor, anchors: torch.Tensor,
                 features: torch.Tensor) -> torch.Tensor:
    """The drafter's final hidden states for slots 1..B-1 of every block: ``[b, n, B-1, H]``."""
    b, width = ids.shape
    block_size = drafter.block_size
    dtype = next(drafter.parameters()).dtype
    tokens, positions = block_inputs(ids, anchors, block_size, drafter.mask_token_id)
    hidden = drafter(
        drafter.embed(tokens, target.embedding).to(dtype),
        features.to(dtype),
        block_positions=positions,
        context_positions=torch.arange(width, device=ids.device).expand(b, width),
        mask=block_visibility(anchors, width, block_size),
    )
    return hidden.view(b, anchors.shape[1], block_size, -1)[:, :, 1:]


def train_step(drafter, target, batch: Batch, settings: TrainSettings, optimizer, generator,
               loss: Callable) -> StepMetrics:
    features, final_hidden = target_pass(target, drafter, batch.ids)
    blocks = sample_anchors(batch, settings.blocks_per_sequence, generator)
    label_ids = greedy_tokens(target, final_hidden, batch.ids) if settings.labels == "greedy" else batch.ids
    labels, valid = block_labels(label_ids, batch.lengths, blocks, drafter.block_size)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if batch.ids.is_cuda else nullcontext()
    with autocast:
        hidden = draft_hidden(drafter, target, batch.ids, blocks.anchors, features)
        metrics = loss(drafter, target, hidden, labels, valid, blocks.anchors, final_hidden, settings)
    optimizer.zero_grad(set_to_none=True)
    metrics.loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), settings.grad_clip)
    optimizer.step()
    return metrics


# ---- the loop ------------------------------------------------------------------------------------

@dataclass
class LogWindow:
    """Metrics summed since the last log line."""

    steps: int = 0
    tokens: int = 0
    began: float = field(default_factory=time.monotonic)
    sums: dict = field(default_factory=dict)

    def add(self, metrics: StepMetrics, tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens
        for name, value in vars(metrics).items():
            value = value.detach()
            self.sums[name] = self.sums[name] + value if name in self.sums else value

    def line(self, progress: Progress, lr: float) -> dict:
        sums = {name: value.float().cpu() for name, value in self.sums.items()}
        seconds = time.monotonic() - self.began
        return {
            "step": progress.step, "epoch": progress.epoch, "minutes": round(progress.trained_seconds / 60, 2),
            "lr": lr, "loss": float(sums["loss"]) / self.steps, "ce": float(sums["ce"]) / self.steps,
            "kl": float(sums["kl"]) / self.steps, "hinge": float(sums["hinge"]) / self.steps,
            "tau_chain": 1 + float(sums["accepted"] / sums["blocks"].clamp(min=1)),
            "slot_accuracy": [round(float(a), 3) for a in sums["correct"] / sums["counted"].clamp(min=1)],
            "slot_topk_accuracy": [round(float(a), 3) for a in sums["correct_topk"] / sums["counted"].clamp(min=1)],
            "tokens_per_s": self.tokens / seconds, "steps_per_s": self.steps / seconds,
            "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
        }


def format_line(line: dict) -> str:
    accuracy, topk = (" ".join(f"{100 * a:.0f}" for a in line[name])
                      for name in ("slot_accuracy", "slot_topk_accuracy"))
    hinge = f" hinge {line['hinge']:.3f}" if line["hinge"] else ""  # only where the term is on
    return (f"step {line['step']:6d} | {line['minutes']:6.2f} min | lr {line['lr']:.2e} | loss {line['loss']:.3f} "
            f"(ce {line['ce']:.3f} kl {line['kl']:.3f}{hinge}) | tau~ {line['tau_chain']:.2f} | acc% {accuracy} | "
            f"top-k% {topk} | {line['tokens_per_s'] / 1000:.0f}k tok/s {line['steps_per_s']:.1f} it/s | "
            f"peak {line['peak_gb']:.0f} GB")


@dataclass
class Trainer:
    """A drafter being trained against a frozen target on one data set."""

    drafter: DFlashDrafter
    target: Target
    data: SequenceData
    settings: TrainSettings
    progress: Progress
    optimizer: torch.optim.Optimizer
    log: Callable[[str], None] = print
    log_path: Path | None = None
    loss: Callable = fused_block_loss  # one of loss_implementations(): the same loss and gradients

    @staticmethod
    def new(drafter, target, data, settings: TrainSettings, progress: Progress, **kwargs) -> Trainer:
        target.model.requires_grad_(False)
        drafter.train()
        decay = [p for p in drafter.parameters() if p.ndim >= 2]  # no weight decay on norms
        rest = [p for p in drafter.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=settings.lr, betas=(0.9, 0.95), fused=target.device.type == "cuda")
        return Trainer(drafter, target, data.to(target.device), settings, progress, optimizer, **kwargs)

    def run(self, max_seconds: float = math.inf, max_steps: int | None = None, on_save=None) -> Progress:
        """Train until the schedule ends, ``max_seconds`` pass or ``max_steps`` steps are done;
        ``on_save`` runs every ``save_every_minutes`` and is the caller's way to checkpoint."""
        settings, progress = self.settings, self.progress
        pad_id = self.target.stop_ids[0]  # any id: padding is never a label nor visible context
        generator = torch.Generator(self.target.device)
        usable = usable_sequences(self.data, settings.max_length)
        if len(usable) == 0:
            raise ValueError(f"none of the {len(self.data)} sequences has a reply token within max_length "
                             f"{settings.max_length}: nothing to train on")
        lengths = self.data.lengths.cpu()
        batches = epoch_batches(usable, lengths, settings.batch_size, progress.epoch, settings.seed)
        began = last = last_save = time.monotonic()
        window, lr, last_step = LogWindow(), settings.lr, progress.step + (max_steps or math.inf)
        while progress.fraction() < 1 and last - began < max_seconds and progress.step < last_step:
            if progress.batch_in_epoch >= len(batches):
                progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
                batches = epoch_batches(usable, lengths, settings.batch_size, progress.epoch, settings.seed)
            batch = make_batch(self.data, batches[progress.batch_in_epoch], settings.max_length, pad_id)
            lr = learning_rate(settings, progress.fraction())
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            generator.manual_seed(settings.seed * 1_000_003 + progress.step)  # anchors depend on the step alone
            metrics = train_step(self.drafter, self.target, batch, settings, self.optimizer, generator, self.loss)
            tokens = int(batch.lengths.sum())
            window.add(metrics, tokens)
            now = time.monotonic()
            progress.step, progress.batch_in_epoch = progress.step + 1, progress.batch_in_epoch + 1
            progress.tokens += tokens
            progress.trained_seconds += now - last
            last = now
            if progress.step % settings.log_every == 0:
                self.report(window, lr)
                window = LogWindow()
            if on_save is not None and now - last_save > settings.save_every_minutes * 60:
                on_save(self)
                last = last_save = time.monotonic()  # saving is not training time
        if window.steps:
            self.report(window, lr)
        return progress

    def report(self, window: LogWindow, lr: float) -> None:
        line = window.line(self.progress, lr)
        self.log(format_line(line))
        if self.log_path is not None:
            with self.log_path.open("a") as f:
                f.write(json.dumps(line) + "\n")


LOSSES = ("reference", "fused", "compiled")


def loss_implementations() -> dict[str, Callable]:
    """One loss, three ways (``objective``; the tests check they agree), by the names in ``LOSSES``:
    which is fastest depends on the machine. Compilation waits for the first call."""
    compiled = functools.partial(fused_block_loss, terms=torch.compile(chunk_terms, dynamic=False))
    return dict(zip(LOSSES, (block_loss, fused_block_loss, compiled)))


def choose_loss(trainer: Trainer, names: list[str], steps: int = 2, rounds: int = 3) -> str:
    """Time each implementation on ``rounds`` turns of ``steps`` steps, the turns interleaved (batch
    sizes and a GPU still settling after the data stage drift between consecutive steps, and would
    otherwise favour whichever ran last), after one warm-up step each (compilation, allocation); keep
    the one with the lowest median for the rest of the run. All are ordinary training steps."""
    implementations, turns = loss_implementations(), {}
    sync = torch.cuda.synchronize if trainer.target.device.type == "cuda" else (lambda: None)

    def timed(name: str, count: int) -> float:
        trainer.loss = implementations[name]
        sync()
        began = time.monotonic()
        trainer.run(max_steps=count)
        sync()
        return (time.monotonic() - began) / count

    for name in names:
        try:
            timed(name, 1)
        except Exception as error:  # e.g. a compiler this machine lacks: the others remain
            trainer.log(f"train: loss '{name}' failed and is left out: {type(error).__name__}: {error}")
            continue
        turns[name] = []
    if not turns:
        raise RuntimeError(f"every loss implementation failed ({', '.join(names)})")
    for _ in range(rounds):
        for name in turns:
            turns[name].append(timed(name, steps))
    seconds = {name: statistics.median(times) for name, times in turns.items()}
    best = min(seconds, key=seconds.get)
    trainer.loss = implementations[best]
    trainer.log("train: seconds per step by loss implementation (median of "
                f"{rounds} interleaved turns of {steps}): "
                + ", ".join(f"{name} {s:.3f}" for name, s in seconds.items()) + f"; training on with '{best}'")
    return best


def profiled_steps(trainer: Trainer, steps: int, rows: int = 25) -> str:
    """Train ``steps`` steps (after two unprofiled ones that warm the allocator and kernels up)
    under torch.profiler; the operators that took the most device time, as a table."""
    from torch.profiler import ProfilerActivity, profile

    trainer.run(max_steps=2)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.target.device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        trainer.run(max_steps=steps)
        if trainer.target.device.type == "cuda":
            torch.cuda.synchronize()
    sort_by = "self_cuda_time_total" if trainer.target.device.type == "cuda" else "self_cpu_time_total"
    return f"train: profile of {steps} steps\n" + profiler.key_averages().table(sort_by=sort_by, row_limit=rows)


# ---- checkpoints ---------------------------------------------------------------------------------

def save_state(trainer: Trainer, path: Path) -> None:
    """Everything a resumed run needs; written to a temporary name first, so a kill mid-write
    leaves the previous checkpoint intact."""
    state = {
        "drafter_config": trainer.drafter.config.to_json(),
        "drafter": trainer.drafter.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "progress": asdict(trainer.progress),
        "settings": asdict(trainer.settings),
    }
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    partial.replace(path)


def load_state(path: Path, device) -> dict:
    state = torch.load(path, map_location=device, weights_only=False)
    state["drafter_config"] = DrafterConfig.from_json(state["drafter_config"])
    state["progress"] = Progress(**state["progress"])
    state["settings"] = TrainSettings(**state["settings"])
    return state


def save_outputs(trainer: Trainer, out: Path, shard_mb: float | None) -> None:
    """The resumable state, the exported (bf16, sharded) drafter and, in its folder, the schedule's state."""
    save_state(trainer, out / STATE_FILE)
    progress = trainer.progress
    extra = {"training": {"steps": progress.step, "tokens": progress.tokens,
                          "minutes": round(progress.trained_seconds / 60, 2),
                          "distill_weight": trainer.settings.distill_weight, "labels": trainer.settings.labels,
                          "blocks_per_sequence": trainer.settings.blocks_per_sequence}}
    export_drafter(trainer.drafter, out / EXPORT_FOLDER, shard_mb=shard_mb, extra=extra)
    schedule = ScheduleState.of(progress, trainer.settings)
    (out / EXPORT_FOLDER / SCHEDULE_FILE).write_text(json.dumps(asdict(schedule), indent=1) + "\n")


def read_schedule(folder: Path) -> ScheduleState | None:
    """The schedule an exported drafter's folder continues, if its ``SCHEDULE_FILE`` came with it."""
    path = folder / SCHEDULE_FILE
    return ScheduleState(**json.loads(path.read_text())) if path.is_file() else None


# ---- command line ----------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target: HF folder, GGUF, or nothing for the bundled SmolLM2")
    parser.add_argument("--data", required=True, type=Path, help="folder with responses-*.pt (engine.training.data)")
    parser.add_argument("--out", required=True, type=Path, help=f"gets {STATE_FILE}, {EXPORT_FOLDER}/, {LOG_FILE}")
    parser.add_argument("--resume", type=Path, help=f"a {STATE_FILE} to continue (its settings are kept)")
    parser.add_argument("--init-from", type=Path,
                        help="an exported drafter folder to start from (a new optimizer): how training carries over "
                             f"GPU sessions, whose checkpoints must come back small; with its {SCHEDULE_FILE} the "
                             "learning-rate schedule goes on where it stopped, without it a new one starts")
    parser.add_argument("--grow-layers", type=int, default=0,
                        help="with --init-from: append this many layers whose outputs start at zero (the drafts "
                             "are unchanged at the first step; training grows the drafter from there)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="target dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--num-layers", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-taps", type=int, default=5)
    parser.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None)
    parser.add_argument("--mask-token-id", type=int, default=16, help="SmolLM2's <empty_output>, never in chat text")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop this run (cleanly) after this long")
    parser.add_argument("--schedule-minutes", type=float, default=None,
                        help="lr schedule length in trained minutes over all runs (default: --max-minutes; "
                             "a resumed run keeps its own unless this is given)")
    parser.add_argument("--schedule-steps", type=int, default=None, help="schedule on steps instead of time")
    parser.add_argument("--planned-minutes", type=float, default=None,
                        help="the schedule's whole length in trained minutes over every session that continues it "
                             f"(--init-from a folder with {SCHEDULE_FILE}): a continued schedule keeps its own "
                             "length unless this is given (engine.training.run's --schedule-minutes is one call's "
                             "plan); it also replaces --schedule-minutes")
    parser.add_argument("--shard-mb", type=float, default=15.0, help="max MiB per weight file; 0: one file")
    parser.add_argument("--loss", choices=["auto", *LOSSES], default="auto",
                        help="how the loss is computed (the same loss and gradients); auto: train a few steps "
                             "with each and keep the fastest")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="first train this many steps under torch.profiler and print where their time went "
                             "(they are ordinary training steps; the table goes to the log)")
    for name, value in asdict(TrainSettings()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value,
                            choices=LABEL_SOURCES if name == "labels" else None)
    return parser.parse_args(argv)


def start(args, target: Target) -> tuple[DFlashDrafter, TrainSettings, Progress, dict | None]:
    """A fresh drafter and settings, or the ones in ``--resume``."""
    if args.resume:
        state = load_state(args.resume, target.device)
        drafter = DFlashDrafter(state["drafter_config"]).to(target.device)
        drafter.load_state_dict(state["drafter"])
        progress, settings = state["progress"], state["settings"]
        minutes = args.planned_minutes or args.schedule_minutes
        if minutes:
            progress.schedule_seconds, progress.schedule_steps = minutes * 60, None
        return drafter, settings, progress, state["optimizer"]
    settings = TrainSettings(**{name: getattr(args, name) for name in asdict(TrainSettings())})
    if args.grow_layers and not args.init_from:
        raise SystemExit("--grow-layers grows a drafter given with --init-from (a fresh one takes --num-layers)")
    if args.init_from:
        drafter = load_drafter(args.init_from).float().to(target.device)
        drafter.config.acceptance = {}  # measured on the weights training starts from, not on what it makes of them
        if args.grow_layers:
            drafter = drafter.with_extra_layers(args.grow_layers, settings.seed)
    else:
        config = fresh_config(target.config, num_layers=args.num_layers, mask_token_id=args.mask_token_id,
                              block_size=args.block_size, num_taps=args.num_taps,
                              target_layer_ids=args.target_layer_ids)
        drafter = DFlashDrafter(config).initialize(settings.seed).to(target.device)
    schedule = read_schedule(args.init_from) if args.init_from else None
    progress = new_progress(args) if schedule is None else continued_progress(schedule, args, settings)
    return drafter, settings, progress, None


def new_progress(args) -> Progress:
    schedule_minutes = args.planned_minutes or args.schedule_minutes or args.max_minutes
    if not (args.schedule_steps or schedule_minutes):
        raise SystemExit("give --max-minutes, --schedule-minutes or --schedule-steps: the schedule needs a length")
    return Progress(schedule_seconds=schedule_minutes * 60 if schedule_minutes else None,
                    schedule_steps=args.schedule_steps)


def continued_progress(schedule: ScheduleState, args, settings: TrainSettings) -> Progress:
    """The progress of ``--init-from``'s schedule, at the point it reached: a warmup done is not repeated."""
    progress = schedule.progress(args.planned_minutes)
    if progress.fraction() >= 1:
        raise SystemExit(f"the schedule in {args.init_from / SCHEDULE_FILE} is complete ({schedule.steps} steps, "
                         f"{schedule.trained_minutes:.1f} trained minutes of {schedule.planned:g} {schedule.kind}): "
                         "give a longer --planned-minutes, or leave the file out to start a new schedule")
    shape = {name: getattr(settings, name) for name in SCHEDULE_SHAPE}
    if shape != schedule.shape:
        print(f"train: the continued schedule was drawn with {schedule.shape}, this run with {shape}: "
              "its learning rate jumps", flush=True)
    return progress


def main(argv=None) -> None:
    args = parse_args(argv)
    began = time.monotonic()
    target = load_target(args.model, *device_and_dtype(args.device, args.dtype))
    data = SequenceData.load(args.data)
    drafter, settings, progress, optimizer_state = start(args, target)
    args.out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer.new(drafter, target, data, settings, progress, log_path=args.out / LOG_FILE)
    if optimizer_state is not None:
        trainer.optimizer.load_state_dict(optimizer_state)
    config = drafter.config
    origin = "fresh"
    if args.resume:
        origin = f"resuming at step {progress.step}"
    elif args.init_from:
        origin = f"from {args.init_from}" + (f", its schedule continued at step {progress.step}"
                                             if progress.step else "")
    print(f"train: {len(data)} sequences, {int(data.lengths.sum())} tokens; "
          f"drafter {parameter_count(drafter) / 1e6:.2f}M params, {config.num_hidden_layers} layers, "
          f"taps {config.target_layer_ids}; {origin}; "
          f"schedule {progress.fraction():.0%} done; {json.dumps(asdict(settings))}", flush=True)
    shard_mb = args.shard_mb or None
    if args.loss == "auto":
        choose_loss(trainer, list(LOSSES))
    else:
        trainer.loss = loss_implementations()[args.loss]
    if args.profile_steps:
        print(profiled_steps(trainer, args.profile_steps), flush=True)
    # time already spent loading (and choosing the loss) counts against this run's budget
    max_seconds = args.max_minutes * 60 - (time.monotonic() - began) if args.max_minutes else math.inf
    trainer.run(max_seconds, on_save=lambda t: save_state(t, args.out / STATE_FILE))
    save_outputs(trainer, args.out, shard_mb)
    print(f"train: saved step {progress.step} ({progress.fraction():.0%} of the schedule) to {args.out}", flush=True)


if __name__ == "__main__":
    main()
