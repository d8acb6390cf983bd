"""Memory estimates: per-GPU peak memory of a workload, per pipeline stage, and whether it fits.

    from launcher.estimate import Workload, estimate_memory
    estimate_memory(Workload.from_recipe(recipe), recipe.hardware).verdict   # "fits" | "risky" | "oom"

Pure arithmetic, no torch: the planner asks `estimate_if_fits` of thousands of layouts.
`launcher.api.estimate(recipe)` adds a suggestion when a recipe does not fit.
"""

from launcher.estimate.breakdown import COMPONENTS, StageMemory
from launcher.estimate.memory import (
    DEFAULT_THRESHOLD,
    MODES,
    MemoryEstimate,
    Mode,
    choose_grad_accumulation,
    estimate_if_fits,
    estimate_memory,
    format_bytes,
    verdict,
)
from launcher.estimate.workload import Workload

__all__ = [
    "COMPONENTS",
    "DEFAULT_THRESHOLD",
    "MODES",
    "MemoryEstimate",
    "Mode",
    "StageMemory",
    "Workload",
    "choose_grad_accumulation",
    "estimate_if_fits",
    "estimate_memory",
    "format_bytes",
    "verdict",
]
