"""Mixture-of-experts models in the planner: active FLOPs, the experts' GEMMs and all-to-alls,
and expert parallelism searched and shown."""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import replace

import pytest

from launcher import catalog
from launcher.contract.layout import Layout
from launcher.estimate import Workload, estimate_memory
from launcher.plan.rank import Scored, first_that_fit
from launcher.plan.throughput import (
    CONSTANTS,
    _Step,
    fsdp_traffic,
    model_flops_per_token,
    predict,
    remote_nodes_per_token,
)
from launcher.recipe import Recipe
from launcher.recipe.hardware import hardware_for
from tests import REPO

QWEN3_MOE = catalog.models()["qwen3-30b-a3b"]
MIXTRAL = catalog.models()["mixtral-8x7b"]
P5 = hardware_for("ml.p5.48xlarge", usd_per_hour=0.0)  # 8 x h100-80gb


def speed(arch, layout, *, seq_len=8192, hardware=P5):
    workload = Workload(arch=arch, layout=layout, seq_len=seq_len, micro_batch_size=1, grad_accum_steps=1)
    return predict(workload, hardware)


def test_model_flops_count_the_parameters_a_token_goes_through():
    # Qwen3-30B-A3B: "30.5B parameters in total, 3.3B activated" (its model card). The matmul
    # weights a token passes (router, top-8 experts, attention, output layer) are the activated
    # ones without the embedding lookup and the norms.
    flops = model_flops_per_token(QWEN3_MOE, 4096)
    attention = 6 * QWEN3_MOE.num_layers * QWEN3_MOE.q_dim * 4096
    active = (flops - attention) / 6
    assert 2.9e9 < active < 3.3e9, active
    assert QWEN3_MOE.num_params() > 30e9  # every expert is stored


def test_expert_parallelism_adds_all_to_alls_and_needs_no_gather_of_the_other_ranks_experts():
    alone = speed(QWEN3_MOE, Layout(data_shard=8))
    split = speed(QWEN3_MOE, Layout(data_shard=8, expert=8))
    assert alone.breakdown["expert_parallel"] == 0.0
    assert split.breakdown["expert_parallel"] > 0.0
    # Each rank's grouped GEMMs get 8 times the rows per expert: the same FLOPs at a higher rate.
    assert split.breakdown["matmul"] < alone.breakdown["matmul"]
    assert split.model_flops_per_token == alone.model_flops_per_token


def test_all_to_alls_across_nodes_cost_more_than_within_one():
    two_nodes = dataclasses.replace(P5, instance_count=2)
    # ep is laid over dp_shard x cp x tp's consecutive ranks: EP 8 stays on one node, EP 16 spans
    # both, and sends half of each rank's copies through one GPU's NIC share.
    within = speed(QWEN3_MOE, Layout(data_shard=16, expert=8), hardware=two_nodes)
    across = speed(QWEN3_MOE, Layout(data_shard=16, expert=16), hardware=two_nodes)
    assert across.breakdown["expert_parallel"] > 2 * within.breakdown["expert_parallel"]


def test_tensor_parallel_ranks_route_their_own_tokens_over_an_ep_group_that_spans_them():
    # TP 2 x dp_shard 4 under EP 8: each tp rank routes half of the micro-batch (parallel/tensor.py),
    # over 8 consecutive ranks of one node, so its all-to-alls carry half the copies of dp_shard 8's.
    two_nodes = dataclasses.replace(P5, instance_count=2)
    alone = speed(QWEN3_MOE, Layout(data_shard=16, expert=8), hardware=two_nodes)
    tensor = speed(QWEN3_MOE, Layout(tensor=2, data_shard=8, expert=8), hardware=two_nodes)
    assert tensor.breakdown["expert_parallel"] == pytest.approx(alone.breakdown["expert_parallel"] / 2, rel=0.05)
    # And the experts' GEMMs see half the rows a rank (the same FLOPs per token, spread over tp).
    assert tensor.breakdown["matmul"] < 0.75 * alone.breakdown["matmul"]


