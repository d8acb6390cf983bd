"""The memory picture as inline SVG: one stacked bar per pipeline stage against the GPU's memory.

No matplotlib: a notebook shows an estimate's picture with nothing but the launcher installed.
Each segment carries a <title> (its component and size) so hovering names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from html import escape

# One colour per memory component, in the estimator's order (launcher.estimate.breakdown.COMPONENTS);
# a component not listed gets grey.
COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#55a868",
    "optimizer_states": "#c44e52",
    "optimizer_temp": "#e17c7f",
    "activations": "#8172b2",
    "fp8": "#937860",
    "fsdp_buffers": "#da8bc3",
    "cp_buffers": "#ccb974",
    "tp_buffers": "#64b5cd",
    "working": "#a1c9f4",
    "loss": "#ffb482",
    "cuda_context": "#8c8c8c",
    "nccl": "#b0b0b0",
    "fragmentation": "#d0d0d0",
}
OTHER_COLOR = "#999999"

_LABEL_W, _BAR_W, _BAR_H, _GAP, _TOP = 70, 420, 22, 8, 28


def memory_bars(
    stages: Sequence[tuple[str, Mapping[str, int]]],
    *,
    capacity_bytes: int,
    threshold: float,
    size: Callable[[float], str],
) -> str:
    """An <svg>: a bar per (label, {component: bytes}) stage, a line at `capacity_bytes` and a
    dashed one at `threshold` of it; `size(bytes)` writes the numbers ('61.2 GiB')."""
    peak = max((sum(parts.values()) for _, parts in stages), default=0)
    scale = _BAR_W / max(capacity_bytes, peak, 1)
    height = _TOP + len(stages) * (_BAR_H + _GAP)
    shown = [c for c in _components(stages) if any(parts.get(c, 0) for _, parts in stages)]
    legend_y = height + 6
    total_h = legend_y + 16 * ((len(shown) + 2) // 3) + 4
    width = _LABEL_W + _BAR_W + 110
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{total_h}' "
        f"viewBox='0 0 {width} {total_h}' font-family='sans-serif' font-size='11'>"
    ]
    for row, (label, breakdown) in enumerate(stages):
        parts.append(_bar(row, label, breakdown, scale, size))
    parts.append(_marker(capacity_bytes * scale, height, f"capacity {size(capacity_bytes)}", "#222", None))
    parts.append(
        _marker(capacity_bytes * threshold * scale, height, f"{threshold:.0%}", "#d62728", "4,3", cls="threshold")
    )
    for index, component in enumerate(shown):
        x = _LABEL_W + (index % 3) * 170
        y = legend_y + 16 * (index // 3)
        parts.append(
            f"<rect x='{x}' y='{y}' width='10' height='10' fill='{COLORS.get(component, OTHER_COLOR)}'/>"
            f"<text x='{x + 14}' y='{y + 9}'>{escape(component)}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _components(stages: Sequence[tuple[str, Mapping[str, int]]]) -> list[str]:
    known = [c for c in COLORS]
    extra = sorted({c for _, parts in stages for c in parts} - set(known))
    return known + extra


def _bar(row: int, label: str, breakdown: Mapping[str, int], scale: float, size: Callable[[float], str]) -> str:
    y = _TOP + row * (_BAR_H + _GAP)
    x = float(_LABEL_W)
    pieces = [f"<text x='4' y='{y + _BAR_H * 0.7:.1f}'>{escape(label)}</text>"]
    for component, value in breakdown.items():
        if value <= 0:
            continue
        w = value * scale
        pieces.append(
            f"<rect class='segment' data-component='{escape(component, quote=True)}' data-bytes='{int(value)}' "
            f"x='{x:.2f}' y='{y}' width='{w:.2f}' height='{_BAR_H}' fill='{COLORS.get(component, OTHER_COLOR)}'>"
            f"<title>{escape(component)}: {escape(size(value))}</title></rect>"
        )
        x += w
    total = sum(breakdown.values())
    pieces.append(f"<text class='peak' x='{x + 4:.2f}' y='{y + _BAR_H * 0.7:.1f}'>{escape(size(total))}</text>")
    return "".join(pieces)


def _marker(x: float, height: int, label: str, color: str, dash: str | None, cls: str = "capacity") -> str:
    x += _LABEL_W
    dashes = f" stroke-dasharray='{dash}'" if dash else ""
    return (
        f"<line class='{cls}' x1='{x:.2f}' y1='{_TOP - 6}' x2='{x:.2f}' y2='{height}' stroke='{color}'{dashes}/>"
        f"<text x='{x:.2f}' y='{_TOP - 10}' fill='{color}' text-anchor='middle'>{escape(label)}</text>"
    )
