"""The throughput model's terms, one rule per test: FLOPs, the bubble, recomputation, communication, cost."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launcher import catalog
from launcher.catalog import ModelArch
from launcher.contract.layout import Layout
from launcher.estimate import Workload
from launcher.plan.rank import candidate_workloads
from launcher.plan.throughput import (
    BREAKDOWN,
    CONSTANTS,
    bubble_fraction,
    model_flops_per_token,
    predict,
    predict_many,
)
from launcher.plan.userbuffers import USERBUFFERS, Overlap, UserbuffersConfig
from launcher.recipe import Recipe
from launcher.recipe.hardware import hardware_for
from tests import REPO, load_script

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
            grad_accumulation="sync_last_gathered",  # FSDP's traffic once per step, outside the pipeline
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


def test_megatron_selective_recomputation_runs_each_kept_layers_core_attention_forward_again():
    # recompute_granularity "selective": attention's forward (a third of its time) once more per
    # layer; under full recomputation the layer's whole forward already includes it.
    plain = run()
    selective = run(recompute_core_attention=True)
    assert selective.breakdown["recompute"] - plain.breakdown["recompute"] == pytest.approx(
        plain.breakdown["attention"] / 3
    )
    full = run(activation_checkpointing="full")
    assert run(activation_checkpointing="full", recompute_core_attention=True).breakdown == full.breakdown


def test_an_unfused_squared_relu_costs_its_counted_bytes_compiled_or_not():
    # Megatron-Core's squared ReLU without bias_activation_fusion: 28 bytes per element of the
    # two-matrix FFN (3/2 of the gated width), forward and backward, eager under compile too.
    def elementwise(activation, compile):
        return run(mlp_activation=activation, compile=compile).breakdown["elementwise"]

    eager_gap = elementwise("squared_relu_unfused", False) - elementwise("swiglu", False)
    compiled_gap = elementwise("squared_relu_unfused", True) - elementwise("swiglu", True)
    f, layers, rows = LLAMA8B.ffn_hidden_size, LLAMA8B.num_layers, 8192
    hbm = 3350e9 * CONSTANTS.hbm_efficiency  # H100 SXM, 3.35 TB/s
    per_byte = layers * rows / hbm  # seconds per byte of every token of every layer
    swiglu = 3 * CONSTANTS.elementwise_bytes_per_ffn * f  # forward, and backward twice that
    assert eager_gap == pytest.approx(per_byte * (28 * 1.5 * f - swiglu))
    assert compiled_gap == pytest.approx(per_byte * (28 * 1.5 * f - CONSTANTS.compiled_elementwise_factor * swiglu))


def test_megatron_block_recomputation_recomputes_k_layers_of_each_virtual_stage():
    # recompute_layers (Megatron-Core's recompute_method block): 5 of 8B's 32 layers recompute their
    # forward; under PP 4 with 2 virtual stages, 2 layers of each 4-layer chunk, half the rank's 8.
    full = run(activation_checkpointing="full")
    five = run(recompute_layers=5)
    assert five.breakdown["recompute"] == pytest.approx(full.breakdown["recompute"] * 5 / 32)
    pipelined = dict(layout=Layout(pipeline=4, virtual_stages=2, data_shard=2), grad_accum_steps=8)
    staged_full = run(activation_checkpointing="full", pipeline_schedule="interleaved_1f1b", **pipelined)
    staged = run(recompute_layers=2, pipeline_schedule="interleaved_1f1b", **pipelined)
    assert staged.breakdown["recompute"] == pytest.approx(staged_full.breakdown["recompute"] / 2)
    more = run(recompute_layers=64)  # more than a stage holds: every layer, as full
    assert more.breakdown["recompute"] == pytest.approx(full.breakdown["recompute"])


def _head_and_loss_s(arch, rows: int, flops_per_weight: int, gemm_rows: int, bytes_per_logit: float) -> float:
    """The output layer's GEMMs and the loss's traffic of one micro-batch on one H100, by hand."""
    k = CONSTANTS
    h, vocab = arch.hidden_size, arch.vocab_size
    rate = H100.peak_bf16_tflops * 1e12 * k.matmul_efficiency["hopper:bf16"]
    shape = 1.0
    for d in (gemm_rows, h, vocab):
        shape *= d / (d + k.gemm_half_dim["bf16"])
    hbm = H100.hbm_gbps * 1e9 * k.hbm_efficiency
    return flops_per_weight * rows * h * vocab / (rate * shape) + bytes_per_logit * rows * vocab / hbm


def test_kept_logits_price_the_output_layer_at_6_flops_in_one_gemm_of_all_the_rows():
    # The entrypoints' fused loss recomputes each chunk's logits (8 FLOPs per output weight and
    # token); Megatron-Core and torchtitan keep them (Workload.logits_materialized: 6), and their
    # GEMM's M is the micro-batch's rows, not a chunk's. Llama 3 8B at 8K: chunks of 1024 rows.
    k = CONSTANTS
    chunked, kept = (run(layout=Layout(), logits_materialized=m) for m in (False, True))
    saved = _head_and_loss_s(LLAMA8B, 8192, 8, 1024, k.loss_bytes_per_logit) - _head_and_loss_s(
        LLAMA8B, 8192, 6, 8192, k.materialized_loss_bytes_per_logit
    )
    assert chunked.step_time_s - kept.step_time_s == pytest.approx(saved, rel=1e-6)


def test_the_fused_loss_is_priced_on_the_contracts_chunks_never_below_1024_tokens():
    # Qwen3-30B-A3B: 151,936 words at h 2048 make 75 chunks, 55 tokens each at 4K, which the
    # entrypoints raise to 1024 (launcher/contract/loss.py): the chunks' GEMMs have M 1024, not 55.
    from launcher.contract.loss import chunk_tokens

    qwen, k = catalog.models()["qwen3-30b-a3b"], CONSTANTS
    assert chunk_tokens(4096, qwen.hidden_size, qwen.vocab_size) == 1024
    chunked, kept = (run(qwen, Layout(), seq_len=4096, logits_materialized=m) for m in (False, True))
    saved = _head_and_loss_s(qwen, 4096, 8, 1024, k.loss_bytes_per_logit) - _head_and_loss_s(
        qwen, 4096, 6, 4096, k.materialized_loss_bytes_per_logit
    )
    assert chunked.step_time_s - kept.step_time_s == pytest.approx(saved, rel=1e-6)


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
    plain, overlapped = (run(layout=layout, tp_overlap=mode) for mode in ("none", "async"))
    assert 0 < overlapped.breakdown["tensor_parallel"] < plain.breakdown["tensor_parallel"]
    assert run(layout=Layout(data_shard=8), tp_overlap="async").breakdown["tensor_parallel"] == 0


def test_tp_saved_inputs_shard_gathers_both_block_inputs_again_in_backward():
    # Exposed (the entrypoints wait on it), or beside the input-gradient GEMM (Megatron-Core's
    # and Transformer Engine's async all-gather): 70B at 16K on TP 4, where that GEMM outlasts it,
    # so only the interference share remains.
    layout = Layout(tensor=4, data_shard=2)
    gathered, shard, overlapped = (
        run(LLAMA70B, layout, seq_len=16384, **changes).breakdown["tensor_parallel"]
        for changes in ({}, {"tp_saved_inputs": "shard"}, {"tp_saved_inputs": "shard", "regather_overlap": True})
    )
    collective = gathered / (LLAMA70B.num_layers * 8 + 2)
    assert shard - gathered == pytest.approx(LLAMA70B.num_layers * 2 * collective)
    assert overlapped - gathered == pytest.approx(
        LLAMA70B.num_layers * 2 * collective * CONSTANTS.tp_overlap_interference
    )
    selective = {"activation_checkpointing": "selective"}
    assert run(LLAMA70B, layout, seq_len=16384, tp_saved_inputs="shard", **selective).breakdown[
        "tensor_parallel"
    ] - run(LLAMA70B, layout, seq_len=16384, **selective).breakdown["tensor_parallel"] == pytest.approx(
        LLAMA70B.num_layers * collective
    )  # half the blocks are checkpointed and regather in their recomputation anyway


def test_overlapped_tensor_parallel_leaves_one_piece_of_each_collective_behind_long_gemms():
    # Llama 3.1 70B at 16K tokens per micro-batch on TP 4: every GEMM outlasts its collective, so
    # each of a block's 8 collectives shows 1/t of itself and the interference share of the rest;
    # the loss's 2 all-gathers stay whole.
    layout = Layout(tensor=4, data_shard=2)
    plain, overlapped = (run(LLAMA70B, layout, seq_len=16384, tp_overlap=mode) for mode in ("none", "async"))
    collective = plain.breakdown["tensor_parallel"] / (LLAMA70B.num_layers * 8 + 2)
    piece = 1 / 4 + 3 / 4 * CONSTANTS.tp_overlap_interference
    expected = (LLAMA70B.num_layers * 8 * piece + 2) * collective
    assert overlapped.breakdown["tensor_parallel"] == pytest.approx(expected)


def test_overlapped_tensor_parallel_runs_its_gemms_in_t_pieces():
    # async TP runs every forward and input-gradient GEMM on rows / t at a time, a lower shape
    # efficiency; Transformer Engine's userbuffers keeps wq/wk/wv's and w1/w3's input gradients
    # whole (bulk overlap), so it loses less.
    layout = Layout(tensor=8, data_shard=1)
    plain, te, torch_async = (
        run(layout=layout, seq_len=2048, tp_overlap=mode).breakdown["matmul"]
        for mode in ("none", "userbuffers", "async")
    )
    assert plain < te < torch_async
    assert torch_async > 1.05 * plain


@pytest.mark.parametrize(
    "overlap, comm, gemm, exposed",
    [
        # Ring exchange: t - 1 copy-engine steps, each beside the GEMM chunk before the one that needs it.
        (Overlap("ring_exchange", num_sm=1), 1.0, 2.0, 0.0),
        (Overlap("ring_exchange", num_sm=1), 1.0, 0.4, 1.0 - 0.4 * 3 / 4),
        # ... and with set_sm_margin the GEMM runs on the other 131 SMs.
        (Overlap("ring_exchange", num_sm=1, sm_margin=True), 1.0, 2.0, 2.0 / 131),
        # Pipelined on 24 SMs held from the GEMM: the GEMM runs 132 / 108 as long, the last of 4 chunks waits.
        (Overlap("pipeline", num_sm=24, sm_margin=True), 1.0, 4.0, 1 / 4 + 4.0 * 24 / 108),
        # TE's default pipeline shares 16 SMs with the GEMM while it runs.
        (Overlap("pipeline", num_sm=16), 1.0, 4.0, 1 / 4 + 1.0 * 16 / 132),
        # Bulk: the whole collective beside the whole GEMM on 24 of its SMs; what outlasts the GEMM shows.
        (Overlap("bulk", num_sm=24), 1.0, 4.0, 24 / 132),
        (Overlap("bulk", num_sm=16), 3.0, 2.0, 1.0 + 2.0 * 16 / 132),
    ],
)
def test_each_userbuffers_method_costs_what_te_runs(overlap, comm, gemm, exposed):
    assert overlap.exposed(comm, gemm, t=4) == pytest.approx(exposed)


def test_a_userbuffers_config_of_unknown_method_or_name_is_refused():
    with pytest.raises(ValueError, match=r"^userbuffers method 'atomic': use one of ring_exchange, pipeline, bulk$"):
        Overlap("atomic")
    with pytest.raises(ValueError, match=r"^userbuffers num_sm 132: use 1 to 131$"):
        Overlap("bulk", num_sm=132)
    with pytest.raises(ValueError, match=r"^userbuffers config 'mine' is not known; use one of te_defaults, "):
        run(LLAMA70B, Layout(tensor=4, data_shard=2), tp_overlap="userbuffers", userbuffers="mine")


def test_userbuffers_ring_exchanges_beside_longer_gemms_leave_only_the_loss_gathers(monkeypatch):
    # A block whose ten collectives all ring-exchange on the copy engines, beside GEMMs that outlast
    # them (70B at 16K tokens over TP 4), adds no TP time of its own: what remains is the loss's
    # two all-gathers of the sequence, which no GEMM hides.
    ring = Overlap("ring_exchange", num_sm=1)
    every_ring = UserbuffersConfig("test", *(ring,) * 10)
    monkeypatch.setitem(USERBUFFERS, "every_ring", every_ring)
    layout = Layout(tensor=4, data_shard=2)
    plain = run(LLAMA70B, layout, seq_len=16384).breakdown["tensor_parallel"]
    collective = plain / (LLAMA70B.num_layers * 8 + 2)  # 8 per block, as in the test above, and the loss's 2
    te = run(LLAMA70B, layout, seq_len=16384, tp_overlap="userbuffers", userbuffers="every_ring")
    assert te.breakdown["tensor_parallel"] == pytest.approx(2 * collective)
    # NeMo's pipelined reduce-scatters hold 24 and 16 SMs from proj's and fc2's GEMMs, and its bulk
    # pairs share SMs: dearer, yet cheaper than the same collectives left waiting.
    nemo = run(LLAMA70B, layout, seq_len=16384, tp_overlap="userbuffers", userbuffers="nemo_h8192_tp4_mbs1_seqlen4096")
    assert te.breakdown["tensor_parallel"] < nemo.breakdown["tensor_parallel"] < plain


def test_megatron_p2p_overlap_hides_sends_behind_chunks_of_the_interleaved_schedule_only():
    interleaved = Layout(pipeline=4, virtual_stages=2, data_shard=2)
    exposed, hidden = (
        run(LLAMA70B, interleaved, grad_accum_steps=8, p2p_overlap=on).breakdown["pipeline_p2p"] for on in (False, True)
    )
    assert exposed > 0 and hidden == 0  # a chunk of 70B's layers outlasts one 8K x 8192 message
    plain = Layout(pipeline=4, data_shard=2)  # Megatron turns it on with virtual stages only
    one, other = (
        run(LLAMA70B, plain, grad_accum_steps=8, p2p_overlap=on).breakdown["pipeline_p2p"] for on in (False, True)
    )
    assert one == other > 0


def test_context_parallel_across_nodes_is_slower_than_within_a_node():
    layout = Layout(tensor=2, context=8)  # 16 GPUs: the cp group spans two nodes of 8...
    across = run(layout=layout, seq_len=131072, activation_checkpointing="full")
    within = run(layout=layout, seq_len=131072, activation_checkpointing="full", gpus_per_node=16)  # ...or one of 16
    # Across: 4 ranks of each cp group per node, the node's two groups (one per TP rank) sharing
    # its 8 NICs: 3200 Gb/s x 0.8 / 2 = 160 GB/s, against NVLink's 450 x 0.8 = 360 GB/s within.
    ratio = across.breakdown["context_parallel"] / within.breakdown["context_parallel"]
    assert 360 / 160 < ratio < 1.1 * 360 / 160  # the rest: 40 us latency per collective, not 15


def test_the_all_gather_path_moves_k_and_v_three_times_per_layer_and_twice_under_document_masking():
    # Kept layers gather K/V in forward and again in backward, then reduce-scatter dK/dV; a
    # checkpointed layer gathers in its recomputed forward instead. Document masking keeps the
    # gathered K/V of kept layers: two. Latency makes the counts exact multiples.
    layout = Layout(context=4, data_shard=2)
    cp = {
        (ac, masked): run(
            layout=layout, seq_len=65536, activation_checkpointing=ac, cp_attention="allgather", document_masking=masked
        ).breakdown["context_parallel"]
        for ac in ("none", "full")
        for masked in (False, True)
    }
    assert cp[("none", False)] == pytest.approx(cp[("full", False)]) == pytest.approx(cp[("full", True)])
    assert cp[("none", True)] == pytest.approx(2 / 3 * cp[("none", False)])


def test_a_p2p_ring_hides_k_and_v_behind_attention_at_long_sequences_only():
    # Transformer Engine's ring sends each K/V chunk beside a step's attention: at 128K a step's
    # attention outlasts its chunk's transfer; at 4K across nodes it does not, and the ring's
    # c - 1 transfers per pass pay their latency c - 1 times where one all-gather pays it once.
    long = Layout(context=8)
    hidden = run(layout=long, seq_len=131072, activation_checkpointing="full", cp_attention="allgather", cp_ring=True)
    gathered = run(layout=long, seq_len=131072, activation_checkpointing="full", cp_attention="allgather")
    assert hidden.breakdown["context_parallel"] == 0 < gathered.breakdown["context_parallel"]
    short = Layout(tensor=2, context=8)  # the cp group spans two nodes
    exposed = run(layout=short, seq_len=4096, cp_attention="allgather", cp_ring=True).breakdown["context_parallel"]
    assert exposed > run(layout=short, seq_len=4096, cp_attention="allgather").breakdown["context_parallel"] > 0


def test_smaller_tensor_parallel_matrices_run_less_efficiently():
    # The same FLOPs per token either way; TP 8 cuts the 1024 KV columns into 128-wide slices.
    tp2, tp8 = (run(layout=Layout(tensor=t, data_shard=8 // t)) for t in (2, 8))
    gpu_seconds_per_token = [r.breakdown["matmul"] * 8 / r.tokens_per_step for r in (tp2, tp8)]
    assert gpu_seconds_per_token[1] > 1.05 * gpu_seconds_per_token[0]


def test_fsdp_under_pipeline_parallelism_syncs_once_per_step():
    layout = Layout(pipeline=4, data_shard=16)
    few, many = (
        run(
            LLAMA70B,
            layout,
            grad_accum_steps=m,
            activation_checkpointing="full",
            grad_accumulation="sync_last_gathered",
        )
        for m in (4, 16)
    )
    assert many.breakdown["fsdp"] <= few.breakdown["fsdp"]  # not once per micro-batch


def test_fsdp_under_pipeline_parallelism_and_sync_each_gathers_and_reduces_every_micro_batch():
    # pipeline.py's _GradientSyncEachMicroBatch: one all-gather and one reduce-scatter of the
    # rank's blocks per micro-batch (never resharded after forward), hidden behind its compute.
    from launcher.plan.throughput import _Step, fsdp_time, fsdp_traffic

    layout = Layout(pipeline=4, data_shard=16)
    hardware = dataclasses.replace(P5_FREE, procs_per_node=8)
    workload = Workload(arch=LLAMA70B, layout=layout, seq_len=8192, micro_batch_size=1, grad_accum_steps=16,
                        grad_accumulation="sync_each")  # fmt: skip
    step = _Step(workload, hardware, CONSTANTS)
    traffic = fsdp_traffic(step)
    per_mb, per_step = fsdp_time(step, compute_mb=0.0)  # nothing to hide behind
    assert per_step == 0
    assert per_mb == pytest.approx(traffic.block_gather + traffic.root_gather + traffic.reduce + traffic.first_block)
    few, many = (
        run(LLAMA70B, layout, grad_accum_steps=m, activation_checkpointing="full", grad_accumulation="sync_each")
        for m in (4, 16)
    )
    assert many.breakdown["fsdp"] > few.breakdown["fsdp"]  # once per micro-batch, where exposed


def test_fp8_speeds_up_large_matmuls():
    layout = Layout(tensor=8, data_shard=4)
    bf16, fp8 = (run(LLAMA70B, layout, fp8=f, activation_checkpointing="full") for f in (False, True))
    assert fp8.breakdown["matmul"] < 0.75 * bf16.breakdown["matmul"]


def test_cached_fp8_weights_are_cast_once_per_step_not_per_micro_batch():
    # Transformer Engine's is_first_microbatch cache (Workload.fp8_weights_cached): the casts of
    # this rank's weights (a cast-transpose each) are paid once in m micro-batches.
    layout, m = Layout(tensor=4, pipeline=8, data_shard=2), 64
    arch, k = LLAMA70B, CONSTANTS
    kwargs = dict(fp8=True, compile=True, grad_accum_steps=m, pipeline_schedule="1f1b", fp8_casts="te_delayed")
    fresh, cached = (run(arch, layout, fp8_weights_cached=c, **kwargs) for c in (False, True))
    h, kv, f, t = arch.hidden_size, arch.kv_dim, arch.ffn_hidden_size, layout.tensor
    weights = (2 * h * h + 2 * h * kv + 3 * h * f) / t
    layers = arch.num_layers // layout.pipeline
    hbm = H100.hbm_gbps * 1e9 * k.hbm_efficiency
    # Uncached, float8 all-gather casts the FSDP shard (1/2) every micro-batch; cached, the whole
    # local weight once.
    saved = k.te_cast_bytes["te_delayed"] * layers * (m * weights / layout.data_shard - weights) / hbm
    assert fresh.breakdown["elementwise"] - cached.breakdown["elementwise"] == pytest.approx(saved, rel=1e-6)


def test_fp8_casts_the_sequence_parallel_inputs_on_the_shard_before_the_gather():
    # torchao's PrepareFloat8ModuleInput casts this rank's s/t rows, then all-gathers float8: the
    # two h-wide block inputs cost 2h/t per token, not 2h; so do wo's and w2's output gradients,
    # which Float8RowwiseParallel casts before backward gathers them. Each at its measured price.
    arch, k = LLAMA70B, CONSTANTS
    h, kv, f = arch.hidden_size, arch.kv_dim, arch.ffn_hidden_size
    hbm = H100.hbm_gbps * 1e9 * k.hbm_efficiency

    def cast_seconds(t):
        layout = Layout(tensor=t, data_shard=8 // t)
        fp8, bf16 = (run(arch, layout, fp8=p, compile=True) for p in (True, False))
        return fp8.breakdown["elementwise"] - bf16.breakdown["elementwise"]

    t = 8
    rows, layers, price = 8192, arch.num_layers, k.torchao_cast_bytes["tensorwise"]
    inputs = rows * (2 * h / t + (h + f) / t)
    grad_outputs = rows * (2 * h / t + (h + 2 * kv + 2 * f) / t)  # wo's and w2's cast on the shard too
    weights = (2 * h * h + 2 * h * kv + 3 * h * f) / t / (8 // t)
    per_layer = price["input"] * inputs + price["grad_output"] * grad_outputs + price["weight"] * weights
    assert cast_seconds(t) == pytest.approx(layers * per_layer / hbm, rel=1e-6)


def test_torchao_cast_prices_are_the_recorded_inductor_fit():
    # scripts/fp8_cast_bytes.py measures them; the constants carry its fit to one decimal.
    record = json.loads((REPO / "docs" / "fp8_cast_bytes.json").read_text())["recipes"]
    fitted = {recipe: {key: round(v, 1) for key, v in r["bytes_per_element"].items()} for recipe, r in record.items()}
    assert fitted == CONSTANTS.torchao_cast_bytes
    assert all(abs(shape["fit_error"]) < 0.02 for r in record.values() for shape in r["shapes"])


def test_transformer_engine_casts_follow_its_fused_cast_transposes():
    # TE v1.8 under sequence parallel, delayed scaling: the norm casts wq/wk/wv's and w1/w3's
    # inputs itself and backward transposes them gathered (2 bytes each); wo's and w2's inputs and
    # the column-parallel output gradients get a cast-transpose (4); wo's and w2's output gradients
    # are cast on the shard (3 / t), gathered and transposed (2). Current scaling adds an amax pass.
    arch, k = LLAMA70B, CONSTANTS
    h, kv, f, t = arch.hidden_size, arch.kv_dim, arch.ffn_hidden_size, 4
    layout, rows = Layout(tensor=t, data_shard=2), 8192
    hbm = H100.hbm_gbps * 1e9 * k.hbm_efficiency

    def cast_seconds(casts):
        fp8, bf16 = (run(arch, layout, fp8=p, compile=True, fp8_casts=casts) for p in (True, False))
        return fp8.breakdown["elementwise"] - bf16.breakdown["elementwise"]

    weights = (2 * h * h + 2 * h * kv + 3 * h * f) / t / layout.data_shard
    delayed = (
        2 * 2 * h * rows
        + 4 * rows * ((h + f) / t + (h + 2 * kv + 2 * f) / t)
        + (3 / t + 2) * 2 * h * rows
        + 4 * weights
    )
    assert cast_seconds("te_delayed") == pytest.approx(arch.num_layers * delayed / hbm, rel=1e-6)
    assert cast_seconds("te_current") > 1.2 * cast_seconds("te_delayed")


def test_bf16_moments_pay_their_unfused_update_in_optimizer_time():
    layout = Layout(data_shard=8)
    fp32, bf16 = (run(LLAMA8B, layout, optimizer_state_dtype=d) for d in ("fp32", "bf16"))
    ratio = CONSTANTS.bf16_moments_bytes_per_param / CONSTANTS.optimizer_bytes_per_param
    assert bf16.breakdown["optimizer"] == pytest.approx(ratio * fp32.breakdown["optimizer"])
    assert bf16.breakdown["matmul"] == fp32.breakdown["matmul"]


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


@pytest.mark.parametrize(
    ("path", "changes", "vary_fp8"),
    [
        ("llama405b-128k.yaml", {}, False),  # pipelined layouts, several ranks that can be the slowest
        ("llama3-8b-8k.yaml", {"cluster.instance_count": 4, "training.global_batch_size": 256}, True),
    ],
)
def test_predicting_every_candidate_at_once_gives_each_ones_own_prediction(path, changes, vary_fp8):
    # predict_many shares rates, links, layer terms and steps between candidates, and within a
    # step the terms of its family and of each recomputed share; nothing it gives may differ from
    # predicting each candidate alone, in any order.
    recipe = Recipe.load(RECIPES / path).with_changes(changes)
    candidates = candidate_workloads(recipe, recipe.hardware, vary_fp8=vary_fp8)
    assert len({w.activation_checkpointing for w in candidates}) == 3
    assert len({w.grad_accumulation for w in candidates}) > 1 or recipe.layout.pipeline > 1
    alone = [predict(w, recipe.hardware) for w in candidates]
    assert predict_many(candidates, recipe.hardware) == alone
    assert predict_many(candidates[::-1], recipe.hardware) == alone[::-1]
    assert predict_many([], recipe.hardware) == []


def test_the_cast_bytes_script_recovers_known_prices_from_block_widths():
    # scripts/fp8_cast_bytes.py's least squares, on blocks whose extra bytes follow set prices.
    script = load_script("fp8_cast_bytes")
    prices = {"input": 11.0, "grad_output": 6.0, "weight": 9.0}
    measured = []
    for hidden, kv_heads, ffn in script.SHAPES:
        i, g, w = script.widths(hidden, kv_heads, ffn)
        extra = prices["input"] * i + prices["grad_output"] * g + prices["weight"] * w
        measured.append(dict(hidden=hidden, kv_heads=kv_heads, ffn=ffn, bf16=1000.0, fp8=1000.0 + extra))
    assert script.fit(measured) == pytest.approx(prices, rel=1e-9)