def test_a_token_reaches_another_node_once_whatever_its_experts_there():
    # Brute force over every top-k choice of experts, spread evenly over the nodes: the expected
    # number of other nodes hit (rank 0 sits on node 0).
    for experts, top_k, nodes in ((8, 2, 2), (16, 4, 4), (12, 3, 3)):
        per_node = experts // nodes
        choices = list(itertools.combinations(range(experts), top_k))
        hit = [len({e // per_node for e in choice} - {0}) for choice in choices]
        assert remote_nodes_per_token(experts, top_k, nodes) == pytest.approx(sum(hit) / len(choices))


def test_a_per_node_dispatcher_sends_a_quarter_of_the_bytes_across_two_nodes():
    # Qwen3-30B-A3B over EP 16 on two nodes (8 experts per rank, top 8 of 128): an
    # all_to_all_single sends the 4 copies of a token bound for the other node, Hybrid-EP's
    # dispatch sends the token once (1 - C(64, 8)/C(128, 8) = 0.996 of the time). The all-to-alls
    # are network-bound, so their time falls about fourfold.
    two_nodes = dataclasses.replace(P5, instance_count=2)
    layout = Layout(data_shard=16, expert=16)
    workload = Workload(arch=QWEN3_MOE, layout=layout, seq_len=4096, micro_batch_size=1, grad_accum_steps=1)
    plain = predict(workload, two_nodes).breakdown["expert_parallel"]
    per_node = predict(dataclasses.replace(workload, ep_dispatch_per_node=True), two_nodes).breakdown["expert_parallel"]
    assert 3.5 < plain / per_node < 4.05
    # Inside one node there is nothing to save.
    inside = dataclasses.replace(workload, layout=Layout(data_shard=8, expert=8))
    assert predict(inside, P5).breakdown["expert_parallel"] == pytest.approx(
        predict(dataclasses.replace(inside, ep_dispatch_per_node=True), P5).breakdown["expert_parallel"]
    )


def wider_experts(arch, factor: int):
    moe = arch.moe.model_copy(update={"expert_ffn_hidden_size": arch.moe.expert_ffn_hidden_size * factor})
    return arch.model_copy(update={"moe": moe})


def test_the_experts_fsdp_group_is_the_ranks_that_hold_the_same_experts():
    # Under EP each rank's experts are an FSDP unit over expert_fsdp = dp_shard x cp / ep ranks,
    # ep apart (entrypoints/parallel/expert.py's mesh: expert_fsdp outside ep). Wider experts
    # add traffic only there.
    two_nodes = dataclasses.replace(P5, instance_count=2)

    def reduce_s(arch, layout):
        workload = Workload(arch=arch, layout=layout, seq_len=4096, micro_batch_size=1, grad_accum_steps=1)
        return fsdp_traffic(_Step(workload, two_nodes, CONSTANTS)).reduce

    # EP 16 over 16 ranks: each rank holds its 8 experts whole, nothing to reduce-scatter.
    whole = Layout(data_shard=16, expert=16)
    assert reduce_s(wider_experts(QWEN3_MOE, 2), whole) == pytest.approx(reduce_s(QWEN3_MOE, whole))
    # EP 8 over 16 ranks on two nodes: the two ranks with the same experts sit on different
    # nodes, so half of each expert gradient leaves through one GPU's NIC share (40 GB/s).
    split = Layout(data_shard=16, expert=8)
    added = reduce_s(wider_experts(QWEN3_MOE, 2), split) - reduce_s(QWEN3_MOE, split)
    layers, moe, h = QWEN3_MOE.num_layers, QWEN3_MOE.moe, QWEN3_MOE.hidden_size
    added_params = layers * moe.num_experts // 8 * moe.expert_params(h)  # the 16 experts a rank holds, twice as wide
    nic_share = 3200 / 8 * 1e9 * CONSTANTS.network_efficiency / 8
    fp32_grad = CONSTANTS.fsdp_grad_bytes["fp32"]
    assert added == pytest.approx(fp32_grad * added_params * (2 - 1) / 2 / nic_share)


def test_the_planner_searches_expert_parallelism_and_shows_it(cli):
    recipe = REPO / "recipes" / "llama3-8b-8k.yaml"
    # 30.5B parameters' weights and AdamW states need two nodes (16 bytes each over 16 GPUs: 30 GB).
    moe = ("--set", "model=qwen3-30b-a3b", "--set", "cluster.instance_count=2", "--top", "500")
    found = cli("plan", recipe, *moe, "--json")
    assert found.code == 0, found.err
    plans = json.loads(found.out)
    assert {plan["expert"] for plan in plans} >= {1, 2, 4, 8, 16}
    table = cli("plan", recipe, *moe)
    header = table.out.splitlines()[3]
    assert "expert" in header.split()
    dense = cli("plan", recipe)
    assert "expert" not in dense.out.splitlines()[3].split()
    assert {plan["expert"] for plan in json.loads(cli("plan", recipe, "--json").out)} == {1}


def test_a_layout_that_fails_rules_out_no_other_expert_degree():
    # Memory is not monotone in the expert degree (qwen3-30b-a3b-64k on 16 H100s, selective:
    # 53.3, 50.9, 50.2 and 63.1 GiB at EP 1, 2, 4 and 8): a failed layout rules out only the same
    # degrees, EP included. Full checkpointing, micro batch 1: about 43 GiB at EP 1 and 38 at EP 4,
    # so at half of the GPU's memory EP 1 fails and EP 4 fits, and the search must find EP 4.
    recipe = Recipe.load(REPO / "recipes" / "qwen3-30b-a3b-64k.yaml")
    base = dataclasses.replace(
        Workload.from_recipe(recipe), activation_checkpointing="full", micro_batch_size=1, grad_accumulation="sync_each"
    )
    ep1, ep4 = (dataclasses.replace(base, layout=dataclasses.replace(base.layout, expert=ep)) for ep in (1, 4))
    threshold = 0.5
    assert not estimate_memory(ep1, recipe.hardware, threshold=threshold).fits
    assert estimate_memory(ep4, recipe.hardware, threshold=threshold).fits
    found = first_that_fit([Scored(ep1, None), Scored(ep4, None)], recipe.hardware, top=2, threshold=threshold)
    assert [item.workload.layout.expert for item, _ in found.fitting] == [4]
    assert found.estimated == 2


def test_megatrons_a2a_overlap_hides_the_all_to_alls_behind_the_other_micro_batchs_compute():
    # overlap_moe_expert_parallel_comm pairs one micro-batch's forward with another's backward,
    # layer by layer (Workload.moe_a2a_overlap, planner-only): each layer's all-to-alls hide behind
    # that layer's compute, paying tp_overlap_interference (0.53) of what they hide, on the chunks
    # that pair. Without pipelining the first micro-batch's forward runs alone.
    two_nodes = dataclasses.replace(P5, instance_count=2)
    base = Workload(
        arch=QWEN3_MOE, layout=Layout(data_shard=16, expert=16), seq_len=4096, micro_batch_size=1, grad_accum_steps=1
    )

    def hidden_per_micro_batch(micro_batches: int) -> tuple[float, float]:
        plain, overlapped = (
            predict(replace(base, grad_accum_steps=micro_batches, moe_a2a_overlap=on), two_nodes).breakdown[
                "expert_parallel"
            ]
            for on in (False, True)
        )
        return (plain - overlapped) / micro_batches, plain / micro_batches

    eight, plain = hidden_per_micro_batch(8)
    two, _ = hidden_per_micro_batch(2)
    assert 0 < eight <= (1 - 0.53) * plain * 7 / 8
    assert eight / two == pytest.approx((7 / 8) / (1 / 2))
    # One micro-batch has nothing to pair with.
    assert hidden_per_micro_batch(1)[0] == pytest.approx(0.0)
