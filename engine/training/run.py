"""The whole procedure as one command: prompts -> replies -> training, within a deadline.

    python -m engine.training.run --model /tmp/smol-hf --out /tmp/dflash --num-prompts 50000 \\
        --deadline-minutes 9 --later-minutes 8.5 [train flags, e.g. --num-layers 4 --distill-weight 0.5]

Run it again with the same --out and it reuses what is there: the data stage is skipped
once data-stats.json exists (``--more-data-minutes`` then adds a top-up of new prompts
first), and training resumes from train/train-state.pt. So one
command, repeated, carries the work over several time-limited GPU calls. The first
training run sets the learning-rate schedule to its own time plus --later-minutes.

Each stage runs in its own process: vLLM's memory is gone before training starts.
Flags this command does not know go to ``engine.training.train``; data flags go in
--data-flags "...".
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.training.data import STATS_FILE, corpus_counts, read_corpus
from engine.training.train import STATE_FILE

TRAIN_FOLDER = "train"
MORE_FOLDER = "more"  # top-ups of data made by later calls: more-1/, more-2/, ...
OVERRUN_MINUTES = 0.75  # a stage (which stops and saves itself) is killed only this long past its budget


@dataclass(frozen=True)
class Plan:
    """How one call's minutes are shared between the stages."""

    deadline_minutes: float  # the call must be done by then (counted from --started-at)
    later_minutes: float = 0.0  # training planned in later calls (resumed runs)
    data_minutes: float = 5.5  # the data stage at most: engine start + prompts + replies
    min_train_minutes: float = 1.5  # the data stage leaves at least this for training
    save_minutes: float = 0.3  # kept back at the end for saving and copying

    def data_budget(self, elapsed_minutes: float) -> float:
        left = self.deadline_minutes - elapsed_minutes - self.min_train_minutes - self.save_minutes
        return min(self.data_minutes, left)

    def train_budget(self, elapsed_minutes: float) -> float:
        return self.deadline_minutes - elapsed_minutes - self.save_minutes

    def schedule_minutes(self, elapsed_minutes: float) -> float:
        """A fresh run's schedule length: this call's training time plus the later calls'."""
        return self.train_budget(elapsed_minutes) + self.later_minutes


class StageFailed(RuntimeError):
    pass


