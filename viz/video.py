"""Speed-comparison video: AR, DFlash and DDTree decoding one prompt on one shared clock.

Every frame is drawn with Pillow straight from the traces (no screen capture), so the
same traces give the same frames on any machine that has the same font: DejaVu from
Debian's ``fonts-dejavu-core``, else the copy bundled with matplotlib, else Pillow's
built-in scalable font. Frames go to H.264 through the ffmpeg binary that ships inside
the ``imageio-ffmpeg`` wheel.

    python -m viz.video --traces FILE|DIR --out comparison.mp4 [--prompt ID] [--preset 720p]

``--traces``: any trace file the Studio writes (the app's download, one ``Trace.save``, a list of traces) or
a folder of them: the bench's ``<prompt_id>.<label>.json`` (``engine.tools.bench --traces``), one set a
prompt, and any other file a set of its own named by its stem (``--prompt`` picks one).
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from engine.methods import BASELINE, TREE, Label, print_rgb
from engine.trace import Step, Trace, TraceError, read_trace_file
from viz.tree_figure import tidy_layout

MAX_COLUMNS = 5  # AR, and DFlash and DDTree of two drafters side by side
INTRO_S = 1.5  # the prompt card
HOLD_S = 2.0  # the final frame, so the finish badges can be read
PROMPT_CARD_LINES = 7
Colour = tuple[int, int, int]
Font = ImageFont.FreeTypeFont | ImageFont.ImageFont


class VideoError(ValueError):
    """Traces that cannot be turned into a comparison video."""


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class Preset:
    name: str
    width: int
    height: int

    def __post_init__(self):
        # multiples of 8 keep ffmpeg from rescaling (1080 is not a multiple of 16)
        if self.width % 8 or self.height % 8:
            raise ValueError(f"preset {self.name}: width and height must be multiples of 8")

    @property
    def scale(self) -> float:
        return self.height / 1080

    def px(self, value: float) -> int:
        """A 1080p length in this preset's pixels (at least one)."""
        return max(1, round(value * self.scale))


PRESETS = {p.name: p for p in (Preset("1080p", 1920, 1080), Preset("720p", 1280, 720), Preset("small", 640, 360))}


@dataclass(frozen=True)
class Theme:
    background: Colour = (15, 17, 23)
    panel: Colour = (24, 27, 36)
    panel_edge: Colour = (42, 47, 61)
    text: Colour = (230, 232, 238)
    muted: Colour = (139, 147, 167)
    track: Colour = (42, 47, 61)
    badge: Colour = (22, 163, 74)
    badge_text: Colour = (255, 255, 255)
    accepted: Colour = (34, 197, 94)
    rejected: Colour = (75, 82, 99)


THEME = Theme()


@dataclass(frozen=True)
class Fonts:
    title: Font
    heading: Font
    clock: Font
    body: Font
    small: Font
    label: Font
    prompt: Font


FONT_FILES = {"sans": "DejaVuSans.ttf", "bold": "DejaVuSans-Bold.ttf", "mono": "DejaVuSansMono.ttf"}


def _font_dirs() -> list[Path]:
    dirs = [Path("/usr/share/fonts/truetype/dejavu")]  # Debian: fonts-dejavu-core
    spec = importlib.util.find_spec("matplotlib")  # found without importing it: that is slow
    if spec is not None and spec.origin is not None:
        dirs.append(Path(spec.origin).parent / "mpl-data" / "fonts" / "ttf")
    return dirs


def font_path(kind: str) -> Path | None:
    """The shipped font file of ``kind`` (``FONT_FILES``), where this machine has it."""
    return next((folder / FONT_FILES[kind] for folder in _font_dirs() if (folder / FONT_FILES[kind]).is_file()), None)


@cache
def load_font(kind: str, size: int) -> Font:
    path = font_path(kind)
    return ImageFont.truetype(str(path), size) if path is not None else ImageFont.load_default(size=size)


def load_fonts(preset: Preset) -> Fonts:
    def sized(kind: str, size_1080p: int) -> Font:
        return load_font(kind, max(8, preset.px(size_1080p)))  # below 8 px nothing is legible anyway

    return Fonts(title=sized("bold", 34), heading=sized("bold", 34), clock=sized("mono", 30), body=sized("sans", 23),
                 small=sized("sans", 19), label=sized("sans", 17), prompt=sized("sans", 38))


def line_height(font: Font) -> int:
    ascent, descent = font.getmetrics()
    return round((ascent + descent) * 1.15)


# ---------------------------------------------------------------- layout


@dataclass(frozen=True)
class Box:
    x0: int
    y0: int
    x1: int
    y1: int

    @property
    def width(self) -> int:
        return self.x1 - self.x0

    @property
    def height(self) -> int:
        return self.y1 - self.y0

    @property
    def xy(self) -> tuple[int, int, int, int]:
        return (self.x0, self.y0, self.x1, self.y1)

    def inset(self, dx: int, dy: int | None = None) -> Box:
        dy = dx if dy is None else dy
        return Box(self.x0 + dx, self.y0 + dy, self.x1 - dx, self.y1 - dy)


