"""The drafter doctor: why acceptance is low, and what to fix (``python -m engine.tools.doctor``, the app's
Doctor tab).

Three kinds of evidence, in one ``DoctorReport``:

- static checks of the two configs and the tokenizer (``engine.measure.doctor_checks``);
- the acceptance probe: every prompt's greedy output teacher-forced through the target once, then the
  drafter's block at every root of the output scored in batched passes (many blocks a pass, each seeing
  only its own context, as ``engine.models.drafter.block_visibility`` lays them out): acceptance per draft
  position given an accepted prefix, the first slot against the target's own confidence, calibration, and
  DFlash / DDTree τ replayed along the output (``engine.measure.acceptance``);
- the miswiring probes: the same blocks fed as a miswired engine would feed them (target layer ids shifted,
  sliding-window layers as full attention and back, the last layer read before the final norm, vLLM's own
  wiring). A wiring far better than the configured one names the fault; a deployment's wiring far worse
  than the configured one names what that deployment gets wrong.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import torch

from engine.errors import EngineError
from engine.loop.decode import Decoder
from engine.loop.settings import MAX_NEW_TOKENS, DecodeSettings
from engine.measure.acceptance import CONFIDENCE_EDGES, Proposals, replay
from engine.measure.doctor_checks import (
    FAULT,
    NOTE,
    WARNING,
    Finding,
    Wiring,
    configured_wiring,
    deployment_wirings,
    static_checks,
    variant_wirings,
)
from engine.methods import BASELINE, DFLASH, TREE
from engine.models import hybrid
from engine.models.drafter import ScriptedDrafter, block_inputs, block_visibility

DEFAULT_PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Explain in three sentences why the sky is blue.",
    "List five tips for a good night's sleep.",
    "What is 17 times 24? Show your working.",
    "Write a short poem about autumn leaves.",
    "How do I make a cup of green tea?",
)
DEFAULT_BUDGETS = (4, 16, 64)
CHANCE = 0.05  # first-slot hits below this, with no wiring doing better: the drafter has learned nothing here
FAR_GAIN, FAR_RATIO = 0.15, 1.5  # "far higher": at least this many points more and this many times as many hits
# a small drafter shrugs a one-layer shift off at its first slot and shows it in its chains and the likelihood of the
# right tokens (the shipped drafter's figures: docs/HISTORY.md, "Lab notes moved out of the code")
LONGER, LIKELIER = 1.15, 0.05  # chains this many times as long (and 0.05 tokens more), 0.05 nats a slot likelier
ROOTS_PER_PASS = 32  # blocks in one drafter pass: a [32*15, vocab] logits chunk stays small
CALIBRATION_EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# Judged roots: below this many the wiring probes' differences are noise (a short probe can name a healthy wiring a
# fault). A first-slot rate on n roots has a standard error of at most 0.5 / sqrt(n)
# (binomial, at p = 1/2), the difference of two rates at most sqrt(2) times that; "far more hits" (FAR_GAIN) must
# be at least two standard errors of that difference: n >= 2 * (2 * 0.5 / FAR_GAIN) ** 2, 89 roots.
MIN_JUDGED_ROOTS = math.ceil(2 * (2 * 0.5 / FAR_GAIN) ** 2)
HEALTHY, FAULTY, CANNOT_JUDGE = 0, 1, 3  # the CLI's exit status (bad input is EngineError: 2)
GREEDY_STAGE, PASSES_STAGE = "the target's greedy outputs", "the target's passes over them"
PROBE_STAGE, WIRING_STAGE = "the drafter's blocks at every root, as configured", "the miswiring probes"


class DoctorStopped(Exception):
    """The doctor was asked to stop (the Doctor tab's Stop): it ends between two of its passes."""


@dataclass(frozen=True)
class DoctorProgress:
    """Where a doctor's run is: its stage, how far through it, the seconds so far, and the seconds left as far as
    this run has timed them (``left_s``: None before the stage's first tick; ``foreseen`` False while the drafter's
    probes, after the target's part, are not timed yet and ``left_s`` is the target's part alone)."""

    stage: str
    done: int
    total: int
    elapsed_s: float
    left_s: float | None
    foreseen: bool

    def __str__(self) -> str:
        said = f"{self.stage} ({self.done} of {self.total}), {self.elapsed_s:.0f} s so far"
        if self.left_s is None:
            return said
        left = f"{said}; about {self.left_s:.0f} s left"
        return left if self.foreseen else f"{left} in this stage (the drafter's probes are timed when they start)"


class Pacer:
    """A doctor's run, stage by stage: each tick reports how far the stage is and, from its own pace, the seconds
    it has left, with those of the stages after it where they follow from it (the miswiring probes score the
    configured probe's blocks again, on fewer roots); a stop asked for ends the run at the next tick."""

    def __init__(self, on_progress: Callable[[DoctorProgress], None] | None = None,
                 should_stop: Callable[[], bool] | None = None):
        self.report = on_progress or (lambda progress: None)
        self.should_stop = should_stop or (lambda: False)
        self.started = time.perf_counter()
        self.stage_started = self.started
        self.name, self.total, self.after, self.foreseen = "", 1, 0.0, False

    def stage(self, name: str, total: int, after: float | None = 0.0) -> None:
        """A stage of ``total`` ticks; ``after``: the later stages' seconds as a multiple of this one's (None: not
        foreseen from it)."""
        self.name, self.total, self.stage_started = name, max(total, 1), time.perf_counter()
        self.after, self.foreseen = after or 0.0, after is not None
        self.tick(0)

    def tick(self, done: int) -> None:
        if self.should_stop():
            raise DoctorStopped(f"the doctor was stopped during {self.name}")
        now = time.perf_counter()
        pace = (now - self.stage_started) / done if done else None
        left = None if pace is None else pace * (self.total - done) + pace * self.total * self.after
        self.report(DoctorProgress(self.name, done, self.total, now - self.started, left, self.foreseen))


@dataclass(frozen=True)
class ProbeSettings:
    max_new_tokens: int = 48
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    wiring_prompts: int = 4  # the miswiring probes multiply the drafter's cost: fewer prompts ...
    wiring_stride: int = 1  # ... and, for a costly drafter, every n-th root
    engine: str = "torch"  # "vllm": also the wirings vLLM itself uses

    def __post_init__(self):
        if not 2 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise EngineError(f"the probe's greedy tokens per prompt must be 2 to {MAX_NEW_TOKENS}, "
                              f"got {self.max_new_tokens}")


@dataclass
class PositionStats:
    """Draft slot ``position`` (1: the token after the root): how often it is right given that every slot
    before it was (``acceptance``), how often at all (``hit_rate``), and how sure the drafter was of it."""

    position: int
    acceptance: float | None
    hit_rate: float | None
    mean_probability: float | None
    blocks: int


@dataclass
class ConfidenceBand:
    """First-slot hits where the target itself gave its next token a probability in [low, high)."""

    low: float
    high: float
    hit_rate: float | None
    roots: int


@dataclass
class CalibrationBin:
    """Drafts whose top token the drafter gave a probability in [low, high): how often it was right."""

    low: float
    high: float
    mean_probability: float | None
    hit_rate: float | None
    count: int


@dataclass
class WiringResult:
    label: str
    first_slot: float
    mean_accepted: float  # draft tokens a chain keeps from each root, on average
    log_likelihood: float  # the drafter's mean log-probability of the right token per slot
    roots: int
    role: str  # "configured", "variant" (a miswiring probe) or "deployment" (how an engine wires it)
    meaning: str = ""
    fix: str = ""


@dataclass
class DoctorReport:
    model: str
    drafter: str
    engine: str
    verdict: str
    status: int  # HEALTHY, FAULTY or CANNOT_JUDGE
    findings: list[Finding]
    prompts: int = 0
    roots: int = 0
    first_slot: float | None = None
    positions: list[PositionStats] = field(default_factory=list)
    confidence_bands: list[ConfidenceBand] = field(default_factory=list)
    calibration: list[CalibrationBin] = field(default_factory=list)
    tau: dict[str, float] = field(default_factory=dict)  # by run label: DFlash's, DDTree's at each budget
    wirings: list[WiringResult] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return self.status == HEALTHY

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(raw: dict) -> DoctorReport:
        nested = {"findings": Finding, "positions": PositionStats, "confidence_bands": ConfidenceBand,
                  "calibration": CalibrationBin, "wirings": WiringResult}
        values = {f.name: raw[f.name] for f in fields(DoctorReport) if f.name in raw}
        for name, kind in nested.items():
            values[name] = [kind(**item) for item in values.get(name, [])]
        return DoctorReport(**values)

    def lines(self) -> list[str]:
        """The report as the CLI prints it: the verdict first, then the evidence."""
        out = [f"verdict: {self.verdict}", f"target {self.model} · drafter {self.drafter} · {self.engine} engine"]
        out += [f"  [{f.severity}] {f.check}: {f.line}" for f in self.findings]
        if self.first_slot is None:
            return out
        out.append(f"acceptance probe: {self.prompts} prompts, {self.roots} roots; "
                   f"first-slot hits {self.first_slot:.1%}; "
                   + ", ".join(f"{name} τ {value:.2f}" for name, value in self.tau.items()))
        out.append("  position  acceptance  hit rate  drafter p  (blocks)")
        out += [f"  {p.position:8d}  {_percent(p.acceptance):>10}  {_percent(p.hit_rate):>8}  "
                f"{_percent(p.mean_probability):>9}  ({p.blocks})" for p in self.positions]
        out.append("first slot by the target's confidence: " + ", ".join(
            f"{band.low:g}–{min(band.high, 1):g}: {_percent(band.hit_rate)} ({band.roots})"
            for band in self.confidence_bands))
        out.append("calibration (drafter p → hit rate): " + ", ".join(
            f"{b.mean_probability:.2f}→{b.hit_rate:.2f} ({b.count})" for b in self.calibration if b.count))
        out.append("wiring probes (first-slot hits, draft tokens a chain keeps, the right tokens' log-likelihood):")
        out += [f"  {w.label}: {w.first_slot:.1%}, {w.mean_accepted:.2f}, log-likelihood {w.log_likelihood:.2f} "
                f"({w.roots} roots)" for w in self.wirings]
        out.append("time: " + ", ".join(f"{name} {value:.1f} s" for name, value in self.seconds.items()))
        return out


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


# ---------------------------------------------------------------- the target's side, once per prompt

@dataclass
class PromptPass:
    """One prompt's greedy output teacher-forced through the target: every hidden state the drafter
    could be fed (HF ``hidden_states`` indices, and the last layer's before the final norm)."""

    ids: torch.Tensor  # [N]: prompt + greedy output
    prompt_length: int
    hidden: tuple[torch.Tensor, ...]  # layer count + 1 entries, [1, N - 1, hidden]
    before_norm: torch.Tensor | None  # the last layer's output before the final norm, where the model has one
    confidence: torch.Tensor  # [N - prompt_length - 1]: the target's probability of each next output token

    def features(self, wiring: Wiring) -> torch.Tensor:
        last = len(self.hidden) - 1
        return torch.cat([self.before_norm if index == last and wiring.last_before_norm else self.hidden[index]
                          for index in wiring.hidden_indices], dim=-1)


def prompt_pass(target, prompt_ids: list[int], output: list[int]) -> PromptPass:
    """Prompt + output through the target once, every layer's hidden state kept."""
    ids = torch.tensor(prompt_ids + output, device=target.device)
    final_norm = getattr(target.model.base_model, "norm", None)
    captured = {}
    hook = final_norm.register_forward_pre_hook(lambda _, args: captured.update(x=args[0])) if final_norm else None
    try:
        with torch.inference_mode():
            positions = torch.arange(len(ids) - 1, device=target.device)[None]
            logits, hidden = target.forward(ids[None, :-1], positions, target.new_cache(), hidden_states=True)
    finally:
        if hook is not None:
            hook.remove()
    # greedy: the target's top probability is the one it gave the next token
    confidence = logits[len(prompt_ids):].float().softmax(-1).amax(-1).cpu()
    return PromptPass(ids, len(prompt_ids), tuple(hidden), captured.get("x"), confidence)


def greedy_outputs(decoder: Decoder, prompt_ids: list[list[int]], max_new_tokens: int,
                   pacer: Pacer | None = None) -> list[list[int]]:
    """The target's greedy output for every prompt (up to and with its stop token). A plain-attention
    target decodes all prompts in one batch, left-padded (the padding masked, positions counted from each
    prompt's first token): a pass a token for all of them instead of one a prompt and a token. A hybrid's
    recurrent layers would run through the padding: it decodes each prompt alone, as AR."""
    target, pacer = decoder.target, pacer or Pacer()
    if hybrid.is_hybrid(target.config) or len(prompt_ids) == 1:
        settings = DecodeSettings(BASELINE.name, max_new_tokens=max_new_tokens, trace_detail="tokens")
        pacer.stage(GREEDY_STAGE, len(prompt_ids) * max_new_tokens, after=None)
        outputs = []
        for ids in prompt_ids:
            before = len(outputs) * max_new_tokens
            trace = decoder.run(settings=settings, prompt_ids=ids,
                                on_step=lambda trace, step, before=before: pacer.tick(before + len(trace.output_ids)))
            outputs.append(trace.output_ids)
        return outputs
    pacer.stage(GREEDY_STAGE, max_new_tokens, after=None)
    width, device = max(map(len, prompt_ids)), target.device
    pad = target.stop_ids[0] if target.stop_ids else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    cache, outputs, stops = target.new_cache(), [[] for _ in prompt_ids], set(target.stop_ids)
    with torch.inference_mode():
        for made in range(max_new_tokens):
            logits = target.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                  **{hybrid.cache_argument(type(target.model)): cache}).logits
            chosen = logits[:, -1].argmax(dim=-1)
            for output, token in zip(outputs, chosen.tolist()):
                if not (output and output[-1] in stops):
                    output.append(token)
            if all(output[-1] in stops for output in outputs):
                break
            pacer.tick(made + 1)
            ids, positions = chosen[:, None], positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return outputs


