"""The throughput model's terms, one rule per test: FLOPs, the bubble, recomputation, communication, cost."""

from __future__ import annotations

import dataclasses

import pytest

from launcher import catalog
from launcher.catalog import ModelArch
from launcher.contract.layout import Layout
from launcher.estimate import Workload
from launcher.plan.throughput import (
    BREAKDOWN,
    CONSTANTS,
    ThroughputUnknown,
    bubble_fraction,
    model_flops_per_token,
    predict,
)
from launcher.recipe import Recipe
from launcher.recipe.hardware import hardware_for
from tests import REPO

RECIPES = REPO / "recipes"

H100 = catalog.accelerators()["h100-80gb"]
LLAMA8B = catalog.models()["llama3.1-8b"]
LLAMA70B = catalog.models()["llama3.1-70b"]
P5 = catalog.instance_types()["ml.p5.48xlarge"]
P5_FREE = hardware_for("ml.p5.48xlarge", usd_per_hour=0.0)  # 8 x h100-80gb; a test sets the price


def run(
    arch=LLAMA8B,
    layout=None,
    *,
    seq_len=8192,
    micro_batch_size=1,
    grad_accum_steps=1,
    accelerator=H100,
    gpus_per_node=8,
    usd_per_hour=0.0,
    constants=CONSTANTS,
    **workload,
):
    hardware = dataclasses.replace(
        P5_FREE, accelerator=accelerator, procs_per_node=gpus_per_node, usd_per_hour=usd_per_hour
    )
    return predict(
        Workload(
            arch=arch,
            layout=layout or Layout(data_shard=8),
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            grad_accum_steps=grad_accum_steps,
            **workload,
        ),
        hardware,
        constants=constants,
    )


def predict_recipe(recipe):
    return predict(Workload.from_recipe(recipe), recipe.hardware)


def test_bubble_is_p_minus_1_over_m_v_plus_p_minus_1():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 8) == 0


def test_model_flops_per_token_is_6n_plus_6_lhs_causal_by_hand():
    tiny = catalog.models()["llama-tiny"]  # h 128, 4 layers, kv_dim 64, ffn 352, vocab 512
    block = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 352  # wq wo, wk wv, w1 w2 w3 = 184320
    dense = 6 * (4 * block + 128 * 512)  # blocks and output layer, not the embedding lookup
    assert model_flops_per_token(tiny, 256) == dense + 6 * 4 * 128 * 256 == 5_603_328
    assert model_flops_per_token(tiny, 256, causal=False) == dense + 12 * 4 * 128 * 256


def test_mfu_counts_flops_as_the_entrypoints_log_them():
    from entrypoints.metrics import flops_per_token
    from launcher.contract.config import ModelConfig

    fields = {k: v for k, v in LLAMA8B.model_dump().items() if k in ModelConfig.__dataclass_fields__}
    config = ModelConfig(name="llama3.1-8b", **{**fields, "rope_scaling": None})
    assert model_flops_per_token(LLAMA8B, 8192) == pytest.approx(flops_per_token(config, 8192))


def test_published_model_flops_match_nemo_model_tflops_for_llama3_8b():
    # NeMo 24.09 lists Llama 3 8B at 8192 tokens as 12,273 tokens/s/GPU and 711 model TFLOP/s.
    llama3_8b = catalog.models()["llama3-8b"]
    assert model_flops_per_token(llama3_8b, 8192, causal=False) == pytest.approx(711e12 / 12273, rel=1e-3)


def test_breakdown_adds_up_to_the_step_time():
    speed = run(LLAMA70B, Layout(tensor=4, context=2, pipeline=4, data_shard=2), grad_accum_steps=8, fp8=True)
    assert set(speed.breakdown) == set(BREAKDOWN)
    assert sum(speed.breakdown.values()) == pytest.approx(speed.step_time_s)


def test_pipeline_bubble_takes_its_fraction_of_the_pipelined_time():
    for v, schedule in ((1, "1f1b"), (2, "interleaved_1f1b")):
        speed = run(
            LLAMA70B,
            Layout(tensor=8, pipeline=4, virtual_stages=v, data_shard=2),
            grad_accum_steps=8,
            pipeline_schedule=schedule,
        )
        once_per_step = speed.breakdown["optimizer"] + speed.breakdown["data_replicate"] + speed.breakdown["fsdp"]
        pipelined = speed.step_time_s - once_per_step
        assert speed.breakdown["pipeline_bubble"] / pipelined == pytest.approx(bubble_fraction(4, 8, v))
        assert speed.bubble_fraction == pytest.approx(bubble_fraction(4, 8, v))


def test_tokens_per_second_follow_from_the_step_time():
    speed = run(layout=Layout(context=2, data_shard=4), micro_batch_size=2, grad_accum_steps=3)
    assert speed.tokens_per_step == 2 * 8192 * 3 * 4
    assert speed.tokens_per_s_per_gpu == pytest.approx(speed.tokens_per_step / speed.step_time_s / 8)


def test_mfu_is_model_flops_over_the_bf16_peak_even_with_fp8():
    speed = run(fp8=True)
    expected = speed.tokens_per_s_per_gpu * model_flops_per_token(LLAMA8B, 8192) / (H100.peak_bf16_tflops * 1e12)
    assert speed.mfu == pytest.approx(expected)


