"""The Doctor tab: the drafter doctor's report on the loaded pair (``engine.measure.doctor``) as the page shows it,
one job on the model's queue, saying as it goes how long it has left; Stop ends it between two of its passes."""

from __future__ import annotations

from concurrent import futures

import gradio as gr

from engine.errors import EngineError
from viz.figures import empty_figure
from viz.page.state import POLL_S, RunControl, Studio, problem, refusal, whole


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
                    "feed them (layer ids ±1, sliding windows, the final norm). Its time grows with the prompts and "
                    "tokens: while it runs it says how long it has left, from its own pace, and Stop ends it.")
        with gr.Row():
            self.prompts = gr.Textbox("\n".join(DEFAULT_PROMPTS), lines=4, label="Prompts (one a line)", scale=3,
                                      elem_id="doctor-prompts")
            with gr.Column(scale=1):
                self.tokens = gr.Number(ProbeSettings.max_new_tokens, label="Greedy tokens per prompt", step=1,
                                        elem_id="doctor-tokens")  # no precision: ``whole`` refuses 2.5, never rounds
                self.vllm = gr.Checkbox(False, label="Also probe the wiring vLLM 0.23 gives this drafter")
                with gr.Row():
                    self.button = gr.Button("Run the doctor", variant="primary", elem_id="doctor-button")
                    self.stop_button = gr.Button("Stop", variant="stop", elem_id="doctor-stop")
        self.verdict = gr.Markdown("Not run yet.", label="Verdict", elem_id="doctor-verdict")
        with gr.Row():
            self.plots = [gr.Plot(empty_figure("run the doctor"), label=name, show_label=False,
                                  elem_id=f"doctor-{name}") for name in self.PLOTS[:2]]
        with gr.Row():
            self.plots += [gr.Plot(empty_figure("run the doctor"), label=name, show_label=False,
                                   elem_id=f"doctor-{name}") for name in self.PLOTS[2:]]
        self.control = gr.State(RunControl())  # the session's doctor Stop switch, apart from its runs'
        # the page checks the settings first, in an event without outputs, so a refusal marks none of them "Error"
        # while the probe itself keeps its progress; an API client calls /examine, which checks them too
        self.button.click(self.check, [self.tokens, self.vllm], None, queue=False, api_visibility="private",
                          show_progress="hidden").success(
            self.examine, [self.prompts, self.tokens, self.vllm, self.control], [self.verdict, *self.plots],
            api_name="examine")
        self.stop_button.click(stop_doctor, self.control, None, queue=False, api_visibility="private",
                               show_progress="hidden")

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

    def examine(self, prompt_text: str, max_new_tokens, check_vllm: bool, control: RunControl):
        """The doctor's report on the prompts, as one job on the model's queue; until it ends, where it is and how
        long it has left (the last message carries the report: API clients see only that one)."""
        from engine.measure.doctor import DoctorStopped, Pacer, diagnose
        from viz.doctor_figures import doctor_figures, report_markdown

        settings = self.probe_settings(max_new_tokens, check_vllm)
        lines = [line.strip() for line in (prompt_text or "").splitlines() if line.strip()]
        control.stop = False
        heard = []
        job = self.studio.queue.submit(diagnose, self.studio.decoder, lines, settings,
                                       pacer=Pacer(heard.append, lambda: control.stop))
        try:
            while not futures.wait([job], timeout=POLL_S).done:
                waiting = self.studio.queue.ahead_of(job) + 1 if not job.running() else 0
                now = (f"waiting for the model, behind {waiting} other run(s)" if waiting else
                       str(heard[-1]) if heard else "starting")
                yield {self.verdict: f"**Running the doctor**: {now}…"}
            report = job.result()
        except DoctorStopped as stopped:
            yield {self.verdict: f"**Stopped**: {stopped}. Nothing was judged."}
            return
        except Exception as exc:  # shown in the tab; the app keeps running
            yield {self.verdict: problem(exc)}
            return
        finally:
            if not job.done():  # the page went away: the doctor stops at its next pass
                control.stop = True
                self.studio.queue.cancel(job)
        figures = doctor_figures(report)
        yield {self.verdict: report_markdown(report)} | {plot: figures[name]
                                                         for plot, name in zip(self.plots, self.PLOTS)}


def stop_doctor(control: RunControl) -> None:
    """The doctor stops at its next pass."""
    control.stop = True

