"""Drive a running (or launched) Studio app through its API, as a user's script would, and print
what it says about speed: per prompt and method τ, step cost in AR steps, the predicted speed-up
τ ÷ cost and the measured one; the budget the page started with and why; the Budget sweep tab on
the first ``--sweep-prompts`` prompts, and on how many of them some budget beat AR.

    python -m engine.tools.app_check --launch "python app.py --engine vllm" --prompts assets/prompts/fresh.jsonl \\
        --limit 5 --max-new-tokens 64 --out app-check.json
    python -m engine.tools.app_check --url http://127.0.0.1:7860/ --limit 3
    python -m engine.tools.app_check --limit 0 --sweep-prompts 69   # the sweep alone, every fresh prompt

Predicted and measured are the same quantity up to the prefill (in the measured wall times,
not in the per-step cost) and warm-up (the app warms every method and candidate budget while
it calibrates at start-up), so their ratio is printed for each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from engine.methods import NAMES
from engine.tools.bench import read_prompts

KEYS = ("tau", "step_cost_vs_ar", "predicted_speedup", "speedup_vs_ar")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, process: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"the app exited with {process.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"the app did not answer at {url} within {timeout_s:.0f} s") from None
            time.sleep(2)


def check(url: str, prompts: list[dict], max_new_tokens: int, sweep_budgets: str,
          sweep_prompts: list[dict]) -> dict:
    from gradio_client import Client

    client = Client(url, verbose=False)
    info = client.predict(api_name="/info")
    print(f"page: {info['engine']} engine on {info['device']}, model {info['model']}, drafter {info['drafter']}")
    print(f"default budget: {info['tree_budget']} ({info['auto_budget']}); fixed: {info['why']}")
    runs = []
    for prompt in prompts:
        outputs = dict(zip(info["run_outputs"], client.predict(prompt["prompt"], max_new_tokens, 0.0, 0,
                                                               info["tree_budget"], list(NAMES), api_name="/run")))
        summary, download = outputs["summary"], outputs["download"]  # /info names /run's outputs, in their order
        engines = {trace["config"]["engine"] for trace in json.loads(Path(download).read_text())["traces"]}
        runs.append({"prompt_id": prompt["id"], "engines": sorted(engines),
                     "methods": {method: {key: entry[key]
                                          for key in KEYS + ("identical_to_ar", "tokens", "wall_s", "prefill_s")}
                                 for method, entry in summary.items()}})
        for method, entry in runs[-1]["methods"].items():
            ratio = (entry["predicted_speedup"] / entry["speedup_vs_ar"]
                     if entry["predicted_speedup"] and entry["speedup_vs_ar"] else None)
            print(f"{prompt['id']:>16} {method:>6}: τ {entry['tau']:.2f}, step cost {entry['step_cost_vs_ar']:.2f} AR "
                  f"steps, predicted {entry['predicted_speedup']:.2f}×, measured {entry['speedup_vs_ar']:.2f}×"
                  + (f" (predicted / measured {ratio:.3f})" if ratio else "")
                  + f", prefill {entry['prefill_s'] / entry['wall_s']:.0%} of its wall time, "
                    f"engine {'/'.join(engines)}")
    sweeps = [sweep(client, prompt, max_new_tokens, sweep_budgets) for prompt in sweep_prompts]
    if sweeps:
        faster = sum(1 for entry in sweeps if entry["best_speedup"] and entry["best_speedup"] > 1)
        print(f"sweep: {faster} of {len(sweeps)} prompts have a DDTree budget faster than AR")
    return {"info": info, "runs": runs, "sweeps": sweeps}


def sweep(client, prompt: dict, max_new_tokens: int, budgets: str) -> dict:
    """The Budget sweep tab on one prompt: its table, and the budget with the best measured speed-up."""
    status, _, table = client.predict(prompt["prompt"], max_new_tokens, 0.0, 0, budgets, api_name="/sweep")
    print(f"sweep {prompt['id']}: {status}")
    for row in table["data"]:
        print("  " + " | ".join(str(cell) for cell in row))
    column = table["headers"].index("measured speed-up")
    speedups = {row[0]: float(row[column].rstrip("×")) for row in table["data"] if row[column] != "–"}
    best = max(speedups, key=speedups.get) if speedups else None
    return {"prompt_id": prompt["id"], "table": table, "best_budget": best,
            "best_speedup": speedups.get(best)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running app (default: launch one with --launch)")
    parser.add_argument("--launch", default="python app.py", help="command that starts the app (a port is added)")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--prompts", default="assets/prompts/fresh.jsonl")
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sweep", default="4, 8, 16, 32, 64", help="the sweep's budgets")
    parser.add_argument("--sweep-prompts", type=int, default=1, help="sweep the first this many prompts")
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    prompts = read_prompts(args.prompts)
    process = None
    url = args.url
    if url is None:
        port = free_port()
        command = shlex.split(args.launch) + ["--host", "127.0.0.1", "--port", str(port)]
        process = subprocess.Popen(command, env=os.environ | {"GRADIO_ANALYTICS_ENABLED": "False"})
        url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(url, process, args.startup_timeout)
        result = check(url, prompts[: args.limit], args.max_new_tokens, args.sweep, prompts[: args.sweep_prompts])
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
