"""The search: exactly the fitting layouts, fastest first, each one a recipe the recipe layer accepts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from launcher.api import estimate, plan
from launcher.errors import UsageError
from launcher.estimate import DEFAULT_THRESHOLD, Workload, estimate_if_fits, estimate_memory
from launcher.plan import SearchOptions, search
from launcher.plan.budget import resolve_budget
from launcher.plan.candidates import shapes
from launcher.plan.explain import why
from launcher.plan.rank import (
    AC_MODES,
    Scored,
    candidate_workloads,
    first_that_fit,
    score,
    smallest_rejected,
    tp_saved_inputs_choices,
)
from launcher.plan.throughput import predict
from launcher.recipe import Recipe
from tests import REPO

RECIPES = REPO / "recipes"

GPU_RECIPES = sorted(p for p in RECIPES.glob("*.yaml") if p.name != "tiny-cpu.yaml")


def exhaustive(recipe, threshold=DEFAULT_THRESHOLD):
    """Every valid layout estimated and scored: what the pruned search must return. Each is asked
    `estimate_if_fits`, which stops at the first pipeline rank over the threshold and answers as
    the whole estimate does (tests/estimate/test_verdict.py checks that): what is checked here is
    the search's skipping of layouts without an estimate."""
    hw, base = recipe.hardware, Workload.from_recipe(recipe)
    found = []
    for shape in shapes(
        recipe.arch,
        world_size=recipe.world_size,
        gpus_per_node=hw.procs_per_node,
        seq_len=base.seq_len,
        global_batch_size=recipe.training.global_batch_size,
        schedule=recipe.parallel.pipeline_schedule,
    ):
        for ac in AC_MODES:
            for saved in tp_saved_inputs_choices(shape.layout, ac):
                workload = replace(
                    base,
                    layout=shape.layout,
                    micro_batch_size=shape.micro_batch_size,
                    grad_accum_steps=shape.grad_accum_steps,
                    pipeline_schedule=shape.pipeline_schedule,
                    activation_checkpointing=ac,
                    tp_saved_inputs=saved,
                )
                if estimate_if_fits(workload, hw, threshold=threshold) is None:
                    continue
                speed = predict(workload, hw)
                found.append((shape.layout, shape.micro_batch_size, ac, saved, speed.tokens_per_s_per_gpu))
    return found


@pytest.mark.parametrize("path", ["llama3-8b-8k.yaml", "llama70b-128k.yaml"])
def test_pruned_search_returns_exactly_the_fitting_layouts_fastest_first(path):
    recipe = Recipe.load(RECIPES / path)
    expected = exhaustive(recipe)
    planned = plan(recipe, top=100_000)
    got = [(p.layout, p.micro_batch_size, p.activation_checkpointing, p.workload.tp_saved_inputs) for p in planned]
    assert set(got) == {(layout, b, ac, saved) for layout, b, ac, saved, _ in expected}
    speeds = [p.tokens_per_s_per_gpu for p in planned]
    assert speeds == sorted(speeds, reverse=True)


@pytest.mark.parametrize("path", [p.name for p in GPU_RECIPES])
def test_every_planned_layout_is_a_valid_recipe(path):
    recipe = Recipe.load(RECIPES / path)
    for planned in plan(recipe, top=5):
        changed = recipe.with_changes(planned.overrides(recipe))
        assert changed.layout == planned.layout
        assert changed.training.micro_batch_size == planned.micro_batch_size
        assert changed.grad_accum_steps == planned.grad_accum_steps
        assert changed.parallel.activation_checkpointing == planned.activation_checkpointing
        assert changed.parallel.tp_saved_inputs == planned.workload.tp_saved_inputs
        assert estimate(changed).per_gpu_peak_bytes == planned.memory.per_gpu_peak_bytes


@pytest.mark.parametrize("seq_len", [262144, 1048576])
def test_sequences_above_128k_are_planned_and_the_plan_estimates_as_fitting(seq_len):
    # Published context-parallel runs go to 1M tokens (NeMo's long-sequence table, torchtitan's
    # 256K rows): the schema, the search and the estimator take them as they take 128K.
    recipe = Recipe.load(
        RECIPES / "llama3-8b-128k-cp.yaml", overrides={"training.seq_len": seq_len, "training.global_batch_size": 16}
    )
    best = plan(recipe, gpus=128, top=1)[0]
    assert best.layout.context * best.layout.tensor * 8192 >= seq_len  # at most 8K tokens a GPU
    planned = recipe.with_changes(best.overrides(recipe))
    assert planned.training.seq_len == seq_len
    assert estimate(planned).verdict == "fits"


