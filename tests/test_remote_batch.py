"""A batch across a process boundary (``engine.loop.remote_batch``): the driver's ``RemoteBatch`` over a
``BatchHost``, every call through JSON as vLLM's workers answer, gives each request the trace the host's batch
gives it, step by step as the rounds go, and stops a request whose client left."""

from __future__ import annotations

import json
import logging
import re
import time

import pytest

from engine.loop.batch import Batch, RoundTimes
from engine.loop.remote_batch import BatchHost, RemoteBatch
from engine.loop.settings import DecodeSettings
from engine.serving.batcher import Batcher, round_times_line
from engine.serving.model_queue import ModelQueue
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


def test_a_remote_round_says_where_its_time_went_the_way_to_the_host_and_back_apart():
    decoder, asked = oracle_decoder()
    host = BatchHost(Batch(decoder, pinned(CHEAP_NODES)))
    hop_s = 0.02
    there = through_json(host)
    remote = RemoteBatch(lambda method, *args: time.sleep(hop_s) or there(method, *args))
    for ids in asked[:2]:
        remote.admit_prepared("", ids, *decoder.prepare(DecodeSettings("ddtree", max_new_tokens=8, tree_budget=6),
                                                        len(ids)))
    rounds = []
    while not remote.idle:
        begun = time.perf_counter()
        remote.advance()
        rounds.append((time.perf_counter() - begun, remote.last_round))
    first = rounds[0][1]
    assert first.prefill_s > 0 and first.step_s > 0, "the first round prefills both prompts and steps them"
    assert all(times.prefill_s < first.prefill_s for _, times in rounds[1:]), "no prompt joins later"
    for seconds, times in rounds:
        assert hop_s <= times.hop_s <= seconds and times.report_s > 0 and times.streams_s > 0
        assert times.total_s == pytest.approx(seconds, abs=0.005)
        assert set(times.stage_s) == {"draft", "tree_build", "tree_compile", "verify", "commit"}
        assert sum(times.stage_s.values()) <= times.step_s


def test_the_servers_line_of_round_times_adds_up_to_its_mean_round():
    timed = [(0.030, 0.001, RoundTimes(prefill_s=0.010, step_s=0.012, report_s=0.001, hop_s=0.004, streams_s=0.002,
                                       stage_s={"draft": 0.004, "verify": 0.006})),
             (0.020, 0.003, RoundTimes(step_s=0.014, report_s=0.001, hop_s=0.002, streams_s=0.001,
                                       stage_s={"draft": 0.002, "verify": 0.008})),
             (0.010, 0.002, RoundTimes(prefill_s=0.009))]  # a round of prompts alone: no step
    line = round_times_line(timed)
    numbers = [float(n) for n in re.findall(r"\d+\.\d+", line)]
    mean, parts, waiting, median, stages = numbers[0], numbers[1:7], numbers[7], numbers[8], numbers[9:]
    assert line.startswith("the last 3 rounds") and mean == 20.0 and sum(parts) == pytest.approx(mean, abs=0.02)
    assert parts == [6.33, 8.67, 0.67, 2.0, 1.0, 1.33] and waiting == 2.0 and median == 20.0
    assert stages == [3.0, 7.0, 3.0], "the stages of the rounds that stepped, the rest of their step its records"


def test_a_served_batch_logs_where_its_rounds_went_once_it_goes_idle(caplog):
    decoder, asked = oracle_decoder()
    queue = ModelQueue()
    batcher = Batcher(decoder, queue, pinned(CHEAP_NODES))
    settings = DecodeSettings("dflash", max_new_tokens=8)
    with caplog.at_level(logging.INFO, logger="ddtree-serve"):
        futures = [batcher.submit(f"request-{n}", "", ids, *decoder.prepare(settings, len(ids)))
                   for n, ids in enumerate(asked[:2])]
        for future in futures:
            future.result(timeout=60)
        # the round that settled them logs after settling them: a job queued behind it runs once it is done
        queue.submit(lambda: None).result(timeout=60)
    lines = [record.getMessage() for record in caplog.records if "mean ms a round" in record.getMessage()]
    rounds = sum(int(re.match(r"the last (\d+) rounds", line).group(1)) for line in lines)
    assert lines and rounds >= max(len(future.result().steps) for future in futures) and not batcher.timed
