"""The training objective: per labelled slot, cross-entropy on the data token mixed with
KL(target || drafter), plus (``--topk-weight``, off by default) a hinge that asks for the label
among the drafter's top k (``topk_hinge``), weighted ``exp(-(k-1)/gamma)`` by the slot's offset k.

Two implementations of one loss:

- ``block_loss``, the readable reference: the [slots, vocab] log-probabilities are built
  whole and autograd differentiates them.
- ``fused_block_loss``, what training runs. The lm_head is the target's and frozen, so the
  gradient with respect to a slot's logits has a closed form,
  ``c * (q - (1-d) onehot(label) - d p + w a (onehot(rival) - onehot(label)))`` (q the drafter's
  softmax, p the target's, d the distillation weight, c the slot's normalised weight, w the
  hinge's weight, a 1 where the hinge is positive, rival the k-th largest logit other than the
  label's); it is computed chunk by chunk in
  the forward pass and only the [slots, hidden] gradient is kept for backward: on a GPU the
  reference's vocabulary-sized elementwise work (casts, softmaxes, their backward) is most of
  the training step when profiled.

``tests/test_training.py`` checks the two against each other: loss, metrics and gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.drafter import DFlashDrafter
from engine.models.target import Target
from engine.training.settings import TrainSettings

CHUNK_ROWS = 2048  # slots per chunk of the fused loss: [2048, 49k] float32 is 0.4 GB


@dataclass
class StepMetrics:
    """Sums over a step (tensors, so logging does not synchronise every step)."""

    loss: torch.Tensor
    ce: torch.Tensor
    kl: torch.Tensor
    hinge: torch.Tensor  # the top-k hinge (0 while its weight is 0: not computed)
    correct: torch.Tensor  # [B-1] slots whose top-1 equals the label
    correct_topk: torch.Tensor  # [B-1] slots whose label is among the top k (settings.topk)
    counted: torch.Tensor  # [B-1] slots with a label
    accepted: torch.Tensor  # total leading correct slots over blocks: tau - 1 if drafts were chains
    blocks: torch.Tensor


def slot_weights(block_size: int, gamma: float, device) -> torch.Tensor:
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def target_logits(target: Target, final_hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits from its final hidden states, only where they are needed."""
    return target.model.get_output_embeddings()(final_hidden)


