"""The Replay view: every run of the session replayed on one clock in the Run columns, its race chart, and the
comparison video of it (``viz.video``)."""

from __future__ import annotations

import time

import gradio as gr

from engine.errors import EngineError
from engine.methods import BASELINE
from engine.trace import Trace
from viz.figures import race_chart
from viz.page.state import LANES, RunControl, Session, ordered, refusal
from viz.text_view import column_html
from viz.video import VideoError, render_video

REPLAY_FRAME_S = 0.1
# strings, so the API lists exactly the values it accepts
REPLAY_SPEEDS = [("0.25×", "0.25"), ("0.5×", "0.5"), ("1× (real time)", "1")]


class ReplayView:
    """The race replayed in the Run columns on one clock, its chart, and the video of it."""

    def __init__(self, session: Session, columns: dict[str, gr.HTML]):
        self.session = session
        self.columns = columns

    def build(self) -> None:
        with gr.Accordion("Replay race (all methods on one clock, from the recorded step times)", open=True):
            with gr.Row():
                self.speed = gr.Radio(REPLAY_SPEEDS, value="0.5", label="Replay speed", scale=3)
                self.replay_button = gr.Button("Replay race", scale=1, elem_id="replay-button")
            self.race = gr.Plot(race_chart([]), label="Tokens over time", show_label=False, elem_id="race-plot")
            with gr.Row():
                self.video_button = gr.Button("Render comparison video (MP4, 720p)", scale=1, elem_id="video-button")
                self.video = gr.Video(label="Comparison video", interactive=False, scale=3, elem_id="video")

    @property
    def status(self) -> gr.Markdown:
        return self.session.status

    def replay(self, traces: dict[str, Trace], speed: str, control: RunControl):
        """Animate every run on one clock, each token appearing when its step ended: the race chart beside the
        button, and the columns above it."""
        runs = ordered(traces)
        if not runs:
            raise refusal(EngineError("nothing to replay yet: run the methods or upload traces"))
        control.stop = False
        speed = float(speed or 1)
        finish = max(trace.summary.wall_s for trace in runs)
        started = time.perf_counter()
        clock = 0.0
        while clock < finish and not control.stop:
            clock = min(finish, (time.perf_counter() - started) * speed)
            yield self._race_frame(traces, clock, f"Replay at {speed:g}×: t = {clock:.2f} s of {finish:.2f} s")
            time.sleep(REPLAY_FRAME_S)
        yield self._race_frame(traces, None, "Replay finished." if not control.stop else "Replay stopped.")

    @staticmethod
    def filmable(traces: dict[str, Trace]) -> list[Trace]:
        runs = ordered(traces)
        if not runs:
            raise refusal(EngineError("nothing to film yet: run the methods or upload traces"))
        return runs

    @staticmethod
    def check_film(traces: dict[str, Trace]) -> None:
        ReplayView.filmable(traces)

    def render_video(self, traces: dict[str, Trace], speed: str, progress=gr.Progress()) -> dict:
        """The race as an MP4, drawn from the traces (the replay speed sets the slow motion)."""
        runs = self.filmable(traces)
        out = self.session.files.path("ddtree-comparison.mp4")
        try:
            render_video(runs, out, preset="720p", slowdown=1.0 / float(speed or 1),
                         progress=lambda done, total: progress(done / total, desc="rendering video frames"))
        except VideoError as exc:
            raise refusal(exc) from None
        return {self.status: f"Video rendered: {len(runs)} columns, {out.stat().st_size / 1e6:.1f} MB.",
                self.video: str(out)}

    def _race_frame(self, traces: dict[str, Trace], clock: float | None, status: str) -> dict:
        ar = traces.get(BASELINE.name)
        return {self.status: status, self.race: race_chart(ordered(traces), until=clock), **{
            self.columns[lane.key]: column_html(lane.caption, traces.get(lane.key), ar, until=clock,
                                                all_done=clock is None) for lane in LANES}}

    def shown(self, traces: dict[str, Trace]) -> dict:
        return {self.race: race_chart(ordered(traces))}

