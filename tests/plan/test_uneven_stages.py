"""Uneven pipeline stages in the estimator and the planner: Llama 3.1 405B's 126 layers on 8 and 16
stages, which no power-of-two pipeline degree above 2 divides."""

from __future__ import annotations

import pytest

from launcher import api
from launcher.estimate import Workload
from launcher.plan.candidates import shapes
from launcher.plan.throughput import predict
from launcher.recipe import Recipe
from tests import REPO

RECIPE = REPO / "recipes" / "llama405b-128k.yaml"


def llama405b_pp(pipeline: int, **changes) -> Recipe:
    """405B at 128K with TP 8 x CP 4 x PP `pipeline` x FSDP 2: 512 GPUs at PP 8, 1024 at PP 16."""
    return Recipe.load(
        RECIPE,
        {
            "parallel.tensor": 8,
            "parallel.context": 4,
            "parallel.pipeline": pipeline,
            "training.global_batch_size": 64,
            "cluster.instance_count": pipeline * 8,
            **changes,
        },
    )


@pytest.mark.parametrize(
    "pipeline, per_stage", [(8, [15] + [16] * 6 + [15]), (16, [7] + [8] * 14 + [7])], ids=["pp8", "pp16"]
)
def test_405b_at_128k_with_pp_8_and_16_validates_estimates_and_plans(pipeline, per_stage):
    recipe = llama405b_pp(pipeline)
    assert recipe.world_size == 64 * pipeline
    estimate = api.estimate(recipe)
    assert estimate.fits, estimate.breakdown
    assert [stage.layers for stage in estimate.stages] == per_stage
    # Stage 0 holds the embedding (its weight, states and V / tp rows of gradient) and a layer
    # fewer than the middle stages; stage 1, a micro-batch fewer in flight than stage 0. One of
    # the two peaks: stage 0 at PP 8, stage 1 at PP 16, where a layer is an eighth of a stage.
    # Of the middle stages stage 1 holds the most; the last stage, the fewest in flight, the least.
    assert estimate.peak_stage == (0 if pipeline == 8 else 1)
    assert max(estimate.stages[1:], key=lambda s: s.allocated_bytes).stage == 1
    assert min(estimate.stages, key=lambda s: s.allocated_bytes).stage == pipeline - 1
    found = api.plan_search(recipe, api.SearchOptions(top=1))
    assert found.current is not None and found.current.layout.pipeline == pipeline
    assert found.current.memory.fits and found.current.tokens_per_s_per_gpu > 0


def test_a_stage_counts_the_layers_it_really_holds():
    balanced = api.estimate(llama405b_pp(8))
    # One layer moved from stage 1 to stage 2: their weights differ by exactly one block.
    moved = api.estimate(llama405b_pp(8, **{"parallel.pipeline_layers": [15, 15, 17, 16, 16, 16, 16, 15]}))
    block = balanced.stages[1].breakdown["parameters"] - moved.stages[1].breakdown["parameters"]
    assert block > 0
    assert moved.stages[2].breakdown["parameters"] - balanced.stages[2].breakdown["parameters"] == pytest.approx(
        block, abs=2
    )
    assert [s.layers for s in moved.stages][:3] == [15, 15, 17]
    assert max(moved.stages[1:], key=lambda s: s.allocated_bytes).stage == 2  # stage 0 holds the embedding


def test_the_slowest_stage_sets_the_pipeline_pace():
    balanced = Workload.from_recipe(llama405b_pp(8))
    lopsided = Workload.from_recipe(llama405b_pp(8, **{"parallel.pipeline_layers": [11, 20, 16, 16, 16, 16, 16, 15]}))
    hardware = llama405b_pp(8).hardware
    fast, slow = predict(balanced, hardware), predict(lopsided, hardware)
    # 20 layers against the balanced split's 16 (or 15 and the output layer): about 20/16 slower.
    assert slow.breakdown["matmul"] / fast.breakdown["matmul"] == pytest.approx(20 / 16, rel=0.06)
    assert slow.step_time_s > 1.15 * fast.step_time_s
    # The bubble is (p - 1) slowest-stage micro-batches, so it grows with that stage too.
    assert slow.breakdown["pipeline_bubble"] > 1.15 * fast.breakdown["pipeline_bubble"]


def test_the_planner_offers_pipeline_degrees_that_do_not_divide_the_layers():
    arch = llama405b_pp(8).arch
    degrees = {
        shape.layout.pipeline
        for shape in shapes(
            arch, world_size=1024, gpus_per_node=8, seq_len=131072, global_batch_size=64, schedule="1f1b"
        )
    }
    assert {4, 8, 16} <= degrees
    assert max(degrees) <= arch.num_layers