def test_planning_another_budget_changes_the_instance_count():
    recipe = Recipe.load(RECIPES / "llama3-8b-8k.yaml")
    best = plan(recipe, gpus=32, top=1)[0]
    assert best.layout.world_size == 32 and best.instance_count == 4
    assert best.overrides(recipe)["cluster.instance_count"] == 4
    assert recipe.with_changes(best.overrides(recipe)).world_size == 32


def test_planning_another_instance_type_drops_what_it_fixes():
    recipe = Recipe.load(RECIPES / "llama3-8b-8k.yaml").with_changes({"cluster.usd_per_hour": 40.0})
    found = search(recipe, SearchOptions(instance_type="ml.p5e.48xlarge", top=1))
    assert found.budget.accelerator_key == "h200-141gb"
    assert found.budget.usd_per_hour == pytest.approx(63.296)  # the recipe's price was for p5
    changed = recipe.with_changes(found.best.overrides(recipe))
    assert changed.hardware.accelerator_key == "h200-141gb"


def test_vary_fp8_tries_both_precisions_on_hopper():
    recipe = Recipe.load(RECIPES / "llama3-8b-8k.yaml").with_changes({"training.compile": True})
    assert {p.fp8 for p in plan(recipe, top=100_000, vary_fp8=True)} == {False, True}
    assert {p.fp8 for p in plan(recipe, top=100_000)} == {False}


def test_a_plan_without_fp8_turns_fp8_experts_off_with_it():
    recipe = Recipe.load(RECIPES / "qwen3-30b-a3b-64k.yaml").with_changes({"precision.fp8_experts": True})
    plans = plan(recipe, top=100_000, vary_fp8=True)
    for fp8 in (False, True):
        planned = next(p for p in plans if p.fp8 == fp8)
        assert planned.settings()["precision.fp8_experts"] is fp8
        recipe.with_changes(planned.settings())  # a recipe that validates either way


def test_the_explanation_names_the_runner_up_and_the_reason():
    found = search(
        Recipe.load(RECIPES / "llama3-8b-8k.yaml"), SearchOptions(top=3, vary_accumulation=False)
    )  # modes can tie
    why_text = why(found)
    assert why_text.startswith(found.best.describe() + " is fastest at ")
    assert found.ranked[1].describe() in why_text
    assert "more per step on" in why_text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpus": 12}, "--gpus 12 is not a multiple of the 8 GPUs of one ml.p5.48xlarge; use e.g. 8 or 16"),
        ({"gpus": 8, "instances": 1}, "give --gpus or --instances, not both"),
        ({"instance_type": "ml.p5x"}, "--instance-type: 'ml.p5x' is not a known instance type (did you mean"),
        ({"instance_type": "ml.p4d.24xlarge"}, "precision.fp8: a100-40gb has no FP8 tensor cores"),
        ({"top": 0}, "--top 0: use a whole number, 1 or more"),
        ({"top": "5"}, "--top '5': use a whole number, 1 or more"),  # from the SDK: a TypeError before
        ({"gpus": 64.5}, "--gpus 64.5: use a whole number from 1 to 131,072"),  # before: 'use e.g. 64.0 or 72.0'
        ({"gpus": "64"}, "--gpus '64': use a whole number from 1 to 131,072"),
    ],
)
def test_bad_budgets_are_refused_with_one_line(kwargs, message):
    recipe = Recipe.load(RECIPES / "mistral7b-32k.yaml")
    with pytest.raises(UsageError) as error:
        search(recipe, SearchOptions(**kwargs))
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_a_held_degree_returns_the_fastest_fitting_layouts_that_have_it():
    recipe = Recipe.load(RECIPES / "llama3-8b-128k-cp.yaml")
    everything = search(recipe, SearchOptions(top=100_000)).ranked
    held = search(recipe, SearchOptions(top=3, fixed=(("context", 1), ("tensor", 8)))).ranked
    expected = [p for p in everything if p.layout.context == 1 and p.layout.tensor == 8][:3]
    assert expected and [p.workload for p in held] == [p.workload for p in expected]
    with pytest.raises(UsageError, match=r"^cannot hold 'contex' in a search: valid: context, data_replicate"):
        search(recipe, SearchOptions(fixed=(("contex", 1),)))
    with pytest.raises(UsageError, match=r"^no valid layout on .* has context=3$"):
        search(recipe, SearchOptions(fixed=(("context", 3),)))


