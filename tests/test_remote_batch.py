"""A batch across a process boundary (``engine.loop.remote_batch``): the driver's ``RemoteBatch`` over a
``BatchHost``, every call through JSON as vLLM's workers answer, gives each request the trace the host's batch
gives it, step by step as the rounds go, and stops a request whose client left."""

from __future__ import annotations

import json

from engine.loop.batch import Batch
from engine.loop.remote_batch import BatchHost, RemoteBatch
from engine.loop.settings import DecodeSettings
from tests.test_batch import CHEAP_NODES, TOKENS, alone, oracle_decoder, pinned


def through_json(host: BatchHost):
    def call(method: str, *args):
        sent = json.loads(json.dumps(args))
        return json.loads(json.dumps(getattr(host, method)(*sent)))
    return call


def test_a_remote_batch_streams_each_requests_steps_and_stops_the_ones_whose_clients_left():
    decoder, asked = oracle_decoder()
    host = BatchHost(Batch(decoder, pinned(CHEAP_NODES)))
    remote = RemoteBatch(through_json(host))
    seen: dict[str, list[int]] = {}

    def streamed(name):
        return lambda trace, step: seen.setdefault(name, []).append(step.index)

    flags = {"stopped": False, "gone": False}
    jobs = {"tree": (asked[0], DecodeSettings("ddtree", max_new_tokens=TOKENS, tree_budget=12)),
            "chain": (asked[1], DecodeSettings("dflash", max_new_tokens=9)),
            "plain": (asked[2], DecodeSettings("ar", max_new_tokens=TOKENS))}
    requests = {name: remote.admit_prepared("", ids, *decoder.prepare(settings, len(ids)), on_step=streamed(name),
                                            name=name) for name, (ids, settings) in jobs.items()}
    stopped = remote.admit_prepared("", asked[3], *decoder.prepare(jobs["plain"][1], len(asked[3])),
                                    should_stop=lambda: flags["stopped"], name="stopped")
    finished = remote.advance() + remote.advance()
    flags["stopped"] = True
    gone = remote.admit_prepared("", asked[4], *decoder.prepare(jobs["plain"][1], len(asked[4])),
                                 should_stop=lambda: flags["gone"], name="gone")
    flags["gone"] = True  # its client left before its first token
    while not remote.idle:
        finished += remote.advance()
    assert sorted(r.name for r in finished) == sorted([*jobs, "stopped", "gone"])
    assert gone.trace is None and stopped.trace.summary.stop_reason == "cancelled"
    for name, (ids, settings) in jobs.items():
        trace = requests[name].trace
        assert trace.output_ids == alone(decoder, ids, settings).output_ids, name
        assert seen[name] == list(range(len(trace.steps))), "each step streamed once, in order"
        assert trace.summary.new_tokens == len(trace.output_ids) and trace.token_texts
    assert requests["chain"].trace.summary.stop_reason == "max_new_tokens"
    assert not host.sent and not host.leaving and host.batch.idle
