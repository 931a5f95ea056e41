"""Benchmark report: BENCHMARKS.md and its plots, from ``engine.tools.bench`` result files.

    python -m viz.report --results results/*.json --out BENCHMARKS.md [--assets assets/bench]
    python -m viz.report --results results/*.json --headline    # just the README table
    python -m viz.report --results "benchmarks/*.json" "benchmarks/hybrid/*.json" "benchmarks/shapes/*.json" \
        "benchmarks/baseline/*.json" --append "benchmarks/kernels/*.md" --out BENCHMARKS.md    # the repo's

Each results file is one measurement setting (say, CPU torch engine, or a GPU) and gets
its own section: where and how it was measured, τ / tokens/s / speedup per method,
per-position acceptance, a budget trade-off plot and an acceptance-length histogram.
``--append`` adds sections other tools wrote, as they are (``engine.tools.gdn_bench --table``'s).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.measure.projection import projection_report
from engine.methods import AUTO, BASELINE, DFLASH, METHODS, TREE, Label
from engine.models.target import BUNDLED_MODEL
from engine.trace import (
    NATIVE_AR,
    NATIVE_AR_GRAPHLESS,
    NATIVE_DFLASH,
    NATIVE_MTP,
    SCRIPTED,
    STAGES,
    TIMING_ONLY,
    TOKENS_ONLY,
)

MAX_POSITIONS = 15  # draft positions shown in the acceptance table (a block of 16 drafts 15)
NATIVE_NAMES = {NATIVE_AR: "vLLM's own AR", NATIVE_AR_GRAPHLESS: "vLLM's own AR, no CUDA graphs",
                NATIVE_DFLASH: "vLLM's own DFlash", NATIVE_MTP: "vLLM's own MTP"}
OTHER_COLOUR = "#64748b"  # a label of no method in the table (vLLM's own); the methods' are their print colours
NATIVE_METHODS = {NATIVE_AR: BASELINE, NATIVE_DFLASH: DFLASH}  # vLLM's own runs drawn in their method's colour
DDTREE_SHADES = ["#fbbf24", "#f59e0b", "#d97706", "#b45309", "#92400e", "#78350f"]


class ReportError(ValueError):
    """A results file that cannot be reported."""


# ---------------------------------------------------------------- reading results


@dataclass(frozen=True)
class MethodRow:
    label: str
    tau: float
    tokens_per_s: float
    speedup: float | None
    identical: str  # "3/3", "yes"/"no", or "baseline" for AR
    vllm_speedup: float | None = None  # vllm engine runs with --native: against vLLM's own AR
    vllm_identical: str = "–"


@dataclass(frozen=True)
class Setting:
    """One results file: one place and way of measuring."""

    path: Path
    config: dict
    runs: list[dict]
    summary: dict
    notes: list[str]
    best: dict | None = None  # the bench's best DDTree budget (tokens/s)

    @property
    def title(self) -> str:
        config = self.config
        where = config.get("host", {}).get("gpu") or str(config.get("device", "unknown device"))
        if (config.get("tensor_parallel_size") or 1) > 1:
            where = f"{config['tensor_parallel_size']}× {where}, tensor parallel"
        prompts = Path(str(config.get("prompts", "?"))).stem
        step = {"fixed": " · fixed-shape step", "readable": " · readable step"}.get(config.get("step"), "")
        step += (" (compiled)" if config.get("compile_step")
                 else " (target compiled by vLLM)" if config.get("vllm_compile") else "")
        cut_before = [what for key, what in (("kernels_pending", "its kernel counts"),
                                             ("native_pending", "vLLM's own AR"))
                      if config.get(key)]
        step += f" · cut off before {' and '.join(cut_before)}" if cut_before else ""
        # the baseline's pace at 135M depends on it (docs/HISTORY.md, the H200 table): say it where the run recorded it
        native = str(config.get("vllm_ar_settings") or "")
        max_seqs = [part for part in native.split(", ") if "max_num_seqs" in part]
        step += f" · vLLM AR: {max_seqs[0]}" if max_seqs else ""
        prompts += f" ({config['num_prompts']})" if config.get("num_prompts") else ""
        dtype = config.get("dtype", "?") + (f" ({config['draft_dtype']} drafts)" if config.get("draft_dtype") else "")
        title = f"{where} · {config.get('engine', '?')} engine{step} · {dtype} · {prompts} prompts"
        model = Path(str(config.get("model"))).name
        if config.get("timing_only"):
            return f"{model} ({TIMING_ONLY}) · {title}"
        # the bundled SmolLM2 goes unnamed: by its name, or as its GGUF staged on the GPU machine
        bundled = model == BUNDLED_MODEL or model.lower().startswith("smollm2-135m-instruct")
        return title if bundled else f"{model} · {title}"

    @property
    def labels(self) -> list[str]:
        return sorted(self.summary, key=lambda label: Label.parse(label).order)

    @property
    def positions(self) -> int:
        block = self.config.get("block_size")
        return min(MAX_POSITIONS, block - 1) if isinstance(block, int) and block > 1 else MAX_POSITIONS

    def rows(self) -> list[MethodRow]:
        return [_method_row(label, self.summary[label]) for label in self.labels]

    def acceptance_lengths(self, label: str) -> list[int]:
        """Every verify step's acceptance length (bonus included), all prompts."""
        return [n for run in self.runs if run_label(run) == label for n in run["acceptance_lengths"]]

    def drafting_labels(self) -> list[str]:
        return [label for label in self.labels
                if Label.parse(label).method is not BASELINE and self.acceptance_lengths(label)]


