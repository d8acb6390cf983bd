"""RESOLVE: every `auto` of a recipe settled once, before anything is built from it.

A recipe may leave four choices to the launcher (`SETTLED_AT_RESOLVE`):
- parallel.data_shard: the GPUs the other degrees leave (the recipe's layout, filled in when the
  recipe was validated);
- parallel.cp_attention: the context-parallel attention path the contract's rule picks for that
  layout (`launcher.contract.layout.cp_attention_for`);
- parallel.grad_accumulation: the mode the job runs; for auto, the estimator's pick, the fastest
  mode whose memory estimate fits under the threshold (`choose_grad_accumulation`);
- checkpoint.every_minutes: the Young/Daly interval from the predicted save time and the
  cluster's interruption rate (`launcher.estimate.checkpoint.auto_every_minutes`).
With `auto_plan` the planner first switches the recipe to its best layout (`launcher.plan.apply`).
Then the stop (`settle_stop`): on an engine where the job sets its own grace (docker, Slurm,
Kubernetes) and the recipe names none, cluster.stop_grace becomes the predicted step plus one
save, with margin (`launcher.estimate.checkpoint.needed_stop_grace`); where the step and the save
cannot fit the job's grace and the recipe saves no periodic checkpoint, checkpoint.every_minutes
becomes the Young/Daly interval, so that a stop loses at most that much.
And a hung collective (`settle_collective_timeout`): where the step is predicted and the recipe
names none, cluster.collective_timeout becomes a multiple of the predicted step plus one save,
which the entrypoints pass to init_process_group (runtime.collective_timeout_s).

The concrete recipe says auto nowhere: its `resolved()` is the contract's `JobConfig`, and what
is built from it (the JobSpec, the bundle, the backends) never calls the estimator or the
planner. The memory estimate describes the concrete recipe. The planner's search and the run-time
forecast read the recipe as given, since they weigh its autos per candidate layout themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from launcher.catalog.engines import capabilities
from launcher.contract.layout import cp_attention_for
from launcher.estimate import DEFAULT_THRESHOLD, Workload, choose_grad_accumulation
from launcher.estimate.checkpoint import auto_every_minutes, estimate_recipe_checkpoint, needed_stop_grace, stop_fits
from launcher.plan.apply import AutoPlan
from launcher.plan.apply import auto_plan as best_layout
from launcher.plan.forecast import forecast
from launcher.recipe import Recipe


@dataclass(frozen=True)
class Resolved:
    """A recipe with every auto settled, beside the recipe as given."""

    recipe: Recipe
    """The recipe as given (with auto_plan: the planner's layout applied); it may still say auto."""
    concrete: Recipe
    """The same recipe with no auto left: what the memory estimate describes and the job runs."""
    settled: dict[str, Any]
    """What each key that said auto became, e.g. {"parallel.data_shard": 8}, and what the launcher
    chose for the stop (cluster.stop_grace; checkpoint.every_minutes where a stop cannot save) and
    for a hung collective (cluster.collective_timeout)."""
    plan: AutoPlan | None = None
    """With auto_plan: the planner's best layout and what it changed."""


def resolve(recipe: Recipe, *, threshold: float = DEFAULT_THRESHOLD, auto_plan: bool = False) -> Resolved:
    """Settle every auto of `recipe`; `threshold` is the share of GPU memory an estimate may fill
    (for grad_accumulation: auto and the planner). A concrete recipe comes back unchanged."""
    planned = None
    if auto_plan:
        planned = best_layout(recipe, threshold=threshold)
        recipe = planned.recipe
    settled = settle(recipe, threshold=threshold)
    concrete = recipe.with_changes(settled) if settled else recipe
    run = forecast(concrete, time_limit_s=None)
    step_s = run.speed.step_time_s if run else None
    save_s = estimate_recipe_checkpoint(concrete, step_s).durable_s
    stop = {**settle_stop(concrete, step_s, save_s), **settle_collective_timeout(concrete, step_s, save_s)}
    if stop:
        settled = {**settled, **stop}
        concrete = concrete.with_changes(stop)
    return Resolved(recipe=recipe, concrete=concrete, settled=settled, plan=planned)


# A healthy rank waits longest in a collective while another finishes its step and then saves
# (DCP's save is collective, the durable copy is not); both are predictions, so the timeout is a
# multiple of them. The floor is NCCL's own default (10 min): what the forecast leaves out, the
# first step's compile and an init_from load before the first collective, fits in it.
COLLECTIVE_TIMEOUT_FACTOR = 4
MIN_COLLECTIVE_TIMEOUT_S = 600


def collective_timeout_s(step_s: float | None, save_s: float | None) -> int | None:
    """The seconds a collective may wait: COLLECTIVE_TIMEOUT_FACTOR x (the step + a save), at
    least MIN_COLLECTIVE_TIMEOUT_S; None where the step is not predicted (the contract's default)."""
    if step_s is None:
        return None
    return max(MIN_COLLECTIVE_TIMEOUT_S, math.ceil(COLLECTIVE_TIMEOUT_FACTOR * (step_s + (save_s or 0.0))))


def settle_collective_timeout(recipe: Recipe, step_s: float | None, save_s: float | None) -> dict[str, Any]:
    """cluster.collective_timeout where the recipe names none and the step is predicted."""
    timeout = collective_timeout_s(step_s, save_s)
    if recipe.cluster.collective_timeout is not None or timeout is None:
        return {}
    return {"cluster.collective_timeout": timeout}


def settle_stop(recipe: Recipe, step_s: float | None, save_s: float | None) -> dict[str, Any]:
    """cluster.stop_grace where the job sets it and the recipe does not; checkpoint.every_minutes
    where the step and a save do not fit the grace and nothing else saves periodically (`step_s`,
    `save_s`: the predicted step and a save until durable; None: not predicted)."""
    engine = capabilities(recipe.cluster.backend)
    if not engine.says_stop_grace():
        return {}
    changes: dict[str, Any] = {}
    if engine.job_sets_stop_grace and recipe.cluster.stop_grace is None:
        changes["cluster.stop_grace"] = needed_stop_grace(step_s, save_s).grace_s
    grace = engine.stop_grace(changes.get("cluster.stop_grace", recipe.cluster.stop_grace))
    periodic = recipe.checkpoint.every_steps or recipe.checkpoint.every_minutes
    if not stop_fits(grace, step_s, save_s) and not periodic:
        changes["checkpoint.every_minutes"] = auto_every_minutes(recipe).minutes
    return changes


def settle(recipe: Recipe, *, threshold: float = DEFAULT_THRESHOLD) -> dict[str, Any]:
    """The value of each key of `recipe.unsettled`, as recipe overrides."""
    choices: dict[str, Callable[[], Any]] = {
        "parallel.data_shard": lambda: recipe.layout.data_shard,
        "parallel.cp_attention": lambda: cp_attention_for(
            recipe.parallel.cp_attention,
            recipe.arch,
            recipe.layout,
            activation_checkpointing=recipe.parallel.activation_checkpointing,
            document_masking=recipe.data.document_masking,
        ),
        "parallel.grad_accumulation": lambda: grad_accumulation(recipe, threshold=threshold),
        "checkpoint.every_minutes": lambda: auto_every_minutes(recipe).minutes,
    }
    return {key: choices[key]() for key in recipe.unsettled}


def grad_accumulation(recipe: Recipe, *, threshold: float = DEFAULT_THRESHOLD) -> str:
    """The mode the job runs: the recipe's (or the one its layout forces), else the estimator's pick."""
    mode = recipe.grad_accumulation()
    if mode != "auto":
        return mode
    return choose_grad_accumulation(Workload.from_recipe(recipe), recipe.hardware, threshold)
