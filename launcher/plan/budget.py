"""The GPU budget a plan searches: the recipe's hardware, or another instance type or count.

A budget is a `Hardware` record built by the recipe layer's own resolver
(`launcher.recipe.hardware.hardware_for`), so a planned cluster is one a recipe would resolve to.
"""

from __future__ import annotations

from launcher.errors import RecipeError, UsageError
from launcher.recipe import Recipe, rules
from launcher.recipe.hardware import Hardware, find_instance_type, hardware_for
from launcher.recipe.schema import MAX_GPUS, MAX_INSTANCES


def resolve_budget(
    recipe: Recipe, *, gpus: int | None = None, instances: int | None = None, instance_type: str | None = None
) -> Hardware:
    """The budget from `--gpus`/`--instances`/`--instance-type`, defaulting to the recipe's own.

    The recipe's `cluster.usd_per_hour` is its price for its own instance type, so it applies
    only when the plan keeps that type.
    """
    if gpus is not None and instances is not None:
        raise UsageError("give --gpus or --instances, not both")
    for flag, value, most in (("--gpus", gpus, MAX_GPUS), ("--instances", instances, MAX_INSTANCES)):
        if value is not None and not (_whole(value) and 1 <= value <= most):  # the SDK's too: 64.5, "64"
            raise UsageError(f"{flag} {value!r}: use a whole number from 1 to {most:,}")
    key = instance_type or recipe.cluster.instance_type
    instance, unknown = find_instance_type(key)
    if unknown is not None:
        raise UsageError(f"--instance-type: {unknown.message}")
    same_type = key == recipe.cluster.instance_type

    if key == "local":
        if not same_type:
            raise UsageError("--instance-type local: this machine's GPUs are unknown; plan for an ml.* instance type")
        if instances not in (None, 1):
            raise UsageError(f"--instances {instances}: a local recipe runs on this one machine; use --gpus")
        per_node, count = gpus or recipe.hardware.procs_per_node, 1
    else:
        per_node = instance.gpus_per_node
        count = _instance_count(recipe, key, per_node, gpus=gpus, instances=instances, same_type=same_type)

    hardware = hardware_for(
        key,
        accelerator_key=recipe.hardware.accelerator_key,
        procs_per_node=per_node,
        instance_count=count,
        usd_per_hour=recipe.cluster.usd_per_hour if same_type else None,
        backend=recipe.cluster.backend,
    )
    # The recipe layer's hardware rules (FP8 needs FP8 tensor cores, ...) for the planned hardware.
    problems = rules.hardware_problems(recipe, recipe.arch, hardware)
    if problems:
        raise RecipeError(problems)
    return hardware


def _instance_count(
    recipe: Recipe, key: str, per_node: int, *, gpus: int | None, instances: int | None, same_type: bool
) -> int:
    if gpus is not None:
        if gpus % per_node:
            lower = max(per_node, gpus - gpus % per_node)
            raise UsageError(
                f"--gpus {gpus} is not a multiple of the {per_node} GPUs of one {key}; use e.g. {lower} or {lower + per_node}"
            )
        return gpus // per_node
    if instances is not None:
        return instances
    if same_type:
        return recipe.cluster.instance_count
    return max(1, recipe.world_size // per_node)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
