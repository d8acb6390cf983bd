"""`launcher submit --auto-plan`: switch a recipe to the planner's best layout on its own GPUs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.estimate import DEFAULT_THRESHOLD
from launcher.plan.explain import speed_unit
from launcher.plan.options import SearchOptions
from launcher.plan.rank import search
from launcher.plan.result import LayoutPlan
from launcher.recipe import Recipe


@dataclass(frozen=True, slots=True)
class AutoPlan:
    recipe: Recipe  # the recipe with the best layout applied (the same recipe if it already had it)
    best: LayoutPlan
    changes: dict[str, tuple[Any, Any]]  # dotted key -> (before, after)
    before: LayoutPlan | None  # the recipe's own layout, predicted

    def lines(self) -> list[str]:
        speed = f"{self.best.tokens_per_s_per_gpu:,.0f} {speed_unit(self.best)} predicted"
        if not self.changes:
            return [f"auto-plan: the recipe's layout is already the best ({self.best.describe()}, {speed})"]
        head = f"auto-plan: {self.best.describe()} ({speed}{self._against_before()}); changed:"
        return [head] + [f"  {key}: {_show(old)} -> {_show(new)}" for key, (old, new) in self.changes.items()]

    def _against_before(self) -> str:
        if self.before is None:
            return ""
        gain = self.best.tokens_per_s_per_gpu / self.before.tokens_per_s_per_gpu - 1
        if gain >= 0:
            return f", {gain:.0%} faster than the recipe's layout"
        # Only a layout that does not fit can be faster than the best that does.
        return (
            f", {-gain:.0%} slower than the recipe's layout, which needs "
            f"{self.before.memory.utilization:.0%} of {self.before.memory.memory_name}"
        )


def auto_plan(recipe: Recipe, *, threshold: float = DEFAULT_THRESHOLD) -> AutoPlan:
    """The recipe with the fastest layout that fits on its own instances, and what changed."""
    found = search(recipe, SearchOptions(top=1, threshold=threshold))
    changes = found.best.changes(recipe)
    planned = recipe.with_changes(found.best.overrides(recipe)) if changes else recipe
    return AutoPlan(recipe=planned, best=found.best, changes=changes, before=found.current)


def _show(value: Any) -> str:
    return "unset" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
