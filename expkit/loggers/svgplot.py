"""Line and scatter charts as SVG, written with the standard library only.

A run's ``curves.svg`` or a sweep's ``sweep.svg`` costs about a millisecond this way;
drawing the same panels with matplotlib cost 0.3-0.6 s, plus 0.5 s to import it: more than
a short sweep job's whole framework budget. Any browser, VS Code and Jupyter show SVG.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

from expkit.core.atomic import write_text_atomic

__all__ = ["CHAR_EM", "COLORS", "Panel", "Series", "charts", "escape", "fit", "line_charts", "nice_ticks", "text_width"]


PANEL_W, PANEL_H = 320, 220
LEFT, RIGHT, TOP, BOTTOM = 52, 20, 26, 34  # margins inside a panel: tick labels, title, axis label
PLOT_H = PANEL_H - TOP - BOTTOM
TICK_SIZE, LABEL_SIZE = 10, 11  # font sizes in px: tick labels and legend entries; axis labels
YLABEL_X = 10  # the rotated y axis label's baseline, from the panel's left edge
# A character's width in em as the layout reckons it: sans-serif digits are 0.55 em, lower-case
# letters 0.5 on average. Text is measured with it to cut a title, a legend entry or a tick name
# to its room and to thin tick labels (a browser's own measure needs a browser).
CHAR_EM = 0.6
LEGEND_LINE, LEGEND_MAX = 13, 20  # px per legend entry; entries shown before "... and N more"


def escape(text: str) -> str:
    """Text for an SVG element's content: &, < and > as entities (xml.sax.saxutils.escape,
    without the millisecond its import costs a run's end).

    Args:
        text: the text to show.

    Returns:
        `text` with ``&``, ``<`` and ``>`` replaced (quotes are left: not for attribute values).
    """
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


class Series:
    """Points of one line (``line=True``) or one set of markers; ``label`` goes in the legend
    and in the element's tooltip; ``key``: who the series is (a job, a metric), so that it has one
    color in every panel of the chart and its legend's; ``errors``: a half-width per point, drawn as an error bar
    (y - e to y + e). (Plain classes, not dataclasses: making the two dataclasses cost 2 ms of
    each run's end, where curves.svg is drawn.)

    Args:
        points: the (x, y) points, in drawing order; non-finite ones are left out.
        label: the series' name in the legend and the tooltip; empty: none.
        line: True: a line through the points (with a marker on each when there are fewer than 50);
            False: markers only.
        errors: the half-width of each point's error bar, in the order of `points`; a non-finite or
            non-positive one draws no bar. None: no error bars.
        key: the series' identity across the chart's panels: every series of one key gets one color,
            the first color not yet taken when it first appears (``data-key`` on its elements). None:
            `label`; empty (or no label): the panel's color with one series, else one by position.
    """

    __slots__ = ("errors", "key", "label", "line", "points")

    def __init__(
        self,
        points: Sequence[tuple[float, float]],
        label: str = "",
        line: bool = True,
        errors: Sequence[float] | None = None,
        key: str | None = None,
    ) -> None:
        self.points, self.label, self.line, self.errors = points, label, line, errors
        self.key = label if key is None else key


class Panel:
    """One chart. ``log_x``: a log10 x axis (positive x only). ``categories``: x values are
    indices into these names, shown as tick labels.

    Args:
        title: the text above the chart.
        series: the series drawn in it; with several, each gets a color of ``COLORS`` in turn.
        xlabel: the text under the x axis.
        ylabel: the text beside the y axis; empty: none.
        log_x: a log10 x axis, ticked at powers of ten; points with x <= 0 are left out.
        categories: the names the x values index, shown as the x tick labels; None: numeric x values.
        legend: list the labelled series under the chart (the first 20, then "... and N more").
        x_range: (low, high) that a linear, non-categorical x axis covers at least, so that panels side
            by side share a scale; None: the points' range only.
    """

    __slots__ = ("categories", "legend", "log_x", "series", "title", "x_range", "xlabel", "ylabel")

    def __init__(
        self,
        title: str,
        series: list[Series],
        xlabel: str = "step",
        ylabel: str = "",
        log_x: bool = False,
        categories: list[str] | None = None,
        legend: bool = False,
        x_range: tuple[float, float] | None = None,
    ) -> None:
        self.title, self.series, self.xlabel, self.ylabel = title, series, xlabel, ylabel
        self.log_x, self.categories, self.legend = log_x, categories, legend
        self.x_range = x_range  # an x axis covering at least this (panels side by side on one scale)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round values (steps of 1, 2 or 5 times a power of ten) covering [lo, hi].

    Args:
        lo: one end of the range (finite).
        hi: the other end (finite); the two may come in either order or be equal.
        count: about how many ticks to give.

    Returns:
        The tick values, ascending, evenly spaced, the first at or below the range and the last at or
        above it.
    """
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:  # one value: widen around it
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    value = first
    while value < hi + step * 0.5:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < hi:
        ticks.append(round(ticks[-1] + step, 12))
    return ticks


def _label(value: float) -> str:
    return f"{value:.4g}"


def _power_label(power: float) -> str:
    """A decade's tick label: 0.001 to 10000 written out, 1e-5 and 1e5 beyond."""
    return f"{10**power:g}" if -3 <= power <= 4 else f"1e{int(power)}"


def _attr(text: str) -> str:
    return escape(text).replace('"', "&quot;")


def text_width(text: str, size: float) -> float:
    """The width in px the layout gives `text` at font `size` (``CHAR_EM`` per character).

    Args:
        text: the text.
        size: its font size in px.

    Returns:
        Its estimated width in px.
    """
    return len(text) * CHAR_EM * size


def fit(text: str, size: float, width: float) -> str:
    """`text`, cut to fit `width` px at font `size`, an ellipsis marking the cut.

    Args:
        text: the text to show.
        size: its font size in px.
        width: the room it has, in px.

    Returns:
        `text` where it fits; else as many of its first characters as fit, then ``…``.
    """
    if text_width(text, size) <= width:
        return text
    return text[: max(int(width / (CHAR_EM * size)) - 1, 1)] + "…"


def _text(x: float, y: float, text: str, size: float, room: float, anchor: str = "middle", extra: str = "") -> str:
    """A <text> cut to `room` px; a cut one carries the whole text in its tooltip."""
    shown = fit(text, size, room)
    tip = f"<title>{escape(text)}</title>" if shown != text else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}"{extra}>{escape(shown)}{tip}</text>'


