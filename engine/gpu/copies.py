"""Host values to the device without waiting for it, and a census of the places that still wait.

A copy from ordinary (pageable) host memory to a GPU waits for every kernel queued before it, which is how a step
launched ahead of the host's reading of the one before (``engine.loop.batch``'s fixed step) would quietly run in
lock step. From pinned memory, non-blocking, the copy takes its place in the stream's order and the host goes on.
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from contextlib import contextmanager

import torch

OWN_CODE = ("/engine/", "/ddtree/")  # where a census names the line that waited


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (a list, or a tensor on the host) on ``device``, copied in stream order: later kernels see it, and
    the host does not wait for earlier ones."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda" or host.device.type != "cpu":  # no pinning to do: on the host, or already on a device
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@contextmanager
def waits_counted(census: Counter):
    """Every operation in the block that makes the host wait for the GPU (a blocking copy, a value read back),
    counted in ``census`` by the innermost line of the Studio's own code that made it (PyTorch's sync debug mode)."""
    def counted(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if any(part in f.filename for part in OWN_CODE)]
        if frames:
            name = frames[-1].filename
            filename, lineno = name[max(name.rfind(part) for part in OWN_CODE) + 1:], frames[-1].lineno
        census[f"{filename}:{lineno} ({str(message).split(',')[0][:60]})"] += 1

    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = counted
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield census
        finally:
            torch.cuda.set_sync_debug_mode(before)
