"""The Budget sweep: DDTree at several tree budgets on the Run tab's prompt and settings (and with its second drafter
too, where one is picked), against one AR run, the runs taking turns on the model (each on its own clock, so that a
load falls on all alike); the best budget is the one measured fastest, said with how noisy one pass is."""

from __future__ import annotations

from dataclasses import replace

import gradio as gr

from engine.errors import EngineError
from engine.methods import BASELINE, TREE
from engine.trace import Trace
from viz.figures import sweep_figure, sweep_points, sweep_verdict
from viz.page.state import (
    Lane,
    PlannedRun,
    RunControl,
    Session,
    checked,
    common_settings,
    disturbed,
    encode_prompt,
    problem,
    refusal,
    run_live,
)
from viz.text_view import run_stats

DEFAULT_SWEEP = "4, 8, 16, 32, 64, 128"
MAX_SWEEP_POINTS = 8
SWEEP_HEADERS = ["budget", "τ", "step cost (AR steps)", "predicted τ ÷ cost", "measured speed-up",
                 "± one pass's noise", "tokens/s", "tokens", "steps", "drafter"]


class SweepView:
    """DDTree at several budgets on the Run tab's prompt and settings, against one AR run."""

    def __init__(self, session: Session):
        self.session = session
        self.studio = session.studio

    def build(self) -> None:
        gr.Markdown("DDTree at several tree budgets on the prompt and settings of the **Run** tab (its second "
                    "drafter too, where one is picked), with AR as the tokens/s reference. The best budget is the one "
                    "measured fastest; each is one pass, whose noise is drawn and said beside it.")
        with gr.Row():
            self.budgets = gr.Textbox(DEFAULT_SWEEP, label=f"Budgets (comma separated, up to {MAX_SWEEP_POINTS})",
                                      scale=3)
            self.sweep_button = gr.Button("Run sweep", variant="primary", scale=1)
            self.stop_button = gr.Button("Stop", variant="stop", scale=0)
        self.status = gr.Markdown("", label="Sweep status")
        self.plot = gr.Plot(sweep_figure([]), label="Budget sweep")
        # the drafter's name wraps, not a header in the middle of a word
        self.table = gr.Dataframe(headers=SWEEP_HEADERS, label="Sweep results", interactive=False, wrap=True,
                                  column_widths=["7%", "6%", "12%", "12%", "11%", "11%", "8%", "7%", "6%", "20%"])

    def sweep(self, prompt, max_new_tokens, temperature, seed, budgets_text, second_drafter, control: RunControl):
        """AR and DDTree at each budget (with each drafter) in turns; the plot and the table once they end."""
        control.stop = False
        try:
            budgets = parse_budgets(budgets_text)
            prompt_ids = encode_prompt(self.studio, prompt)
            common = common_settings(max_new_tokens, temperature, seed)
            decoders = {Lane(TREE): self.studio.decoder,
                        Lane(TREE, second=True): self.studio.second_decoder(second_drafter)}
            planned = [PlannedRun(Lane(BASELINE), self.studio.decoder, common)] + [
                PlannedRun(lane, decoder, replace(common, method=TREE.name, tree_budget=budget))
                for budget in budgets for lane, decoder in decoders.items() if decoder is not None]
            notes = checked(prompt_ids, planned)
        except EngineError as exc:
            raise refusal(exc) from None
        said = "".join(f" · {note}" for note in notes)
        for note in notes:
            gr.Info(note)
        heading = f"{BASELINE.title} and {TREE.title} at {len(budgets)} budget(s) in turns, each on its own clock"
        compiling = next(filter(None, (self.studio.first_use(run.settings, run.decoder) for run in planned)), None)
        live = None
        try:
            for live in run_live(self.studio, prompt, prompt_ids, planned, control):
                tokens = sum(run_stats(trace).tokens for trace in live.traces.values())
                bar = progress_bar(tokens, len(planned) * common.max_new_tokens)
                doing = (f"waiting for the model, behind {live.waiting_behind} other run(s)" if live.waiting_behind
                         else f"{compiling}…" if compiling and not tokens else f"{tokens} tokens")
                yield {self.status: f"{bar} {heading}: {doing}{said}"}
        except Exception as exc:
            yield {self.status: problem(exc)}
            return
        race = live.race
        traces = race.traces if race is not None else []
        baseline = next((trace for trace in traces if trace.config.method_row is BASELINE), None)
        runs = [trace for trace in traces if trace is not baseline]
        done = "Sweep stopped." if control.stop else "Sweep finished."
        verdict = sweep_verdict(runs, baseline)
        # the last message carries everything: API clients only see the final one
        yield {self.status: " ".join(filter(None, [f"{progress_bar(1, 1)} {done}", verdict])) + said
               + disturbed(self.studio, race), **self._results(runs, baseline)}

    def _results(self, runs: list[Trace], baseline: Trace | None) -> dict:
        return {self.plot: sweep_figure(runs, baseline), self.table: sweep_rows(runs, baseline)}


def parse_budgets(text: str) -> list[int]:
    parts = [part.strip() for part in (text or "").replace(";", ",").split(",") if part.strip()]
    try:
        budgets = sorted({int(part) for part in parts})
    except ValueError:
        raise EngineError(f"budgets must be whole numbers separated by commas, e.g. {DEFAULT_SWEEP}") from None
    if not budgets:
        raise EngineError(f"enter at least one budget, e.g. {DEFAULT_SWEEP}")
    if len(budgets) > MAX_SWEEP_POINTS:
        raise EngineError(f"at most {MAX_SWEEP_POINTS} budgets per sweep, got {len(budgets)}")
    return budgets


def sweep_rows(runs: list[Trace], baseline: Trace | None) -> list[list]:
    rows = []
    for points in sweep_points(runs, baseline).values():
        for point in points:
            stats, entry, trace = run_stats(point.trace), point.economics, point.trace
            rows.append([point.budget, round(stats.tau, 3), _shown(entry.step_cost_vs_ar, ""),
                         _shown(entry.predicted_speedup, "×"), _shown(entry.speedup_vs_ar, "×"),
                         _shown(point.noise, "×"), round(stats.tokens_per_s, 2), stats.tokens, stats.steps,
                         trace.config.drafter])
    return rows


def _shown(value: float | None, unit: str) -> str:
    return "–" if value is None else f"{value:.2f}{unit}"


def progress_bar(done: int, total: int, width: int = 20) -> str:
    bar = round(width * done / total) if total else width
    return f"`[{'█' * bar}{'·' * (width - bar)}]`"