def _finite(points: Sequence[tuple[float, float]], log_x: bool) -> list[tuple[float, float]]:
    out = []
    for x, y in points:
        x, y = float(x), float(y)
        if math.isfinite(x) and math.isfinite(y) and (x > 0 or not log_x):
            out.append((math.log10(x) if log_x else x, y))
    return out


def _error_bars(series: Series, log_x: bool) -> list[tuple[float, float, float]]:
    """(x, y, half-width) of each finite point with a finite, positive error."""
    kept = []
    for (x, y), e in zip(series.points, series.errors or ()):
        usable = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (x, y, e)) and e > 0
        if usable and (x > 0 or not log_x):
            kept.append((math.log10(x) if log_x else float(x), float(y), float(e)))
    return kept


def _x_ticks(panel: Panel, xs: list[float]) -> tuple[list[float], list[str]]:
    if panel.categories is not None:
        ticks = [float(i) for i in range(len(panel.categories))]
        if len(ticks) == 1:  # one category: give the axis some width around it
            return [-1.0, 0.0, 1.0], ["", panel.categories[0], ""]
        return ticks, list(panel.categories)
    if panel.log_x:
        ticks = [float(t) for t in range(math.floor(min(xs)), math.ceil(max(xs)) + 1)]
        if len(ticks) == 1:
            ticks = [ticks[0] - 1, ticks[0], ticks[0] + 1]
        return ticks, [_power_label(t) for t in ticks]
    if panel.x_range is not None:
        xs = [*xs, *panel.x_range]
    ticks = nice_ticks(min(xs), max(xs))
    return ticks, [_label(t) for t in ticks]


def _thin(positions: list[float], labels: list[str]) -> list[str]:
    """`labels` with every k-th kept, k the smallest with which no two kept ones come within 4 px,
    the others blank: each tick stays, its label stops running into the next."""
    widths = [text_width(label, TICK_SIZE) for label in labels]
    for k in range(1, len(labels)):
        kept = [i for i in range(0, len(labels), k) if labels[i]]
        if all(positions[b] - positions[a] >= (widths[a] + widths[b]) / 2 + 4 for a, b in itertools.pairwise(kept)):
            return [label if i % k == 0 else "" for i, label in enumerate(labels)]
    return labels[:1] + [""] * (len(labels) - 1)


