"""The server under concurrency, through the official ``openai`` client: aggregate output tokens per second,
time per output token and time to first token, per method and concurrency, batched or one request at a time.

    python -m engine.tools.serve_bench --prompts assets/prompts/fresh.jsonl --limit 16 --max-tokens 64 \\
        --concurrency 1,2,4,8 --methods ar,dflash,ddtree@auto --modes batched,one-at-a-time --rounds 2 \\
        --out benchmarks/serve/cpu-serve.json

It starts ``python -m engine.tools.serve`` for each mode (``--one-at-a-time`` for that mode) on a free port, all at
once (an idle server costs memory, not time), warms every method up, then for each concurrency C, each mode and each
method sends every prompt once, C clients at a time, each streamed and greedy. With ``--rounds N`` it does so N
times, the modes and methods in the opposite order every other round, so that a machine whose speed drifts during
the run favours no method and no mode; a method's rate at C is the median of its rounds' (each round's is kept), its
times to first token and per output token are over every round's requests. A request's time to first token is from
its send to its first text; its time per output token is the rest of its time over the rest of its tokens; the
aggregate rate is every completion token over the wall time of the whole set. Every text is held to the prompt's
text alone through AR (the one-at-a-time server's AR at concurrency 1, or the batched AR at 1 if that mode is not
run).

A device whose calls are limited in time runs the set in parts on one machine: ``--continue-from`` an earlier part's
results (same prompts, same length) takes that part's AR reference and keeps its runs in this part's results (held
to this part's reference where that part ran none), and ``--native-concurrency`` runs vLLM's own methods at
concurrencies of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import openai
import torch

from engine.errors import EngineError, run_command
from engine.methods import AR, AUTO, BASELINE, DFLASH, METHODS, Label, Method
from engine.tools.bench import read_prompts
from engine.trace import NATIVE_AR, NATIVE_DFLASH, traces_from_data

MODES = {"batched": [], "one-at-a-time": ["--one-at-a-time"]}
NATIVE_LABELS = {AR: NATIVE_AR, DFLASH: NATIVE_DFLASH}  # vLLM's own runs of a method, as the report names them
START_S = 300


@dataclass(frozen=True)
class Answer:
    prompt_id: str
    text: str
    tokens: int
    sent: float  # seconds, this machine's monotonic clock
    first: float | None  # when its first text arrived
    done: float
    tau: float
    trace_id: str | None = None  # the server's trace of it (the Studio's answers)
    engine_tpot_s: float | None = None  # its time per output token on the engine's own clock (``engine_timed``)

    @property
    def ttft_s(self) -> float:
        return (self.first or self.done) - self.sent

    @property
    def tpot_s(self) -> float | None:
        if self.first is None or self.tokens < 2:
            return None
        return (self.done - self.first) / (self.tokens - 1)


def percentile(values: list[float], share: float) -> float | None:
    """The ``share`` quantile (nearest rank), None of nothing."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered) + 0.5) - 1))]


