"""The training objective: per labelled slot, cross-entropy on the data token mixed with
KL(target || drafter), weighted ``exp(-(k-1)/gamma)`` by the slot's offset k.

Two implementations of one loss:

- ``block_loss``, the readable reference: the [slots, vocab] log-probabilities are built
  whole and autograd differentiates them.
- ``fused_block_loss``, what training runs. The lm_head is the target's and frozen, so the
  gradient with respect to a slot's logits has a closed form,
  ``c * (q - (1-d) onehot(label) - d p)`` (q the drafter's softmax, p the target's, d the
  distillation weight, c the slot's normalised weight); it is computed chunk by chunk in
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
    correct: torch.Tensor  # [B-1] slots whose top-1 equals the label
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


def step_metrics(loss, ce, kl, hits: torch.Tensor, valid: torch.Tensor) -> StepMetrics:
    """``hits``: top-1 correct per labelled slot, in ``valid``'s order."""
    slots = torch.zeros_like(valid)
    slots[valid] = hits
    leading = slots.long().cumprod(-1).sum(-1)  # accepted draft tokens if the block were verified greedily
    return StepMetrics(loss, ce.detach(), kl.detach(), slots.sum((0, 1)), valid.sum((0, 1)), leading.sum(),
                       valid[:, :, 0].sum())


# ---- the reference ---------------------------------------------------------------------------------

def block_loss(drafter: DFlashDrafter, target: Target, hidden: torch.Tensor, labels: torch.Tensor,
               valid: torch.Tensor, anchors: torch.Tensor, final_hidden: torch.Tensor,
               settings: TrainSettings) -> StepMetrics:
    """Weighted CE (and KL to the target) over the slots that have a label, by autograd."""
    weights = slot_weights(drafter.block_size, settings.gamma, hidden.device).expand_as(valid)[valid]
    student = torch.log_softmax(drafter.logits(hidden[valid], target.lm_head), -1, dtype=torch.float32)
    wanted = labels[valid]
    ce = -(student.gather(1, wanted[:, None]).squeeze(1) * weights).sum() / weights.sum()
    kl = torch.zeros((), device=hidden.device)
    if settings.distill_weight > 0:
        kl = (distillation_kl(target, final_hidden, anchors, valid, student) * weights).sum() / weights.sum()
    loss = (1 - settings.distill_weight) * ce + settings.distill_weight * kl
    return step_metrics(loss, ce, kl, student.detach().argmax(-1) == wanted, valid)


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


def chunk_terms(hidden: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor, teacher: torch.Tensor | None,
                lm_head: torch.Tensor, shape: LogitsShape):
    """One chunk of slots: (d loss / d hidden, sum of coef * CE, sum of coef * KL, top-1 hits)."""
    d = shape.distill_weight
    raw = F.linear(hidden.to(shape.dtype), lm_head) * shape.multiplier
    logits = (torch.tanh(raw / shape.softcap) * shape.softcap if shape.softcap else raw).float()
    normaliser = torch.logsumexp(logits, -1, keepdim=True)
    log_q = logits - normaliser
    ce = -log_q.gather(1, labels[:, None]).squeeze(1)
    hits = logits.argmax(-1) == labels
    grad = log_q.exp()
    kl = torch.zeros_like(ce)
    if d > 0:
        log_p = torch.log_softmax(F.linear(teacher.to(shape.dtype), lm_head).float(), -1)
        p = log_p.exp()
        kl = (p * (log_p - log_q)).sum(-1)
        grad = grad - d * p
    grad = grad.scatter_add(1, labels[:, None], torch.full_like(ce, d - 1)[:, None]) * coef[:, None]
    if shape.softcap:
        grad = grad * (1 - (logits / shape.softcap) ** 2)
    grad_hidden = (grad * shape.multiplier).to(shape.dtype) @ lm_head
    return grad_hidden, (coef * ce).sum(), (coef * kl).sum(), hits


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
        grads, hits = [], []
        ce = kl = hidden.new_zeros((), dtype=torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, len(hidden), rows):
                part = slice(start, start + rows)
                grad, ce_part, kl_part, hit = terms(hidden[part], labels[part], coef[part],
                                                    None if teacher is None else teacher[part], lm_head, shape)
                grads.append(grad)
                ce, kl = ce + ce_part, kl + kl_part
                hits.append(hit)
        ctx.save_for_backward(torch.cat(grads)[:total].to(hidden.dtype))
        hits = torch.cat(hits)[:total]
        ctx.mark_non_differentiable(ce, kl, hits)
        d = shape.distill_weight
        return (1 - d) * ce + d * kl, ce, kl, hits

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
                        settings.distill_weight)
    teacher = teacher_hidden(final_hidden, anchors, valid) if settings.distill_weight > 0 else None
    loss, ce, kl, hits = ClosedFormLoss.apply(hidden[valid], labels[valid], weights / weights.sum(), teacher,
                                              target.lm_head.to(dtype), shape, terms)
    return step_metrics(loss, ce, kl, hits, valid)
