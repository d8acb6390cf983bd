"""Estimate a recipe, and when it does not fit, find one concrete change that does.

Candidates are the changes a user would try, least disruptive first: stronger activation
checkpointing, a smaller micro-batch, more context, tensor or pipeline parallelism on the same
GPUs, those combined with full checkpointing, and last, more instances. Every candidate must
pass the same layout rules a recipe must (`launcher.recipe.rules.layout_problems`), and is
re-estimated; the first that fits is the suggestion.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from launcher.contract.layout import Layout, tensor_choices
from launcher.estimate.memory import (
    DEFAULT_THRESHOLD,
    MemoryEstimate,
    Mode,
    Workload,
    estimate_workload,
    format_bytes,
)
from launcher.recipe.rules import layout_problems

if TYPE_CHECKING:
    from launcher.recipe import Recipe

AC_ORDER = ("none", "selective", "full")
MAX_INSTANCE_SCALE = 16  # suggest at most 16x the instances before giving up


def recipe_workload(recipe: Recipe) -> Workload:
    return Workload(
        arch=recipe.arch,
        layout=recipe.layout,
        seq_len=recipe.training.seq_len,
        micro_batch_size=recipe.training.micro_batch_size,
        grad_accum_steps=recipe.grad_accum_steps,
        dtype=recipe.precision.dtype,
        fp8=recipe.precision.fp8,
        fp8_recipe=recipe.precision.fp8_recipe,
        activation_checkpointing=recipe.parallel.activation_checkpointing,
        pipeline_schedule=recipe.parallel.pipeline_schedule,
    )


def estimate_recipe(recipe: Recipe, *, mode: Mode = "fsdp", threshold: float = DEFAULT_THRESHOLD) -> MemoryEstimate:
    """The recipe's memory estimate, with a suggestion that itself fits when it does not."""
    accelerator = recipe.hardware.accelerator
    result = estimate_workload(recipe_workload(recipe), accelerator, mode=mode, threshold=threshold)
    if result.fits:
        return result
    found = find_fitting_change(recipe, mode=mode, threshold=threshold)
    if found is None:
        return result.with_suggestion(
            f"no layout on up to {MAX_INSTANCE_SCALE}x the GPUs fits under {threshold:.0%}; "
            "use GPUs with more memory or a shorter training.seq_len"
        )
    change, fitted = found
    return result.with_suggestion(
        f"{change.describe()} (estimated {format_bytes(fitted.per_gpu_peak_bytes)}, {fitted.utilization:.0%})"
    )


@dataclass(frozen=True)
class Change:
    """A candidate edit of a recipe, as dotted recipe keys and their new values."""

    edits: tuple[tuple[str, object], ...]

    def describe(self) -> str:
        parts = []
        for key, value in self.edits:
            if key == "parallel.activation_checkpointing":
                parts.append(f"set {key}: {value}")
            elif key == "training.micro_batch_size":
                parts.append(f"lower {key} to {value}")
            elif key == "parallel.data_shard":
                parts.append(f"{key}: {value}")
            else:
                parts.append(f"raise {key} to {value}")
        return " and ".join(parts)

    def as_overrides(self) -> dict[str, object]:
        return dict(self.edits)


def find_fitting_change(
    recipe: Recipe, *, mode: Mode = "fsdp", threshold: float = DEFAULT_THRESHOLD
) -> tuple[Change, MemoryEstimate] | None:
    """The first candidate change that passes the layout rules and fits, with its estimate."""
    base = recipe_workload(recipe)
    accelerator = recipe.hardware.accelerator
    for change, workload, gpus_per_node in _candidates(recipe, base):
        problems = layout_problems(
            workload.layout,
            workload.arch,
            seq_len=workload.seq_len,
            global_batch_size=recipe.training.global_batch_size,
            micro_batch_size=workload.micro_batch_size,
            gpus_per_node=gpus_per_node,
            schedule=workload.pipeline_schedule,
        )
        if problems:
            continue
        estimate = estimate_workload(workload, accelerator, mode=mode, threshold=threshold)
        if estimate.fits:
            return change, estimate
    return None