def _method_row(label: str, entry: dict) -> MethodRow:
    identical = entry.get("identical_to_ar")
    if Label.parse(label).method is BASELINE:
        shown = "baseline"
    elif isinstance(identical, bool):
        shown = "yes" if identical else "no"
    else:
        shown = str(identical) if identical is not None else "–"
        if entry.get("near_ties_vs_ar"):
            shown += f" ({entry['near_ties_vs_ar']} at near-ties)"
    vllm_identical = "baseline" if label == NATIVE_AR else str(entry.get("identical_to_vllm_ar", "–"))
    return MethodRow(label, float(entry["tau"]), float(entry["tokens_per_s"]), entry.get("speedup_vs_ar"), shown,
                     entry.get("speedup_vs_vllm_ar"), vllm_identical)


def label_budget(label: str) -> int | None:
    """The node count a label carries (``ddtree@32``), if any."""
    budget = Label.parse(label).budget
    return budget if isinstance(budget, int) else None


def run_label(run: dict) -> str:
    if run.get("label"):
        return run["label"]
    row = METHODS.get(run["method"])
    return row.label(run.get("tree_budget")) if row is not None else run["method"]


def display_label(label: str) -> str:
    parsed = Label.parse(label)
    name = parsed.method.title if parsed.method is not None else NATIVE_NAMES.get(label, label)
    if parsed.budget is not None:
        name = f"{name} ({'auto budget' if parsed.budget == AUTO else f'budget {parsed.budget}'})"
    return f"{name}, tokens-only trace" if label.endswith(TOKENS_ONLY) else name


def load_setting(path: str | Path) -> Setting:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path} is not valid JSON: {exc}") from exc
    _check_results(path, data)
    return Setting(path, data["config"], data["runs"], data["summary"], list(data.get("notes", [])), data.get("best"))


def _check_results(path: Path, data) -> None:
    if not isinstance(data, dict) or not all(isinstance(data.get(k), t) for k, t in
                                             (("config", dict), ("runs", list), ("summary", dict))):
        raise ReportError(f"{path} is not an engine.tools.bench results file: it needs config, runs and summary")
    for label, entry in data["summary"].items():
        missing = [k for k in ("tau", "tokens_per_s") if k not in entry]
        if missing:
            raise ReportError(f"{path}: summary of {label} has no {missing[0]}")
    for index, run in enumerate(data["runs"]):
        missing = [k for k in ("method", "acceptance_lengths") if k not in run]
        if missing:
            raise ReportError(f"{path}: run {index} has no {missing[0]}")


def expand_paths(patterns: list[str]) -> list[Path]:
    """Result paths; patterns are globbed here too, for shells that pass them through quoted."""
    paths: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise ReportError(f"no results files match {pattern!r}")
        paths += [Path(m) for m in matches]
    return list(dict.fromkeys(paths))


# ---------------------------------------------------------------- numbers


def per_position_acceptance(lengths: list[int], positions: int) -> list[float]:
    """Share of steps that accepted draft position k (k = 1..positions). A step's
    acceptance length counts the bonus token, so it accepted position k iff length > k."""
    if not lengths:
        return [0.0] * positions
    return [sum(1 for n in lengths if n > k) / len(lengths) for k in range(1, positions + 1)]