# ---------------------------------------------------------------- the drafter's side, batched

@dataclass
class BlockScores:
    """The drafter's blocks at ``anchors`` (root positions): top-k per slot, and the greedy labels."""

    anchors: list[int]
    log_probs: torch.Tensor  # [R, B-1, k]
    tokens: torch.Tensor  # [R, B-1, k]
    labels: torch.Tensor  # [R, B-1]; -1 past the output's end
    label_log_probs: torch.Tensor  # [R, B-1]: the drafter's log-probability of each label

    @property
    def valid(self) -> torch.Tensor:
        return self.labels >= 0

    @property
    def hits(self) -> torch.Tensor:
        return (self.tokens[:, :, 0] == self.labels) & self.valid

    def every(self, stride: int) -> BlockScores:
        return BlockScores(self.anchors[::stride], self.log_probs[::stride], self.tokens[::stride],
                           self.labels[::stride], self.label_log_probs[::stride])


def score_blocks(decoder: Decoder, run: PromptPass, wiring: Wiring, anchors: list[int], top_k: int) -> BlockScores:
    drafter = decoder.drafter
    embedding, lm_head = decoder.draft_weights
    block = drafter.block_size
    features = run.features(wiring).to(embedding.dtype)
    device = embedding.device
    ids = run.ids.cpu()
    targets = torch.tensor(anchors)[:, None] + torch.arange(1, block)
    labels = torch.where(targets < len(ids), ids[targets.clamp(max=len(ids) - 1)], -1)
    top_log_probs, top_tokens, label_log_probs = [], [], []
    with torch.inference_mode():
        for start in range(0, len(anchors), ROOTS_PER_PASS):
            chunk = torch.tensor([anchors[start:start + ROOTS_PER_PASS]], device=device)
            context = int(chunk.max())  # every block sees only rows before its own root
            tokens, positions = block_inputs(run.ids[None], chunk, block, drafter.mask_token_id)
            masks = {kind: block_visibility(chunk, context, block, *kind) for kind in set(wiring.layer_kinds)}
            hidden = drafter(drafter.embed(tokens, embedding), features[:, :context], block_positions=positions,
                             context_positions=torch.arange(context, device=device)[None],
                             mask=[masks[kind] for kind in wiring.layer_kinds])
            hidden = hidden.view(chunk.shape[1], block, -1)[:, 1:]
            log_probs = torch.log_softmax(drafter.logits(hidden, lm_head).float(), dim=-1)
            top = log_probs.topk(top_k, dim=-1)
            top_log_probs.append(top.values.cpu())
            top_tokens.append(top.indices.cpu())
            label_log_probs.append(log_probs.gather(-1, labels[start:start + ROOTS_PER_PASS, :, None].clamp(min=0)
                                                    .to(device))[..., 0].cpu())
    return BlockScores(anchors, torch.cat(top_log_probs), torch.cat(top_tokens), labels, torch.cat(label_log_probs))


