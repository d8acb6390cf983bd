"""One sentence on why the best layout wins, from the difference in where the step time goes."""

from __future__ import annotations

from launcher.plan.result import LayoutPlan, Search
from launcher.plan.throughput import BREAKDOWN, BREAKDOWN_WORDS


def speed_unit(plan: LayoutPlan) -> str:
    """'tokens/s/GPU', or 'tokens/s per CPU rank' where there is no GPU."""
    device = plan.memory.device
    return "tokens/s/GPU" if device == "GPU" else f"tokens/s per {device}"


def why(search: Search) -> str:
    """'<best> is fastest at N tokens/s/GPU (M% MFU): X% ahead of the runner-up (...), which spends
    ...; K faster layouts need more than T% of GPU memory' (K: those faster than the best)."""
    best = search.best
    mfu = best.throughput.mfu_text()
    head = f"{best.describe()} is fastest at {best.tokens_per_s_per_gpu:,.0f} {speed_unit(best)}" + (
        f" ({mfu} MFU)" if mfu != "-" else ""
    )
    clauses = []
    if len(search.ranked) > 1:
        clauses.append(_against(best, search.ranked[1], "the runner-up"))
    if search.faster_but_too_big:
        clauses.append(
            f"{search.faster_but_too_big} faster layout{'s' if search.faster_but_too_big > 1 else ''} "
            f"need{'s' if search.faster_but_too_big == 1 else ''} more than {search.threshold:.0%} of "
            f"{best.memory.memory_name}"
        )
    return head + (": " + "; ".join(clauses) if clauses else "") + "."


def against_recipe(search: Search) -> str | None:
    """How the recipe's own layout compares, when the plan searched the recipe's own budget."""
    current, best = search.current, search.best
    if current is None:
        return None
    if current.settings() == best.settings():
        return "The recipe already uses this layout."
    fits = (
        "" if current.memory.fits else f", and needs {current.memory.utilization:.0%} of {current.memory.memory_name}"
    )
    slower = 1 - current.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu
    above_or_below = f"{slower:.0%} below" if slower >= 0 else f"{-slower:.0%} above"
    return (
        f"The recipe's own layout ({current.describe()}) predicts {current.tokens_per_s_per_gpu:,.0f} "
        f"{speed_unit(current)}, {above_or_below} the best{fits}."
    )


def _against(best: LayoutPlan, other: LayoutPlan, name: str) -> str:
    ratio = best.tokens_per_s_per_gpu / other.tokens_per_s_per_gpu - 1
    if ratio < 0.0005:
        return f"it ties with {name} ({other.describe()})"
    diffs = {k: other.throughput.breakdown[k] - best.throughput.breakdown[k] for k in BREAKDOWN}
    reason = max(diffs, key=diffs.__getitem__)
    return (
        f"{ratio:.1%} ahead of {name} ({other.describe()}), which spends "
        f"{_seconds(diffs[reason])} more per step on {BREAKDOWN_WORDS[reason]}"
    )


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
