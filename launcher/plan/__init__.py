"""The layout planner: every valid parallel layout for a GPU budget, ranked by predicted speed.

    from launcher.plan import plan
    best = plan(recipe, gpus=64, top=5)[0]
    recipe.with_changes(best.overrides(recipe))

Pure arithmetic, no torch: candidates come from `candidates`, speed from
`launcher.estimate.throughput`, memory from `launcher.estimate.estimate_memory`.
"""

from launcher.plan.budget import Budget, resolve_budget
from launcher.plan.rank import Search, plan, search
from launcher.plan.result import LayoutPlan

__all__ = ["Budget", "LayoutPlan", "Search", "plan", "resolve_budget", "search"]