def run_stage(name: str, command: list[str], timeout_minutes: float) -> float:
    """Run one stage as a child process (its output passes straight through); its seconds.
    A stage that overruns its time by far is stopped with everything it started (vLLM's
    engine runs in a grandchild process that would otherwise keep the GPU)."""
    print(f"== {name}: {shlex.join(command)}", flush=True)
    began = time.monotonic()
    child = subprocess.Popen(command, env=os.environ | {"PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        code = child.wait(timeout=timeout_minutes * 60)
    except subprocess.TimeoutExpired:
        code = None
    stop_group(child)  # also after a clean exit: a leftover engine process would hold GPU memory
    seconds = time.monotonic() - began
    if code is None:
        raise StageFailed(f"{name} ran past {timeout_minutes:.1f} min and was stopped")
    if code != 0:
        raise StageFailed(f"{name} failed (exit status {code}) after {seconds / 60:.2f} min")
    print(f"== {name}: done in {seconds / 60:.2f} min", flush=True)
    return seconds


def stop_group(child: subprocess.Popen) -> None:
    """End what is left of the child's process group (the child and whatever it started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return  # nothing left
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(1)  # grandchildren get a moment to exit too


def make_data(args, plan: Plan, elapsed) -> None:
    """The data stage; if vLLM fails, transformers ``generate`` carries on where it stopped."""
    try:
        minutes = plan.data_budget(elapsed())
        run_stage("data", data_command(args, args.backend, minutes), minutes + OVERRUN_MINUTES)
    except StageFailed as failure:
        if (args.out / STATS_FILE).exists():  # the data was written; only the exit went wrong
            print(f"== data: {failure}, but {STATS_FILE} was written: going on", flush=True)
            return
        if args.backend != "vllm" or not args.fallback:
            raise
        minutes = plan.data_budget(elapsed())
        print(f"== data: {failure}; falling back to transformers generate for {minutes:.2f} min", flush=True)
        command = data_command(args, "transformers", minutes) + ["--batch-size", "256"]
        run_stage("data (transformers)", command, minutes + OVERRUN_MINUTES)


def more_data(args, plan: Plan, elapsed) -> None:
    """A top-up before resumed training: new prompts (another seed) answered into ``more-K/``,
    which training reads beside the first data (less the prompts the first data answered or held out:
    the line printed after the top-up counts them). A failure costs this call its data, not its training."""
    count = 1 + sum(1 for folder in args.out.glob(f"{MORE_FOLDER}-*") if (folder / STATS_FILE).exists())
    folder = args.out / f"{MORE_FOLDER}-{count}"
    minutes = min(args.more_data_minutes, plan.data_budget(elapsed()))
    try:
        run_stage(f"more data ({folder.name})", data_command(args, args.backend, minutes, folder,
                                                              args.data_seed + 1000 * count), minutes + OVERRUN_MINUTES)
    except StageFailed as failure:
        print(f"== more data: {failure}; training on what is there", flush=True)
        return
    print("== corpus: " + json.dumps(corpus_counts(read_corpus(args.out))), flush=True)


def data_command(args, backend: str, minutes: float, out: Path | None = None, seed: int | None = None) -> list[str]:
    command = [sys.executable, "-m", "engine.training.data", "--out", str(out or args.out), "--backend", backend,
               "--num-prompts", str(args.num_prompts), "--max-minutes", f"{minutes:.2f}",
               "--seed", str(args.data_seed if seed is None else seed),
               "--workers", str(args.data_workers if backend == "vllm" else 1)]
    if args.model:
        command += ["--model", args.model]
    return command + shlex.split(args.data_flags)


def train_command(args, train_flags: list[str], minutes: float, schedule_minutes: float) -> list[str]:
    folder = args.out / TRAIN_FOLDER
    command = [sys.executable, "-m", "engine.training.train", "--data", str(args.out), "--out", str(folder),
               "--max-minutes", f"{minutes:.2f}"]
    if args.model:
        command += ["--model", args.model]
    state = folder / STATE_FILE
    command += ["--resume", str(state)] if state.exists() else ["--schedule-minutes", f"{schedule_minutes:.2f}"]
    return command + train_flags


def parse_args(argv=None):
    # no abbreviations: a flag meant for train must never be taken as a prefix of one of ours
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--model", default=None, help="HF folder of the target (vLLM needs one)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--backend", choices=["vllm", "transformers"], default="vllm")
    parser.add_argument("--num-prompts", type=int, default=50_000)
    parser.add_argument("--data-workers", type=int, default=1, help="vLLM engines generating side by side")
    parser.add_argument("--deadline-minutes", type=float, default=9.0, help="this call ends by then")
    parser.add_argument("--started-at", type=float, default=None,
                        help="unix time the call started (default: now); the deadline counts from it")
    parser.add_argument("--later-minutes", type=float, default=0.0, help="training planned in later calls")
    parser.add_argument("--data-minutes", type=float, default=Plan.data_minutes)
    parser.add_argument("--min-train-minutes", type=float, default=Plan.min_train_minutes)
    parser.add_argument("--data-seed", type=int, default=0,
                        help="the data's seed (prompts, sampling); a top-up K uses this + 1000 K")
    parser.add_argument("--more-data-minutes", type=float, default=0.0,
                        help="in a call that finds the data made: generate this much more (new prompts) first")
    parser.add_argument("--data-flags", default="",
                        help='extra engine.training.data flags, e.g. "--chunk-prompts 4096"')
    parser.add_argument("--data-only", action="store_true",
                        help="make the data (or the top-up) and stop: a call whose corpus is carried back for later")
    parser.add_argument("--no-fallback", dest="fallback", action="store_false",
                        help="if vLLM fails, stop instead of generating with transformers")
    return parser.parse_known_args(argv)


def main(argv=None) -> None:
    try:
        run_all(*parse_args(argv))
    except StageFailed as failure:
        print(f"== stopped: {failure}", flush=True)
        sys.exit(1)


def run_all(args, train_flags: list[str]) -> None:
    started_at = args.started_at or time.time()
    # a data-only call keeps no minutes back for training
    plan = Plan(args.deadline_minutes, args.later_minutes, args.data_minutes,
                0.0 if args.data_only else args.min_train_minutes)

    def elapsed() -> float:
        return (time.time() - started_at) / 60

    if (args.out / STATS_FILE).exists():
        print(f"== data: reusing {args.out} ({STATS_FILE} exists)", flush=True)
        if args.more_data_minutes > 0:
            more_data(args, plan, elapsed)
    else:
        make_data(args, plan, elapsed)
    if args.data_only:
        print(f"== data only: done at {elapsed():.2f} min, no training in this call", flush=True)
        return
    minutes = plan.train_budget(elapsed())
    if minutes < 0.5:
        print(f"== train: skipped, only {minutes:.2f} min left before the deadline", flush=True)
        return
    command = train_command(args, train_flags, minutes, plan.schedule_minutes(elapsed()))
    run_stage("train", command, minutes + OVERRUN_MINUTES)
    print(f"== all stages done at {elapsed():.2f} min", flush=True)


if __name__ == "__main__":
    main()