# ---------------------------------------------------------------- measures

def first_slot_rate(scores: list[BlockScores]) -> float:
    valid = torch.cat([s.valid[:, 0] for s in scores])
    return float(torch.cat([s.hits[:, 0] for s in scores]).sum() / max(int(valid.sum()), 1))


def mean_accepted(scores: list[BlockScores]) -> float:
    """Draft tokens a chain keeps from each root: the run of right slots from the first."""
    kept = torch.cat([s.hits.int().cumprod(dim=1).sum(dim=1) for s in scores if s.valid[:, 0].any()]).float()
    return float(kept.mean()) if len(kept) else 0.0


def label_log_likelihood(scores: list[BlockScores]) -> float:
    """The drafter's mean log-probability of the right token per slot: graded where hit rates are coarse."""
    valid = torch.cat([s.valid.flatten() for s in scores])
    return float(torch.cat([s.label_log_probs.flatten() for s in scores])[valid].mean())


def position_stats(scores: list[BlockScores]) -> list[PositionStats]:
    hits = torch.cat([s.hits for s in scores])
    valid = torch.cat([s.valid for s in scores])
    probability = torch.cat([s.log_probs[:, :, 0].exp() for s in scores])
    prefix = torch.cat([torch.ones_like(hits[:, :1]), hits.int().cumprod(dim=1)[:, :-1].bool()], dim=1)
    stats = []
    for slot in range(hits.shape[1]):
        counted, reached = valid[:, slot], valid[:, slot] & prefix[:, slot]
        stats.append(PositionStats(
            slot + 1, _rate(hits[reached, slot]), _rate(hits[counted, slot]),
            float(probability[counted, slot].mean()) if counted.any() else None, int(counted.sum())))
    return stats