def length_histogram(lengths: list[int], longest: int) -> list[float]:
    """Share of steps with acceptance length 1..longest."""
    if not lengths:
        return [0.0] * longest
    return [sum(1 for n in lengths if n == length) / len(lengths) for length in range(1, longest + 1)]


# ---------------------------------------------------------------- markdown


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _speedup(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _metric_cells(row: MethodRow, native: bool) -> list[str]:
    cells = [display_label(row.label), f"{row.tau:.2f}", f"{row.tokens_per_s:.1f}", _speedup(row.speedup),
             row.identical]
    return cells + [_speedup(row.vllm_speedup), row.vllm_identical] if native else cells


METRIC_HEADER = ["Method", "τ (tokens per verify step)", "tokens/s", "speedup vs AR", "identical to AR"]
NATIVE_HEADER = ["speedup vs vLLM AR", "identical to vLLM AR"]


def _native(settings: list[Setting]) -> bool:
    """Whether any setting timed vLLM's own decoding beside ours (then the table says how we compare)."""
    return any(NATIVE_AR in setting.summary for setting in settings)


def headline_table(settings: list[Setting]) -> str:
    native = _native(settings)
    rows = [[setting.title, *_metric_cells(row, native)] for setting in settings for row in setting.rows()]
    return _table(["Setting", *METRIC_HEADER, *(NATIVE_HEADER if native else [])], rows)


def method_table(setting: Setting) -> str:
    native = _native([setting])
    return _table(METRIC_HEADER + (NATIVE_HEADER if native else []),
                  [_metric_cells(row, native) for row in setting.rows()])


def acceptance_table(setting: Setting) -> str:
    positions = setting.positions
    rows = []
    for label in setting.drafting_labels():
        lengths = setting.acceptance_lengths(label)
        shares = per_position_acceptance(lengths, positions)
        rows.append([display_label(label), str(len(lengths)), *(f"{share:.0%}" for share in shares)])
    return _table(["Method", "steps", *(f"k={k}" for k in range(1, positions + 1))], rows)


def stage_ms(setting: Setting, label: str) -> tuple[dict[str, float], float] | None:
    """A method's milliseconds per verify step in each stage (the engine's stage timers) and its
    wall time per step; None when its runs have no stage timers."""
    runs = [run for run in setting.runs if run_label(run) == label and run.get("stage_s")]
    steps = sum(run.get("verify_steps") or 0 for run in runs)
    if not steps:
        return None
    per_step = {stage: 1000 * sum(run["stage_s"].get(stage, 0.0) for run in runs) / steps for stage in STAGES}
    return per_step, 1000 * sum(run["wall_s"] for run in runs) / steps


def stage_table(setting: Setting) -> str | None:
    """Milliseconds per verify step in each stage, and the rest of the loop (detokenizing,
    recording the trace, Python); None when no run has stage timers."""
    rows = []
    for label in setting.labels:
        timed = stage_ms(setting, label)
        if timed is None:
            continue
        per_step, wall = timed
        cells = [f"{per_step[stage]:.2f}" for stage in STAGES]
        rows.append([display_label(label), *cells, f"{wall - sum(per_step.values()):.2f}", f"{wall:.2f}"])
    if not rows:
        return None
    return _table(["Method", *STAGES, "rest", "wall per step (ms)"], rows)


def verify_cost_table(settings: list[Setting]) -> str | None:
    """The target's verify pass per step against the tokens it checks (AR: 1; DFlash: the block;
    DDTree@B: the root and B nodes), as milliseconds and as AR verifies of the same run, for every
    setting that timed at least two tree sizes."""
    columns: list[str] = []
    rows = []
    ar = BASELINE.label()
    for setting in settings:
        verify = {label: timed[0]["verify"] for label in setting.labels
                  if not label.endswith(TOKENS_ONLY) and Label.parse(label).method is not None
                  and (timed := stage_ms(setting, label)) is not None}
        if ar not in verify or sum(Label.parse(label).method is TREE for label in verify) < 2:
            continue
        rows.append((setting, verify))
        columns += [label for label in verify if label not in columns and label != ar]
    if not rows:
        return None
    columns.sort(key=lambda label: Label.parse(label).order)
    blocks = {setting.config.get("block_size") for setting, _ in rows}
    block = f"{next(iter(blocks))} tokens" if len(blocks) == 1 else "a block"
    names = [f"@{budget} ({budget + 1})" if (budget := label_budget(label)) is not None
             else f"{Label.parse(label).method.title} ({block})" for label in columns]
    cells = [[setting.title, f"{verify[ar]:.2f}",
              *(f"{verify[label]:.2f} ({verify[label] / verify[ar]:.2f}×)" if label in verify else "–"
                for label in columns)] for setting, verify in rows]
    return _table(["Setting", "AR verify (1 token), ms", *names], cells)


PREFILL_STAGES = ("target", "context", "start")


def prefill_table(setting: Setting) -> str | None:
    """Milliseconds per run before the first step: the prompt pass, the drafter's context, the
    fixed program's start (where recorded), and the prefill's share of the run's wall time."""
    rows = []
    for label in setting.labels:
        runs = [run for run in setting.runs if run_label(run) == label and run.get("prefill_s") is not None]
        if not runs:
            continue
        prefill = 1000 * sum(run["prefill_s"] for run in runs) / len(runs)
        staged = [stage for stage in PREFILL_STAGES if any(stage in run.get("prefill_stage_s", {}) for run in runs)]
        cells = [f"{1000 * sum(run.get('prefill_stage_s', {}).get(stage, 0.0) for run in runs) / len(runs):.1f}"
                 if stage in staged else "–" for stage in PREFILL_STAGES]
        share = sum(run["prefill_s"] for run in runs) / sum(run["wall_s"] for run in runs)
        rows.append([display_label(label), *cells, f"{prefill:.1f}", f"{share:.0%}"])
    if not rows:
        return None
    return _table(["Method", *PREFILL_STAGES, "prefill per run (ms)", "share of wall time"], rows)


def kernel_table(setting: Setting) -> str | None:
    """CUDA kernels per verify step in each stage (``engine.tools.bench --count-kernels``)."""
    counted = {label: setting.summary[label]["kernels_per_step"] for label in setting.labels
               if "kernels_per_step" in setting.summary.get(label, {})}
    if not counted:
        return None
    stages = [stage for stage in STAGES if any(stage in counts for counts in counted.values())]
    rows = [[display_label(label), *(f"{counts[stage]:.0f}" if stage in counts else "–" for stage in stages),
             f"{sum(counts.values()):.0f}"] for label, counts in counted.items()]
    return _table(["Method", *stages, "kernels per step"], rows)


def slowest_kernel_table(setting: Setting) -> str | None:
    """The kernels that took the most device time per verify step, by method and stage
    (``engine.tools.bench --count-kernels``)."""
    rows = [[display_label(label), stage, f"`{name}`", f"{micros:.1f}"] for label in setting.labels
            for stage, kernels in setting.summary.get(label, {}).get("slowest_kernels", {}).items()
            for name, micros in kernels]
    return _table(["Method", "stage", "kernel", "µs per step"], rows) if rows else None


def economics_table(setting: Setting) -> str | None:
    """τ against what a step costs in AR steps: the prediction τ ÷ cost next to the measured speed-up."""
    rows = []
    for label in setting.labels:
        entry = setting.summary[label]
        if entry.get("step_cost_vs_ar") is None:
            continue
        rows.append([display_label(label), f"{entry['tau']:.2f}", f"{entry['step_ms']:.1f}",
                     f"{entry['step_cost_vs_ar']:.2f}", _speedup(entry.get("predicted_speedup")),
                     _speedup(entry.get("speedup_vs_ar"))])
    if not rows:
        return None
    return _table(["Method", "τ", "ms per step", "step cost (AR steps)", "predicted τ ÷ cost",
                   "measured speedup"], rows)


def category_table(setting: Setting) -> str | None:
    """τ per prompt category (the prompts file's ``category`` field), one row per drafting method."""
    labels = [label for label in setting.drafting_labels() if setting.summary[label].get("tau_by_category")]
    if not labels:
        return None
    categories = sorted({c for label in labels for c in setting.summary[label]["tau_by_category"]})
    counts = {c: len({r.get("prompt_id") for r in setting.runs if r.get("category") == c}) for c in categories}
    rows = [[display_label(label),
             *(f"{setting.summary[label]['tau_by_category'].get(c, 0.0):.2f}" for c in categories)]
            for label in labels]
    return _table(["Method", *(f"{c} ({counts[c]})" for c in categories)], rows)


def projects(setting: Setting) -> bool:
    """Whether a run's step costs stand for a deployment at a model's shape: random weights, bf16, and
    a drafter's real pass (a scripted drafter's exactness run times its script instead)."""
    config = setting.config
    return (bool(config.get("timing_only")) and config.get("dtype") == "bfloat16"
            and SCRIPTED not in str(config.get("drafter")))


def projection_text(setting: Setting) -> str:
    """``engine.measure.projection``'s table for a run at a model's shape (random weights), τ from the shipped
    drafter's curve and from the DDTree paper."""
    return projection_report({"config": setting.config, "runs": setting.runs, "summary": setting.summary})


def measurement_lines(setting: Setting) -> list[str]:
    """Where and how the numbers were measured, from the results' own config."""
    config, host = setting.config, setting.config.get("host", {})
    lines = [f"Results file: `{setting.path.as_posix()}`"]
    device = str(config.get("device", "?"))
    if host.get("gpu"):
        device += f" ({host['gpu']})"
    host_bits = [host["platform"]] if host.get("platform") else []
    host_bits += [f"{package} {host[package]}" for package in ("torch", "transformers") if host.get(package)]
    if host.get("threads"):
        host_bits.append(f"{host['threads']} CPU threads")
    lines.append(f"Device: {device}" + (f" — {', '.join(host_bits)}" if host_bits else ""))
    lines.append(f"Engine: {config.get('engine', '?')}, dtype {config.get('dtype', '?')}")
    drafter = str(config.get("drafter", "?"))
    if config.get("drafter_trained") is False and "untrained" not in drafter.lower():
        drafter += " (untrained)"
    revision = config.get("drafter_revision")
    if config.get("drafter_trained"):
        drafter += (f" (weights {revision})" if revision
                    else " (weights not fingerprinted: the first trained 4-layer drafter, docs/HISTORY.md)")
    lines.append(f"Target model: {config.get('model', '?')}; drafter: {drafter}")
    prompts = f"`{config['prompts']}`" if config.get("prompts") else "?"
    count = config.get("num_prompts") or len({run.get("prompt_id") for run in setting.runs})
    lines.append(f"Prompts: {prompts} ({count} prompts), up to {config.get('max_new_tokens', '?')} new tokens each")
    lines.append(f"Decoding: {_sampling(config)}, draft block size {config.get('block_size', '?')}, "
                 f"tree budgets {', '.join(map(str, config.get('tree_budgets') or [])) or '–'}")
    if config.get("compared_to"):
        counts = ", ".join(f"{display_label(label)} {entry['identical_to_reference']}"
                           for label, entry in setting.summary.items() if "identical_to_reference" in entry)
        lines.append(f"Outputs identical to the AR of `{config['compared_to']}` (`--compare-to`): {counts}")
    if config.get("command"):
        lines.append(f"Command: `{config['command']}`")
    if config.get("total_s") is not None:
        lines.append(f"Whole benchmark took {config['total_s']:.0f} s")
    return lines


def _sampling(config: dict) -> str:
    temperature = config.get("temperature")
    if temperature is None:
        return "temperature ?"
    return "greedy (temperature 0)" if temperature == 0 else f"sampling at temperature {temperature:g}"


# ---------------------------------------------------------------- plots


def _pyplot():
    """matplotlib with the file-only backend, or None when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # no display; also keeps output identical across machines
    import matplotlib.pyplot as plt

    return plt


def _save(plt, figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    # no version stamp, so reruns give identical files; "tight" keeps legends placed outside the axes
    figure.savefig(path, dpi=120, metadata={"Software": None}, bbox_inches="tight")
    plt.close(figure)
    return path


def plot_budget_tradeoff(plt, setting: Setting, path: Path) -> Path | None:
    """τ and speedup vs tree budget for DDTree, DFlash as flat reference lines; None without DDTree runs."""
    rows = [row for row in setting.rows() if label_budget(row.label) is not None]
    if not rows:
        return None
    budgets = [label_budget(row.label) for row in rows]
    dflash = next((row for row in setting.rows() if row.label == DFLASH.label()), None)
    figure, tau_axis = plt.subplots(figsize=(7, 4))
    speed_axis = tau_axis.twinx()
    tau_axis.plot(budgets, [row.tau for row in rows], "o-", color=TREE.print_colour, label="DDTree τ")
    if all(row.speedup is not None for row in rows):
        speed_axis.plot(budgets, [row.speedup for row in rows], "s--", color="#16a34a", label="DDTree speedup")
        speed_axis.axhline(1.0, color=BASELINE.print_colour, linestyle=":", linewidth=1, label="AR (1×)")
    if dflash is not None:
        tau_axis.axhline(dflash.tau, color=DFLASH.print_colour, linewidth=1.2, label="DFlash τ")
        if dflash.speedup is not None:
            speed_axis.axhline(dflash.speedup, color=DFLASH.print_colour, linestyle="--", linewidth=1.2,
                               label="DFlash speedup")
    tau_axis.set_xscale("log", base=2)
    tau_axis.set_xticks(budgets, [str(b) for b in budgets])
    tau_axis.minorticks_off()
    tau_axis.set_xlabel("DDTree tree budget (drafted nodes per step)")
    tau_axis.set_ylabel("τ: tokens per verify step")
    speed_axis.set_ylabel("speedup vs AR (tokens/s)")
    for axis in (tau_axis, speed_axis):  # from zero, with headroom so the top marker is not cut
        axis.set_ylim(0, axis.get_ylim()[1] * 1.12)
    handles = tau_axis.get_legend_handles_labels()[0] + speed_axis.get_legend_handles_labels()[0]
    tau_axis.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8)
    tau_axis.set_title(f"Budget trade-off — {setting.title}", fontsize=10)
    tau_axis.grid(alpha=0.3)
    return _save(plt, figure, path)


def plot_acceptance_histogram(plt, setting: Setting, path: Path) -> Path | None:
    """Grouped bars: share of verify steps per acceptance length; None without drafting runs."""
    labels = setting.drafting_labels()
    if not labels:
        return None
    longest = setting.positions + 1
    width = 0.8 / len(labels)
    figure, axis = plt.subplots(figsize=(8, 4))
    for index, label in enumerate(labels):
        shares = length_histogram(setting.acceptance_lengths(label), longest)
        offsets = [length - 0.4 + width * (index + 0.5) for length in range(1, longest + 1)]
        axis.bar(offsets, shares, width=width, color=_label_colour(label, setting), label=display_label(label))
    axis.set_xticks(range(1, longest + 1))
    axis.set_xlabel("acceptance length (accepted draft tokens + 1 bonus)")
    axis.set_ylabel("share of verify steps")
    axis.set_title(f"Acceptance lengths — {setting.title}", fontsize=10)
    axis.legend(fontsize=8)
    axis.grid(axis="y", alpha=0.3)
    return _save(plt, figure, path)


def _label_colour(label: str, setting: Setting) -> str:
    if label_budget(label) is None:
        method = Label.parse(label).method
        return method.print_colour if method is not None else OTHER_COLOUR
    budgets = sorted(b for b in map(label_budget, setting.labels) if b is not None)
    # spread the budgets over the shades, light (small) to dark (large)
    step = (len(DDTREE_SHADES) - 1) / max(1, len(budgets) - 1)
    return DDTREE_SHADES[round(budgets.index(label_budget(label)) * step)]


# ---------------------------------------------------------------- the report


def asset_names(settings: list[Setting]) -> list[str]:
    """A file-name stem per setting, unique even when two results files share a name."""
    names: list[str] = []
    for setting in settings:
        base = re.sub(r"[^A-Za-z0-9_-]+", "-", setting.path.stem).strip("-") or "results"
        name, count = base, 2
        while name in names:
            name, count = f"{base}-{count}", count + 1
        names.append(name)
    return names


def build_report(settings: list[Setting], out_path: Path, assets_dir: Path, command: str,
                 appendices: list[Path] = (), served: list[Path] = ()) -> str:
    plt = _pyplot()
    parts = [
        "# Benchmarks",
        f"Generated by `{command}` from {len(settings)} results file(s) written by `engine.tools.bench`; "
        "rerun it rather than editing by hand. τ is the mean acceptance length (accepted draft tokens + the bonus "
        "token per verify step; AR's is 1). Speedup is the method's tokens per second over AR's (whole wall times), "
        "in the same run. "
        "What each run was for and what it taught, in prose, is in [docs/HISTORY.md](docs/HISTORY.md), which this "
        "report never rewrites.",
        "## Headline",
        headline_table(settings),
    ]
    verify = verify_cost_table(settings)
    if verify is not None:
        parts += ["## Verify cost by tree size\n\nThe target's verify pass per step (its stage timer), in ms, and in "
                  "brackets over the same run's AR verify (one token). Column headings: the tokens a pass checks "
                  "(DDTree@B: the root and B nodes). Only settings that timed two or more budgets.", verify]
    if plt is None:
        parts.append("_Plots were skipped: matplotlib is not installed (`pip install matplotlib`)._")
    for setting, name in zip(settings, asset_names(settings)):
        parts += _setting_section(setting, plt, assets_dir / name, out_path.parent)
    for path in served:
        parts += serve_section(path, plt, assets_dir / path.stem, out_path.parent)
    parts += [path.read_text().strip() for path in appendices]
    return "\n\n".join(parts) + "\n"


def _section(heading: str, table: str | None) -> list[str]:
    """A heading and its table, or nothing where the run has no data for it."""
    return [heading, table] if table is not None else []


def _setting_section(setting: Setting, plt, asset_stem: Path, markdown_dir: Path) -> list[str]:
    parts = [f"## {setting.title}", "Measured:\n" + "\n".join(f"- {line}" for line in measurement_lines(setting)),
             method_table(setting)]
    parts += _section("### Step economics\n\nSpeed-up = τ ÷ step cost: a step commits τ tokens and costs this many "
                      "AR steps (mean step wall time, prefill excluded, over AR's in the same run). The measured "
                      "speed-up includes the prefill.", economics_table(setting))
    best = setting.best
    if best is not None:
        parts.append(f"Best DDTree budget in this run: **{best['tree_budget']}** ({best['tokens_per_s']:.1f} tokens/s, "
                     f"τ {best['tau']:.2f}).")
    parts += _section("### τ by prompt category\n\nThe number of prompts per category is in brackets.",
                      category_table(setting))
    parts += _section("### Where the time goes\n\nMilliseconds per verify step, from the engine's stage timers "
                      "(wall time includes the prefill, spread over the steps).", stage_table(setting))
    parts += _section("### The prefill\n\nMilliseconds per run before the first verify step: the prompt's pass "
                      "through the target (and the first token's read), the drafter's context features, the fixed "
                      "program's start. Speed-ups include it; the step cost leaves it out.", prefill_table(setting))
    parts += _section("### Kernels per step\n\nCUDA kernels each stage launches per verify step (profiler, one run of "
                      "the first prompt per method; kernels a CUDA graph replays count one by one).",
                      kernel_table(setting))
    parts += _section("### Slowest kernels per step\n\nThe same profiler run: the kernels that took the most device "
                      "time per verify step in each stage (names cut to 90 characters).", slowest_kernel_table(setting))
    if setting.drafting_labels():
        parts += ["### Per-position acceptance\n\nShare of verify steps that accepted draft position k "
                  "(all prompts): a step accepts position k when its acceptance length exceeds k.",
                  acceptance_table(setting)]
    if plt is not None:
        plots = [("Budget trade-off", plot_budget_tradeoff(plt, setting, _suffixed(asset_stem, "-budget.png"))),
                 ("Acceptance lengths",
                  plot_acceptance_histogram(plt, setting, _suffixed(asset_stem, "-acceptance.png")))]
        parts += [f"### {title}\n\n![{title} — {setting.title}]({_relative(png, markdown_dir)})"
                  for title, png in plots if png is not None]
    if projects(setting):
        parts += ["### Projection (not a measurement)\n\n`python -m engine.tools.projection "
                  f"{setting.path.as_posix()}`: speed-up = τ ÷ step cost, with this run's step costs at the "
                  "model's shape and τ taken from elsewhere.", projection_text(setting)]
    if setting.notes:
        parts.append("### Notes from the benchmark run\n\n" + "\n".join(f"- {note}" for note in setting.notes))
    return parts


# ---------------------------------------------------------------- serving under concurrency

def serve_section(path: Path, plt, asset_stem: Path, markdown_dir: Path) -> list[str]:
    """An ``engine.tools.serve_bench`` results file: its table, and aggregate tokens/s against concurrency per method
    and mode (batched: solid, one at a time: dashed)."""
    results = json.loads(path.read_text())
    if results.get("kind") != "serve":
        raise ReportError(f"{path} is not a serve_bench results file (no \"kind\": \"serve\")")
    config, runs = results["config"], results["runs"]
    parts = [f"## Serving under concurrency: {path.stem}",
             f"`{results['command']}`: {config['count']} prompts of `{config['prompts']}`, {config['max_tokens']} new "
             "tokens each, greedy, streamed through the official `openai` client against the real server; each "
             "concurrency sends every prompt once, that many clients at a time. Tokens/s: every completion token "
             "over the set's wall time (over several rounds, the median round's, each round's in brackets). "
             "TTFT: from a request's send to its first text; TPOT: the rest of its time "
             "over the rest of its tokens. Identical: texts equal to the prompt's alone through AR.",
             serve_table(runs)]
    if plt is not None:
        png = plot_concurrency(plt, runs, path.stem, _suffixed(asset_stem, "-concurrency.png"))
        parts.append(f"![Aggregate tokens/s against concurrency — {path.stem}]({_relative(png, markdown_dir)})")
    return parts


def serve_table(runs: list[dict]) -> str:
    lines = ["| mode | method | concurrency | tokens/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | τ | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for run in (run for points in _grouped(runs).values() for run in points):  # by concurrency, in whichever part
        tpot = (f"{1000 * run['tpot_p50_s']:.0f} / {1000 * run['tpot_p99_s']:.0f}"
                if run["tpot_p50_s"] is not None else "–")
        rounds = run.get("round_tokens_per_s", [])
        rate = f"{run['tokens_per_s']:.1f}" + (f" ({', '.join(f'{r:.1f}' for r in rounds)})" if len(rounds) > 1 else "")
        lines.append(f"| {run['mode']} | {display_label(run['label'])} | {run['concurrency']} | "
                     f"{rate} | {run['ttft_p50_s']:.2f} / {run['ttft_p99_s']:.2f} | {tpot} | "
                     f"{run['tau']:.2f} | {run['identical']} |")
    return "\n".join(lines)


def plot_concurrency(plt, runs: list[dict], title: str, path: Path) -> Path:
    figure, axis = plt.subplots(figsize=(7, 4))
    for (mode, label), points in _grouped(runs).items():
        row = Label.parse(label).method or NATIVE_METHODS.get(label)
        concurrency = [run["concurrency"] for run in points]
        axis.plot(concurrency, [run["tokens_per_s"] for run in points], "o-" if mode == "batched" else "s--",
                  color=row.print_colour if row is not None else OTHER_COLOUR,
                  label=f"{display_label(label)}, {mode}")
    axis.set_xscale("log", base=2)
    ticks = sorted({run["concurrency"] for run in runs})
    axis.set_xticks(ticks, [str(c) for c in ticks])
    axis.minorticks_off()
    axis.set_xlabel("clients at once")
    axis.set_ylabel("aggregate output tokens/s")
    axis.set_ylim(0, axis.get_ylim()[1] * 1.12)
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8)
    axis.set_title(f"Serving under concurrency — {title}", fontsize=10)
    axis.grid(alpha=0.3)
    return _save(plt, figure, path)


def _grouped(runs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["mode"], run["label"]), []).append(run)
    return {key: sorted(points, key=lambda run: run["concurrency"]) for key, points in groups.items()}


def _suffixed(stem: Path, suffix: str) -> Path:
    return stem.with_name(stem.name + suffix)


def _relative(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m viz.report", description=__doc__.splitlines()[0])
    parser.add_argument("--results", nargs="+", required=True,
                        help="engine.tools.bench results JSON files (globs allowed)")
    parser.add_argument("--out", default="BENCHMARKS.md")
    parser.add_argument("--assets", default="assets/bench", help="folder for the PNG plots")
    parser.add_argument("--headline", action="store_true", help="print only the headline markdown table")
    parser.add_argument("--serve", nargs="*", default=[], metavar="JSON",
                        help="engine.tools.serve_bench results files (globs allowed): a section each")
    parser.add_argument("--append", nargs="*", default=[], metavar="MARKDOWN",
                        help="markdown sections other tools wrote (globs allowed), appended as they are: e.g. "
                             "engine.tools.gdn_bench --table's")
    args = parser.parse_args(argv)
    try:
        settings = [load_setting(path) for path in expand_paths(args.results)]
        if args.headline:
            print(headline_table(settings))
            return 0
        out = Path(args.out)
        command = "python -m viz.report " + " ".join(sys.argv[1:] if argv is None else argv)
        report = build_report(settings, out, Path(args.assets), command, expand_paths(args.append),
                              expand_paths(args.serve))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
    except (ReportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} and plots in {args.assets}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
