"""The layout planner: every valid parallel layout for a GPU budget, ranked by predicted speed.

    from launcher.plan import plan
    best = plan(recipe, gpus=64, top=5)[0]
    recipe.with_changes(best.overrides(recipe))

Pure arithmetic, no torch: candidates come from `candidates`, speed from `throughput`, memory
from `launcher.estimate.estimate_memory`. `suggest` asks the same search for the smallest
change that makes a recipe fit.
"""

from launcher.plan.budget import resolve_budget
from launcher.plan.rank import plan, search
from launcher.plan.result import LayoutPlan, LayoutPlans, Search

__all__ = ["LayoutPlan", "LayoutPlans", "Search", "plan", "resolve_budget", "search"]
