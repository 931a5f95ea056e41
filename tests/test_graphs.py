"""``engine.gpu.graphs.GraphedCall``'s bookkeeping, with the recording stood in for (no GPU here;
the programs it replays are tested on the GPU in tests/test_fixed_step_gpu.py)."""

from __future__ import annotations

from contextlib import contextmanager

import engine.gpu.graphs as graphs


class FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_the_first_call_runs_eagerly_then_every_call_replays_what_was_recorded(monkeypatch):
    calls, recorded, streams = [], [], []

    def record(program, pool=None, stream=None):
        streams.append(stream)
        recorded.append(program())  # a recording runs the program's ops into the graph once
        return FakeGraph(), "outputs the graph writes"

    @contextmanager
    def capturing():
        yield "vLLM's stream"

    monkeypatch.setattr(graphs, "record", record)
    monkeypatch.setattr(graphs.torch.cuda, "synchronize", lambda: calls.append("synchronized"))
    call = graphs.GraphedCall(lambda: calls.append("ran") or len(calls), capturing=capturing, synchronize=True)

    assert call() == 1  # the eager run's own result
    assert calls == ["ran", "synchronized", "ran"] and streams == ["vLLM's stream"]
    assert call() == "outputs the graph writes" and call() == "outputs the graph writes"
    assert call.graph.replays == 2 and len(recorded) == 1  # recorded once, never run eagerly again