@dataclass(frozen=True)
class ColumnLayout:
    panel: Box
    name: Box  # method name (left) and the column's clock (right)
    subtitle: Box  # model + drafter
    engine: Box  # engine, device, dtype
    stats: Box  # tokens, tau, tokens/s
    progress: Box
    text: Box
    badge: Box  # status while running, the finish badge at the end


@dataclass(frozen=True)
class Layout:
    preset: Preset
    header: Box
    columns: tuple[ColumnLayout, ...]
    tree: Box | None


def compute_layout(preset: Preset, fonts: Fonts, column_count: int, with_tree: bool) -> Layout:
    px = preset.px
    margin, gap = px(32), px(24)
    header = Box(margin, px(20), preset.width - margin, px(20) + line_height(fonts.title) + line_height(fonts.small))
    bottom = preset.height - margin
    tree = None
    if with_tree:
        tree = Box(margin, bottom - px(300), preset.width - margin, bottom)
        bottom = tree.y0 - gap
    width = (preset.width - 2 * margin - gap * (column_count - 1)) // column_count
    columns = tuple(_column_layout(Box(margin + i * (width + gap), header.y1 + gap, margin + i * (width + gap) + width,
                                       bottom), fonts, px) for i in range(column_count))
    return Layout(preset, header, columns, tree)


def _column_layout(panel: Box, fonts: Fonts, px: Callable[[float], int]) -> ColumnLayout:
    inner = panel.inset(px(20), px(16))
    rows = []
    y = inner.y0
    for height in (line_height(fonts.heading), line_height(fonts.small), line_height(fonts.small),
                   line_height(fonts.small) + px(6), px(10)):
        rows.append(Box(inner.x0, y, inner.x1, y + height))
        y += height
    badge = Box(inner.x0, inner.y1 - line_height(fonts.body) - px(16), inner.x1, inner.y1)
    text = Box(inner.x0, y + px(14), inner.x1, badge.y0 - px(10))
    return ColumnLayout(panel, *rows, text, badge)


# ---------------------------------------------------------------- what each column shows at time t


def sanitize(piece: str) -> str:
    """Text as drawn: tabs become spaces; other control characters (bar newlines) are dropped."""
    piece = piece.replace("\t", "    ")
    return "".join(c for c in piece if c == "\n" or c.isprintable())


@dataclass(frozen=True)
class ColumnState:
    elapsed_s: float  # the column's own clock: it stops when the run finished
    chars: int  # characters of the (sanitized) text shown so far
    tokens: int
    steps: int  # verify steps completed
    tau: float | None  # mean acceptance length so far; None before the first step
    finished: bool

    @property
    def in_prefill(self) -> bool:
        return self.tokens == 0 and not self.finished


@dataclass(frozen=True)
class Column:
    """One trace, precomputed so the state at any time is a couple of bisects."""

    trace: Trace
    text: str
    prefill_end: float
    step_ends: tuple[float, ...]
    chars_after: tuple[int, ...]  # after the prefill (index 0) and after each step
    tokens_after: tuple[int, ...]
    wall_s: float
    speedup: float | None  # tokens/s relative to AR; None when there is no AR trace

    @staticmethod
    def from_trace(trace: Trace, ar_tokens_per_s: float | None = None) -> Column:
        text = sanitize(trace.prefill.first_text)
        chars, tokens = [len(text)], [1]
        for step in trace.steps:
            text += sanitize("".join(step.committed_text))
            chars.append(len(text))
            tokens.append(tokens[-1] + step.acceptance_length)
        ends = tuple(s.t_end for s in trace.steps)
        wall = max([trace.prefill.t_end, *ends, trace.summary.wall_s if trace.summary else 0.0])
        speedup = (tokens[-1] / wall) / ar_tokens_per_s if ar_tokens_per_s and wall > 0 else None
        return Column(trace, text, trace.prefill.t_end, ends, tuple(chars), tuple(tokens), wall, speedup)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_after[-1] / self.wall_s if self.wall_s > 0 else 0.0

    def state_at(self, t: float) -> ColumnState:
        finished = t >= self.wall_s
        if t < self.prefill_end:
            return ColumnState(max(t, 0.0), 0, 0, 0, None, finished)
        steps = bisect.bisect_right(self.step_ends, t)
        tau = (self.tokens_after[steps] - 1) / steps if steps else None  # the prefill's token is no step's
        return ColumnState(min(t, self.wall_s), self.chars_after[steps], self.tokens_after[steps], steps, tau, finished)

    def step_at(self, t: float) -> Step | None:
        """The last step verified by time t: the tree on screen."""
        steps = bisect.bisect_right(self.step_ends, t)
        return self.trace.steps[steps - 1] if steps else None


