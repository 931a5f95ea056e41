"""The Traffic view: a Studio server's recent requests (``python -m engine.tools.serve``), any of them opened in
every view of the page as an upload is."""

from __future__ import annotations

import time
from collections.abc import Callable

import gradio as gr

from engine.errors import EngineError
from engine.methods import METHODS
from engine.serving.traffic import DEFAULT_SERVER, ServedRequest, recent_requests, request_traces, server_url
from engine.trace import Trace
from viz.page.state import Session, by_lane, refusal


class TrafficView:
    """A Studio server's recent requests (``python -m engine.tools.serve``), any of them opened in every view of
    the page as an upload is: the columns, the economics, the replay and the step inspector."""

    HEADERS = ["time (UTC)", "endpoint", "method", "prompt", "tokens", "steps", "τ", "tokens/s", "finish"]

    def __init__(self, session: Session, present: Callable[[dict[str, Trace], str], dict]):
        self.session = session
        self.studio = session.studio
        self.present = present

    def build(self) -> None:
        server = self.studio.server
        with gr.Accordion("Traffic: the requests a Studio server answered (open one to inspect its trees)",
                          open=server is not None):
            with gr.Row():
                self.url = gr.Textbox(server or DEFAULT_SERVER, label="Server (python -m engine.tools.serve)", scale=3,
                                      elem_id="traffic-url")
                self.refresh_button = gr.Button("Refresh", scale=1, elem_id="traffic-refresh")
            self.table = gr.Dataframe(headers=self.HEADERS, label="Recent requests, newest first (click one to open "
                                      "it)", interactive=False, elem_id="traffic-table")
            with gr.Row():
                self.request = gr.Dropdown([], label="Request", scale=3, elem_id="traffic-request")
                self.open_button = gr.Button("Open in the inspector", scale=1, elem_id="traffic-open")
            self.listed = gr.State([])  # the ids of the table's rows, in its order

    def refresh(self, url: str) -> dict:
        try:
            requests = recent_requests(url)
        except EngineError as exc:
            raise refusal(exc) from None
        rows = [[time.strftime("%H:%M:%S", time.gmtime(r.created)), r.endpoint, _served_label(r), r.prompt[:80],
                 r.tokens, r.steps, round(r.tau, 2), round(r.tokens_per_s, 1), r.finish_reason] for r in requests]
        choices = [(f"{row[0]} · {row[2]} · {request.prompt[:40]!r}", request.id)
                   for row, request in zip(rows, requests)]
        return {self.table: rows, self.listed: [request.id for request in requests],
                self.request: gr.Dropdown(choices=choices, value=choices[0][1] if choices else None),
                self.session.status: f"{len(requests)} request(s) served by {server_url(url)}."}

    def open(self, url: str, trace_id: str | None) -> dict:
        try:
            traces = request_traces(url, trace_id)
        except EngineError as exc:
            raise refusal(exc) from None
        trace = traces[0]
        return self.present(by_lane([trace]), f"Opened request {trace_id} from {server_url(url)}: "
                                              f"{trace.config.label}, {len(trace.steps)} steps.")

    def pick_row(self, ids: list[str], selected: gr.SelectData) -> str:
        """A click on the table picks the request of that row (which ``open`` then opens)."""
        row = selected.index[0] if isinstance(selected.index, (list, tuple)) else selected.index
        if not 0 <= row < len(ids):
            raise refusal(EngineError("that row is not in the list any more: refresh it"))
        return ids[row]


def _served_label(request: ServedRequest) -> str:
    """A request's run label (``ddtree@16``); a method this page does not know, by its name."""
    row = METHODS.get(request.method)
    return row.label(request.tree_budget) if row is not None else request.method

