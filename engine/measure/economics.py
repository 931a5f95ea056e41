"""Why a method is fast or slow: tokens per step (τ) against what a step costs.

A verify step of DFlash or DDTree commits τ tokens on average but costs more than an AR
step (the draft pass, a wider verify, the walk). In AR steps, that cost is
``step_cost_vs_ar``, so the speed-up over AR is predicted by ``τ ÷ step_cost_vs_ar``. The
prediction leaves out what is not a step: the prefill (the same prompt for every method,
but DFlash and DDTree also read the prompt's hidden states into the drafter) and, with
few steps, timing noise; the measured speed-up (the method's tokens per second ÷ AR's, whole wall
times) includes them. Both come from the same runs, so they agree up to the prefill's share
of the time. Throughput, not wall time: where outputs differ in length (a bf16 near-tie, a
sampled run), the same wall time for more tokens is faster.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from engine.methods import BASELINE
from engine.trace import Summary


@dataclass(frozen=True)
class Timing:
    """A method's runs, summed: wall time, the prefill's part of it, verify steps, the tokens
    those steps committed (the prefill's first token apart) and all new tokens."""

    wall_s: float
    prefill_s: float
    steps: int
    committed: int
    tokens: int

    @staticmethod
    def of(summaries: Iterable[Summary]) -> Timing:
        summaries = list(summaries)
        return Timing(sum(s.wall_s for s in summaries), sum(s.time_to_first_token_s for s in summaries),
                      sum(s.steps for s in summaries), sum(sum(s.acceptance_lengths) for s in summaries),
                      sum(s.new_tokens for s in summaries))

    @property
    def step_s(self) -> float | None:
        """Mean wall time of one verify step, the prefill left out."""
        return (self.wall_s - self.prefill_s) / self.steps if self.steps else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.wall_s if self.wall_s > 0 else None

    @property
    def tau(self) -> float | None:
        return self.committed / self.steps if self.steps else None


@dataclass(frozen=True)
class Economics:
    tau: float | None
    step_ms: float | None
    step_cost_vs_ar: float | None  # a step's wall time in AR steps
    predicted_speedup: float | None  # tau / step_cost_vs_ar
    speedup_vs_ar: float | None  # measured: the method's tokens per second / AR's

    def to_dict(self) -> dict:
        return asdict(self)


def economics(timings: dict[str, Timing], baseline: str = BASELINE.label()) -> dict[str, Economics]:
    """Each run label's τ, step cost in ``baseline`` steps, predicted and measured speed-up over it."""
    reference = timings.get(baseline)
    ar_step = reference.step_s if reference else None
    result = {}
    for label, timing in timings.items():
        step, tau = timing.step_s, timing.tau
        cost = step / ar_step if step is not None and ar_step else None
        result[label] = Economics(
            tau=tau, step_ms=1000 * step if step is not None else None, step_cost_vs_ar=cost,
            predicted_speedup=tau / cost if tau is not None and cost else None,
            speedup_vs_ar=_ratio(timing.tokens_per_s, reference.tokens_per_s if reference else None),
        )
    return result


def speed_noise(steps: Iterable[tuple[int, float]]) -> float | None:
    """How far one pass's tokens per second may stray by chance, relative to it: the standard error of tokens ÷
    seconds over its steps (``(tokens, seconds)`` each), as a ratio estimator's, from how the steps' times spread
    about their tokens. It sees what moved the steps within the pass (a busy machine, a slow step), not what moves
    a whole pass (a warm cache); None under two steps."""
    steps = list(steps)
    count, tokens, seconds = len(steps), sum(t for t, _ in steps), sum(s for _, s in steps)
    if count < 2 or tokens == 0 or seconds <= 0:
        return None
    rate = tokens / seconds
    spread = sum((t - rate * s) ** 2 for t, s in steps) / (count - 1)
    return math.sqrt(spread / count) / (tokens / count)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def explain(label: str, entry: Economics) -> str:
    """One plain sentence: where the speed-up (or slow-down) comes from."""
    if entry.tau is None:
        return f"{label}: no verify steps to measure."
    if entry.step_cost_vs_ar is None or entry.predicted_speedup is None:
        return (f"{label} commits {entry.tau:.2f} tokens per step; whether that is faster than AR depends on what a "
                "step costs, counted in AR steps: run AR with it to measure that.")
    verdict = "faster" if entry.predicted_speedup >= 1 else "slower"
    measured = f", measured {entry.speedup_vs_ar:.2f}×" if entry.speedup_vs_ar is not None else ""
    return (f"{label} commits {entry.tau:.2f} tokens per step and a step costs {entry.step_cost_vs_ar:.2f} AR steps: "
            f"{entry.tau:.2f} ÷ {entry.step_cost_vs_ar:.2f} = {entry.predicted_speedup:.2f}× "
            f"({verdict} than AR{measured}).")
