"""Line charts drawn on the server as SVG geometry: no chart library, nothing to fetch.

:func:`line_chart` turns ``(x, y)`` points into the numbers an SVG template draws (a polyline's
points, axis ticks and their labels). Long series are thinned to at most ``max_points``, keeping
the first and last point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Chart", "line_chart"]


@dataclass
class Chart:
    """A drawn chart: ``points`` is an SVG polyline's ``points`` attribute."""

    title: str
    width: int
    height: int
    points: str
    x_ticks: list[tuple[float, str]]
    y_ticks: list[tuple[float, str]]
    last: str
    count: int
    left: int = 44
    top: int = 8
    bottom: int = 20


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    size = abs(value)
    if size >= 1e5 or size < 1e-3:
        return f"{value:.2g}"
    if size >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _ticks(lo: float, hi: float, n: int = 4, *, whole: bool = False) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if whole:  # training steps: no tick between two steps
        step = max(1.0, float(math.ceil(step)))
    first = math.ceil(lo / step) * step
    out = []
    value = first
    while value <= hi + step * 1e-9:
        out.append(round(value, 12))
        value += step
    return out


def line_chart(
    title: str,
    points: list[tuple[float, float]],
    *,
    width: int = 270,
    height: int = 130,
    max_points: int = 400,
) -> Chart:
    """The geometry of a line chart of ``points`` (sorted by x by the caller)."""
    if len(points) > max_points:
        stride = math.ceil(len(points) / max_points)
        points = points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])
    chart = Chart(title, width, height, "", [], [], "", len(points))
    if not points:
        return chart
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    plot_w = width - chart.left - 8
    plot_h = height - chart.top - chart.bottom

    def sx(x: float) -> float:
        return chart.left + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return chart.top + (1 - (y - y0) / (y1 - y0)) * plot_h

    chart.points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    whole = all(float(x).is_integer() for x in xs)
    chart.x_ticks = [(sx(t), _fmt(t)) for t in _ticks(x0, x1, 4, whole=whole) if x0 <= t <= x1]
    chart.y_ticks = [(sy(t), _fmt(t)) for t in _ticks(y0, y1, 3)]
    chart.last = _fmt(points[-1][1])
    return chart