def _candidates(recipe: Recipe, base: Workload) -> Iterator[tuple[Change, Workload, int]]:
    layout = base.layout
    gpus_per_node = recipe.hardware.procs_per_node
    explicit_shard = recipe.parallel.data_shard != "auto"
    gbs = recipe.training.global_batch_size

    def with_layout(new: Layout, edits: list[tuple[str, object]], ac: str | None = None, mbs: int | None = None):
        if explicit_shard and new.data_shard != layout.data_shard:
            edits = [*edits, ("parallel.data_shard", new.data_shard)]
        micro = mbs or base.micro_batch_size
        per_step = micro * new.data_parallel
        workload = replace(
            base,
            layout=new,
            micro_batch_size=micro,
            grad_accum_steps=max(1, gbs // per_step),
            activation_checkpointing=ac or base.activation_checkpointing,
        )
        return Change(tuple(edits)), workload, gpus_per_node

    def regrid(world: int, **degrees: int) -> Layout | None:
        merged = {
            "tensor": layout.tensor,
            "context": layout.context,
            "pipeline": layout.pipeline,
            "data_replicate": layout.data_replicate,
            "virtual_stages": layout.virtual_stages,
        } | degrees
        others = merged["tensor"] * merged["context"] * merged["pipeline"] * merged["data_replicate"]
        if world % others:
            return None
        return Layout(data_shard=world // others, **merged)

    stronger_ac = list(AC_ORDER[AC_ORDER.index(base.activation_checkpointing) + 1 :])
    world = layout.world_size

    # 1. Recompute more.
    for ac in stronger_ac:
        yield with_layout(layout, [("parallel.activation_checkpointing", ac)], ac=ac)
    # 2. Fewer sequences per micro-batch.
    mbs = base.micro_batch_size // 2
    while mbs >= 1:
        yield with_layout(layout, [("training.micro_batch_size", mbs)], mbs=mbs)
        mbs //= 2
    # 3. More of one parallelism on the same GPUs, alone and then with full recomputation.
    for ac in [None, *(["full"] if "full" in stronger_ac else [])]:
        ac_edit = [("parallel.activation_checkpointing", ac)] if ac else []
        for axis, values in _degree_ladders(recipe, layout, gpus_per_node):
            for value in values:
                new = regrid(world, **{axis: value})
                if new is not None:
                    yield with_layout(new, [*ac_edit, (f"parallel.{axis}", value)], ac=ac)
    # 4. More instances of the same kind, same degrees, FSDP over the rest.
    if recipe.cluster.backend != "local":
        count = recipe.cluster.instance_count
        for scale in (2, 4, 8, 16):
            if scale > MAX_INSTANCE_SCALE:
                break
            for ac in [None, *(["full"] if "full" in stronger_ac else [])]:
                new = regrid(world * scale)
                if new is not None:
                    ac_edit = [("parallel.activation_checkpointing", ac)] if ac else []
                    yield with_layout(new, [*ac_edit, ("cluster.instance_count", count * scale)], ac=ac)


def _degree_ladders(recipe: Recipe, layout: Layout, gpus_per_node: int) -> list[tuple[str, list[int]]]:
    """Larger context, tensor and pipeline degrees worth trying, smallest first."""
    world = layout.world_size
    context = [c for c in _doublings(layout.context, world) if c > layout.context]
    tensor = [t for t in tensor_choices(recipe.arch, gpus_per_node) if t > layout.tensor]
    pipeline = [p for p in _doublings(layout.pipeline, world) if p > layout.pipeline]
    return [("context", context), ("tensor", tensor), ("pipeline", pipeline)]


def _doublings(start: int, limit: int) -> list[int]:
    values, value = [], start * 2
    while value <= limit:
        values.append(value)
        value *= 2
    return values
