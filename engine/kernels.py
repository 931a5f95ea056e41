"""Kernels per decoding stage, counted with the PyTorch profiler on a CUDA device.

``StageClock`` marks each stage with a profiler range while a profiler runs, and it
synchronises at both ends of a stage, so every kernel a stage launches (also those a CUDA
graph replays) starts inside that stage's range: kernels are attributed by start time.
"""

from __future__ import annotations

from typing import Callable

import torch

STAGE_MARK = "stage:"
NOT_KERNELS = ("Memcpy", "Memset")


def kernels_per_step(run: Callable[[], object]) -> dict[str, float]:
    """Mean kernels per verify step, by stage, over the generation ``run()`` makes (it returns its Trace)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("counting kernels needs a CUDA device")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        trace = run()
    events = profiler.events()
    stages = [(event.name.removeprefix(STAGE_MARK), event.time_range.start, event.time_range.end)
              for event in events if event.name.startswith(STAGE_MARK)]
    counts = dict.fromkeys(sorted({name for name, _, _ in stages}), 0)
    for event in events:
        if event.device_type != DeviceType.CUDA or event.name.startswith(NOT_KERNELS):
            continue
        stage = next((name for name, begin, end in stages if begin <= event.time_range.start <= end), None)
        if stage is not None:
            counts[stage] += 1
    steps = max(1, len(trace.steps))
    return {name: count / steps for name, count in counts.items()}