def _rate(hits: torch.Tensor) -> float | None:
    return float(hits.float().mean()) if len(hits) else None


def confidence_bands(scores: list[BlockScores], runs: list[PromptPass]) -> list[ConfidenceBand]:
    hits = torch.cat([s.hits[:-1, 0] for s in scores])  # the last root has no next token
    confidence = torch.cat([run.confidence for run in runs])
    edges = (0.0,) + CONFIDENCE_EDGES + (1.01,)
    return [ConfidenceBand(low, high, _rate(hits[(confidence >= low) & (confidence < high)]),
                           int(((confidence >= low) & (confidence < high)).sum()))
            for low, high in zip(edges, edges[1:])]


def calibration(scores: list[BlockScores]) -> list[CalibrationBin]:
    valid = torch.cat([s.valid for s in scores])
    probability = torch.cat([s.log_probs[:, :, 0].exp() for s in scores])[valid]
    hits = torch.cat([s.hits for s in scores])[valid]
    edges = (0.0,) + CALIBRATION_EDGES + (1.01,)
    bins = []
    for low, high in zip(edges, edges[1:]):
        inside = (probability >= low) & (probability < high)
        bins.append(CalibrationBin(low, min(high, 1.0), float(probability[inside].mean()) if inside.any() else None,
                                   _rate(hits[inside]), int(inside.sum())))
    return bins