def teacher_hidden(final_hidden: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The target's final hidden state that predicts each labelled slot: the token at ``a + k``
    is the target's output at position ``a + k - 1``. ``[labelled slots, H]``"""
    source = anchors[:, :, None] + torch.arange(valid.shape[-1], device=anchors.device)
    rows = torch.arange(len(anchors), device=anchors.device)[:, None, None].expand_as(source)
    return final_hidden[rows[valid], source[valid]]


def total_loss(ce, kl, hinge, distill_weight: float, topk_weight: float):
    """The mix both implementations minimise (each term already a weighted mean over slots)."""
    return (1 - distill_weight) * ce + distill_weight * kl + topk_weight * hinge


def kth_other(logits: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the k-th largest logit other than the label's, and its index: the label is among the
    row's top k when its logit is above this one, and out of it when below."""
    others = logits.scatter(1, labels[:, None], -torch.inf)
    values, indices = others.topk(k, dim=-1)
    return values[:, -1], indices[:, -1]


def topk_hinge(logits: torch.Tensor, labels: torch.Tensor, k: int, margin: float):
    """``relu(margin - (z_label - z_rival))`` per row, z_rival the k-th largest other logit; and the rival's index.

    A DDTree tree verifies several drafted tokens per depth, so a slot is accepted when the target's
    token is among the drafter's top few there, not only its first; cross-entropy and KL spend their
    gradient on the whole distribution, this term only where the label's rank decides that. It is
    the top-k hinge loss of top-k classification (Lapin et al., 2015; Berrada et al., 2018), in its
    plain, non-smoothed form: zero exactly when the label leads every other logit but k-1 by the
    margin, so a label the tree holds with room to spare costs nothing, and at least ``margin``
    whenever the label falls outside the top k (divided by the margin it bounds the top-k error from
    above; at k = 1 it is the multiclass hinge). On logits the normaliser cancels: the margin is
    a log-probability ratio, the label at least ``e**margin`` times as likely as its rival. Its
    gradient is two entries per slot (down on the rival, up on the label), which keeps the fused
    loss's closed form a scatter; a smoothed top-k loss (Berrada et al., 2018) would need sums over
    k-subsets of a 49k vocabulary. It is not convex alone; it is added to CE and KL, which shape the
    rest of the distribution."""
    rival, index = kth_other(logits, labels, k)
    return torch.relu(margin - (logits.gather(1, labels[:, None]).squeeze(1) - rival)), index


def within_top_k(logits: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """Whether each row's label is among its k largest logits (fewer than k logits above it)."""
    return (logits > logits.gather(1, labels[:, None])).sum(-1) < k


def per_slot(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Values of the labelled slots (in ``valid``'s order) laid out as ``valid``, False elsewhere."""
    slots = torch.zeros_like(valid)
    slots[valid] = values
    return slots


def step_metrics(loss, ce, kl, hinge, hits: torch.Tensor, topk_hits: torch.Tensor,
                 valid: torch.Tensor) -> StepMetrics:
    """``hits``, ``topk_hits``: label = top-1, label within the top k, per labelled slot in ``valid``'s order."""
    slots = per_slot(hits, valid)
    leading = slots.long().cumprod(-1).sum(-1)  # accepted draft tokens if the block were verified greedily
    return StepMetrics(loss, ce.detach(), kl.detach(), hinge.detach(), slots.sum((0, 1)),
                       per_slot(topk_hits, valid).sum((0, 1)), valid.sum((0, 1)), leading.sum(), valid[:, :, 0].sum())


# ---- the reference ---------------------------------------------------------------------------------

def block_loss(drafter: DFlashDrafter, target: Target, hidden: torch.Tensor, labels: torch.Tensor,
               valid: torch.Tensor, anchors: torch.Tensor, final_hidden: torch.Tensor,
               settings: TrainSettings) -> StepMetrics:
    """Weighted CE (KL to the target, the top-k hinge) over the slots that have a label, by autograd."""
    weights = slot_weights(drafter.block_size, settings.gamma, hidden.device).expand_as(valid)[valid]
    logits = drafter.logits(hidden[valid], target.lm_head).float()  # the fused loss's float32 logits
    student = torch.log_softmax(logits, -1)
    wanted = labels[valid]
    ce = -(student.gather(1, wanted[:, None]).squeeze(1) * weights).sum() / weights.sum()
    kl = hinge = torch.zeros((), device=hidden.device)
    if settings.distill_weight > 0:
        kl = (distillation_kl(target, final_hidden, anchors, valid, student) * weights).sum() / weights.sum()
    if settings.topk_weight > 0:
        slot_hinge, _ = topk_hinge(logits, wanted, settings.topk, settings.topk_margin)
        hinge = (slot_hinge * weights).sum() / weights.sum()
    loss = total_loss(ce, kl, hinge, settings.distill_weight, settings.topk_weight)
    return step_metrics(loss, ce, kl, hinge, student.detach().argmax(-1) == wanted,
                        within_top_k(logits.detach(), wanted, settings.topk), valid)


def distillation_kl(target: Target, final_hidden: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                    student: torch.Tensor) -> torch.Tensor:
    """KL(target || drafter) per labelled slot."""
    with torch.no_grad():
        logits = target_logits(target, teacher_hidden(final_hidden, anchors, valid))
        teacher = torch.log_softmax(logits, -1, dtype=student.dtype)
        teacher_probs = teacher.exp()
        negative_entropy = torch.linalg.vecdot(teacher_probs, teacher)
        del logits, teacher
    # sum_v p(v) log q(v), in float32 (autocast would round 49k log-probabilities to bf16); a
    # multiply-and-sum, not a batched matrix product: on the H200 cuBLAS ran that [1, 49k] x [49k, 1]
    # product per slot as its slowest kernel, a quarter of the whole training step (profiled)
    with torch.autocast(student.device.type, enabled=False):
        cross = torch.linalg.vecdot(teacher_probs, student)
    return negative_entropy - cross


# ---- the fused loss ------------------------------------------------------------------------------

@dataclass(frozen=True)
class LogitsShape:
    """How the drafter turns a hidden state into logits, and the loss's mix."""

    dtype: torch.dtype  # the logits' matmul (bf16 under autocast, as the reference's)
    multiplier: float
    softcap: float | None
    distill_weight: float
    topk_weight: float
    topk: int
    topk_margin: float


def chunk_terms(hidden: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor, teacher: torch.Tensor | None,
                lm_head: torch.Tensor, shape: LogitsShape):
    """One chunk of slots: (d loss / d hidden, sums of coef * CE, coef * KL and coef * hinge, top-1 hits,
    top-k hits)."""
    d, w = shape.distill_weight, shape.topk_weight
    raw = F.linear(hidden.to(shape.dtype), lm_head) * shape.multiplier
    logits = (torch.tanh(raw / shape.softcap) * shape.softcap if shape.softcap else raw).float()
    normaliser = torch.logsumexp(logits, -1, keepdim=True)
    log_q = logits - normaliser
    ce = -log_q.gather(1, labels[:, None]).squeeze(1)
    hits = logits.argmax(-1) == labels
    topk_hits = within_top_k(logits, labels, shape.topk)
    grad = log_q.exp()
    kl = hinge = torch.zeros_like(ce)
    if d > 0:
        log_p = torch.log_softmax(F.linear(teacher.to(shape.dtype), lm_head).float(), -1)
        p = log_p.exp()
        kl = (p * (log_p - log_q)).sum(-1)
        grad = grad - d * p
    label_grad = torch.full_like(ce, d - 1)
    if w > 0:
        hinge, rival = topk_hinge(logits, labels, shape.topk, shape.topk_margin)
        push = w * (hinge > 0).float()  # relu's derivative, as autograd takes it: 0 at the kink
        grad = grad.scatter_add(1, rival[:, None], push[:, None])
        label_grad = label_grad - push
    grad = grad.scatter_add(1, labels[:, None], label_grad[:, None]) * coef[:, None]
    if shape.softcap:
        grad = grad * (1 - (logits / shape.softcap) ** 2)
    grad_hidden = (grad * shape.multiplier).to(shape.dtype) @ lm_head
    return grad_hidden, (coef * ce).sum(), (coef * kl).sum(), (coef * hinge).sum(), hits, topk_hits


class ClosedFormLoss(torch.autograd.Function):
    """The loss of ``chunk_terms`` over all slots; its backward scales the gradient kept from forward."""

    @staticmethod
    def forward(ctx, hidden, labels, coef, teacher, lm_head, shape: LogitsShape, terms):
        total = len(hidden)
        rows = min(CHUNK_ROWS, total)
        padding = -total % rows  # the last chunk is padded (weight 0): every chunk has one shape, one compilation
        if padding:
            hidden, labels, coef = (F.pad(hidden, (0, 0, 0, padding)), F.pad(labels, (0, padding)),
                                    F.pad(coef, (0, padding)))
            teacher = None if teacher is None else F.pad(teacher, (0, 0, 0, padding))
        grads, hits, topk_hits = [], [], []
        ce = kl = hinge = hidden.new_zeros((), dtype=torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, len(hidden), rows):
                part = slice(start, start + rows)
                grad, ce_part, kl_part, hinge_part, hit, topk_hit = terms(
                    hidden[part], labels[part], coef[part], None if teacher is None else teacher[part], lm_head,
                    shape)
                grads.append(grad)
                ce, kl, hinge = ce + ce_part, kl + kl_part, hinge + hinge_part
                hits.append(hit)
                topk_hits.append(topk_hit)
        ctx.save_for_backward(torch.cat(grads)[:total].to(hidden.dtype))
        hits, topk_hits = torch.cat(hits)[:total], torch.cat(topk_hits)[:total]
        ctx.mark_non_differentiable(ce, kl, hinge, hits, topk_hits)
        return total_loss(ce, kl, hinge, shape.distill_weight, shape.topk_weight), ce, kl, hinge, hits, topk_hits

    @staticmethod
    def backward(ctx, grad_loss, *_):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None, None, None


def fused_block_loss(drafter: DFlashDrafter, target: Target, hidden: torch.Tensor, labels: torch.Tensor,
                     valid: torch.Tensor, anchors: torch.Tensor, final_hidden: torch.Tensor,
                     settings: TrainSettings, terms=chunk_terms) -> StepMetrics:
    """``block_loss``'s loss, metrics and gradients, without vocabulary-sized autograd state.
    ``terms``: ``chunk_terms`` or a compiled copy of it."""
    weights = slot_weights(drafter.block_size, settings.gamma, hidden.device).expand_as(valid)[valid]
    autocast = torch.is_autocast_enabled(hidden.device.type)
    dtype = torch.get_autocast_dtype(hidden.device.type) if autocast else hidden.dtype
    shape = LogitsShape(dtype, drafter.config.output_multiplier, drafter.config.final_logit_softcapping,
                        settings.distill_weight, settings.topk_weight, settings.topk, settings.topk_margin)
    teacher = teacher_hidden(final_hidden, anchors, valid) if settings.distill_weight > 0 else None
    loss, ce, kl, hinge, hits, topk_hits = ClosedFormLoss.apply(
        hidden[valid], labels[valid], weights / weights.sum(), teacher, target.lm_head.to(dtype), shape, terms)
    return step_metrics(loss, ce, kl, hinge, hits, topk_hits, valid)
