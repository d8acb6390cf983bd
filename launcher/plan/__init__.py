"""The layout planner: every valid parallel layout for a GPU budget, ranked by predicted speed.

    from launcher.plan import SearchOptions, search
    best = search(recipe, SearchOptions(gpus=64, top=5)).best
    recipe.with_changes(best.overrides(recipe))

`launcher.api.plan(recipe, gpus=64, top=5)` is the public entry: it loads the recipe and returns
the ranked layouts.

Pure arithmetic, no torch: candidates come from `candidates`, speed from `throughput`, memory
from `launcher.estimate.estimate_memory`. `suggest` asks the same search for the smallest
change that makes a recipe fit.
"""

from launcher.plan.budget import resolve_budget
from launcher.plan.options import SearchOptions
from launcher.plan.rank import search
from launcher.plan.result import LayoutPlan, LayoutPlans, Search

__all__ = ["LayoutPlan", "LayoutPlans", "Search", "SearchOptions", "resolve_budget", "search"]
