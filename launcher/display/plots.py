"""PNG plots through matplotlib (the `plot` extra): the memory per stage, the plans, the metrics.

matplotlib is imported inside each function, with the Agg backend, so `launcher --help` and a
headless job never load it; without it, the error names the extra to install.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launcher.display.svg import COLORS, OTHER_COLOR
from launcher.errors import UsageError

GIB = 2**30
PLOT_SUFFIXES = (".png", ".svg", ".pdf")  # what Agg's savefig writes that people open
# The metrics panels: (key in the history, axis label, scale applied to the value).
METRIC_PANELS = (
    ("loss", "loss", 1.0),
    ("tokens_per_s_per_gpu", "tokens/s per GPU", 1.0),
    ("mfu", "MFU (%)", 100.0),
    ("mem_reserved_gib", "memory reserved (GiB)", 1.0),
)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or a one-line error naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("plotting needs matplotlib: pip install 'launcher[plot]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: str | Path) -> Path:
    path = Path(path)
    # Checked here, not left to savefig: it appends ".png" to a name without a suffix (a
    # directory's too), so the file written would not be the one named, and an unknown suffix is
    # its ValueError.
    problem = (
        "is a directory" if path.is_dir() else None if path.suffix.lower() in PLOT_SUFFIXES else "has no image suffix"
    )
    if problem:
        pyplot().close(figure)
        raise UsageError(f"cannot write the plot to {path}: it {problem}; name a .png, .svg or .pdf file")
    try:
        figure.savefig(path, dpi=110, bbox_inches="tight")
    except OSError as error:
        raise UsageError(f"cannot write the plot to {path}: {error.strerror or error}") from None
    finally:
        pyplot().close(figure)
    return path


def _limits(axes, capacity: float, threshold: float, *, vertical: bool) -> None:
    """The GPU's memory and the fits threshold as lines across the plot."""
    draw = axes.axvline if vertical else axes.axhline
    draw(capacity, color="#222", linewidth=1.2, label=f"GPU memory {capacity:.1f} GiB")
    draw(capacity * threshold, color="#d62728", linestyle="--", linewidth=1.2, label=f"{threshold:.0%} threshold")


def plot_memory(
    path: str | Path,
    stages: Sequence[tuple[str, Mapping[str, int]]],
    *,
    capacity_bytes: int,
    threshold: float,
    title: str,
) -> Path:
    """Stacked bars, one per pipeline stage, of memory by component, with capacity and threshold lines."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(8, 1.6 + 0.9 * max(len(stages), 1)))
    labels = [label for label, _ in stages]
    components = [c for c in {c: None for _, parts in stages for c in parts} if any(p.get(c, 0) for _, p in stages)]
    left = [0.0] * len(stages)
    for component in components:
        widths = [parts.get(component, 0) / GIB for _, parts in stages]
        axes.barh(labels, widths, left=left, color=COLORS.get(component, OTHER_COLOR), label=component)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    _limits(axes, capacity_bytes / GIB, threshold, vertical=True)
    axes.invert_yaxis()
    axes.set_xlabel("per-GPU memory (GiB)")
    axes.set_title(title, fontsize=10)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _save(figure, path)


def plot_plans(
    path: str | Path,
    points: Sequence[tuple[str, int, float]],
    *,
    best: int,
    capacity_bytes: int,
    threshold: float,
    title: str,
) -> Path:
    """Predicted tokens/s/GPU against peak memory, one dot per (label, peak bytes, tokens/s) layout;
    the best one is marked and labelled."""
    if not points:
        raise UsageError("no layout fits, so there is nothing to plot; `launcher plan` says what to change")
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(8, 5))
    axes.scatter([p[1] / GIB for p in points], [p[2] for p in points], s=18, color="#4c72b0", label="layouts that fit")
    label, peak, speed = points[best]
    axes.scatter([peak / GIB], [speed], s=140, marker="*", color="#ff7f0e", zorder=3, label="best")
    axes.annotate(label, (peak / GIB, speed), xytext=(-10, -4), textcoords="offset points", fontsize=8, ha="right")
    _limits(axes, capacity_bytes / GIB, threshold, vertical=True)
    axes.set_xlabel("predicted peak memory per GPU (GiB)")
    axes.set_ylabel("predicted tokens/s per GPU")
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8)
    return _save(figure, path)


def plot_metrics(history: Any, path: str | Path) -> Path:
    """Loss, tokens/s/GPU, MFU and memory against step from a MetricsHistory (`.job`, `.column(key)`)."""
    if not len(history):
        raise UsageError(f"{history.job}: no steps logged yet, so there is nothing to plot")
    plt = pyplot()
    figure, grid = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    steps = history.column("step")
    for axes, (key, label, scale) in zip(grid.flat, METRIC_PANELS, strict=True):
        _curve(axes, steps, [v * scale for v in history.column(key)], label)
    _validation_curve(grid.flat[0], steps, history.column("val_loss"))
    for axes in grid[1]:
        axes.set_xlabel("step")
    figure.suptitle(f"{history.job}: {len(history)} steps", fontsize=11)
    figure.tight_layout()
    return _save(figure, path)


def _validation_curve(axes, steps: list[float], values: list[float]) -> None:
    """The held-out loss on the loss panel, at the steps that evaluated (none: nothing drawn)."""
    measured = [(s, v) for s, v in zip(steps, values, strict=True) if not math.isnan(v)]
    if not measured:
        return
    axes.plot([], [], color="C0", label="training")  # the loss curve drawn before, in the first colour
    axes.plot([s for s, _ in measured], [v for _, v in measured], marker="o", color="#d62728", label="validation")
    axes.legend(fontsize=8)


def _curve(axes, steps: list[float], values: list[float], label: str) -> None:
    measured = [(s, v) for s, v in zip(steps, values, strict=True) if not math.isnan(v)]
    axes.set_ylabel(label)
    if not measured:
        # MFU on a CPU has no peak to divide by: say so rather than draw an empty frame.
        axes.text(0.5, 0.5, "not measured", ha="center", va="center", transform=axes.transAxes, color="#888")
        axes.set_yticks([])
        return
    axes.plot([s for s, _ in measured], [v for _, v in measured], marker="." if len(measured) < 50 else None)
    axes.grid(alpha=0.3)
