"""A server-rendered SVG sparkline (KV-cache usage, TTFT): no chart library, no script.

Only presentation attributes (no ``style``), so the page's CSP needs no
'unsafe-inline'. Gaps in the samples (no replica reporting) break the line.
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape

HIGH_WATERMARK = 0.85  # the seeds' numbers: shrink admission above, recover below low
LOW_WATERMARK = 0.70


def svg(points: Sequence[tuple[float, float]], since: float, until: float, *, width: int = 240,
        height: int = 40, gap_s: float = 30.0, label: str = "KV usage", top: float = 1.0,
        marks: Sequence[tuple[float, str]] = ((HIGH_WATERMARK, "#d9534f"), (LOW_WATERMARK, "#e0a800"))) -> Markup:
    """``top``: the value drawn at the top edge; ``marks``: dashed lines (value, color)."""
    span = max(until - since, 1e-9)
    top = top if top > 0 else 1.0

    def x(t: float) -> float:
        return round((min(max(t, since), until) - since) / span * width, 1)

    def y(v: float) -> float:
        return round(height - min(max(v / top, 0.0), 1.0) * height, 1)

    runs: list[list[tuple[float, float]]] = []
    last_t: float | None = None
    for t, v in points:
        if last_t is None or t - last_t > gap_s:
            runs.append([])
        runs[-1].append((t, v))
        last_t = t
    parts = [
        f'<svg class="sparkline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(label)}">',
        f"<title>{escape(label)}: {len(points)} samples over the last {round(span / 60)} min</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#f6f7f9"/>',
    ]
    for mark, color in marks:
        parts.append(f'<line class="watermark" x1="0" x2="{width}" y1="{y(mark)}" y2="{y(mark)}" '
                     f'stroke="{color}" stroke-width="0.6" stroke-dasharray="3 2"/>')
    for run in runs:
        if len(run) == 1:
            t, v = run[0]
            parts.append(f'<circle cx="{x(t)}" cy="{y(v)}" r="1.2" fill="#2563eb"/>')
            continue
        coords = " ".join(f"{x(t)},{y(v)}" for t, v in run)
        parts.append(f'<polyline points="{coords}" fill="none" stroke="#2563eb" stroke-width="1.4"/>')
    if points:
        t, v = points[-1]
        parts.append(f'<circle class="last" cx="{x(t)}" cy="{y(v)}" r="2" fill="#1e3a8a"/>')
    else:
        parts.append(f'<text x="{width / 2}" y="{height / 2 + 4}" text-anchor="middle" font-size="10" '
                     f'fill="#888">no samples</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