def test_cost_per_million_tokens_and_per_run_come_from_the_instance_price():
    speed = run(layout=Layout(data_shard=16), usd_per_hour=55.04, steps=1000)
    assert speed.instance_count == 2
    assert speed.usd_per_hour == pytest.approx(2 * 55.04)
    dollars_per_s = 2 * 55.04 / 3600
    assert speed.usd_per_million_tokens == pytest.approx(dollars_per_s / (speed.tokens_per_s_per_gpu * 16) * 1e6)
    assert speed.time_to_train_s == pytest.approx(1000 * speed.step_time_s)
    assert speed.usd_per_run == pytest.approx(dollars_per_s * 1000 * speed.step_time_s)


def test_recipe_price_overrides_the_catalog():
    recipe = Recipe.load(RECIPES / "llama3-8b-8k.yaml")
    assert predict_recipe(recipe).usd_per_hour == pytest.approx(P5.usd_per_hour)
    cheaper = recipe.with_changes({"cluster.usd_per_hour": 30.0})
    assert predict_recipe(cheaper).usd_per_hour == pytest.approx(30.0)
    assert predict_recipe(cheaper).time_to_train_s == pytest.approx(3000 * predict_recipe(recipe).step_time_s)


def test_recomputation_costs_a_forward_of_the_checkpointed_blocks():
    none, selective, full = (run(activation_checkpointing=ac) for ac in ("none", "selective", "full"))
    assert none.breakdown["recompute"] == 0
    assert selective.breakdown["recompute"] == pytest.approx(full.breakdown["recompute"] / 2)
    forward = (full.breakdown["matmul"] + full.breakdown["attention"]) / 3  # rough: forward is 1/3 of FLOPs
    assert 0.8 * forward < full.breakdown["recompute"] < 1.2 * forward
    assert none.tokens_per_s_per_gpu > selective.tokens_per_s_per_gpu > full.tokens_per_s_per_gpu


def test_attention_time_per_token_grows_linearly_with_the_sequence():
    flat = dataclasses.replace(CONSTANTS, attention_half_seq=0)  # no short-sequence penalty
    short, long = (run(seq_len=s, constants=flat) for s in (32768, 65536))
    per_token = [r.breakdown["attention"] / r.tokens_per_step for r in (short, long)]
    assert per_token[1] == pytest.approx(2 * per_token[0])


def test_single_gpu_has_no_communication():
    speed = run(layout=Layout(), gpus_per_node=1)
    assert speed.communication_s == 0
    assert speed.breakdown["pipeline_bubble"] == 0


def test_tensor_parallel_traffic_is_exposed_unless_overlapped():
    layout = Layout(tensor=4, data_shard=2)
    assert run(layout=layout).breakdown["tensor_parallel"] > 0
    hidden = dataclasses.replace(CONSTANTS, tp_overlap=1.0)
    assert run(layout=layout, constants=hidden).breakdown["tensor_parallel"] == 0


def test_context_parallel_across_nodes_is_slower_than_within_a_node():
    layout = Layout(tensor=2, context=8)  # 16 GPUs: the cp group spans two nodes of 8...
    across = run(layout=layout, seq_len=131072, activation_checkpointing="full")
    within = run(layout=layout, seq_len=131072, activation_checkpointing="full", gpus_per_node=16)  # ...or one of 16
    # Across: 4 ranks of each cp group per node, the node's two groups (one per TP rank) sharing
    # its 8 NICs: 3200 Gb/s x 0.8 / 2 = 160 GB/s, against NVLink's 450 x 0.8 = 360 GB/s within.
    ratio = across.breakdown["context_parallel"] / within.breakdown["context_parallel"]
    assert 360 / 160 < ratio < 1.1 * 360 / 160  # the rest: 40 us latency per collective, not 15


def test_smaller_tensor_parallel_matrices_run_less_efficiently():
    # The same FLOPs per token either way; TP 8 cuts the 1024 KV columns into 128-wide slices.
    tp2, tp8 = (run(layout=Layout(tensor=t, data_shard=8 // t)) for t in (2, 8))
    gpu_seconds_per_token = [r.breakdown["matmul"] * 8 / r.tokens_per_step for r in (tp2, tp8)]
    assert gpu_seconds_per_token[1] > 1.05 * gpu_seconds_per_token[0]


def test_fsdp_under_pipeline_parallelism_syncs_once_per_step():
    layout = Layout(pipeline=4, data_shard=16)
    few, many = (run(LLAMA70B, layout, grad_accum_steps=m, activation_checkpointing="full") for m in (4, 16))
    assert many.breakdown["fsdp"] <= few.breakdown["fsdp"]  # not once per micro-batch


def test_fp8_speeds_up_large_matmuls():
    layout = Layout(tensor=8, data_shard=4)
    bf16, fp8 = (run(LLAMA70B, layout, fp8=f, activation_checkpointing="full") for f in (False, True))
    assert fp8.breakdown["matmul"] < 0.75 * bf16.breakdown["matmul"]


def test_the_host_cpu_has_no_throughput_to_predict():
    cpu = catalog.accelerators()["cpu"]
    with pytest.raises(ThroughputUnknown, match="throughput is predicted for GPUs only"):
        run(layout=Layout(), accelerator=cpu, gpus_per_node=4)


def test_a_hand_built_arch_without_a_catalog_entry_predicts():
    arch = ModelArch(
        hidden_size=1024,
        num_layers=8,
        num_heads=8,
        num_kv_heads=8,
        ffn_hidden_size=4096,
        vocab_size=32000,
        max_context=4096,
    )
    assert run(arch, Layout(), seq_len=4096, gpus_per_node=1).tokens_per_s_per_gpu > 0
