"""Verdicts against the threshold, and suggestions that themselves fit and pass the rules."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from launcher import api
from launcher.api import plan
from launcher.estimate import MemoryEstimate, Workload, estimate_if_fits, estimate_memory, format_bytes, verdict
from launcher.plan.budget import resolve_budget
from launcher.plan.rank import candidate_workloads
from launcher.plan.suggest import find_fitting_change
from launcher.recipe import Recipe
from launcher.recipe.rules import layout_problems

RECIPE_DIR = Path(__file__).resolve().parents[2] / "recipes"
RECIPES = sorted(RECIPE_DIR.glob("*.yaml"))
GIB = 2**30


@pytest.mark.parametrize(
    "peak, expected",
    [(79, "fits"), (80, "fits"), (81, "risky"), (100, "risky"), (101, "oom")],
)
def test_fits_up_to_the_threshold_risky_up_to_all_memory_oom_beyond(peak, expected):
    assert verdict(peak, 100, 0.8) == expected


def test_threshold_is_configurable():
    assert verdict(85, 100, 0.9) == "fits"
    assert verdict(85, 100, 0.5) == "risky"


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_fits(path):
    estimate = api.estimate(Recipe.load(path))
    assert estimate.verdict == "fits", estimate.headline()
    assert estimate.suggestion is None


def test_a_fitting_recipe_reports_its_peak_stage_and_largest_component():
    estimate = api.estimate(Recipe.load("recipes/llama3-8b-8k.yaml"))
    assert isinstance(estimate, MemoryEstimate)
    assert estimate.largest_component == max(estimate.breakdown, key=estimate.breakdown.get)
    assert estimate.utilization == estimate.per_gpu_peak_bytes / estimate.gpu_memory_bytes
    assert f"largest: {estimate.largest_component}" in estimate.headline()


MISTRAL_32K = {
    "name": "mistral-32k",
    "model": "mistral-7b",
    "training": {"seq_len": 32768, "global_batch_size": 32, "micro_batch_size": 1, "steps": 10},
    "precision": {"dtype": "bf16"},
    "parallel": {"context": 2, "activation_checkpointing": "none"},
    "cluster": {"backend": "sagemaker", "instance_type": "ml.p5.48xlarge", "instance_count": 1},
    "sagemaker": {"role_arn": "arn:aws:iam::111122223333:role/SageMakerTrainingRole"},
}


# Mistral 7B at 32K on one p5 (dp_shard 4 x cp 2), two sequences per micro-batch and no
# checkpointing, needs about twice an H100.
TWO_SEQUENCES = {"training.micro_batch_size": 2}


def test_a_recipe_that_does_not_fit_gets_a_suggestion_that_fits():
    recipe = Recipe.from_dict(MISTRAL_32K, TWO_SEQUENCES)
    estimate = api.estimate(recipe)
    assert estimate.verdict == "oom"
    change, fitted = find_fitting_change(recipe)
    assert estimate.suggestion == (
        f"{change.describe()} (estimated {format_bytes(fitted.per_gpu_peak_bytes)}, {fitted.utilization:.0%})"
    )
    # The suggested recipe passes every recipe rule and fits when estimated again.
    changed = recipe.with_changes(change.as_overrides())
    assert api.estimate(changed).verdict == "fits"
    assert fitted.per_gpu_peak_bytes == api.estimate(changed).per_gpu_peak_bytes


def test_the_suggestion_is_the_planners_fastest_layout_among_those_with_the_fewest_edits():
    recipe = Recipe.from_dict(MISTRAL_32K, TWO_SEQUENCES)
    change, _ = find_fitting_change(recipe)
    # Every layout the planner finds that fits, fastest first, with the recipe keys it changes
    # (data_shard "auto" follows the other degrees by itself, and grad_accumulation "auto" picks
    # the fastest mode that fits by itself).
    follow = ("parallel.data_shard", "parallel.grad_accumulation")
    edits = [
        {key: value for key, value in planned.overrides(recipe).items() if key not in follow}
        for planned in plan(recipe, top=100_000)
    ]
    fewest = min(len(e) for e in edits)
    assert fewest == 1 and len(change.edits) == 1
    assert change.as_overrides() == next(e for e in edits if len(e) == fewest)
    assert re.fullmatch(r"(set \S+: \S+|(raise|lower) \S+ to \d+)", change.describe())


def test_a_model_too_large_for_the_recipes_gpus_gets_more_instances():
    # 70B needs 16 bytes per parameter for weights, gradients and AdamW: over 64 GiB per GPU
    # on one or two p5 instances, whatever the layout.
    recipe = Recipe.from_dict(MISTRAL_32K, {"model": "llama3.1-70b", "parallel.activation_checkpointing": "full"})
    assert api.estimate(recipe).verdict == "oom"
    change, fitted = find_fitting_change(recipe)
    assert change.as_overrides()["cluster.instance_count"] in (2, 4)
    assert api.estimate(recipe.with_changes(change.as_overrides())).per_gpu_peak_bytes == fitted.per_gpu_peak_bytes
    assert fitted.fits


def test_suggestion_raises_a_parallel_degree_when_checkpointing_is_already_full():
    recipe = Recipe.from_dict(MISTRAL_32K, {"parallel.activation_checkpointing": "full", "parallel.context": 1})
    estimate = api.estimate(recipe, threshold=0.3)
    assert estimate.verdict != "fits"
    change, fitted = find_fitting_change(recipe, threshold=0.3)
    assert fitted.per_gpu_peak_bytes <= 0.3 * fitted.gpu_memory_bytes
    assert estimate.suggestion.startswith(change.describe())
    assert estimate.suggestion.startswith("raise parallel.")
    changed = recipe.with_changes(change.as_overrides())  # validates every recipe rule
    assert api.estimate(changed, threshold=0.3).verdict == "fits"
    workload = Workload.from_recipe(changed)
    assert not layout_problems(
        workload.layout,
        workload.arch,
        seq_len=workload.seq_len,
        global_batch_size=changed.training.global_batch_size,
        micro_batch_size=workload.micro_batch_size,
        gpus_per_node=8,
        schedule=workload.pipeline_schedule,
    )


def test_an_explicit_data_shard_changes_with_the_degree_that_takes_its_gpus():
    recipe = Recipe.from_dict(
        MISTRAL_32K, {"parallel.activation_checkpointing": "full", "parallel.context": 1, "parallel.data_shard": 8}
    )
    change, _ = find_fitting_change(recipe, threshold=0.3)
    edits = change.as_overrides()
    assert "parallel.data_shard" in edits
    assert recipe.with_changes(edits).layout.world_size == 8


def test_no_fitting_layout_says_what_to_change_instead():
    recipe = Recipe.from_dict(
        MISTRAL_32K,
        {"model": "llama3.1-405b", "training.seq_len": 131072, "cluster.instance_type": "ml.p4d.24xlarge"},
    )
    estimate = api.estimate(recipe)
    assert estimate.verdict == "oom"
    assert estimate.suggestion.startswith("no layout on up to 16x the GPUs fits")


def test_megatron_mode_verdict_uses_the_published_estimate_without_overheads():
    estimate = api.estimate(Recipe.load("recipes/llama3-8b-8k.yaml"), mode="megatron")
    assert estimate.mode == "megatron"
    assert estimate.per_gpu_peak_bytes == estimate.allocated_bytes


def test_the_planners_early_rejection_answers_as_the_whole_estimate_does():
    # estimate_if_fits stops at the first pipeline rank above the threshold, and under auto tries
    # the modes in the order the choice weighs them: where the whole estimate fits it must return
    # that very estimate, and None wherever it does not.
    recipe = Recipe.load(RECIPE_DIR / "llama405b-128k.yaml")
    budget = resolve_budget(recipe, gpus=1024, instance_type="ml.p5en.48xlarge")
    candidates = candidate_workloads(recipe, budget)
    sample = candidates[:: len(candidates) // 40]
    sample += [replace(w, grad_accumulation="auto") for w in sample[::3]]
    heaviest_not_first = fitting = rejected = 0
    for threshold in (0.8, 1.0):
        for workload in sample:
            whole = estimate_memory(workload, budget, threshold=threshold)
            quick = estimate_if_fits(workload, budget, threshold=threshold)
            assert quick == (whole if whole.fits else None), (workload.layout, threshold)
            fitting += whole.fits
            rejected += not whole.fits
            heaviest_not_first += whole.peak_stage != 0
    # The sample holds both answers, and pipelines whose heaviest rank is not the first one asked.
    assert fitting > 10 and rejected > 10 and heaviest_not_first > 10, (fitting, rejected, heaviest_not_first)
    # The published accounting is answered whole.
    for name, fits in (("tiny-cpu.yaml", True), ("llama3-8b-8k.yaml", False)):
        dense = Recipe.load(RECIPE_DIR / name)
        published = Workload.from_recipe(dense)
        whole = estimate_memory(published, dense.hardware, mode="megatron")
        assert whole.fits == fits
        assert estimate_if_fits(published, dense.hardware, mode="megatron") == (whole if fits else None)
