"""What a run will take and cost, said before any money is spent.

    run = forecast(recipe, time_limit_s=recipe.cluster.max_run)
    run.line()      # 'time: 201.4 s/step x 1000 steps = 2.3 days; cost about $21,000 (4 x ml.p5e.48xlarge at $253.18/h)'
    run.overrun()   # None, or one line: the predicted run time exceeds the time limit, and what would fit

The step time is the planner's prediction (`launcher.plan.throughput.predict`); the run time is
steps x step time, and the cost is the run time at the cluster's hourly price (the catalog's
on-demand price, or `cluster.usd_per_hour`). A job whose engine stops it at a time limit
(SageMaker's MaxRuntimeInSeconds) and whose predicted run time exceeds that limit would be
killed before its last step: `submit` refuses it unless forced, and says which `max_run` or
which `training.steps` would fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.display.text import duration
from launcher.estimate import Workload
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

    @property
    def run_s(self) -> float:
        return self.steps * self.speed.step_time_s

    @property
    def usd(self) -> float:
        return self.speed.usd_per_hour * self.run_s / 3600

    def line(self) -> str:
        return (
            f"time: {self.speed.step_time_s:.1f} s/step x {self.steps} steps = {duration(self.run_s)}; "
            f"cost about ${self.usd:,.0f} ({self.hardware_text} at ${self.speed.usd_per_hour:,.2f}/h)"
        )

    def overrun(self) -> str | None:
        """One line when the predicted run time exceeds the time limit, with the changes that fit."""
        if self.time_limit_s is None or self.run_s <= self.time_limit_s:
            return None
        steps_that_fit = math.floor(self.time_limit_s / self.speed.step_time_s)
        needed_s = self.run_s * TIME_LIMIT_HEADROOM
        limit = f"{math.ceil(needed_s / 86400)}d" if needed_s > 86400 else f"{math.ceil(needed_s / 3600)}h"
        fixes = []
        if needed_s <= SAGEMAKER_MAX_RUN_S:
            fixes.append(f"set cluster.max_run: {limit}")
        if steps_that_fit > 0:
            fixes.append(f"training.steps: {steps_that_fit}")
        fix = " or ".join(fixes) if fixes else "a faster layout (launcher plan) or more instances"
        return (
            f"{self.recipe_name}: the predicted run time {duration(self.run_s)} ({self.steps} steps x "
            f"{self.speed.step_time_s:.1f} s) exceeds cluster.max_run {duration(self.time_limit_s)}, so the job "
            f"would be stopped before its last step; {fix}"
        )

    def to_dict(self) -> dict:
        return {
            "step_time_s": round(self.speed.step_time_s, 4),
            "steps": self.steps,
            "run_s": round(self.run_s, 1),
            "usd": round(self.usd, 2),
            "usd_per_hour": round(self.speed.usd_per_hour, 2),
            "time_limit_s": self.time_limit_s,
        }


def forecast(recipe: Recipe, *, time_limit_s: int | None) -> RunForecast | None:
    """The recipe's predicted run time and cost; None where nothing can be predicted (the host CPU)."""
    try:
        speed = predict(Workload.from_recipe(recipe), recipe.hardware)
    except ThroughputUnknown:
        return None
    return RunForecast(
        recipe_name=recipe.name,
        speed=speed,
        steps=recipe.training.steps,
        hardware_text=f"{recipe.cluster.instance_count} x {recipe.hardware.instance_key}",
        time_limit_s=time_limit_s,
    )