def replayed_tau(scores: list[BlockScores], runs: list[PromptPass], budgets: tuple[int, ...]) -> dict[str, float]:
    """DFlash and DDTree τ, their greedy steps replayed along each output (``engine.measure.acceptance``)."""
    replayed = [(DFLASH, 0)] + [(TREE, budget) for budget in budgets]
    lengths: dict[str, list[int]] = {method.label(budget): [] for method, budget in replayed}
    for score, run in zip(scores, runs):
        proposals = Proposals(run.ids[run.prompt_length:].tolist(), score.log_probs, score.tokens, run.confidence)
        for method, budget in replayed:
            lengths[method.label(budget)] += replay(proposals, method, budget)
    return {name: sum(values) / len(values) if values else 0.0 for name, values in lengths.items()}


# ---------------------------------------------------------------- the verdict

def far_higher(better: float, worse: float) -> bool:
    return better >= worse + FAR_GAIN and better >= worse * FAR_RATIO


def clearly_better(better: WiringResult, worse: WiringResult) -> bool:
    """Far more first-slot hits, or longer chains and likelier right tokens together."""
    return far_higher(better.first_slot, worse.first_slot) or (
        better.mean_accepted >= worse.mean_accepted * LONGER + 0.05
        and better.log_likelihood >= worse.log_likelihood + LIKELIER)


