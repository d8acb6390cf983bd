"""The published findings on parallel layouts, reproduced by the planner.

Each test fixes a model and a GPU budget where several layouts fit, lets the planner rank all of
them, and checks one finding: keep tensor parallelism small, prefer larger micro-batches, use
context parallelism at 128K, 405B needs pipeline parallelism or a large TP x CP, and at 8K on
128 GPUs plain FSDP beats adding PP, CP or TP.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from launcher.api import plan
from launcher.contract.layout import Layout
from launcher.estimate import DEFAULT_THRESHOLD, Workload
from launcher.plan import LayoutPlan
from launcher.plan.budget import resolve_budget
from launcher.plan.rank import Scored, candidate_workloads, first_that_fit, lightest_first
from launcher.plan.throughput import CONSTANTS, predict
from launcher.recipe import Recipe
from tests import REPO

RECIPES = REPO / "recipes"

ALL = 100_000  # rank every layout that fits


@pytest.fixture(scope="module")
def llama8b_8k() -> list[LayoutPlan]:
    return plan(Recipe.load(RECIPES / "llama3-8b-8k.yaml"), top=ALL)


@pytest.fixture(scope="module")
def mistral7b_32k() -> list[LayoutPlan]:
    return plan(Recipe.load(RECIPES / "mistral7b-32k.yaml").with_changes({"training.compile": True}), top=ALL)


def pairs_differing_in(plans: list[LayoutPlan], varied: str) -> list[tuple[LayoutPlan, LayoutPlan]]:
    """(a, b) with a's `varied` smaller than b's and everything else equal but data_shard/accumulation
    (what sequence parallel keeps of its gathered inputs too: the shard costs more all-gathers)."""
    groups = defaultdict(list)
    for p in plans:
        key = {**dataclasses.asdict(p.layout), "micro_batch_size": p.micro_batch_size}
        key.pop(varied)
        key.pop("data_shard")
        key |= {"ac": p.activation_checkpointing, "fp8": p.fp8, "schedule": p.pipeline_schedule}
        key["tp_saved_inputs"] = p.workload.tp_saved_inputs
        groups[tuple(sorted(key.items()))].append(p)
    value = (lambda p: getattr(p.layout, varied)) if varied != "micro_batch_size" else (lambda p: p.micro_batch_size)
    return [(a, b) for group in groups.values() for a in group for b in group if value(a) < value(b)]


@pytest.mark.parametrize("scenario", ["llama8b_8k", "mistral7b_32k"])
def test_smaller_tensor_parallel_ranks_higher(scenario, request):
    # One node, without pipeline parallelism. With pipelines, at a fixed global batch, a smaller TP
    # degree means more data-parallel ranks, fewer micro-batches each and a larger bubble. Across
    # nodes, a larger TP degree also divides the FSDP traffic that FSDP2 repeats every micro-batch,
    # which can outweigh it (70B at 8K on 64 GPUs with one micro-batch per step).
    plans = [p for p in request.getfixturevalue(scenario) if p.layout.pipeline == 1]
    pairs = pairs_differing_in(plans, "tensor")
    assert len(pairs) >= 10, "the scenario should let several TP degrees fit"
    for small, large in pairs:
        assert small.tokens_per_s_per_gpu > large.tokens_per_s_per_gpu, (small.describe(), large.describe())
    fitting_tp = sorted({p.layout.tensor for p in plans})
    assert len(fitting_tp) >= 3 and plans[0].layout.tensor in fitting_tp[:2]


@pytest.mark.parametrize("scenario", ["llama8b_8k", "mistral7b_32k"])
def test_larger_micro_batch_ranks_higher(scenario, request):
    # Without pipeline parallelism: there a larger micro batch also means fewer micro-batches to
    # fill the pipeline, a trade-off the bubble term weighs.
    plans = [p for p in request.getfixturevalue(scenario) if p.layout.pipeline == 1]
    pairs = pairs_differing_in(plans, "micro_batch_size")
    assert len(pairs) >= 5, "the scenario should let several micro-batch sizes fit"
    for small, large in pairs:
        assert large.tokens_per_s_per_gpu > small.tokens_per_s_per_gpu, (small.describe(), large.describe())


def test_at_128k_the_best_layouts_use_context_parallelism():
    # Published with Megatron's context parallelism, whose attention runs as fast as unsplit
    # attention. The entrypoints' zigzag kernel measures at 0.58 of that (docs/planner.md); with
    # it, tensor parallelism wins wherever it alone shards enough (the next test).
    recipe = Recipe.load(RECIPES / "llama70b-128k.yaml").with_changes({"training.compile": True})
    fast_cp = dataclasses.replace(CONSTANTS, cp_attention_factor=dict.fromkeys(CONSTANTS.cp_attention_factor, 1.0))
    plans = plan(recipe, top=ALL, constants=fast_cp)
    assert any(p.layout.context == 1 for p in plans), "layouts without CP fit too"
    assert all(p.layout.context > 1 for p in plans[:5])


def test_at_128k_context_parallelism_takes_over_where_tensor_parallelism_cannot_shard_enough():
    # 70B at 128K on 32 H100-80GB: one node's 8-way TP cannot hold the sequence's activations.
    recipe = Recipe.load(RECIPES / "llama70b-128k.yaml").with_changes(
        {"cluster.instance_type": "ml.p5.48xlarge", "training.compile": True}
    )
    plans = plan(recipe, top=ALL)
    assert len(plans) >= 3
    assert all(p.layout.context > 1 for p in plans)


def test_405b_at_128k_needs_pipeline_or_large_tensor_x_context():
    # On H100-80GB, as published; 141 GB H200s hold 405B at 128K with TP 8 and full checkpointing.
    recipe = Recipe.load(RECIPES / "llama405b-128k.yaml").with_changes(
        {"training.global_batch_size": 1024, "training.compile": True}
    )
    budget = resolve_budget(recipe, instances=128, instance_type="ml.p5.48xlarge")  # 1024 GPUs, DP up to 1024
    deep, shallow = [], []
    for workload in candidate_workloads(recipe, budget):
        layout = workload.layout
        (deep if layout.pipeline > 1 or layout.tensor * layout.context >= 16 else shallow).append(
            Scored(workload, None)
        )
    # Searched lightest first, each layout that fails rules out the heavier ones of its degrees
    # (rank.first_that_fit): no layout without PP and with TP x CP below 16 fits, and some do.
    assert len(shallow) > 1000
    assert first_that_fit(sorted(shallow, key=lightest_first), budget, top=1, threshold=DEFAULT_THRESHOLD).fitting == []
    assert (
        len(first_that_fit(sorted(deep, key=lightest_first), budget, top=10, threshold=DEFAULT_THRESHOLD).fitting) == 10
    )


@pytest.fixture(scope="module")
def llama8b_8k_on_128_h100s():
    recipe = Recipe.load(RECIPES / "llama3-8b-8k.yaml").with_changes(
        {"cluster.instance_count": 16, "training.global_batch_size": 1024}  # 8M tokens per step
    )
    return Workload.from_recipe(recipe), recipe.hardware


@pytest.mark.parametrize("added", ["pipeline", "context", "tensor"])
@pytest.mark.parametrize("ac", ["selective", "full"])
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_at_8k_on_128_h100s_plain_fsdp_beats_adding_pp_cp_or_tp_by_5_to_20_percent(
    llama8b_8k_on_128_h100s, added, ac, micro_batch
):
    # Published sweeps of Llama 3 8B at 8K on 128 H100s: plain FSDP is best, and PP 2, CP 2 or
    # TP 2 each cost 5-20%. With one GPU's NIC share for node-spanning collectives the planner had
    # PP 2 1.3-1.4x faster and CP 2 1.9x slower at micro batch 1. PP's cost is its bubble (1/9 with 8 micro-batches per stage and
    # 2 stages) and the last stage's output layer; CP's its slower attention kernel; TP's its
    # sequence-parallel collectives, all on NVLink.
    base, hardware = llama8b_8k_on_128_h100s

    def speed(layout: Layout) -> float:
        m = 1024 // (micro_batch * layout.data_parallel)
        w = dataclasses.replace(
            base, layout=layout, micro_batch_size=micro_batch, grad_accum_steps=m, activation_checkpointing=ac
        )
        return predict(w, hardware).tokens_per_s_per_gpu

    plain = speed(Layout(data_shard=128))
    with_added = speed(Layout(data_shard=64, **{added: 2}))
    assert 0.03 < 1 - with_added / plain < 0.25, (added, with_added, plain)
