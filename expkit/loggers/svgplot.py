"""Line and scatter charts as SVG, written with the standard library only.

A run's ``curves.svg`` or a sweep's ``sweep.svg`` costs about a millisecond this way;
drawing the same panels with matplotlib cost 0.3-0.6 s, plus 0.5 s to import it: more than
a short sweep job's whole framework budget. Any browser, VS Code and Jupyter show SVG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from expkit.core.atomic import write_text_atomic

__all__ = ["COLORS", "Panel", "Series", "charts", "escape", "line_charts", "nice_ticks"]


PANEL_W, PANEL_H = 320, 220
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 26, 34  # margins inside a panel: tick labels, title, axis label
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
    and in the element's tooltip; ``errors``: a half-width per point, drawn as an error bar
    (y - e to y + e). (Plain classes, not dataclasses: making the two dataclasses cost 2 ms of
    each run's end, where curves.svg is drawn.)

    Args:
        points: the (x, y) points, in drawing order; non-finite ones are left out.
        label: the series' name in the legend and the tooltip; empty: none.
        line: True: a line through the points (with a marker on each when there are fewer than 50);
            False: markers only.
        errors: the half-width of each point's error bar, in the order of `points`; a non-finite or
            non-positive one draws no bar. None: no error bars.
    """

    __slots__ = ("errors", "label", "line", "points")

    def __init__(
        self,
        points: Sequence[tuple[float, float]],
        label: str = "",
        line: bool = True,
        errors: Sequence[float] | None = None,
    ) -> None:
        self.points, self.label, self.line, self.errors = points, label, line, errors


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
        return ticks, [_label(10**t) for t in ticks]
    if panel.x_range is not None:
        xs = [*xs, *panel.x_range]
    ticks = nice_ticks(min(xs), max(xs))
    return ticks, [_label(t) for t in ticks]


def _panel(panel: Panel, x0: int, single_color: str) -> list[str]:
    bars = {id(s): _error_bars(s, panel.log_x) for s in panel.series if s.errors is not None}
    series = [Series(_finite(s.points, panel.log_x), s.label, s.line) for s in panel.series]
    whiskers = [bars.get(id(s), []) for s in panel.series]
    out = [f'<text x="{x0 + PANEL_W / 2:.0f}" y="16" text-anchor="middle" font-size="13">{escape(panel.title)}</text>']
    plot_w, plot_h = PANEL_W - LEFT - RIGHT, PANEL_H - TOP - BOTTOM
    left, top = x0 + LEFT, TOP
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#888"/>')
    points = [p for s in series for p in s.points]
    if not points:
        out.append(
            f'<text x="{left + plot_w / 2:.0f}" y="{top + plot_h / 2:.0f}" text-anchor="middle" '
            'font-size="11" fill="#888">no finite values</text>'
        )
        return out
    xt, xlabels = _x_ticks(panel, [p[0] for p in points])
    spans = [(y - e, y + e) for bar in whiskers for _, y, e in bar]
    yt = nice_ticks(
        min([p[1] for p in points] + [lo for lo, _ in spans]), max([p[1] for p in points] + [hi for _, hi in spans])
    )

    def px(x: float) -> float:
        return left + (x - xt[0]) / (xt[-1] - xt[0]) * plot_w

    def py(y: float) -> float:
        return top + plot_h - (y - yt[0]) / (yt[-1] - yt[0]) * plot_h

    for t, label in zip(xt, xlabels):
        out.append(
            f'<line x1="{px(t):.1f}" y1="{top + plot_h}" x2="{px(t):.1f}" y2="{top + plot_h + 4}" stroke="#888"/>'
        )
        out.append(
            f'<text x="{px(t):.1f}" y="{top + plot_h + 15}" text-anchor="middle" font-size="10">{escape(label)}</text>'
        )
    for t in yt:
        out.append(f'<line x1="{left}" y1="{py(t):.1f}" x2="{left + plot_w}" y2="{py(t):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 4}" y="{py(t) + 3:.1f}" text-anchor="end" font-size="10">{_label(t)}</text>')
    out.append(
        f'<text x="{left + plot_w / 2:.0f}" y="{PANEL_H - 4}" text-anchor="middle" font-size="11">'
        f"{escape(panel.xlabel)}</text>"
    )
    if panel.ylabel:
        out.append(
            f'<text x="{x0 + 10}" y="{top + plot_h / 2:.0f}" text-anchor="middle" font-size="11" '
            f'transform="rotate(-90 {x0 + 10} {top + plot_h / 2:.0f})">{escape(panel.ylabel)}</text>'
        )
    colors = [single_color] if len(series) == 1 else [COLORS[i % len(COLORS)] for i in range(len(series))]
    for s, color, bar in zip(series, colors, whiskers):
        tip = f"<title>{escape(s.label)}</title>" if s.label else ""
        for x, y, e in bar:
            X, lo, hi = px(x), py(y - e), py(y + e)
            out.append(
                f'<path class="errorbar" d="M{X:.1f},{lo:.1f}V{hi:.1f}M{X - 4:.1f},{lo:.1f}h8M{X - 4:.1f},'
                f'{hi:.1f}h8" stroke="{color}" stroke-width="1.2" fill="none">{tip}</path>'
            )
        if s.line and s.points:
            coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
            out.append(
                f'<polyline class="series" points="{coords}" fill="none" stroke="{color}" '
                f'stroke-width="1.5">{tip}</polyline>'
            )
        if not s.line or len(s.points) < 50:
            kind = "marker" if s.line else "point"
            out += [
                f'<circle class="{kind}" cx="{px(x):.1f}" cy="{py(y):.1f}" r="{2.5 if s.line else 3.5}" '
                f'fill="{color}">{tip}</circle>'
                for x, y in s.points
            ]
    if panel.legend:
        labelled = [(i, s) for i, s in enumerate(series) if s.label]
        for row, (i, s) in enumerate(labelled[:LEGEND_MAX]):
            y = PANEL_H + 4 + row * LEGEND_LINE
            out.append(f'<rect class="legend" x="{left}" y="{y}" width="10" height="3" fill="{colors[i]}"/>')
            out.append(f'<text x="{left + 14}" y="{y + 5}" font-size="10">{escape(s.label[:60])}</text>')
        if len(labelled) > LEGEND_MAX:
            y = PANEL_H + 4 + LEGEND_MAX * LEGEND_LINE
            out.append(
                f'<text x="{left + 14}" y="{y + 5}" font-size="10">... and {len(labelled) - LEGEND_MAX} more</text>'
            )
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
    for i, panel in enumerate(panels):
        body += _panel(panel, i * PANEL_W, COLORS[i % len(COLORS)])
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