def compared(first: WiringResult, second: WiringResult) -> str:
    def measured(r: WiringResult) -> str:
        return f"{r.first_slot:.1%} first-slot hits, {r.mean_accepted:.2f} draft tokens kept"

    second_name = f"with {second.label}" if second.role == "variant" else second.label
    return f"{first.label}: {measured(first)}; {second_name}: {measured(second)}"


def probe_findings(results: list[WiringResult]) -> list[Finding]:
    configured = next(r for r in results if r.role == "configured")
    findings = []
    winners = [r for r in results if r.role == "variant" and clearly_better(r, configured)]
    if winners:
        best = max(winners, key=lambda r: (r.mean_accepted, r.first_slot))
        findings.append(Finding(FAULT, "wiring", f"{compared(configured, best)} — {best.meaning}; fix: {best.fix}"))
    elif configured.first_slot < CHANCE:
        findings.append(Finding(FAULT, "untrained", f"acceptance at chance ({configured.first_slot:.1%} first-slot "
                                "hits, and no miswiring probe does better): the drafter is untrained or not for "
                                "this target"))
    for deployment in (r for r in results if r.role == "deployment"):
        if clearly_better(configured, deployment):
            findings.append(Finding(FAULT, "deployment", f"{compared(configured, deployment)} — {deployment.meaning}; "
                                                         f"fix: {deployment.fix}"))
    return findings


def sample_shortfall(results: list[WiringResult], prompts: int, settings: ProbeSettings) -> str | None:
    """Why the probes cannot judge the wiring yet (too few roots scored), or None when they can."""
    judged = next(r for r in results if r.role == "configured").roots
    if judged >= MIN_JUDGED_ROOTS:
        return None
    if prompts < settings.wiring_prompts:
        remedy = "more prompts or more tokens per prompt"
    else:
        remedy = f"more tokens per prompt (the wiring probes score the first {settings.wiring_prompts} prompts)"
    return f"too few draft positions to judge ({judged} scored, need {MIN_JUDGED_ROOTS}): use {remedy}"


