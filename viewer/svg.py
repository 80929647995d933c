"""Hand-drawn inline SVG charts: line charts and bar charts, readable without JavaScript.

Each function returns one `<svg>` element. Labels pass through `esc`; numbers are formatted
here. Missing values (None, NaN) break a line rather than being drawn as zero.
"""

from __future__ import annotations

import math
from typing import Sequence

from viewer.html import esc

WIDTH, HEIGHT = 360, 180
PAD_L, PAD_R, PAD_T, PAD_B = 48, 10, 22, 26
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2")


def _num(v: float) -> str:
    return f"{v:.3g}"


def _finite(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _frame(title: str, lo: float, hi: float, x_lo: float, x_hi: float, x_label: str) -> str:
    bottom, right = HEIGHT - PAD_B, WIDTH - PAD_R
    return (f'<text x="{PAD_L}" y="14" class="ct">{esc(title)}</text>'
            f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{bottom}" class="ax"/>'
            f'<line x1="{PAD_L}" y1="{bottom}" x2="{right}" y2="{bottom}" class="ax"/>'
            f'<text x="{PAD_L - 4}" y="{PAD_T + 8}" class="yl">{_num(hi)}</text>'
            f'<text x="{PAD_L - 4}" y="{bottom}" class="yl">{_num(lo)}</text>'
            f'<text x="{PAD_L}" y="{HEIGHT - 8}" class="xl">{_num(x_lo)}</text>'
            f'<text x="{right}" y="{HEIGHT - 8}" class="xl xr">{_num(x_hi)}</text>'
            f'<text x="{(PAD_L + right) / 2}" y="{HEIGHT - 8}" class="xl xm">{esc(x_label)}</text>')


def _empty(title: str) -> str:
    return (f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}"'
            f' role="img"><text x="{PAD_L}" y="14" class="ct">{esc(title)}</text>'
            f'<text x="{PAD_L}" y="{HEIGHT / 2}" class="none">no data</text></svg>')


def line_chart(title: str, xs: Sequence[float], series: dict[str, Sequence[float | None]],
               x_label: str = "") -> str:
    """One chart, one polyline per series (with a legend when there are several)."""
    values = [v for ys in series.values() for v in _finite(ys)]
    if not xs or not values:
        return _empty(title)
    lo, hi = min(values), max(values)
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    x_lo, x_hi = min(xs), max(xs)
    x_span = (x_hi - x_lo) or 1.0
    plot_w, plot_h = WIDTH - PAD_L - PAD_R, HEIGHT - PAD_T - PAD_B

    def point(x: float, y: float) -> str:
        return (f"{PAD_L + (x - x_lo) / x_span * plot_w:.1f},"
                f"{PAD_T + (hi - y) / (hi - lo) * plot_h:.1f}")

    parts = [_frame(title, lo, hi, x_lo, x_hi, x_label)]
    for i, (name, ys) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        runs: list[list[str]] = [[]]
        for x, y in zip(xs, ys):
            if y is None or not math.isfinite(y):
                runs.append([])
            else:
                runs[-1].append(point(x, y))
        for pts in runs:
            if len(pts) == 1:
                cx, cy = pts[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{colour}"/>')
            elif pts:
                parts.append(f'<polyline points="{" ".join(pts)}" fill="none" '
                             f'stroke="{colour}" stroke-width="1.5"/>')
        if len(series) > 1:
            parts.append(f'<text x="{WIDTH - PAD_R - 4}" y="{PAD_T + 10 + 11 * i}" class="lg" '
                         f'fill="{colour}">{esc(name)}</text>')
    return (f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
            f'height="{HEIGHT}" role="img">{"".join(parts)}</svg>')


def bar_chart(title: str, labels: Sequence[str], values: Sequence[float],
              x_label: str = "") -> str:
    """Vertical bars, one per label, with the count above each bar."""
    if not values or max(values) <= 0:
        return _empty(title)
    hi = max(values)
    plot_w, plot_h = WIDTH - PAD_L - PAD_R, HEIGHT - PAD_T - PAD_B
    step = plot_w / len(values)
    parts = [f'<text x="{PAD_L}" y="14" class="ct">{esc(title)}</text>',
             f'<line x1="{PAD_L}" y1="{HEIGHT - PAD_B}" x2="{WIDTH - PAD_R}" '
             f'y2="{HEIGHT - PAD_B}" class="ax"/>',
             f'<text x="{(PAD_L + WIDTH - PAD_R) / 2}" y="{HEIGHT - 2}" class="xl xm">'
             f'{esc(x_label)}</text>']
    for i, (label, value) in enumerate(zip(labels, values)):
        h = value / hi * (plot_h - 12)
        x, y = PAD_L + i * step + step * 0.1, HEIGHT - PAD_B - h
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{step * 0.8:.1f}" height="{h:.1f}" '
                     f'fill="{COLOURS[0]}"><title>{esc(label)}: {_num(value)}</title></rect>')
        parts.append(f'<text x="{x + step * 0.4:.1f}" y="{y - 2:.1f}" class="bv">'
                     f'{_num(value)}</text>')
        if len(values) <= 16:
            parts.append(f'<text x="{x + step * 0.4:.1f}" y="{HEIGHT - PAD_B + 11}" '
                         f'class="xl xm">{esc(label)}</text>')
    return (f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
            f'height="{HEIGHT}" role="img">{"".join(parts)}</svg>')