def column_states(columns: list[Column], t: float) -> list[ColumnState]:
    return [c.state_at(t) for c in columns]


# ---------------------------------------------------------------- text wrapping


@dataclass(frozen=True)
class WrappedLine:
    start: int
    end: int
    appears_at: int  # characters shown when this line starts (a paragraph's first line: right after the newline)


def wrap_text(text: str, font: Font, width: int) -> list[WrappedLine]:
    """Greedy word wrap of the *final* text; streaming shows prefixes of these lines, so a
    word never jumps to the next line while it is being typed."""
    lines: list[WrappedLine] = []
    offset = 0
    for paragraph in text.split("\n"):
        first = True
        for start, end in _wrap_paragraph(paragraph, font, width):
            lines.append(WrappedLine(offset + start, offset + end, offset if first else offset + start + 1))
            first = False
        offset += len(paragraph) + 1
    return lines


def _wrap_paragraph(paragraph: str, font: Font, width: int) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    line_start = 0
    for word in re.finditer(r"\s*\S+|\s+", paragraph):
        if font.getlength(paragraph[line_start:word.end()].rstrip()) <= width:
            continue
        if word.start() > line_start:
            spans.append((line_start, word.start()))
            line_start = word.start() + len(word.group()) - len(word.group().lstrip())  # no leading space on a new line
        while font.getlength(paragraph[line_start:word.end()]) > width:  # a word wider than the column: cut it
            cut = _longest_fit(paragraph, line_start, word.end(), font, width)
            spans.append((line_start, cut))
            line_start = cut
    spans.append((line_start, len(paragraph)))
    return spans


def _longest_fit(text: str, start: int, end: int, font: Font, width: int) -> int:
    cut = start + 1  # at least one character per line, however narrow the column
    while cut < end and font.getlength(text[start:cut + 1]) <= width:
        cut += 1
    return cut


def visible_lines(lines: list[WrappedLine], chars: int, max_lines: int) -> list[WrappedLine]:
    """The lines started by ``chars`` characters, scrolled so the newest is on screen."""
    shown = bisect.bisect_right([line.appears_at for line in lines], chars)
    return lines[max(0, shown - max_lines):shown]


def fit_first(options: list[str], font: Font, width: float) -> str:
    """The first (longest, clearest) option that fits; else the last one cut to fit."""
    for option in options:
        if font.getlength(option) <= width:
            return option
    return fit_text(options[-1], font, width)


def fit_text(text: str, font: Font, width: float) -> str:
    """``text`` cut with an ellipsis so it fits ``width`` pixels."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "…") > width:
        text = text[:-1]
    return text + "…"


# ---------------------------------------------------------------- names shown on screen


def method_title(trace: Trace) -> str:
    return trace.config.heading(long=True)


def short_title(trace: Trace) -> str:
    return trace.config.heading()


def drafter_name(trace: Trace) -> str | None:
    config = trace.config
    if not config.method_row.drafts or not config.drafter:
        return None
    if config.drafter_trained or "untrained" in config.drafter.lower():  # engine.loop.loading already says so
        return config.drafter
    return f"{config.drafter} (untrained)"


def drafter_lines(trace: Trace) -> list[str]:
    """How the column's models are named, longest first: narrow columns take a shorter form."""
    drafter, model = drafter_name(trace), trace.config.model_label
    return [f"{model} + drafter {drafter}", f"{model} + {drafter}"] if drafter else [f"{model} · target only"]


def engine_line(trace: Trace) -> str:
    config = trace.config
    return f"{config.engine} engine · {config.device} · {config.dtype}"


def playback_line(slowdown: float) -> str:
    if slowdown == 1:
        return "real time"
    if slowdown > 1:
        return f"slow motion, {slowdown:.3g}× slower than real time"
    return f"sped up {1 / slowdown:.3g}× (clocks show real time)"


def token_label(piece: str) -> str:
    """A token as a tree label: whitespace drawn as visible marks, since a blank label reads as missing."""
    if piece.isspace():
        piece = piece.replace(" ", "␣")
    return piece.replace("\n", "↵").replace("\t", "→") or "∅"


def column_order(trace: Trace) -> tuple[int, int, str]:
    return Label.parse(trace.config.label).order


# ---------------------------------------------------------------- the DDTree strip


@dataclass(frozen=True)
class TreeDrawing:
    """Node centres of one step's tree: x by depth, y by the tidy layout's row (each subtree contiguous)."""

    points: tuple[tuple[float, float], ...]  # root first
    parents: tuple[int, ...]  # per node, root's is -1
    row_height: float
    depth_width: float


def layout_tree(step: Step, box: Box, columns: int) -> TreeDrawing:
    """The app's tidy layout (``viz.tree_figure.tidy_layout``) scaled into ``box``: the video draws the
    tree the inspector draws."""
    layout = tidy_layout(step)
    dx = box.width / columns
    dy = box.height / (layout.row_count + 1)
    points = tuple((box.x0 + dx * (depth + 0.5), box.y0 + dy * (row + 1))
                   for depth, row in (layout.positions[node] for node in range(step.tree_size + 1)))
    return TreeDrawing(points, (-1, *step.tree_parents), dy, dx)