def verdict(findings: list[Finding], first_slot: float | None, tau: dict[str, float],
            shortfall: str | None = None) -> tuple[str, int]:
    """The faults, else why the sample cannot be judged (``sample_shortfall``), else healthy."""
    faults = [f for f in findings if f.severity == FAULT]
    if faults:
        return "; ".join(f.line for f in faults), FAULTY
    if shortfall:
        return shortfall, CANNOT_JUDGE
    measured = (" configs (static checks only: no acceptance probe)" if first_slot is None else
                f": first-slot hits {first_slot:.1%}, " + ", ".join(f"{k} τ {v:.2f}" for k, v in tau.items()))
    warned = sum(f.severity == WARNING for f in findings)
    return f"healthy{measured}" + (f" ({warned} warning{'s' * (warned > 1)} below)" if warned else ""), HEALTHY


# ---------------------------------------------------------------- the whole check

def probe_can_run(findings: list[Finding]) -> bool:
    """Taps outside the target cannot be fed, nor a block without slots."""
    return not any(f.severity == FAULT and f.check in ("layer ids", "block size", "layer types", "mask token")
                   for f in findings)


def static_report(model: str, drafter: str, engine: str, findings: list[Finding]) -> DoctorReport:
    """The report of the static checks alone (a config-only pair, or one the probe cannot run on)."""
    line, status = verdict(findings, None, {})
    return DoctorReport(model, drafter, engine, line, status, findings)


def target_passes(decoder: Decoder, prompts, max_new_tokens: int, pacer: Pacer | None = None) -> list[PromptPass]:
    """Every prompt's greedy output and its target pass: the probe's slow half, and the drafter's no part
    of it, so drafters for one target can share them (``diagnose(runs=...)``)."""
    if not prompts:
        raise EngineError("the doctor needs at least one prompt")
    pacer = pacer or Pacer()
    prompt_ids = [decoder.target.chat_ids(prompt) for prompt in prompts]
    outputs = greedy_outputs(decoder, prompt_ids, max_new_tokens, pacer)
    pacer.stage(PASSES_STAGE, len(prompt_ids), after=None)
    runs = []
    for ids, output in zip(prompt_ids, outputs):
        runs.append(prompt_pass(decoder.target, ids, output))
        pacer.tick(len(runs))
    return runs


