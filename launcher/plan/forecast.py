"""What a run will take and cost, said before any money is spent.

    run = forecast(recipe, time_limit_s=recipe.cluster.max_run)
    run.line()      # 'time: 201.4 s/step x 1000 steps = 2.3 days; cost about $21,000 (4 x ml.p5e.48xlarge at $253.18/h)'
    run.overrun()   # None, or one line: the predicted run time exceeds the time limit, and what would fit

The step time is the planner's prediction (`launcher.plan.throughput.predict`); the run time is
steps x step time, and the cost is the run time at the cluster's hourly price (the catalog's
on-demand price, or `cluster.usd_per_hour`). A job whose engine stops it at a time limit
(SageMaker's MaxRuntimeInSeconds) and whose predicted run time exceeds that limit would be
killed before its last step: `submit` refuses it unless forced, and says which `max_run` or
which `training.steps` would fit. A run longer than one job may run at all (SageMaker: the
account's quota "Longest run time for a training job") is no overrun: it is planned as a chain of
`jobs` jobs of one lineage, each a `launcher submit --resume` of the last.

With data.validation the run also evaluates held-out data (`evaluations` times, each
data.validation.batches global batches forward-only): `evaluation_s` per batch is the predicted
step's forward share, a third of its compute and communication (a forward is 2 of the 6 FLOPs per
parameter and token a step does; FSDP gathers once of its three transfers), without what only a
training step does: recomputation, the optimizer step and the HSDP gradient all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.display.text import duration
from launcher.estimate import Workload
from launcher.plan.modes import FORWARD_SHARE
from launcher.plan.throughput import Throughput, ThroughputUnknown, predict
from launcher.recipe import Recipe
from launcher.recipe.schema import SAGEMAKER_MAX_RUN_S

# A suggested time limit leaves this much room over the prediction (startup, checkpoints, a
# slower node), rounded up to whole days (whole hours under a day).
TIME_LIMIT_HEADROOM = 1.15


@dataclass(frozen=True, slots=True)
class RunForecast:
    recipe_name: str
    speed: Throughput
    steps: int
    hardware_text: str
    time_limit_s: int | None
    """Where the engine stops the job (SageMaker's max_run); None where nothing stops it."""
    longest_job_s: int | None = None
    """The longest one job may run on the engine (its account's quota); None: no such limit."""
    resumable: bool = True
    """Whether a next job would continue this one: it saves periodic checkpoints and resumes."""
    evaluations: int = 0
    """Held-out batches evaluated over the run (data.validation: evaluations x batches)."""
    evaluation_s: float = 0.0
    """Predicted seconds of one evaluated batch (`evaluation_batch_s`)."""
    start_step: int = 0
    """The checkpoint the job resumes from: `steps` are those after it."""

    @property
    def run_s(self) -> float:
        return self.steps * self.speed.step_time_s + self.evaluations * self.evaluation_s

    @property
    def usd(self) -> float:
        return self.speed.usd_per_hour * self.run_s / 3600

    def line(self) -> str:
        evaluating = f" + {self.evaluations} validation batches x {self.evaluation_s:.1f} s" if self.evaluations else ""
        return (
            f"time: {self.speed.step_time_s:.1f} s/step x {self.steps} steps{self._after}{evaluating} = "
            f"{duration(self.run_s)}; "
            f"cost about ${self.usd:,.0f} ({self.hardware_text} at ${self.speed.usd_per_hour:,.2f}/h)"
        )

    @property
    def _after(self) -> str:
        return f" after step {self.start_step}" if self.start_step else ""

    @property
    def jobs(self) -> int:
        """How many jobs the run takes: more than one where no single job may run it all."""
        chained = (
            self.resumable
            and self.time_limit_s is not None
            and self.longest_job_s is not None
            and self.run_s > max(self.time_limit_s, self.longest_job_s)
        )
        return math.ceil(self.run_s / self.time_limit_s) if chained else 1

    def chain_line(self) -> str | None:
        """One line when the run is planned as a chain of jobs, None when one job runs it."""
        if self.jobs == 1:
            return None
        return (
            f"chain: the run takes {self.jobs} jobs of cluster.max_run {duration(self.time_limit_s)}, since one job "
            f"may run at most {duration(self.longest_job_s)} here; each continues the checkpoints of the one before"
        )

    def overrun(self) -> str | None:
        """One line when the predicted run time exceeds the time limit, with the changes that fit."""
        if self.time_limit_s is None or self.run_s <= self.time_limit_s or self.jobs > 1:
            return None
        per_step = self.run_s / self.steps if self.evaluations else self.speed.step_time_s  # with its evaluations
        steps_that_fit = math.floor(self.time_limit_s / per_step)
        needed_s = self.run_s * TIME_LIMIT_HEADROOM
        limit = f"{math.ceil(needed_s / 86400)}d" if needed_s > 86400 else f"{math.ceil(needed_s / 3600)}h"
        fixes = []
        if needed_s <= (self.longest_job_s or SAGEMAKER_MAX_RUN_S):
            fixes.append(f"set cluster.max_run: {limit}")
        if steps_that_fit > 0:
            fixes.append(f"training.steps: {self.start_step + steps_that_fit}")
        if not self.resumable and self.longest_job_s is not None and self.run_s > self.longest_job_s:
            # A chain of jobs would start each one from nothing saved: it needs periodic checkpoints.
            fixes.append("checkpoint.every_minutes: 60 with resume: auto (then a chain of jobs runs it)")
        fix = " or ".join(fixes) if fixes else "a faster layout (launcher plan) or more instances"
        return (
            f"{self.recipe_name}: the predicted run time {duration(self.run_s)} ({self.steps} steps{self._after} x "
            f"{self.speed.step_time_s:.1f} s) exceeds cluster.max_run {duration(self.time_limit_s)}, so the job "
            f"would be stopped before its last step; {fix}"
        )

    def to_dict(self) -> dict:
        found = {
            "step_time_s": round(self.speed.step_time_s, 4),
            "steps": self.steps,
            "run_s": round(self.run_s, 1),
            "usd": round(self.usd, 2),
            "usd_per_hour": round(self.speed.usd_per_hour, 2),
            "time_limit_s": self.time_limit_s,
            "jobs": self.jobs,
        }
        if self.start_step:
            found["start_step"] = self.start_step
        if self.evaluations:
            found.update(validation_batches=self.evaluations, validation_batch_s=round(self.evaluation_s, 4))
        return found


def evaluation_batch_s(speed: Throughput) -> float:
    """Predicted seconds to evaluate one global batch forward-only under the predicted layout."""
    training_only = sum(speed.breakdown[k] for k in ("recompute", "optimizer", "data_replicate"))
    return (speed.step_time_s - training_only) * FORWARD_SHARE


def validation_batches(recipe: Recipe, start_step: int = 0) -> int:
    """Global batches the run evaluates after `start_step`: data.validation.batches after every
    every_steps-th step and after the last (once, where that is one of them)."""
    validation, steps = recipe.data.validation, recipe.training.steps
    if validation is None:
        return 0
    every = validation.every_steps
    evaluations = steps // every - start_step // every + (steps % every != 0) if every else 1
    return evaluations * validation.batches


def forecast(
    recipe: Recipe, *, time_limit_s: int | None, longest_job_s: int | None = None, start_step: int = 0
) -> RunForecast | None:
    """The recipe's predicted run time and cost from `start_step` (a checkpoint it resumes from) to
    training.steps; None where nothing can be predicted (the host CPU)."""
    checkpoint = recipe.checkpoint
    try:
        speed = predict(Workload.from_recipe(recipe), recipe.hardware)
    except ThroughputUnknown:
        return None
    return RunForecast(
        recipe_name=recipe.name,
        speed=speed,
        steps=recipe.training.steps - start_step,
        start_step=start_step,
        hardware_text=f"{recipe.cluster.instance_count} x {recipe.hardware.instance_key}",
        time_limit_s=time_limit_s,
        longest_job_s=longest_job_s,
        resumable=bool(checkpoint.every_steps or checkpoint.every_minutes) and checkpoint.resume != "never",
        evaluations=validation_batches(recipe, start_step),
        evaluation_s=evaluation_batch_s(speed),
    )
