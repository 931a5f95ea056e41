"""Kernels per decoding stage, counted and timed with the PyTorch profiler on a CUDA device.

``StageClock`` marks each stage with a profiler range while a profiler runs, and it
synchronises at both ends of a stage, so every kernel a stage launches (also those a CUDA
graph replays) starts inside that stage's range: kernels are attributed by start time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

STAGE_MARK = "stage:"
NOT_KERNELS = ("Memcpy", "Memset")
SLOWEST = int(os.environ.get("DDTREE_SLOWEST_KERNELS", 5))  # kernels named per stage (more: to find a cost)
NAME_CHARS = 90  # a templated CUDA kernel's name, cut to what a table can show


@dataclass(frozen=True)
class KernelProfile:
    """One generation's kernels, per verify step, by stage: how many, and which took the most device time."""

    counts: dict[str, float]
    slowest: dict[str, list[tuple[str, float]]]  # stage -> (kernel name, µs per step), slowest first


@dataclass(frozen=True)
class KernelEvent:
    name: str
    start: float  # µs, the profiler's clock
    duration: float  # µs on the device


def attribute(stages: list[tuple[str, float, float]], kernels: list[KernelEvent], steps: int,
              slowest: int = SLOWEST) -> KernelProfile:
    """Each kernel to the stage (name, start, end) its start falls in; totals per step. A kernel
    launched outside every stage (between steps, on the host's side of the loop) is left out."""
    counts = dict.fromkeys(sorted({name for name, _, _ in stages}), 0.0)
    times: dict[str, dict[str, float]] = {name: {} for name in counts}
    for kernel in kernels:
        stage = next((name for name, begin, end in stages if begin <= kernel.start <= end), None)
        if stage is None:
            continue
        counts[stage] += 1
        name = kernel.name[:NAME_CHARS]
        times[stage][name] = times[stage].get(name, 0.0) + kernel.duration
    steps = max(1, steps)
    return KernelProfile({name: count / steps for name, count in counts.items()},
                         {stage: sorted(((name, total / steps) for name, total in by_name.items()),
                                        key=lambda item: -item[1])[:slowest]
                          for stage, by_name in times.items()})


def profile_kernels(run: Callable[[], object]) -> KernelProfile:
    """The kernels of the generation ``run()`` makes (it returns its Trace), per verify step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("counting kernels needs a CUDA device")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        trace = run()
    events = profiler.events()
    stages = [(event.name.removeprefix(STAGE_MARK), event.time_range.start, event.time_range.end)
              for event in events if event.name.startswith(STAGE_MARK)]
    kernels = [KernelEvent(event.name, event.time_range.start, event.time_range.elapsed_us()) for event in events
               if event.device_type == DeviceType.CUDA and not event.name.startswith(NOT_KERNELS)]
    return attribute(stages, kernels, len(trace.steps))


@dataclass(frozen=True)
class DeviceTime:
    """How busy a stretch of work kept the GPU: its kernels' own time against the wall's."""

    wall_s: float
    kernels: int
    busy_s: float  # every kernel's time, summed
    slowest: list[tuple[str, int, float]]  # (kernel name, launches, seconds in all), the most time first

    def line(self, rounds: int) -> str:
        slowest = "; ".join(f"{name} ×{count / rounds:.1f} {1e3 * seconds / rounds:.3f}"
                            for name, count, seconds in self.slowest)
        return (f"device busy {1e3 * self.busy_s / rounds:.2f} ms of {1e3 * self.wall_s / rounds:.2f} ms a round "
                f"({100 * self.busy_s / self.wall_s:.0f}%), {self.kernels / rounds:.0f} kernels a round; the most time "
                f"(launches and ms a round): {slowest}")


def device_time(run: Callable[[], object], slowest: int = SLOWEST) -> DeviceTime:
    """The kernels ``run()`` puts on the GPU, timed by the profiler (its CUDA activity alone, so that the host's side
    runs at its own pace)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("timing kernels needs a CUDA device")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    by_name: dict[str, list[float]] = {}
    for event in profiler.events():
        if event.device_type == DeviceType.CUDA and not event.name.startswith(NOT_KERNELS):
            by_name.setdefault(event.name[:NAME_CHARS], []).append(event.time_range.elapsed_us() / 1e6)
    ranked = sorted(((name, len(times), sum(times)) for name, times in by_name.items()), key=lambda item: -item[2])
    return DeviceTime(wall, sum(len(times) for times in by_name.values()), sum(t for _, _, t in ranked),
                      ranked[:slowest])
