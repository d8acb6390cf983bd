"""The GPU budget a plan searches: which instance type, how many of them, at what price."""

from __future__ import annotations

from dataclasses import dataclass

from launcher import catalog
from launcher.catalog import Accelerator, InstanceType, choices
from launcher.errors import RecipeError, UsageError
from launcher.recipe import rules
from launcher.recipe.resolve import Hardware, suggest


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    instance_type: str
    instance: InstanceType
    accelerator_key: str
    accelerator: Accelerator
    gpus_per_node: int
    instance_count: int
    usd_per_hour: float  # one instance

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.instance_count

    def __str__(self) -> str:
        if self.instance_type == "local":
            return f"{self.world_size} x {self.accelerator_key} on this machine"
        return f"{self.instance_count} x {self.instance_type} ({self.world_size} x {self.accelerator_key})"


def resolve_budget(recipe, *, gpus: int | None, instances: int | None, instance_type: str | None) -> Budget:
    """The budget from `--gpus`/`--instances`/`--instance-type`, defaulting to the recipe's own.

    The recipe's `cluster.usd_per_hour` is its price for its own instance type, so it applies
    only when the plan keeps that type.
    """
    if gpus is not None and instances is not None:
        raise UsageError("give --gpus or --instances, not both")
    for flag, value in (("--gpus", gpus), ("--instances", instances)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: use a positive number")
    key = instance_type or recipe.cluster.instance_type
    instance_types = catalog.instance_types()
    if key not in instance_types:
        raise UsageError(
            f"--instance-type: '{key}' is not a known instance type{suggest(key, instance_types)}; use {choices(instance_types)}"
        )
    instance = instance_types[key]
    same_type = key == recipe.cluster.instance_type

    if key == "local":
        if not same_type:
            raise UsageError("--instance-type local: this machine's GPUs are unknown; plan for an ml.* instance type")
        accelerator_key, accelerator = recipe.hardware.accelerator_key, recipe.hardware.accelerator
        if instances not in (None, 1):
            raise UsageError(f"--instances {instances}: a local recipe runs on this one machine; use --gpus")
        per_node = gpus or recipe.hardware.procs_per_node
        count = 1
    else:
        accelerator_key = instance.accelerator
        accelerator = catalog.accelerators()[accelerator_key]
        per_node = instance.gpus_per_node
        if gpus is not None:
            if gpus % per_node:
                lower = max(per_node, gpus - gpus % per_node)
                raise UsageError(
                    f"--gpus {gpus} is not a multiple of the {per_node} GPUs of one {key}; use e.g. {lower} or {lower + per_node}"
                )
            count = gpus // per_node
        elif instances is not None:
            count = instances
        elif same_type:
            count = recipe.cluster.instance_count
        else:
            count = max(1, recipe.world_size // per_node)

    # The recipe layer's hardware rules (FP8 needs FP8 tensor cores, ...) for the planned hardware.
    problems = rules.hardware_problems(
        recipe, recipe.arch, Hardware(key, instance, accelerator_key, accelerator, per_node)
    )
    if problems:
        raise RecipeError(problems)
    price = (
        recipe.cluster.usd_per_hour if same_type and recipe.cluster.usd_per_hour is not None else instance.usd_per_hour
    )
    return Budget(
        instance_type=key,
        instance=instance,
        accelerator_key=accelerator_key,
        accelerator=accelerator,
        gpus_per_node=per_node,
        instance_count=count,
        usd_per_hour=price,
    )
