"""data.validation in the estimator and the forecast: the forward-only pass is counted, never
sets the memory peak, and adds its time to the run."""

from __future__ import annotations

import pytest

from launcher.estimate import Workload, estimate_memory
from launcher.estimate.fsdp import moments
from launcher.plan.forecast import forecast
from launcher.recipe import Recipe
from launcher.resolve import resolve
from tests.backends.helpers import REPO

EVALUATES = {"data.validation.source": "synthetic", "data.validation.every_steps": 100, "data.validation.batches": 4}
# One recipe per kind of layout: FSDP only, TP + CP at 128K, PP x TP x CP at 128K, and 405B.
RECIPES = ["llama3-8b-8k", "llama3-8b-128k-cp", "llama70b-128k", "llama405b-128k"]
LAYOUTS = [
    {},
    {"parallel.grad_accumulation": "sync_last_gathered", "training.micro_batch_size": 1},
]


def concrete(name: str, changes: dict):
    return resolve(Recipe.load(REPO / "recipes" / f"{name}.yaml", changes)).concrete


@pytest.mark.parametrize("changes", LAYOUTS, ids=["as-written", "sync-last-gathered"])
@pytest.mark.parametrize("name", RECIPES)
def test_evaluation_is_counted_below_the_training_peak_so_the_estimate_is_unchanged(name, changes):
    plain, evaluating = concrete(name, changes), concrete(name, {**changes, **EVALUATES})
    found = moments(Workload.from_recipe(evaluating), rank=evaluating.layout.pipeline - 1)
    evaluation = sum(found.pop("evaluation (forward only)").values())
    assert "evaluation (forward only)" not in moments(Workload.from_recipe(plain))
    assert evaluation < max(sum(moment.values()) for moment in found.values())
    for rank in range(evaluating.layout.pipeline):
        by_rank = moments(Workload.from_recipe(evaluating), rank=rank)
        assert sum(by_rank["evaluation (forward only)"].values()) < max(
            sum(m.values()) for key, m in by_rank.items() if key != "evaluation (forward only)"
        )
    before = estimate_memory(Workload.from_recipe(plain), plain.hardware)
    after = estimate_memory(Workload.from_recipe(evaluating), evaluating.hardware)
    assert after.to_dict() == before.to_dict()


def test_the_forecast_adds_the_evaluated_batches_forward_time():
    plain, evaluating = concrete("llama70b-128k", {}), concrete("llama70b-128k", EVALUATES)
    before, after = forecast(plain, time_limit_s=None), forecast(evaluating, time_limit_s=None)
    # 1000 steps, every 100: 10 evaluations of 4 batches.
    assert after.evaluations == 40
    step = before.speed.step_time_s
    breakdown = before.speed.breakdown
    assert after.evaluation_s == pytest.approx(
        (step - breakdown["recompute"] - breakdown["optimizer"] - breakdown["data_replicate"]) / 3
    )
    assert 0 < after.evaluation_s < step / 2
    assert after.run_s == pytest.approx(before.run_s + 40 * after.evaluation_s)
    assert f"x 1000 steps + 40 validation batches x {after.evaluation_s:.1f} s = " in after.line()
    assert "validation" not in before.line() and "validation_batches" not in before.to_dict()
    assert after.to_dict()["validation_batches"] == 40


def test_an_evaluation_only_after_the_last_step_is_counted_once():
    run = forecast(concrete("llama3-8b-8k", {"data.validation.source": "synthetic"}), time_limit_s=None)
    assert run.evaluations == 1
    uneven = forecast(concrete("llama3-8b-8k", {**EVALUATES, "data.validation.every_steps": 7}), time_limit_s=None)
    steps = uneven.steps
    assert uneven.evaluations == 4 * (steps // 7 + (steps % 7 != 0))
