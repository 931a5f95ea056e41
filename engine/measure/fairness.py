"""Whether runs' timings are this machine's own, and when not, what disturbed them.

A machine doing something else slows every step it shares a processor with; ``engine.loop.race`` spreads that over
every method alike, and this module says when there was something to spread:

- AR's steps (one token each, the prompt's pass left out) far slower than this kind of machine decodes them: the
  bench's record for it (``assets/budgets.json``), else the page's start-up timing on this very machine. Something
  else is using the processor, and a load can slow the methods unlike each other (small passes suffer the most);
- a run's steps far slower over one stretch of its own time than over another: the load came or went while it ran
  (in turns, its stretches span the race).

Each finding is a sentence with its figures and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.methods import BASELINE, method
from engine.trace import Trace

AR_FAR_BELOW = 0.7  # AR decoding slower than this share of the reference's speed is not the machine's own speed
STRETCH_S = 1.0  # a run's pace is compared over stretches this long: long against a step's jitter, short against a run
PACE_DISAGREE = 1.5  # a run's steps this many times slower over one stretch than over another: the load changed


@dataclass(frozen=True)
class ArReference:
    """How fast AR decodes on this kind of machine, and who measured it."""

    tokens_per_s: float  # AR's tokens a second after the prompt's pass (one a step)
    measured_by: str  # "the bench recorded"
    where: str  # "on this kind of machine (CPU, 2 threads | ...)"


def decode_rate(trace: Trace) -> float | None:
    """Steps a second after the prompt's pass (AR's tokens a second); None without a step."""
    seconds = trace.summary.wall_s - trace.prefill.t_end
    return len(trace.steps) / seconds if trace.steps and seconds > 0 else None


def slow_ar(ar: list[Trace], reference: ArReference | None) -> str | None:
    """The sentence that says AR decoded far slower than ``reference``, or None."""
    steps = sum(len(trace.steps) for trace in ar)
    seconds = sum(trace.summary.wall_s - trace.prefill.t_end for trace in ar)
    if reference is None or not steps or seconds <= 0:
        return None
    rate = steps / seconds
    if rate >= AR_FAR_BELOW * reference.tokens_per_s:
        return None
    return (f"AR decoded {rate:.1f} tokens/s (the prompt's pass left out), where {reference.measured_by} "
            f"{reference.tokens_per_s:.1f} {reference.where}: something else is using the processor, which slows the "
            "methods unlike each other. Close it and run again")


def uneven_pace(trace: Trace) -> str | None:
    """The sentence that says a run's steps went far slower over one stretch of it than over another, or None."""
    per_step = stretch_step_seconds(trace)
    if len(per_step) < 2 or max(per_step) < PACE_DISAGREE * min(per_step):
        return None
    name = method(trace.config.method).title
    return (f"{name}'s steps took {max(per_step) * 1000:.0f} ms at its slowest and {min(per_step) * 1000:.0f} ms at "
            f"its fastest ({STRETCH_S:g} s of its own time each): the machine's load changed while it ran. Run again "
            "once it is quiet")


def stretch_step_seconds(trace: Trace) -> list[float]:
    """Seconds a step over each stretch of at least ``STRETCH_S`` of the run's own clock, the prompt's pass left
    out; a last stretch under half that joins the one before."""
    stretches: list[tuple[int, float]] = []  # steps, seconds
    began, steps = trace.prefill.t_end, 0
    for step in trace.steps:
        steps += 1
        if step.t_end - began >= STRETCH_S:
            stretches.append((steps, step.t_end - began))
            began, steps = step.t_end, 0
    if steps:
        rest = trace.steps[-1].t_end - began
        if stretches and rest < STRETCH_S / 2:
            joined, seconds = stretches.pop()
            steps, rest = steps + joined, rest + seconds
        stretches.append((steps, rest))
    return [seconds / steps for steps, seconds in stretches]


def disturbance(traces: list[Trace], reference: ArReference | None) -> list[str]:
    """Every finding on one prompt's runs: AR against ``reference``, then each run's pace over its stretches."""
    ar = [trace for trace in traces if trace.config.method == BASELINE.name]
    findings = [slow_ar(ar, reference)]
    findings += [uneven_pace(trace) for trace in traces]
    return [finding for finding in findings if finding is not None]
