"""A training run's settings: what ``engine.training.train``'s loop and ``engine.training.objective``'s
loss both read, and what a checkpoint saves so that a resumed run goes on as it began."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainSettings:
    batch_size: int = 64  # sequences per step
    blocks_per_sequence: int = 32
    max_length: int = 768  # longer sequences are cut (most prompts + a 256-token reply fit)
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_fraction: float = 0.03
    weight_decay: float = 0.01
    gamma: float = 7.0  # slot k weighs exp(-(k-1)/gamma)
    distill_weight: float = 0.5  # 0: cross-entropy on the label only; 1: KL to the target only
    labels: str = "data"  # "data": the reply's own tokens; "greedy": the target's argmax at each position
    topk_weight: float = 0.0  # weight of the top-k hinge (objective.topk_hinge); 0: off, the loss is CE and KL alone
    topk: int = 4  # a tree holds a slot's label if it is among the drafter's top k there: the hinge's k and the log's
    topk_margin: float = 1.0  # the hinge is zero once the label's logit leads the k-th other logit by this much
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 50
    save_every_minutes: float = 2.0