def diagnose(decoder: Decoder, prompts: list[str] | tuple[str, ...] = DEFAULT_PROMPTS,
             settings: ProbeSettings = ProbeSettings(), raw_drafter_config: dict | None = None,
             pacer: Pacer | None = None, runs: list[PromptPass] | None = None) -> DoctorReport:
    """Check ``decoder``'s target + drafter pair; ``raw_drafter_config`` (the drafter's config.json) lets the
    vLLM checks see keys the Studio does not read (``eagle_aux_hidden_state_layer_ids``); ``runs``: the
    target's passes already made (``target_passes``), else made here from ``prompts``. ``pacer`` hears how far
    it is and may stop it (``DoctorStopped``)."""
    target, drafter = decoder.target, decoder.drafter
    if drafter is None or isinstance(drafter, ScriptedDrafter):
        raise EngineError("the doctor checks a trained DFlash drafter: load one (a scripted drafter knows its answers)")
    pacer = pacer or Pacer()
    findings = static_checks(target.config, target.tokenizer, drafter.config, settings.engine, raw_drafter_config)
    findings.append(Finding(NOTE, "dtype", f"target {_dtype(target.dtype)}, drafts in {_dtype(drafter.dtype)}"))
    report = static_report(target.name, decoder.drafter_info.name, settings.engine, findings)
    if not probe_can_run(findings):
        return report
    clock = time.perf_counter()
    if runs is None:
        runs = target_passes(decoder, prompts, settings.max_new_tokens, pacer)
        report.seconds["target"] = time.perf_counter() - clock
    clock = time.perf_counter()
    probes = wiring_probes(decoder, runs, settings, raw_drafter_config)
    # each miswiring probe scores the wiring prompts' roots (every ``wiring_stride``-th) as the configured probe does
    roots = [len(run.ids) - run.prompt_length for run in runs]
    share = sum(-(-count // settings.wiring_stride) for count in roots[: settings.wiring_prompts]) / max(sum(roots), 1)
    pacer.stage(PROBE_STAGE, len(runs), after=len(probes) * share)
    scores = measure_acceptance(report, decoder, runs, settings.budgets, pacer)
    report.seconds["probe"] = time.perf_counter() - clock
    clock = time.perf_counter()
    report.wirings = probe_wirings(decoder, runs, scores, settings, probes, pacer)
    report.seconds["wirings"] = time.perf_counter() - clock
    shortfall = sample_shortfall(report.wirings, len(runs), settings)
    if shortfall is None:  # a small sample's probes name no fault: their differences would be noise
        report.findings += probe_findings(report.wirings)
    report.verdict, report.status = verdict(report.findings, report.first_slot, report.tau, shortfall)
    return report


def measure_acceptance(report: DoctorReport, decoder: Decoder, runs: list[PromptPass],
                       budgets: tuple[int, ...], pacer: Pacer | None = None) -> list[BlockScores]:
    """The configured drafter's blocks at every root of every output, and the report's measures of them."""
    configured, pacer = configured_wiring(decoder.drafter), pacer or Pacer()
    scores = []
    for run in runs:
        scores.append(score_blocks(decoder, run, configured, list(range(run.prompt_length, len(run.ids))),
                                   max(budgets + (1,))))
        pacer.tick(len(scores))
    report.prompts, report.roots = len(runs), sum(len(s.anchors) for s in scores)
    report.first_slot = first_slot_rate(scores)
    report.positions = position_stats(scores)
    report.confidence_bands = confidence_bands(scores, runs)
    report.calibration = calibration(scores)
    report.tau = replayed_tau(scores, runs, budgets)
    return scores


def wiring_probes(decoder: Decoder, runs: list[PromptPass], settings: ProbeSettings,
                  raw_drafter_config: dict | None) -> list[tuple[Wiring, str]]:
    """Every miswiring to probe, with its role: a variant of the configured wiring, or a deployment's."""
    drafter, num_layers = decoder.drafter, len(runs[0].hidden) - 1
    return [(w, "variant") for w in variant_wirings(drafter, num_layers, runs[0].before_norm is not None)] + \
        [(w, "deployment") for w in deployment_wirings(drafter, num_layers, settings.engine, raw_drafter_config)]


def probe_wirings(decoder: Decoder, runs: list[PromptPass], scores: list[BlockScores], settings: ProbeSettings,
                  probes: list[tuple[Wiring, str]], pacer: Pacer | None = None) -> list[WiringResult]:
    """The configured wiring and every miswiring on the same roots (fewer of them: see ``ProbeSettings``)."""
    pacer = pacer or Pacer()
    subset = [s.every(settings.wiring_stride) for s in scores[: settings.wiring_prompts]]
    results = [wiring_result(configured_wiring(decoder.drafter), subset, "configured")]
    pacer.stage(WIRING_STAGE, len(probes))
    for wiring, role in probes:
        probed = [score_blocks(decoder, run, wiring, s.anchors, 1) for run, s in zip(runs, subset)]
        results.append(wiring_result(wiring, probed, role))
        pacer.tick(len(results) - 1)
    return results


def wiring_result(wiring: Wiring, scores: list[BlockScores], role: str) -> WiringResult:
    return WiringResult(wiring.label, first_slot_rate(scores), mean_accepted(scores), label_log_likelihood(scores),
                        sum(len(s.anchors) for s in scores), role, wiring.meaning, wiring.fix)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