def ask(served: Served, prompt: dict, label: Label, max_tokens: int) -> Answer:
    api = openai.OpenAI(base_url=served.url, api_key="none", max_retries=0, timeout=600)
    extra = {"method": label.method.name} | ({"tree_budget": label.budget} if label.budget is not None else {})
    sent, first, pieces, usage, ddtree = time.monotonic(), None, [], None, {}
    stream = api.chat.completions.create(model=served.model, messages=[{"role": "user", "content": prompt["prompt"]}],
                                         max_tokens=max_tokens, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic()
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
        ddtree = (chunk.model_extra or {}).get("ddtree") or ddtree
    return Answer(prompt["id"], "".join(pieces), usage.completion_tokens, sent, first, time.monotonic(),
                  ddtree.get("tau", 0.0), ddtree.get("trace_id"))


def engine_timed(served: Served, answer: Answer) -> Answer:
    """The answer with its time per output token as the engine saw it: from its trace (the server's, fetched once
    every client is done), its first token to its last on the clock where the models run. Beside the client's, it
    says how much of a served token's time is the step itself and how much the way to the client."""
    if answer.trace_id is None:
        return answer
    data = httpx.get(f"{served.url}/traces/{answer.trace_id}", timeout=60).raise_for_status().json()
    trace = traces_from_data(data)[0]
    tokens = len(trace.output_ids)
    if not trace.steps or tokens < 2:
        return answer
    return replace(answer, engine_tpot_s=(trace.steps[-1].t_end - trace.prefill.t_end) / (tokens - 1))


@dataclass(frozen=True)
class Run:
    mode: str
    label: str
    concurrency: int
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    tau: float
    identical: str  # "16/16": texts equal to the prompt's alone through AR
    answers: list[dict]
    round_tokens_per_s: list[float] = field(default_factory=list)  # each round's rate, in round order
    engine_tpot_p50_s: float | None = None  # the answers' times per output token on the engine's clock, p50


def merged(rounds: list[Run]) -> Run:
    """One method's runs at one concurrency, a run each round, as one: the median round's rate, and the times of
    every round's requests."""
    answers = [answer for run in rounds for answer in run.answers]
    same = [run.identical.split(" ")[0].split("/") for run in rounds if run.identical != "-"]
    identical = (f"{sum(int(a) for a, _ in same)}/{sum(int(b) for _, b in same)}" if same else "-")
    if any("reference" in run.identical for run in rounds):
        identical += " (the reference)"
    first, timed = rounds[0], [Answer(**a) for a in answers]
    return Run(first.mode, first.label, first.concurrency, statistics.median(run.tokens_per_s for run in rounds),
               *latencies(timed), statistics.mean(run.tau for run in rounds), identical, answers,
               [run.tokens_per_s for run in rounds], engine_tpot(timed))


def measure(served: Served, prompts: list[dict], label: Label, concurrency: int, max_tokens: int, mode: str,
            reference: dict[str, str] | None) -> Run:
    began = time.monotonic()
    with ThreadPoolExecutor(concurrency) as clients:
        answers = list(clients.map(lambda prompt: ask(served, prompt, label, max_tokens), prompts))
    wall = time.monotonic() - began
    answers = [engine_timed(served, answer) for answer in answers]
    return judged(Run(mode, label.text, concurrency, sum(a.tokens for a in answers) / wall, *latencies(answers),
                      statistics.mean(a.tau for a in answers), "-", [asdict(a) for a in answers],
                      engine_tpot_p50_s=engine_tpot(answers)), reference)


def latencies(answers: list[Answer]) -> tuple[float, float, float | None, float | None]:
    """p50 and p99 of the answers' times to first token, then of their times per output token."""
    ttft = [a.ttft_s for a in answers]
    tpot = [a.tpot_s for a in answers if a.tpot_s is not None]
    return percentile(ttft, 0.5), percentile(ttft, 0.99), percentile(tpot, 0.5), percentile(tpot, 0.99)


def engine_tpot(answers: list[Answer]) -> float | None:
    """p50 of the answers' times per output token on the engine's clock (None: none was timed there)."""
    return percentile([a.engine_tpot_s for a in answers if a.engine_tpot_s is not None], 0.5)


def measure_native(args: argparse.Namespace, natives: list[Method], prompts: list[dict], concurrencies: list[int],
                   reference: dict[str, str] | None) -> Iterator[list[Run]]:
    """vLLM's own AR and DFlash (``--native``) on the same prompts, once the Studio's servers are gone: its engine
    in this process at its fastest settings that keep its outputs (``native_llm``), under each concurrency as many
    clients (``native_clients``: its own continuous batching), every round; each method's runs as it ends."""
    from engine.on_vllm.vllm_engine import ClientTarget, model_folder, native_clients, native_llm, timed_clients
    from engine.serving.startup import add_model_arguments

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    served, _ = parser.parse_known_args(args.server_args.split())
    target = ClientTarget("native", model_folder(served.model), torch.bfloat16, 0)  # the server's prompts and stops
    ids = [target.chat_ids(prompt["prompt"]) for prompt in prompts]
    stops = target.stop_ids
    for row in natives:
        runs = []
        llm = native_llm(served.model, served.dtype or "bfloat16", served.drafter if row.drafts else None)
        native_clients(llm, ids[:1], 1, 8, stops)  # warm-up, untimed
        for concurrency in concurrencies:
            rounds = []
            for _ in range(args.rounds):
                timed = timed_clients(llm, ids, concurrency, args.max_tokens, stops)
                as_sent = [Answer(prompts[a.index]["id"], target.decode(a.output_ids),
                                  len(a.output_ids), a.sent, a.first, a.done, 0.0) for a in timed.answers]
                rounds.append(judged(Run("vllm", NATIVE_LABELS[row], concurrency,
                                         sum(a.tokens for a in as_sent) / timed.seconds, *latencies(as_sent),
                                         timed.tau, "-", [asdict(a) for a in as_sent]), reference))
                print(table(rounds[-1:]).splitlines()[-1], flush=True)
            runs.append(merged(rounds))
        del llm
        yield runs


def continued(path: Path, prompts: list[dict], max_tokens: int) -> tuple[list[Run], dict[str, str] | None]:
    """An earlier part's runs and its AR reference (None if it ran none), refused unless it ran these prompts at
    this length."""
    earlier = json.loads(path.read_text())
    ids = {prompt["id"] for prompt in prompts}
    runs = [Run(**run) for run in earlier["runs"]]
    if earlier["config"]["max_tokens"] != max_tokens or any({a["prompt_id"] for a in run.answers} != ids
                                                            for run in runs):
        raise EngineError(f"--continue-from {path}: it ran {earlier['config']['count']} prompts at "
                          f"{earlier['config']['max_tokens']} tokens, not these {len(ids)} at {max_tokens}")
    reference = next(({a["prompt_id"]: a["text"] for a in run.answers} for run in runs
                      if run.identical.endswith("(the reference)")), None)
    return runs, reference


def judged(run: Run, reference: dict[str, str] | None) -> Run:
    """``run`` with its texts held to the AR reference, if it has not been and there is one: as it is measured, or
    later (an earlier part's runs, when a later part runs the reference)."""
    if run.identical != "-" or reference is None:
        return run
    same = sum(answer["text"] == reference[answer["prompt_id"]] for answer in run.answers)
    return replace(run, identical=f"{same}/{len(run.answers)}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Served:
    """``python -m engine.tools.serve`` in a process of its own, for one mode."""

    def __init__(self, mode: str, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        command = [sys.executable, "-m", "engine.tools.serve", "--port", str(self.port), *MODES[mode], *extra]
        self.process = subprocess.Popen(command, env=os.environ | {"PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + START_S
        while True:
            if self.process.poll() is not None:
                raise EngineError(f"the server ({' '.join(command)}) exited with {self.process.returncode}")
            try:
                listed = httpx.get(f"{self.url}/models", timeout=2)
                if listed.status_code == 200:
                    self.model = listed.json()["data"][0]["id"]  # the name it serves its model by
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise EngineError(f"the server did not answer within {START_S} s")
            time.sleep(0.5)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def table(runs: list[Run]) -> str:
    lines = ["| mode | method | concurrency | tokens/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | engine TPOT p50 "
             "(ms) | τ | identical to AR |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        tpot = (f"{1000 * run.tpot_p50_s:.0f} / {1000 * run.tpot_p99_s:.0f}" if run.tpot_p50_s is not None else "–")
        engine = f"{1000 * run.engine_tpot_p50_s:.1f}" if run.engine_tpot_p50_s is not None else "–"
        lines.append(f"| {run.mode} | {run.label} | {run.concurrency} | {run.tokens_per_s:.1f} | "
                     f"{run.ttft_p50_s:.2f} / {run.ttft_p99_s:.2f} | {tpot} | {engine} | {run.tau:.2f} | "
                     f"{run.identical} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.serve_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="assets/prompts/fresh.jsonl")
    parser.add_argument("--limit", type=int, default=16, help="prompts, spread evenly over the file")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--methods", default=f"ar,dflash,ddtree@{AUTO}", help="labels: ar, dflash, ddtree@auto, ...")
    parser.add_argument("--modes", default="batched,one-at-a-time", help=f"of {', '.join(MODES)}")
    parser.add_argument("--server-args", default="", help="more flags for the server (its model flags)")
    parser.add_argument("--rounds", type=int, default=1, help="times every method runs at every concurrency")
    parser.add_argument("--native", default="", help="vLLM's own methods too, after the servers (GPU): ar, dflash")
    parser.add_argument("--native-concurrency", default="", help="concurrencies of vLLM's own runs (default: "
                        "--concurrency's)")
    parser.add_argument("--continue-from", type=Path, help="an earlier part's results: its AR reference, its runs kept")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def save(args: argparse.Namespace, prompts: list[dict], runs: list[Run]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"kind": "serve", "command": " ".join(sys.argv),
                                    "config": {"prompts": args.prompts, "count": len(prompts),
                                               "max_tokens": args.max_tokens, "cpu_threads": os.cpu_count(),
                                               "baseline": BASELINE.name},
                                    "runs": [asdict(run) for run in runs]}, indent=1))


def main(args: argparse.Namespace) -> int:
    rows = read_prompts(args.prompts)
    prompts = rows[:: max(1, len(rows) // args.limit)][: args.limit]
    labels = [Label.parse(text) for text in args.methods.split(",")]
    unknown = [label.text for label in labels if label.method is None]
    modes = args.modes.split(",")
    if unknown or set(modes) - set(MODES):
        raise EngineError(f"unknown method labels {unknown} or modes {modes}: methods ar, dflash, ddtree@N, "
                          f"ddtree@auto; modes {', '.join(MODES)}")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    natives = [METHODS.get(name) for name in args.native.split(",") if name]
    if any(row not in (AR, DFLASH) for row in natives) or (DFLASH in natives and
                                                             "--drafter" not in args.server_args.split()):
        raise EngineError(f"--native takes ar and dflash (vLLM's own DFlash runs the --drafter the server args "
                          f"name), got {args.native!r}")
    modes = sorted(modes, key=lambda m: m != "one-at-a-time")  # the AR reference first, where it is run
    served: dict[str, Served] = {}
    measured: dict[tuple[str, str, int], list[Run]] = {}
    earlier, reference = continued(args.continue_from, prompts, args.max_tokens) if args.continue_from else ([], None)
    try:
        for mode in modes:
            served[mode] = Served(mode, args.server_args.split())
            for label in labels:  # warm-up: the first run of each method pays for what it builds
                ask(served[mode], prompts[0], label, 8)
        for round_index in range(args.rounds):
            flip = round_index % 2 == 1
            for concurrency in concurrencies:
                for mode in modes[::-1] if flip else modes:
                    for label in labels[::-1] if flip else labels:
                        run = measure(served[mode], prompts, label, concurrency, args.max_tokens, mode, reference)
                        if reference is None and label.is_baseline and concurrency == 1:
                            reference = {a["prompt_id"]: a["text"] for a in run.answers}
                            run = Run(**(asdict(run) | {"identical": f"{len(prompts)}/{len(prompts)} (the reference)"}))
                        measured.setdefault((mode, label.text, concurrency), []).append(run)
                        print(f"round {round_index + 1}: " + table([run]).splitlines()[-1], flush=True)
                        # saved as it goes: a run cut short by its time limit keeps what it measured
                        save(args, prompts, earlier + [merged(rounds) for rounds in measured.values()])
    finally:
        for server in served.values():
            server.close()
    runs = [judged(run, reference) for run in earlier] + [merged(measured[(mode, label.text, concurrency)])
                                                          for mode in modes for label in labels
                                                          for concurrency in concurrencies]
    save(args, prompts, runs)
    if natives:
        native_concurrencies = [int(c) for c in (args.native_concurrency or args.concurrency).split(",")]
        for native_runs in measure_native(args, natives, prompts, native_concurrencies, reference):
            runs += native_runs
            save(args, prompts, runs)  # each method's as it ends: vLLM's start-up is the slow part
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, parse_args()))