class _Frame:
    """Where a panel's plot area lies, and its axes' ticks: values to px."""

    def __init__(self, x0: int, xt: list[float], yt: list[float], y_labels: list[str]) -> None:
        widest = max(text_width(label, TICK_SIZE) for label in y_labels)
        # the y tick labels end 4 px left of the plot and start clear of the rotated axis label
        self.x0, self.left = x0, x0 + max(LEFT, math.ceil(YLABEL_X + 0.2 * LABEL_SIZE + 2 + widest + 4))
        self.top, self.w, self.h = TOP, x0 + PANEL_W - RIGHT - self.left, PLOT_H
        self.xt, self.yt = xt, yt

    def px(self, x: float) -> float:
        return self.left + (x - self.xt[0]) / (self.xt[-1] - self.xt[0]) * self.w

    def py(self, y: float) -> float:
        return self.top + self.h - (y - self.yt[0]) / (self.yt[-1] - self.yt[0]) * self.h


def _axes(panel: Panel, frame: _Frame, x_labels: list[str], y_labels: list[str]) -> list[str]:
    """The frame, the ticks and their labels, and the axis labels."""
    f = frame
    out = [f'<rect x="{f.left}" y="{f.top}" width="{f.w}" height="{f.h}" fill="none" stroke="#888"/>']
    positions = [f.px(t) for t in f.xt]
    if panel.categories is not None and len(positions) > 1:  # names: each cut to the room between two ticks
        room = max(positions[1] - positions[0] - 4, 3 * CHAR_EM * TICK_SIZE)
        x_labels = [fit(label, TICK_SIZE, room) for label in x_labels]
    bottom = f.top + f.h
    for x, label in zip(positions, _thin(positions, x_labels)):
        out.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#888"/>')
        if label:  # centred on its tick, but inside the panel
            half = text_width(label, TICK_SIZE) / 2
            x = min(max(x, f.x0 + half + 1), f.x0 + PANEL_W - half - 1)
            out.append(_text(x, bottom + 15, label, TICK_SIZE, PANEL_W))
    for t, label in zip(f.yt, y_labels):
        out.append(f'<line x1="{f.left}" y1="{f.py(t):.1f}" x2="{f.left + f.w}" y2="{f.py(t):.1f}" stroke="#eee"/>')
        out.append(_text(f.left - 4, f.py(t) + 3, label, TICK_SIZE, PANEL_W, anchor="end"))
    out.append(_text(f.left + f.w / 2, PANEL_H - 4, panel.xlabel, LABEL_SIZE, f.w))
    if panel.ylabel:
        x, y = f.x0 + YLABEL_X, f.top + f.h / 2
        out.append(_text(x, y, panel.ylabel, LABEL_SIZE, f.h, extra=f' transform="rotate(-90 {x} {y:.0f})"'))
    return out


def _marks(series: Series, points: list[tuple[float, float]], bars: list, color: str, frame: _Frame) -> list[str]:
    """One series' error bars, line and markers, each with the series' tooltip and key."""
    px, py = frame.px, frame.py
    tip = f"<title>{escape(series.label)}</title>" if series.label else ""
    key = f' data-key="{_attr(series.key)}"' if series.key else ""
    out = []
    for x, y, e in bars:
        X, lo, hi = px(x), py(y - e), py(y + e)
        out.append(
            f'<path class="errorbar" d="M{X:.1f},{lo:.1f}V{hi:.1f}M{X - 4:.1f},{lo:.1f}h8M{X - 4:.1f},'
            f'{hi:.1f}h8" stroke="{color}" stroke-width="1.2" fill="none"{key}>{tip}</path>'
        )
    if series.line and points:
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        out.append(
            f'<polyline class="series" points="{coords}" fill="none" stroke="{color}" '
            f'stroke-width="1.5"{key}>{tip}</polyline>'
        )
    if not series.line or len(points) < 50:
        kind = "marker" if series.line else "point"
        out += [
            f'<circle class="{kind}" cx="{px(x):.1f}" cy="{py(y):.1f}" r="{2.5 if series.line else 3.5}" '
            f'fill="{color}"{key}>{tip}</circle>'
            for x, y in points
        ]
    return out


def _legend(panel: Panel, colors: list[str], frame: _Frame) -> list[str]:
    """The labelled series under the panel, each in its color, each label cut to the panel's width."""
    labelled = [(s, color) for s, color in zip(panel.series, colors) if s.label]
    left, room = frame.left, frame.x0 + PANEL_W - 4 - (frame.left + 14)
    out = []
    for row, (s, color) in enumerate(labelled[:LEGEND_MAX]):
        y = PANEL_H + 4 + row * LEGEND_LINE
        key = f' data-key="{_attr(s.key)}"' if s.key else ""
        out.append(f'<rect class="legend" x="{left}" y="{y}" width="10" height="3" fill="{color}"{key}/>')
        out.append(_text(left + 14, y + 5, s.label, TICK_SIZE, room, anchor="start"))
    if len(labelled) > LEGEND_MAX:
        y = PANEL_H + 4 + LEGEND_MAX * LEGEND_LINE
        out.append(_text(left + 14, y + 5, f"... and {len(labelled) - LEGEND_MAX} more", TICK_SIZE, room, "start"))
    return out


