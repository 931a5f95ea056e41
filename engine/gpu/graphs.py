"""CUDA graphs, written once: record a call, and replay a call from the graph of its first run.

Every fixed-shape program here (the drafter's pass, the fixed step's two programs, a verify
pass, the KV compaction) is launch-bound on a GPU and is replayed as a graph. A first call
runs eagerly and returns its result; the graph is recorded after it, which runs nothing, so
the outputs the graph holds are those of the next replay.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch


def record(program: Callable[[], object], pool=None, stream: torch.cuda.Stream | None = None
           ) -> tuple[torch.cuda.CUDAGraph, object]:
    """``program()`` recorded as a CUDA graph (nothing runs), and the outputs its replays write."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = program()
    return graph, outputs


class GraphedCall:
    """``program()`` eagerly at its first call, then replayed from the graph recorded after it.

    ``capturing``: a context that yields the stream to record on (vLLM's, under tensor
    parallelism); ``synchronize``: wait for the eager run before recording (its inputs were
    written by work still queued)."""

    def __init__(self, program: Callable[[], object], capturing: Callable[[], AbstractContextManager] = nullcontext,
                 synchronize: bool = False):
        self.program, self.capturing, self.synchronize = program, capturing, synchronize
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        eager = self.program()
        if self.synchronize:
            torch.cuda.synchronize()
        with self.capturing() as stream:
            self.graph, self.outputs = record(self.program, stream=stream)
        return eager
