"""The Traces view: the session's traces as a file to download (``engine.trace``'s trace file, with the run's
API digest beside it), and an upload that shows a file's traces in every view."""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from engine.trace import Trace, TraceError, read_trace_file
from viz.page.state import TRACE_FILE_NAME, Session, by_lane, ordered, refusal, save_traces
from viz.page.summary import run_summary


class TracesView:
    """The session's traces as a file to download, and an upload that shows a file's traces."""

    def __init__(self, session: Session):
        self.session = session

    def build(self) -> None:
        with gr.Accordion("Traces: download or upload (replay and inspect without running a model)", open=False):
            with gr.Row():
                self.download = gr.File(label="Download this run's traces (JSON)", interactive=False)
                self.upload = gr.File(label="Upload traces (JSON)", file_types=[".json"], type="filepath")
            self.summary = gr.JSON(label="Run summary", value={})

    def load_upload(self, path: str | None, present: Callable[[dict[str, Trace], str], dict]) -> dict:
        if not path:
            return {}
        try:
            traces = read_trace_file(path)
        except TraceError as exc:
            raise refusal(exc) from None
        shown = by_lane(traces)
        status = f"Loaded {len(shown)} trace(s) from the upload."
        if len(shown) < len(traces):
            status += " The file holds several traces of one method and drafter; the first of each is shown."
        try:
            return present(shown, status)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # a value of the wrong kind that the reader let through: refused, not an internal error
            raise refusal(TraceError(f"the file's traces hold a value that cannot be shown ({type(exc).__name__}: "
                                     f"{exc})")) from None

    def shown(self, traces: dict[str, Trace]) -> dict:
        runs = ordered(traces)
        download = save_traces(runs, self.session.files.path(TRACE_FILE_NAME)) if runs else None
        return {self.summary: run_summary(traces), self.download: download}