def _panel(panel: Panel, x0: int, colors: list[str]) -> list[str]:
    bars = [_error_bars(s, panel.log_x) if s.errors is not None else [] for s in panel.series]
    points = [_finite(s.points, panel.log_x) for s in panel.series]
    out = [_text(x0 + PANEL_W / 2, 16, panel.title, _title_size(panel.title), PANEL_W - 8)]
    every = [p for series_points in points for p in series_points]
    if not every:
        left, plot_w = x0 + LEFT, PANEL_W - LEFT - RIGHT
        out.append(f'<rect x="{left}" y="{TOP}" width="{plot_w}" height="{PLOT_H}" fill="none" stroke="#888"/>')
        out.append(
            f'<text x="{left + plot_w / 2:.0f}" y="{TOP + PLOT_H / 2:.0f}" text-anchor="middle" '
            'font-size="11" fill="#888">no finite values</text>'
        )
        return out
    xt, x_labels = _x_ticks(panel, [p[0] for p in every])
    spans = [(y - e, y + e) for bar in bars for _, y, e in bar]
    ys = [p[1] for p in every]
    yt = nice_ticks(min(ys + [lo for lo, _ in spans]), max(ys + [hi for _, hi in spans]))
    y_labels = [_label(t) for t in yt]
    frame = _Frame(x0, xt, yt, y_labels)
    out += _axes(panel, frame, x_labels, y_labels)
    for s, series_points, bar, color in zip(panel.series, points, bars, colors):
        out += _marks(s, series_points, bar, color, frame)
    if panel.legend:
        out += _legend(panel, colors, frame)
    return out


def _title_size(title: str) -> int:
    """13 px, or down to 10 px where that fits the panel's width (a longer one is cut at 10)."""
    return next((size for size in (13, 12, 11, 10) if text_width(title, size) <= PANEL_W - 8), 10)


def _colors(panels: Sequence[Panel]) -> list[list[str]]:
    """Each series' color, panel by panel: one per key across the chart, in order of first appearance
    (a job's line, its points and its legend entry alike); a series without a key takes the panel's
    color when it is the panel's only one, else the color of its position."""
    by_key: dict[str, str] = {}
    out = []
    for i, panel in enumerate(panels):
        colors = []
        for j, s in enumerate(panel.series):
            if s.key:
                colors.append(by_key.setdefault(s.key, COLORS[len(by_key) % len(COLORS)]))
            else:
                colors.append(COLORS[(i if len(panel.series) == 1 else j) % len(COLORS)])
        out.append(colors)
    return out


def _legend_rows(panel: Panel) -> int:
    if not panel.legend:
        return 0
    labelled = sum(1 for s in panel.series if s.label)
    return min(labelled, LEGEND_MAX) + (1 if labelled > LEGEND_MAX else 0)


def charts(path: str | Path, panels: Sequence[Panel]) -> None:
    """``panels`` side by side, written atomically to ``path``. Non-finite values (a NaN loss),
    and x <= 0 on a log axis, are left out.

    Args:
        path: the SVG file to write.
        panels: the charts, left to right.
    """
    width = PANEL_W * max(len(panels), 1)
    rows = max((_legend_rows(p) for p in panels), default=0)
    height = PANEL_H + (rows * LEGEND_LINE + 6 if rows else 0)
    body: list[str] = []
    for i, (panel, colors) in enumerate(zip(panels, _colors(panels))):
        body += _panel(panel, i * PANEL_W, colors)
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">\n'
        f'<rect width="{width}" height="{height}" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n"
    )
    write_text_atomic(Path(path), svg)


def line_charts(path: str | Path, panels: dict[str, Sequence[tuple[float, float]]], xlabel: str = "step") -> None:
    """One panel per entry of ``panels`` (title -> [(x, y), ...]), one line each.

    Args:
        path: the SVG file to write.
        panels: the points of each panel's one line, by panel title.
        xlabel: the x axis label of every panel.
    """
    charts(path, [Panel(title, [Series(points)], xlabel=xlabel) for title, points in panels.items()])
