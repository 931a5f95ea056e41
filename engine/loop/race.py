"""Several runs on one model thread in turns, so that whatever else the machine does lands on all of them alike.

Run methods one after another, and a load that starts, stops or shifts midway lands on one method and not the
next: the speed-ups a page shows then say more about the machine than about the methods. ``take_turns`` gives each
run a turn of about ``TURN_S``, in order, round after round, until every run has ended. Each run keeps its own
clock (``Run.turn``): its trace's times count its own steps alone, so a replay or a video shows each method as if
it had run alone, and ``engine.measure.fairness`` can tell from those times whether the load changed meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.errors import EngineError
from engine.loop.run import Run
from engine.loop.settings import DecodeSettings
from engine.trace import Step, Trace

TURN_S = 0.25  # long against a step, so a turn takes a few; short against a load that comes and goes


@dataclass
class Race:
    """Runs of one prompt, each with the steps its turns took."""

    traces: list[Trace]
    turns: list[list[int]]  # per run, the steps of each of its turns, in order
    in_turns: bool = True  # False: each ran whole, one after another (runs that cannot take turns)


def check_apart(settings: list[DecodeSettings]) -> None:
    """Runs that take turns keep their buffers apart by ``DecodeSettings.apart``: no two may share it."""
    keys = [setting.apart for setting in settings]
    twins = sorted({label for label, detail in keys if keys.count((label, detail)) > 1})
    if twins:
        raise EngineError(f"{', '.join(twins)} asked for twice: the runs of one race must differ in method, budget "
                          "or trace detail")


def one_after_another(traces: list[Trace]) -> Race:
    """Runs that could not take turns, each run whole in its turn."""
    return Race(traces, [[len(trace.steps)] for trace in traces], in_turns=False)


def take_turns(runs: list[Run], turn_s: float = TURN_S) -> Race:
    """Every run to its end, a turn of about ``turn_s`` each in order, round after round."""
    turns: list[list[int]] = [[] for _ in runs]
    going = {index: iter(run) for index, run in enumerate(runs)}
    with torch.inference_mode():
        while going:
            for index, steps in list(going.items()):
                with runs[index].turn():
                    taken, ended = take_turn(steps, turn_s)
                turns[index].append(taken)
                if ended:
                    del going[index]
    return Race([run.trace for run in runs], turns)


def take_turn(steps: Iterator[Step], turn_s: float) -> tuple[int, bool]:
    """Steps until the turn's time is up (one at least): how many, and whether the run ended."""
    began, taken = time.perf_counter(), 0
    for _ in steps:
        taken += 1
        if time.perf_counter() - began >= turn_s:
            return taken, False
    return taken, True