# ---------------------------------------------------------------- timeline


@dataclass(frozen=True)
class Timeline:
    race_s: float  # the slowest run's wall time
    fps: int
    slowdown: float = 1.0
    intro_s: float = INTRO_S
    hold_s: float = HOLD_S

    @property
    def intro_frames(self) -> int:
        return round(self.intro_s * self.fps)

    @property
    def race_frames(self) -> int:
        return math.ceil(self.race_s * self.slowdown * self.fps) + 1  # the last lands exactly on race_s

    @property
    def hold_frames(self) -> int:
        return round(self.hold_s * self.fps)

    @property
    def frame_count(self) -> int:
        return self.intro_frames + self.race_frames + self.hold_frames

    def moment(self, frame: int) -> float | None:
        """Trace time shown by a frame; None for the prompt card."""
        if frame < self.intro_frames:
            return None
        return min((frame - self.intro_frames) / (self.fps * self.slowdown), self.race_s)


# ---------------------------------------------------------------- drawing


@dataclass(frozen=True)
class CardRow:
    text: str
    font: Font
    colour: Colour
    space_before: int = 0


class Scene:
    """Everything needed to draw any frame: the columns, fonts, layout and a static backdrop."""

    def __init__(self, traces: list[Trace], preset: Preset, slowdown: float = 1.0, theme: Theme = THEME):
        traces = sorted(traces, key=column_order)
        _check_traces(traces)
        ar = next((t for t in traces if t.config.method_row is BASELINE), None)
        ar_speed = Column.from_trace(ar).tokens_per_s if ar else None
        self.columns = [Column.from_trace(t, ar_speed) for t in traces]
        self.tree_column = next((c for c in reversed(self.columns) if c.trace.config.method_row is TREE), None)
        self.preset, self.slowdown, self.theme = preset, slowdown, theme
        self.fonts = load_fonts(preset)
        self.layout = compute_layout(preset, self.fonts, len(self.columns), self.tree_column is not None)
        self.wrapped = [wrap_text(c.text, self.fonts.body, box.text.width)
                        for c, box in zip(self.columns, self.layout.columns)]
        self.race_s = max(c.wall_s for c in self.columns)
        self.backdrop = self._draw_backdrop()
        self._tree_cache: dict[int, Image.Image] = {}

    @property
    def size(self) -> tuple[int, int]:
        return (self.preset.width, self.preset.height)

    def frame(self, t: float | None) -> Image.Image:
        """The prompt card for ``None``, else the race at trace time ``t``."""
        if t is None:
            return self.prompt_card()
        image = self.backdrop.copy()
        draw = ImageDraw.Draw(image)
        self._draw_header_clock(draw, t)
        for column, box, lines in zip(self.columns, self.layout.columns, self.wrapped):
            self._draw_column(draw, column, box, lines, column.state_at(t))
        if self.tree_column is not None:
            self._draw_tree(image, t)
        return image

    # -- static parts

    def _draw_backdrop(self) -> Image.Image:
        theme, fonts = self.theme, self.fonts
        image = Image.new("RGB", self.size, theme.background)
        draw = ImageDraw.Draw(image)
        header = self.layout.header
        methods = " vs ".join(method_title(c.trace) for c in self.columns)
        draw.text((header.x0, header.y0), fit_text(methods, fonts.title, header.width * 2 // 3), font=fonts.title,
                  fill=theme.text)
        prompt = f"Prompt: {_prompt_text(self.columns[0].trace)}".replace("\n", " ")
        draw.text((header.x0, header.y0 + line_height(fonts.title)),
                  fit_text(prompt, fonts.small, header.width * 2 // 3), font=fonts.small, fill=theme.muted)
        for column, box in zip(self.columns, self.layout.columns):
            self._draw_column_frame(draw, column, box)
        if self.layout.tree is not None:
            draw.rounded_rectangle(self.layout.tree.xy, radius=self.preset.px(14), fill=theme.panel,
                                   outline=theme.panel_edge, width=self.preset.px(2))
        return image

    def _draw_column_frame(self, draw: ImageDraw.ImageDraw, column: Column, box: ColumnLayout) -> None:
        theme, fonts, trace = self.theme, self.fonts, column.trace
        colour = print_rgb(trace.config.method_row, trace.config.drafter_tag)
        draw.rounded_rectangle(box.panel.xy, radius=self.preset.px(14), fill=theme.panel, outline=theme.panel_edge,
                               width=self.preset.px(2))
        draw.rectangle((box.panel.x0 + self.preset.px(14), box.panel.y0, box.panel.x1 - self.preset.px(14),
                        box.panel.y0 + self.preset.px(4)), fill=colour)  # the method's colour as a top rule
        room = box.name.width - fonts.clock.getlength("000.00 s") - self.preset.px(12)
        draw.text((box.name.x0, box.name.y0), fit_first([method_title(trace), short_title(trace)], fonts.heading, room),
                  font=fonts.heading, fill=colour)
        draw.text((box.subtitle.x0, box.subtitle.y0), fit_first(drafter_lines(trace), fonts.small, box.subtitle.width),
                  font=fonts.small, fill=theme.text)
        draw.text((box.engine.x0, box.engine.y0), fit_text(engine_line(trace), fonts.small, box.engine.width),
                  font=fonts.small, fill=theme.muted)

    def prompt_card(self) -> Image.Image:
        theme, fonts, px = self.theme, self.fonts, self.preset.px
        area = Box(0, 0, *self.size).inset(px(160), px(80))
        rows = [CardRow("DDTree Studio · speed comparison", fonts.small, theme.muted),
                CardRow("Prompt", fonts.heading, print_rgb(TREE), space_before=px(24)),
                *(CardRow(line, fonts.prompt, theme.text, space_before=px(10) if i == 0 else 0)
                  for i, line in enumerate(self._prompt_lines(area.width))),
                *(CardRow(fit_text(fact, fonts.body, area.width), fonts.body, theme.muted,
                          space_before=px(30) if i == 0 else 0) for i, fact in enumerate(self.card_facts()))]
        image = Image.new("RGB", self.size, theme.background)
        draw = ImageDraw.Draw(image)
        y = area.y0 + (area.height - sum(row.space_before + line_height(row.font) for row in rows)) // 2  # centred
        for row in rows:
            y += row.space_before
            draw.text((area.x0, y), row.text, font=row.font, fill=row.colour)
            y += line_height(row.font)
        return image

    def _prompt_lines(self, width: int) -> list[str]:
        font = self.fonts.prompt
        prompt = sanitize(_prompt_text(self.columns[0].trace))
        lines = [prompt[line.start:line.end].strip() for line in wrap_text(prompt, font, width)]
        if len(lines) > PROMPT_CARD_LINES:
            lines = lines[:PROMPT_CARD_LINES - 1] + [fit_text(lines[PROMPT_CARD_LINES - 1] + " …", font, width)]
        return lines

    def card_facts(self) -> list[str]:
        traces = [c.trace for c in self.columns]
        first = traces[0].config
        sampling = "greedy" if first.temperature == 0 else f"temperature {first.temperature:g}"
        block_sizes = _unique(str(t.config.block_size) for t in traces if t.config.method_row.drafts)
        blocks = f" · draft block {', '.join(block_sizes)}" if block_sizes else ""
        return [
            "Methods: " + " · ".join(method_title(t) for t in traces),
            "Target: " + ", ".join(_unique(t.config.model_label for t in traces)),
            *(f"Drafter: {d}" for d in _unique(drafter_name(t) for t in traces) if d),
            *(f"Recorded on: {e}" for e in _unique(engine_line(t) for t in traces)),
            f"Decoding: {sampling} · up to {first.max_new_tokens} new tokens{blocks}",
            f"Playback: {playback_line(self.slowdown)}",
        ]

    # -- moving parts

    def _draw_header_clock(self, draw: ImageDraw.ImageDraw, t: float) -> None:
        header, fonts = self.layout.header, self.fonts
        draw.text((header.x1, header.y0), f"t = {t:.2f} s", font=fonts.title, fill=self.theme.text, anchor="ra")
        draw.text((header.x1, header.y0 + line_height(fonts.title)), playback_line(self.slowdown), font=fonts.small,
                  fill=self.theme.muted, anchor="ra")

    def _draw_column(self, draw: ImageDraw.ImageDraw, column: Column, box: ColumnLayout, lines: list[WrappedLine],
                     state: ColumnState) -> None:
        theme, fonts = self.theme, self.fonts
        colour = print_rgb(column.trace.config.method_row, column.trace.config.drafter_tag)
        draw.text((box.name.x1, box.name.y0 + line_height(fonts.heading) // 2), f"{state.elapsed_s:.2f} s",
                  font=fonts.clock, fill=theme.text if not state.finished else colour, anchor="rm")
        draw.text((box.stats.x0, box.stats.y0), fit_text(_stats_line(column, state), fonts.small, box.stats.width),
                  font=fonts.small, fill=theme.text)
        self._draw_progress(draw, box.progress, state.tokens / column.tokens_after[-1], colour)
        self._draw_text(draw, column.text, box.text, lines, state, colour)
        self._draw_status(draw, box.badge, column, state)

    def _draw_progress(self, draw: ImageDraw.ImageDraw, box: Box, fraction: float, colour: Colour) -> None:
        radius = box.height // 2
        draw.rounded_rectangle(box.xy, radius=radius, fill=self.theme.track)
        if fraction > 0:
            draw.rounded_rectangle((box.x0, box.y0, box.x0 + max(box.height, round(box.width * fraction)), box.y1),
                                   radius=radius, fill=colour)

    def _draw_text(self, draw: ImageDraw.ImageDraw, text: str, box: Box, lines: list[WrappedLine], state: ColumnState,
                   colour: Colour) -> None:
        font, step = self.fonts.body, line_height(self.fonts.body)
        shown = visible_lines(lines, state.chars, max(1, box.height // step))
        y = box.y0
        for line in shown:
            draw.text((box.x0, y), text[line.start:min(line.end, state.chars)].rstrip(), font=font,
                      fill=self.theme.text)
            y += step
        if not state.finished:  # a cursor where the next tokens will land
            last = shown[-1] if shown else None
            x = box.x0 + (font.getlength(text[last.start:min(last.end, state.chars)]) if last else 0)
            y = (y - step) if last else y
            ascent, _ = font.getmetrics()
            draw.rectangle((x + 2, y + 2, x + 2 + max(2, step // 6), y + ascent), fill=colour)

    def _draw_status(self, draw: ImageDraw.ImageDraw, box: Box, column: Column, state: ColumnState) -> None:
        theme, font, radius = self.theme, self.fonts.body, self.preset.px(10)
        centre = ((box.x0 + box.x1) // 2, (box.y0 + box.y1) // 2)
        if state.finished:
            draw.rounded_rectangle(box.xy, radius=radius, fill=theme.badge)
            draw.text(centre, fit_text(_badge_text(column), font, box.width - 2 * radius), font=font,
                      fill=theme.badge_text, anchor="mm")
            return
        status = "prefill…" if state.in_prefill else f"decoding · step {state.steps + 1}"
        draw.rounded_rectangle(box.xy, radius=radius, outline=theme.panel_edge, width=self.preset.px(2))
        draw.text(centre, status, font=font, fill=theme.muted, anchor="mm")

    def _draw_tree(self, image: Image.Image, t: float) -> None:
        step = self.tree_column.step_at(t)
        key = step.index if step is not None else -1
        if key not in self._tree_cache:
            self._tree_cache = {key: self._draw_tree_panel(step)}  # one entry: steps only move forward
        box = self.layout.tree
        image.paste(self._tree_cache[key], (box.x0, box.y0))

    def _draw_tree_panel(self, step: Step | None) -> Image.Image:
        theme, fonts, px = self.theme, self.fonts, self.preset.px
        box = self.layout.tree
        panel = Image.new("RGB", (box.width, box.height), theme.background)
        draw = ImageDraw.Draw(panel)
        local = Box(0, 0, box.width, box.height)
        draw.rounded_rectangle(local.xy, radius=px(14), fill=theme.panel, outline=theme.panel_edge, width=px(2))
        inner = local.inset(px(20), px(14))
        draw.text((inner.x0, inner.y0), fit_text(self._tree_caption(step), fonts.small, inner.width * 3 // 5),
                  font=fonts.small, fill=theme.text)
        self._draw_legend(draw, inner)
        drawing_box = Box(inner.x0, inner.y0 + line_height(fonts.small) + line_height(fonts.label), inner.x1, inner.y1)
        if step is None or not step.tree_tokens:
            draw.text(((drawing_box.x0 + drawing_box.x1) // 2, (drawing_box.y0 + drawing_box.y1) // 2),
                      "the draft tree appears after the first verify step", font=fonts.body, fill=theme.muted,
                      anchor="mm")
            return panel
        self._draw_step_tree(draw, step, drawing_box)
        return panel

    def _tree_caption(self, step: Step | None) -> str:
        title = method_title(self.tree_column.trace)
        if step is None:
            return f"{title} · draft tree"
        bonus = " + 1 bonus token" if _has_bonus(step) else ""
        return f"{title} · step {step.number}: {step.tree_size} drafted nodes, {len(step.accepted) - 1} accepted{bonus}"

    def _draw_legend(self, draw: ImageDraw.ImageDraw, inner: Box) -> None:
        theme, font, r = self.theme, self.fonts.label, self.preset.px(7)
        x, y = inner.x1, inner.y0 + line_height(self.fonts.small) // 2
        # laid out from the right edge leftwards, so the entries are listed last to first
        for text, fill, outline in (("bonus (target's token)", None, theme.accepted),
                                    ("rejected", theme.rejected, None), ("accepted path", theme.accepted, None)):
            x -= font.getlength(text)
            draw.text((x, y), text, font=font, fill=theme.muted, anchor="lm")
            x -= r * 2 + self.preset.px(6)
            draw.ellipse((x - r, y - r, x + r, y + r), fill=fill, outline=outline, width=max(1, r // 3))
            x -= r + self.preset.px(24)

    def _draw_step_tree(self, draw: ImageDraw.ImageDraw, step: Step, box: Box) -> None:
        theme, px = self.theme, self.preset.px
        # one x slot per draft depth (fixed by the block size, so the tree does not rescale between steps),
        # plus the root's and the bonus token's
        block_size = self.tree_column.trace.config.block_size or 0
        tree = layout_tree(step, box, max(block_size, max(step.tree_depths) + 1) + 1)
        radius = max(1.5, min(px(9), tree.row_height / 2.6, tree.depth_width / 5))
        on_path = set(step.accepted)
        for node in range(1, len(tree.points)):  # grey edges first so the path is drawn on top
            if node not in on_path:
                draw.line((*tree.points[tree.parents[node]], *tree.points[node]), fill=theme.rejected, width=px(2))
        for node in range(1, len(tree.points)):
            if node not in on_path:
                self._dot(draw, tree.points[node], radius, theme.rejected)
        for parent, child in zip(step.accepted, step.accepted[1:]):
            draw.line((*tree.points[parent], *tree.points[child]), fill=theme.accepted, width=px(5))
        for node in step.accepted:
            self._dot(draw, tree.points[node], radius * 1.2, theme.accepted)
        path_points = [tree.points[n] for n in step.accepted[1:]]
        self._label_tokens(draw, path_points, step.committed_text, radius, tree.depth_width, above=True)
        if _has_bonus(step):
            # half a depth slot after the last accepted node: nodes only ever sit on whole slots, so the bonus
            # (which is no drafted node) never covers one
            last = tree.points[step.accepted[-1]]
            bonus_at = (last[0] + tree.depth_width / 2, last[1])
            draw.line((*last, *bonus_at), fill=theme.accepted, width=px(2))
            self._dot(draw, bonus_at, radius * 1.2, theme.panel, outline=theme.accepted)
            self._label_tokens(draw, [bonus_at], [step.committed_text[len(step.accepted) - 1]], radius,
                               tree.depth_width, above=False)
        self._dot(draw, tree.points[0], radius * 1.4, print_rgb(TREE))

    def _label_tokens(self, draw: ImageDraw.ImageDraw, points: list[tuple[float, float]], pieces: list[str],
                      radius: float, spacing: float, above: bool) -> None:
        font, offset = self.fonts.label, radius * 1.4 + 2
        for (x, y), piece in zip(points, pieces):
            text = fit_text(token_label(piece), font, spacing * 0.95)
            if above:
                draw.text((x, y - offset), text, font=font, fill=self.theme.text, anchor="md")
            else:
                draw.text((x, y + offset), text, font=font, fill=self.theme.accepted, anchor="ma")

    @staticmethod
    def _dot(draw: ImageDraw.ImageDraw, centre: tuple[float, float], radius: float, fill: Colour | None,
             outline: Colour | None = None) -> None:
        x, y = centre
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=fill, outline=outline,
                     width=max(1, round(radius / 3)))


def _unique(values) -> list:
    return list(dict.fromkeys(values))


def _prompt_text(trace: Trace) -> str:
    config = trace.config
    return config.prompt.strip() or f"(given as {len(config.prompt_ids)} token ids)"


def _has_bonus(step: Step) -> bool:
    """The bonus token is cut when the run hit a stop token or its token limit inside the path."""
    return len(step.committed_ids) >= len(step.accepted)


def _stats_line(column: Column, state: ColumnState) -> str:
    total = column.tokens_after[-1]
    parts = [f"{state.tokens}/{total} tokens"]
    if column.trace.config.method_row.drafts:
        parts.append(f"τ {state.tau:.2f}" if state.tau is not None else "τ –")
    if state.elapsed_s > 0 and state.tokens:
        parts.append(f"{state.tokens / state.elapsed_s:.1f} tok/s")
    return " · ".join(parts)


def _badge_text(column: Column) -> str:
    done = f"done in {column.wall_s:.2f} s"
    if column.speedup is None:
        return done
    if column.trace.config.method_row is BASELINE:
        return f"{done} · baseline"
    return f"{done} · {column.speedup:.2f}× vs AR"


def _check_traces(traces: list[Trace]) -> None:
    if not traces:
        raise VideoError("no traces given: pass the AR, DFlash and DDTree traces of one prompt")
    if len(traces) > MAX_COLUMNS:
        raise VideoError(f"{len(traces)} traces given; a video shows at most {MAX_COLUMNS} columns")
    if len({tuple(t.config.prompt_ids) for t in traces}) > 1:
        raise VideoError("the traces are of different prompts; a comparison needs one prompt's runs")
    empty = [t.config.label for t in traces if t.summary is None]
    if empty:
        raise VideoError(f"trace {empty[0]} is unfinished (no summary): record the whole run")


# ---------------------------------------------------------------- output


def render_video(traces: list[Trace], out_path: str | Path, preset: str = "1080p", fps: int = 30,
                 slowdown: float = 1.0, progress: Callable[[int, int], None] | None = None) -> Path:
    """Render the traces of one prompt to an H.264 MP4; ``progress(done, total)`` is called per frame."""
    if preset not in PRESETS:
        raise VideoError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if fps < 1 or slowdown <= 0:
        raise VideoError("fps must be at least 1 and slowdown above 0")
    try:
        import imageio_ffmpeg  # only here: the app runs without it where no video is made
    except ImportError as exc:
        raise VideoError("making a video needs imageio-ffmpeg: pip install imageio-ffmpeg") from exc
    scene = Scene(traces, PRESETS[preset], slowdown)
    timeline = Timeline(scene.race_s, fps, slowdown)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = imageio_ffmpeg.write_frames(
        str(out), scene.size, fps=fps, codec="libx264", pix_fmt_out="yuv420p", macro_block_size=8, quality=None,
        # CRF 18 keeps small text crisp; faststart lets browsers play it before it has fully loaded
        output_params=["-crf", "18", "-preset", "medium", "-tune", "animation", "-movflags", "+faststart"],
    )
    writer.send(None)  # start the generator: ffmpeg is launched here
    try:
        _write_frames(writer, scene, timeline, progress)
    except BaseException:
        writer.close()
        out.unlink(missing_ok=True)
        raise
    writer.close()
    return out


def _write_frames(writer, scene: Scene, timeline: Timeline, progress: Callable[[int, int], None] | None) -> None:
    previous_moment, frame_bytes = object(), b""
    for index in range(timeline.frame_count):
        moment = timeline.moment(index)
        if moment != previous_moment:  # the card and the final hold repeat one frame
            frame_bytes = scene.frame(moment).tobytes()
            previous_moment = moment
        writer.send(frame_bytes)
        if progress is not None:
            progress(index + 1, timeline.frame_count)


def trace_sets(folder: str | Path) -> dict[str, list[Path]]:
    """The trace files in ``folder`` by the prompt they record: the bench's ``<prompt_id>.<label>.json``
    grouped by prompt id; any other file (the app's download, one ``Trace.save``) a set named by its stem."""
    found: dict[str, list[Path]] = {}
    for path in sorted(Path(folder).glob("*.json")):
        prompt_id, _, _ = path.stem.rpartition(".")
        found.setdefault(prompt_id or path.stem, []).append(path)
    return found


def pick_traces(source: str | Path, prompt_id: str | None, labels: list[str] | None) -> list[Trace]:
    """The traces to show from ``source``: a trace file of any shape the Studio writes
    (``engine.trace.read_trace_file``), or a folder of them (``trace_sets``; ``prompt_id`` picks a set);
    ``labels`` (``ar``, ``ddtree@32``) picks runs, else every run (the first of each label)."""
    source = Path(source)
    if source.is_dir():
        found = trace_sets(source)
        if not found:
            raise VideoError(f"no trace files (*.json) in {source}")
        if prompt_id is None:
            if len(found) > 1:
                raise VideoError(f"{source} holds traces of {len(found)} prompts; choose one with --prompt: "
                                 + ", ".join(found))
            prompt_id = next(iter(found))
        if prompt_id not in found:
            raise VideoError(f"no traces for prompt {prompt_id!r} in {source}; found: {', '.join(found)}")
        files = found[prompt_id]
    elif prompt_id is not None:
        raise VideoError(f"--prompt picks among a folder's trace sets; {source} is one file")
    else:
        files = [source]
    by_label: dict[str, Trace] = {}
    for path in files:
        for trace in read_trace_file(path):
            by_label.setdefault(trace.config.label, trace)
    labels = labels or list(by_label)
    missing = [label for label in labels if label not in by_label]
    if missing:
        raise VideoError(f"{prompt_id or source.name} has no {missing[0]} trace; found: {', '.join(by_label)}")
    if len(labels) > MAX_COLUMNS:
        raise VideoError(f"{prompt_id or source.name} has {len(labels)} traces ({', '.join(labels)}); pick at most "
                         f"{MAX_COLUMNS} with --labels, e.g. --labels ar,dflash,ddtree@32")
    return [by_label[label] for label in labels]


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(prog="python -m viz.video", description=__doc__.splitlines()[0])
    parser.add_argument("--traces", required=True, help="a trace file (the app's download, one trace, a list) or a "
                                                         "folder of them (engine.tools.bench --traces)")
    parser.add_argument("--out", default="comparison.mp4")
    parser.add_argument("--prompt", help="prompt id (or file stem), when the folder holds several prompts")
    parser.add_argument("--labels", help="comma-separated labels to show, e.g. ar,dflash,ddtree@32 (default: all)")
    parser.add_argument("--preset", choices=list(PRESETS), default="1080p")
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--slowdown", type=float, default=1.0, help="2 plays at half speed; 0.5 at double speed")
    args = parser.parse_args(argv)
    try:
        traces = pick_traces(args.traces, args.prompt, args.labels.split(",") if args.labels else None)
        with tqdm(unit="frame", desc="rendering") as bar:
            def advance(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)
            out = render_video(traces, args.out, args.preset, args.fps, args.slowdown, advance)
    except (VideoError, TraceError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
