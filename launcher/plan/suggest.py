"""When a recipe does not fit: the planner's search, asked for the smallest change that does.

The candidates are the planner's (`launcher.plan.rank`): every valid layout, micro batch and
activation checkpointing, checked by the same rules a recipe must pass. They are tried on the
recipe's own GPUs first, then on 2, 4, 8 and 16 times as many instances of the same type. On
each budget the suggestion is the layout that fits with the fewest changed recipe keys, and the
fastest of those (by predicted throughput, the planner's order) when several do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.estimate import DEFAULT_THRESHOLD, MemoryEstimate, Mode, Workload, estimate_memory, format_bytes
from launcher.plan.budget import resolve_budget
from launcher.plan.rank import Failures, Scored, candidate_workloads, first_that_fit, lightest_first
from launcher.plan.result import recipe_settings
from launcher.plan.throughput import Throughput, ThroughputUnknown, predict
from launcher.recipe import Recipe
from launcher.recipe.hardware import Hardware

INSTANCE_SCALES = (1, 2, 4, 8, 16)  # suggest at most 16x the instances before giving up
# The order in which a suggestion names its edits: the least disruptive first.
EDIT_ORDER = (
    "parallel.activation_checkpointing",
    "parallel.tp_saved_inputs",
    "training.micro_batch_size",
    "parallel.tensor",
    "parallel.context",
    "parallel.pipeline",
    "parallel.virtual_stages",
    "parallel.pipeline_schedule",
    "parallel.data_replicate",
    "parallel.data_shard",
    "parallel.expert",
    "precision.fp8",
    "cluster.instance_count",
)


@dataclass(frozen=True)
class Change:
    """An edit of a recipe, as dotted recipe keys with their old and new values."""

    edits: tuple[tuple[str, Any, Any], ...]

    def describe(self) -> str:
        """'set parallel.activation_checkpointing: full and raise parallel.tensor to 2'."""
        parts = []
        for key, old, new in self.edits:
            if isinstance(new, int) and not isinstance(new, bool) and key != "parallel.data_shard":
                parts.append(f"{'raise' if new > old else 'lower'} {key} to {new}")
            else:
                parts.append(f"set {key}: {str(new).lower() if isinstance(new, bool) else new}")
        return " and ".join(parts)

    def as_overrides(self) -> dict[str, Any]:
        return {key: new for key, _, new in self.edits}


def suggestion(recipe: Recipe, *, mode: Mode = "fsdp", threshold: float = DEFAULT_THRESHOLD) -> str:
    """One sentence for a recipe that does not fit: the change that does, or what to do instead."""
    found = find_fitting_change(recipe, mode=mode, threshold=threshold)
    if found is None:
        scale = _scales(recipe)[-1]
        where = "this machine" if scale == 1 else f"up to {scale}x the GPUs"
        return (
            f"no layout on {where} fits under {threshold:.0%}; use GPUs with more memory or a shorter training.seq_len"
        )
    change, fitted = found
    return f"{change.describe()} (estimated {format_bytes(fitted.per_gpu_peak_bytes)}, {fitted.utilization:.0%})"


def find_fitting_change(
    recipe: Recipe, *, mode: Mode = "fsdp", threshold: float = DEFAULT_THRESHOLD
) -> tuple[Change, MemoryEstimate] | None:
    """The change with the fewest edits that fits, on the smallest budget where one does, with its estimate."""
    current = recipe_settings(Workload.from_recipe(recipe), recipe.hardware)
    for scale in _scales(recipe):
        budget = resolve_budget(recipe, instances=None if scale == 1 else recipe.cluster.instance_count * scale)
        by_edits: dict[int, list[Scored]] = {}
        failures = Failures()  # one budget: a layout too big in one group rules out heavier ones in the next
        for workload in candidate_workloads(recipe, budget):
            count = len(_edits(recipe, current, workload, budget))
            by_edits.setdefault(count, []).append(Scored(workload, None))
        for count in sorted(by_edits):
            # Memory first, then speed only for what fits: the fastest wins. The lightest layouts go
            # first, so that one that fails rules out the heavier ones without an estimate.
            group = sorted(by_edits[count], key=lightest_first)
            found = first_that_fit(group, budget, top=len(group), threshold=threshold, mode=mode, failures=failures)
            if found.fitting:
                scored = [
                    (Scored(item.workload, _speed_or_none(item.workload, budget)), fit) for item, fit in found.fitting
                ]
                item, _ = min(scored, key=lambda pair: pair[0].sort_key())
                change = Change(_edits(recipe, current, item.workload, budget))
                return change, _estimate_changed(recipe, change, mode, threshold)
    return None


def _estimate_changed(recipe: Recipe, change: Change, mode: Mode, threshold: float) -> MemoryEstimate:
    """The estimate of the recipe with the change applied, as `launcher estimate` would make it:
    a candidate's accumulation mode is not an edit where the recipe says auto, so the changed
    recipe runs the mode auto picks for it, which can hold more than the candidate's."""
    changed = recipe.with_changes(change.as_overrides())
    return estimate_memory(Workload.from_recipe(changed), changed.hardware, mode=mode, threshold=threshold)


def _scales(recipe: Recipe) -> tuple[int, ...]:
    """Multiples of the recipe's instances to try: this machine has only its own GPUs."""
    return (1,) if recipe.hardware.instance_key == "local" else INSTANCE_SCALES


def _edits(
    recipe: Recipe, current: dict[str, Any], workload: Workload, budget: Hardware
) -> tuple[tuple[str, Any, Any], ...]:
    """The recipe keys `workload` on `budget` changes, least disruptive first. data_shard follows
    the other degrees unless the recipe sets it."""
    new = recipe_settings(workload, budget)
    changed = {key for key, value in new.items() if current[key] != value}
    if recipe.parallel.data_shard == "auto":
        changed.discard("parallel.data_shard")
    return tuple((key, current[key], new[key]) for key in EDIT_ORDER if key in changed)


def _speed_or_none(workload: Workload, hardware: Hardware) -> Throughput | None:
    # A GPU without datasheet peaks has no speed model: its candidates are ordered by simplicity alone.
    try:
        return predict(workload, hardware)
    except ThroughputUnknown:
        return None