def test_a_model_that_fits_nowhere_says_how_much_it_needs():
    recipe = Recipe.load(RECIPES / "llama405b-128k.yaml")
    with pytest.raises(
        UsageError,
        match=r"no layout of llama3.1-405b at 131072 tokens fits in 80% of h200-141gb memory on 1 x ml.p5en.48xlarge .* the smallest needs 897.0 GiB per GPU",
    ):
        search(recipe, SearchOptions(instances=1))
    # The least of every rejected layout's whole estimate, though only those no other of the same
    # degrees is lighter than on every axis were estimated whole.
    budget = resolve_budget(recipe, instances=1)
    scored = sorted(score(candidate_workloads(recipe, budget), budget), key=Scored.sort_key)
    rejected = first_that_fit(scored, budget, top=10, threshold=DEFAULT_THRESHOLD).rejected
    every = min(estimate_memory(w, budget).per_gpu_peak_bytes for w in rejected)
    assert len(rejected) > 100
    assert smallest_rejected(rejected, budget, threshold=DEFAULT_THRESHOLD).per_gpu_peak_bytes == every


def test_a_local_gpu_machine_plans_its_process_count(tmp_path):
    path = tmp_path / "local.yaml"
    path.write_text(
        "name: local-gpu\nmodel: llama3.2-1b\ntraining: {seq_len: 8192, global_batch_size: 8, steps: 10}\n"
        "cluster: {backend: local, instance_type: local, device: cuda, accelerator: h200-141gb, nproc_per_node: 2}\n"
    )
    recipe = Recipe.load(path)
    best = plan(recipe, gpus=4, top=1)[0]
    assert best.instance_count == 1 and best.throughput.usd_per_million_tokens == 0
    changed = recipe.with_changes(best.overrides(recipe))
    assert changed.cluster.nproc_per_node == 4 and changed.world_size == 4
    with pytest.raises(UsageError, match="a local recipe runs on this one machine; use --gpus"):
        search(recipe, SearchOptions(instances=2))


def test_searching_accumulation_modes_keeps_those_whose_unsharded_state_fits():
    # Llama 3 8B at 8K on 4 p5s, 8 micro-batches per FSDP rank: keeping gradients (and parameters)
    # unsharded between micro-batches saves traffic, where the memory it holds fits.
    recipe = Recipe.load(RECIPES / "llama3-8b-8k.yaml").with_changes(
        {"cluster.instance_count": 4, "training.global_batch_size": 256}
    )
    plain = search(recipe, SearchOptions(top=15, vary_accumulation=False))
    assert {p.grad_accumulation for p in plain.ranked} == {"sync_each"}
    varied = search(recipe, SearchOptions(top=45))  # deep enough for a gathered layout's twin
    kept = [p for p in varied.ranked if p.grad_accumulation != "sync_each"]
    assert kept, "some layouts have room for unsharded gradients"
    for p in kept:
        assert p.memory.fits
    # The fastest plain FSDP 32 layout holds 8B's fp32 gradients nowhere: it stays sync_each.
    fsdp32 = [p for p in varied.ranked if p.layout.data_shard == 32 and p.layout.tensor == 1]
    assert fsdp32 and all(p.grad_accumulation == "sync_each" for p in fsdp32)
    gathered = next(p for p in kept if p.grad_accumulation == "sync_last_gathered")
    twin = next(
        p
        for p in varied.ranked
        if p.grad_accumulation == "sync_each"
        and (p.layout, p.micro_batch_size, p.activation_checkpointing)
        == (
            gathered.layout,
            gathered.micro_batch_size,
            gathered.activation_checkpointing,
        )
    )
    assert gathered.tokens_per_s_per_gpu > twin.tokens_per_s_per_gpu


def test_the_planner_keeps_the_tensor_parallel_shard_where_that_lets_a_faster_layout_fit():
    # Llama 3.1 70B at 8K, FP8, bf16 gradients, on 64 H100 80GB: TP 4 x FSDP 16 without
    # recomputation fits only when sequence parallel keeps the shard of its gathered inputs
    # (parallel/regather.py), and beats every layout that fits without it.
    recipe = Recipe.load(RECIPES / "llama70b-128k.yaml").with_changes(
        {
            "training.seq_len": 8192,
            "training.global_batch_size": 128,
            "cluster.instance_type": "ml.p5.48xlarge",
            "cluster.instance_count": 8,
            "parallel.context": 1,
            "precision.fp8": True,
            "training.compile": True,
            "parallel.reduce_dtype": "bf16",
        }
    )
    best = plan(recipe, top=1)[0]
    assert best.workload.tp_saved_inputs == "shard" and best.layout.tensor > 1
    assert "TP saves shard" in best.describe()
    planned = recipe.with_changes(best.overrides(recipe))
    assert planned.parallel.tp_saved_inputs == "shard"
    assert estimate(planned).verdict == "fits"
    assert estimate(planned.with_changes({"parallel.tp_saved_inputs": "gathered"})).verdict != "fits"
