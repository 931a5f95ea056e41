"""The Doctor tab: the drafter doctor's report on the loaded pair (``engine.measure.doctor``) as the page shows it,
one job on the model's queue."""

from __future__ import annotations

import gradio as gr

from engine.errors import EngineError
from viz.figures import empty_figure
from viz.page.state import Studio, problem, refusal, whole


class DoctorView:
    """The Doctor tab: why the loaded pair's acceptance is what it is, and what to fix (``engine.measure.doctor``,
    the same report as ``python -m engine.tools.doctor``), drawn by ``viz.doctor_figures``."""

    PLOTS = ("positions", "calibration", "confidence", "wirings")

    def __init__(self, studio: Studio):
        self.studio = studio

    def build(self) -> None:
        from engine.measure.doctor import DEFAULT_PROMPTS, ProbeSettings

        gr.Markdown("Checks the loaded target + drafter pair: the configs, acceptance per draft position on the "
                    "target's own greedy output, calibration, and the same blocks fed as a miswired engine would "
                    "feed them (layer ids ±1, sliding windows, the final norm). About a minute on the CPU.")
        with gr.Row():
            self.prompts = gr.Textbox("\n".join(DEFAULT_PROMPTS), lines=4, label="Prompts (one a line)", scale=3,
                                      elem_id="doctor-prompts")
            with gr.Column(scale=1):
                self.tokens = gr.Number(ProbeSettings.max_new_tokens, label="Greedy tokens per prompt", step=1,
                                        elem_id="doctor-tokens")  # no precision: ``whole`` refuses 2.5, never rounds
                self.vllm = gr.Checkbox(False, label="Also probe the wiring vLLM 0.23 gives this drafter")
                self.button = gr.Button("Run the doctor", variant="primary", elem_id="doctor-button")
        self.verdict = gr.Markdown("Not run yet.", label="Verdict", elem_id="doctor-verdict")
        with gr.Row():
            self.plots = [gr.Plot(empty_figure("run the doctor"), label=name, show_label=False,
                                  elem_id=f"doctor-{name}") for name in self.PLOTS[:2]]
        with gr.Row():
            self.plots += [gr.Plot(empty_figure("run the doctor"), label=name, show_label=False,
                                   elem_id=f"doctor-{name}") for name in self.PLOTS[2:]]
        # the page checks the settings first, in an event without outputs, so a refusal marks none of them "Error"
        # while the probe itself keeps its progress; an API client calls /examine, which checks them too
        self.button.click(self.check, [self.tokens, self.vllm], None, queue=False, api_visibility="private",
                          show_progress="hidden").success(
            self.examine, [self.prompts, self.tokens, self.vllm], [self.verdict, *self.plots], api_name="examine")

    def probe_settings(self, max_new_tokens, check_vllm: bool):
        from engine.measure.doctor import ProbeSettings

        try:
            if self.studio.require_model().engine != "torch":
                raise EngineError("the Doctor tab probes on the torch engine: run python -m engine.tools.doctor "
                                  "--engine vllm for vLLM's wiring")
            return ProbeSettings(max_new_tokens=whole(max_new_tokens, "greedy tokens per prompt"),
                                 engine="vllm" if check_vllm else "torch")
        except EngineError as exc:
            raise refusal(exc) from None

    def check(self, max_new_tokens, check_vllm: bool) -> None:
        self.probe_settings(max_new_tokens, check_vllm)

    def examine(self, prompt_text: str, max_new_tokens, check_vllm: bool) -> dict:
        """The doctor's report on the prompts, as one job on the model's queue."""
        from engine.measure.doctor import diagnose
        from viz.doctor_figures import doctor_figures, report_markdown

        settings = self.probe_settings(max_new_tokens, check_vllm)
        lines = [line.strip() for line in (prompt_text or "").splitlines() if line.strip()]
        try:
            report = self.studio.queue.run(diagnose, self.studio.decoder, lines, settings)
        except Exception as exc:  # shown in the tab; the app keeps running
            return {self.verdict: problem(exc)}
        figures = doctor_figures(report)
        return {self.verdict: report_markdown(report)} | {plot: figures[name]
                                                          for plot, name in zip(self.plots, self.PLOTS)}

