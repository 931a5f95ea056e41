"""The Traffic view: a Studio server's recent requests (``python -m engine.tools.serve``), any of them opened in
every view of the page as an upload is; the list refreshes itself while the panel is open."""

from __future__ import annotations

import time
from collections.abc import Callable

import gradio as gr

from engine.errors import EngineError
from engine.methods import METHODS
from engine.serving.traffic import DEFAULT_SERVER, ServedRequest, recent_requests, request_traces, server_url
from engine.trace import Trace
from viz.page.state import Session, by_lane, refusal

REFRESH_S = 5.0  # how often an open panel asks the server for its list
PROMPT_SHOWN = 48  # a prompt's first characters in the table: the numbers after it stay in view


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
                          open=server is not None) as self.panel:
            with gr.Row():
                self.url = gr.Textbox(server or DEFAULT_SERVER, label="Server (python -m engine.tools.serve)", scale=3,
                                      elem_id="traffic-url")
                self.refresh_button = gr.Button("Refresh", scale=1, elem_id="traffic-refresh")
            # every column in view on a laptop's screen: the prompt wraps rather than pushing τ and finish aside
            self.table = gr.Dataframe(headers=self.HEADERS, label="Recent requests, newest first (click one to open "
                                      "it)", interactive=False, elem_id="traffic-table", wrap=True,
                                      column_widths=["9%", "14%", "10%", "28%", "7%", "6%", "6%", "9%", "11%"])
            with gr.Row():
                self.request = gr.Dropdown([], label="Request", scale=3, elem_id="traffic-request")
                self.open_button = gr.Button("Open in the inspector", scale=1, elem_id="traffic-open")
            self.listed = gr.State([])  # the ids of the table's rows, in its order
        self.clock = gr.Timer(REFRESH_S, active=server is not None)  # ticks while the panel is open

    def refresh(self, url: str) -> dict:
        try:
            listed = self.listing(url)
        except EngineError as exc:
            raise refusal(exc) from None
        return {**listed, self.session.status: f"{len(listed[self.listed])} request(s) served by {server_url(url)}."}

    def follow(self, url: str, chosen: str | None) -> dict:
        """The list again, as the open panel's clock asks for it, the request picked kept and the status line
        left to what it says; a server that stops answering stops the clock, said once there (Refresh asks again)."""
        try:
            return self.listing(url, chosen)
        except EngineError as exc:
            return {self.session.status: f"The traffic list stopped refreshing: {exc}. Refresh to ask again.",
                    self.clock: gr.Timer(active=False)}

    def listing(self, url: str, chosen: str | None = None) -> dict:
        """The server's requests, newest first, and the one picked (``chosen`` while it is listed, else the newest)."""
        requests = recent_requests(url)
        rows = [[time.strftime("%H:%M:%S", time.gmtime(r.created)), r.endpoint, _served_label(r),
                 r.prompt[:PROMPT_SHOWN], r.tokens, r.steps, round(r.tau, 2), round(r.tokens_per_s, 1),
                 r.finish_reason] for r in requests]
        choices = [(f"{row[0]} · {row[2]} · {request.prompt[:40]!r}", request.id)
                   for row, request in zip(rows, requests)]
        ids = [request.id for request in requests]
        picked = chosen if chosen in ids else ids[0] if ids else None
        return {self.table: rows, self.listed: ids, self.request: gr.Dropdown(choices=choices, value=picked)}

    def watch(self, open_: bool) -> gr.Timer:
        """The clock runs while the panel is open."""
        return gr.Timer(active=open_)

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

