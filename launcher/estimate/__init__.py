"""Memory estimates: per-GPU peak memory of a recipe, per pipeline stage, and whether it fits.

    from launcher.estimate import estimate_memory, estimate_recipe
    estimate_recipe(recipe).verdict        # "fits" | "risky" | "oom"

Pure arithmetic, no torch: the planner calls `estimate_memory` thousands of times.
"""

from launcher.estimate.memory import (
    COMPONENTS,
    DEFAULT_THRESHOLD,
    MODES,
    MemoryEstimate,
    StageMemory,
    Workload,
    estimate_memory,
    estimate_workload,
    format_bytes,
    verdict,
)
from launcher.estimate.suggest import estimate_recipe

__all__ = [
    "COMPONENTS",
    "DEFAULT_THRESHOLD",
    "MODES",
    "MemoryEstimate",
    "StageMemory",
    "Workload",
    "estimate_memory",
    "estimate_recipe",
    "estimate_workload",
    "format_bytes",
    "verdict",
]
