"""The drafter doctor: check a target + drafter pair, say why acceptance is low and what to fix.

    python -m engine.tools.doctor [--model M] --drafter D [--prompts P.jsonl] [--engine torch|vllm]
        [--max-new-tokens 48] [--static] [--out REPORT.json]

Prints the verdict first, then the evidence (``engine.measure.doctor``). Exit status: 0 healthy, 1 a fault
(named, with its fix), 2 bad input (one error line), 3 not judged: too few draft positions scored to tell a
miswiring from noise (more prompts or tokens per prompt). ``--engine vllm`` also checks what vLLM 0.23 itself
reads (its layer-id convention, its drafter windows) and probes that wiring on the torch engine: vLLM
itself is not run. ``--static``: the config checks alone, for config-only shapes (``assets/shapes/``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engine.errors import EngineError, run_command
from engine.loop.decode import Decoder
from engine.loop.loading import AUTO, DRAFT_DTYPE_HELP, display_name, draft_dtype_for, drafter_info
from engine.measure.doctor import (
    DEFAULT_PROMPTS,
    DoctorProgress,
    Pacer,
    ProbeSettings,
    diagnose,
    probe_can_run,
    static_report,
)
from engine.measure.doctor_checks import check_for_this_target, static_checks
from engine.models.drafter import load_drafter, read_drafter_config
from engine.models.target import BUNDLED_MODEL, bundled_gguf, has_tokenizer, load_target, shape_config
from engine.tools.bench import read_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="target: folder, GGUF file or hub id (default: the bundled one)")
    parser.add_argument("--drafter", required=True, help="the DFlash drafter folder")
    parser.add_argument("--prompts", default=None, help="a prompts JSONL file (default: a small built-in set)")
    parser.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    parser.add_argument("--max-new-tokens", type=int, default=ProbeSettings.max_new_tokens,
                        help="greedy tokens per prompt the probe scores")
    parser.add_argument("--dtype", default="float32", help="the target's dtype")
    parser.add_argument("--draft-dtype", default=AUTO, help=DRAFT_DTYPE_HELP)
    parser.add_argument("--static", action="store_true", help="the config checks alone (no weights needed)")
    parser.add_argument("--out", default=None, help="also write the report as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, parse_args(argv))


def _main(args: argparse.Namespace) -> int:
    settings = ProbeSettings(max_new_tokens=args.max_new_tokens, engine=args.engine)
    prompts = [p["prompt"] for p in read_prompts(args.prompts)] if args.prompts else list(DEFAULT_PROMPTS)
    config = read_drafter_config(args.drafter)  # bad drafter input fails here, before any load
    raw = json.loads((Path(args.drafter) / "config.json").read_text())
    name = display_name(args.drafter)
    if args.static:
        tokenizer = None
        if args.model and has_tokenizer(args.model):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.model)
        findings = static_checks(shape_config(args.model), tokenizer, config, args.engine, raw)
        return finish(static_report(args.model, name, args.engine, findings), args.out)
    check_for_this_target(model_config(args.model), config)  # a drafter for another target: exit 2 before the load
    started = time.perf_counter()
    target = load_target(args.model, dtype=args.dtype)
    findings = static_checks(target.config, target.tokenizer, config, args.engine, raw)  # another target: exit 2
    if not probe_can_run(findings):
        return finish(static_report(target.name, name, args.engine, findings), args.out)
    drafter = load_drafter(args.drafter).to(device=target.device).eval()
    drafter = drafter.to(dtype=draft_dtype_for(target, drafter, args.draft_dtype))
    decoder = Decoder(target, drafter, drafter_info(args.drafter))
    print(f"loaded in {time.perf_counter() - started:.1f} s; probing {len(prompts)} prompts", file=sys.stderr)
    report = diagnose(decoder, prompts, settings, raw, pacer=Pacer(say_stage))
    return finish(report, args.out)


def say_stage(progress: DoctorProgress) -> None:
    """Each stage as it starts, on stderr."""
    if progress.done == 0:
        print(progress.stage, file=sys.stderr)


def model_config(model: str | None):
    """The target's config alone, read without its weights."""
    from transformers import AutoConfig

    if model in (None, BUNDLED_MODEL) or model.endswith(".gguf"):
        gguf = bundled_gguf() if model in (None, BUNDLED_MODEL) else Path(model)
        if not gguf.is_file():
            raise EngineError(f"GGUF file {model!r} does not exist")
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return shape_config(model)


def finish(report, out: str | None) -> int:
    print("\n".join(report.lines()))
    if out:
        Path(out).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    return report.status


if __name__ == "__main__":
    sys.exit(main())
