"""`fsdp` mode on hand-computed values: llama-tiny (h 128, L 4, 8 heads, 4 KV heads so
kv_dim 64, f 352, V 512, head_dim 16) at s 256, b 1, bf16, on FSDP 2 unless a test says
otherwise. The comment beside each number is its arithmetic."""

from __future__ import annotations

from dataclasses import replace

import pytest

from launcher.catalog import models
from launcher.contract.layout import Layout
from launcher.estimate import Workload, estimate_memory, fsdp
from launcher.estimate.breakdown import ALLOCATED_COMPONENTS
from launcher.estimate.overheads import CUDA_CONTEXT_BYTES, FRAGMENTATION_FRACTION, NCCL_BYTES_PER_COMMUNICATOR
from launcher.recipe.hardware import hardware_for

TINY = models()["llama-tiny"]
P5 = hardware_for("ml.p5.48xlarge")  # 8 x h100-80gb

P_BLOCK = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 352 + 2 * 128  # 184,576
P_ROOT = 2 * 512 * 128 + 128  # embedding, output, final norm: 131,200
P_RANK = 4 * P_BLOCK + P_ROOT  # 869,504
# Saved per token: 2 x (block input, residual, two norm outputs, q, attention output = 6h;
# k, v = 2 kv) + 8 (two fp32 rstd) + 4 x 8 heads (fp32 log-sum-exp) + 2 x 2f (the SwiGLU's
# gate and up; w2 keeps no copy of their product, which backward makes again).
SAVED_PER_LAYER = 256 * (2 * (6 * 128 + 2 * 64) + 8 + 32 + 2 * 2 * 352)  # 829,440
PRODUCT = 2 * 256 * 352  # the SwiGLU's product, made again for w2's backward
LAYER_INPUT = 2 * 256 * 128  # 65,536
ROPE = 2 * 256 * 16  # the bf16 RoPE table: 8,192
# Last stage: the final norm's input + rstd, the loss's hidden states, int64 targets, bool
# mask, fp32 log-sum-exp.
HEAD = (2 * 128 + 4) * 256 + 2 * 256 * 128 + (8 + 1 + 4) * 256  # 135,424


def workload(**changes) -> Workload:
    base = dict(arch=TINY, layout=Layout(data_shard=2), seq_len=256, micro_batch_size=1, grad_accum_steps=1)
    return Workload(**(base | changes))


def test_states_are_16_bytes_per_parameter_over_the_fsdp_group():
    step = fsdp.moments(workload())["optimizer step"]
    assert step["parameters"] == 4 * P_RANK // 2 + 4 * 256 * 16  # fp32 masters + fp32 RoPE table
    assert step["gradients"] == 4 * P_RANK // 2
    assert step["optimizer_states"] == 8 * P_RANK // 2
    assert step["optimizer_temp"] == 0  # fused AdamW on CUDA


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_bf16_moments_hold_4_bytes_per_parameter_and_two_fp32_chunks_of_the_largest_shard(device):
    # training.optimizer.state_dtype bf16 (AdamWBf16Moments): exp_avg and exp_avg_sq in bf16, updated
    # in fp32 one chunk of a shard at a time: the largest here is the embedding's 512 x 128 / 2.
    step = fsdp.moments(workload(optimizer_state_dtype="bf16"), device=device)["optimizer step"]
    assert step["optimizer_states"] == 4 * P_RANK // 2
    assert step["parameters"] == 4 * P_RANK // 2 + 4 * 256 * 16  # the fp32 masters stay
    assert step["optimizer_temp"] == 2 * 4 * 512 * 128 // 2


def test_fsdp_shards_over_dp_shard_times_context_not_replicas():
    hsdp = fsdp.moments(workload(layout=Layout(data_replicate=2, data_shard=2, context=2)))["optimizer step"]
    assert hsdp["optimizer_states"] == 8 * P_RANK // 4


def test_cpu_runs_foreach_adamw_with_a_parameter_sized_temporary():
    step = fsdp.moments(workload(), device="cpu")["optimizer step"]
    assert step["optimizer_temp"] == 4 * P_RANK // 2


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("none", 4 * SAVED_PER_LAYER + HEAD + ROPE),  # 3,461,376
        ("selective", 2 * SAVED_PER_LAYER + 2 * LAYER_INPUT + HEAD + ROPE),  # layers 1 and 3 recompute
        ("full", 4 * LAYER_INPUT + HEAD + ROPE),
    ],
)
def test_saved_activations_per_checkpointing_mode(mode, expected):
    assert fsdp.saved_activation_bytes(workload(activation_checkpointing=mode)) == expected


def test_loss_backward_holds_every_activation_the_gathered_root_and_one_chunk_of_logits():
    moment = fsdp.moments(workload())["loss backward"]
    assert moment["activations"] == 4 * SAVED_PER_LAYER + ROPE + HEAD
    # gathered embedding + output + norm, the output weight's bf16 gradient, and the last
    # block prefetched by the root's pre-backward hook
    assert moment["fsdp_buffers"] == 2 * P_ROOT + 2 * 512 * 128 + 2 * P_BLOCK
    # chunk = max(ceil(256 / ceil(512 / 128)), min(256, 1024)) = 256 tokens x 512 vocab,
    # 10 bytes per value in backward, plus grad_h
    assert moment["loss"] == 10 * 256 * 512 + 2 * 256 * 128


def test_first_block_in_backward_holds_its_prefetched_neighbour_and_mlp_gradients():
    moment = fsdp.moments(workload())["backward of layer 3"]
    assert moment["activations"] == 4 * SAVED_PER_LAYER + ROPE
    # root, output gradient, this block, the prefetched block and w2's bf16 weight gradient
    assert moment["fsdp_buffers"] == 2 * P_ROOT + 2 * 512 * 128 + 2 * 2 * P_BLOCK + 2 * 128 * 352
    # the product made again, gradients of w2's input, silu(w1 x) and w3 x less the product
    # once w2 is through, plus the incoming gradient
    assert moment["working"] == PRODUCT + 2 * 2 * 256 * 352 + 2 * 256 * 128
    assert moment["gradients"] == 0


def test_second_block_adds_the_previous_reduce_scatter_buffer_and_gradient_shards():
    moment = fsdp.moments(workload())["backward of layer 2"]
    assert moment["fsdp_buffers"] == 2 * P_ROOT + 2 * 512 * 128 + 2 * 2 * P_BLOCK + 4 * P_BLOCK + 2 * 128 * 352
    assert moment["gradients"] == 4 * P_BLOCK // 2


def test_gradient_accumulation_keeps_every_gradient_shard():
    moment = fsdp.moments(workload(grad_accum_steps=4))["backward of layer 3"]
    assert moment["gradients"] == 4 * P_RANK // 2


def test_tensorwise_fp8_all_gathers_float8_weights_and_casts_w2_input_through_fp32():
    moment = fsdp.moments(workload(fp8=True))["backward of layer 3"]
    linear = P_BLOCK - 2 * 128
    gathered = linear + 2 * 2 * 128  # 1 byte per linear weight, bf16 norms
    # w2's backward casts its T x f input, made again, to float8 (9 bytes per value) beside its
    # bf16 input gradient (2 x T x f) and two float8 copies of its T x h incoming gradient;
    # that beats the bf16 MLP backward (3 x 2 x T x f + 2 x T x h + w2's gradient).
    assert moment["fp8"] == PRODUCT + 9 * 256 * 352 + 2 * 256 * 352 + 2 * 256 * 128
    assert moment["working"] == 2 * 256 * 128
    assert moment["fsdp_buffers"] == 2 * P_ROOT + 2 * 512 * 128 + 2 * gathered
    assert moment["activations"] == fsdp.moments(workload())["backward of layer 3"]["activations"]


def test_float8_tensor_parallel_styles_skip_the_backward_cast():
    tp = Layout(tensor=2, data_shard=2)
    kept = fsdp.moments(workload(fp8=True, layout=tp))["backward of layer 3"]
    # The block saves w2's float8 input, so a kept block casts nothing for w2 in backward; it
    # peaks at w1's or w3's cast of its T x f/t output gradient (9 bytes per value), beside the
    # other's output gradient, the full-sequence input gradient and the incoming one's shard.
    assert kept["fp8"] == 9 * 256 * 352 / 2
    assert kept["working"] == 2 * 256 * 352 / 2 + 2 * 256 * 128 + 2 * 128 * 128
    recomputed = fsdp.moments(workload(fp8=True, layout=tp, activation_checkpointing="full"))["backward of layer 3"]
    # A checkpointed block's recomputation casts w2's input again (9 bytes per value) beside the
    # bf16 product (1 more than the float8 copy the saved set counts), with the float8-gathered
    # incoming gradient (T x h) and the MLP's bf16 input shard (`recomputed_cast`).
    assert recomputed["fp8"] == (9 + 1) * 256 * 352 / 2 + 256 * 128 + 2 * 128 * 128


def test_gloo_has_no_float8_all_gather():
    cpu = fsdp.moments(workload(fp8=True), device="cpu")["loss backward"]
    assert cpu["fsdp_buffers"] == 2 * P_ROOT + 2 * 512 * 128 + 2 * P_BLOCK


def test_tensor_parallel_keeps_gathered_norm_outputs_and_shards_the_rest():
    moments = fsdp.moments(workload(layout=Layout(tensor=2, data_shard=2)))
    moment = moments["backward of layer 3"]
    # per layer: two norm outputs gathered to the full 256 tokens: (256 - 128) x 128 x 2 each
    assert moment["tp_buffers"] == 4 * 2 * 2 * 128 * 128
    saved_tp = 256 * (2 * (2 * 128 / 2 + 2 * 128 / 2 + (128 + 2 * 64) / 2 + 128 / 2) + 4 + 16 + 2 * 2 * 352 / 2)
    assert moment["activations"] == round(4 * saved_tp + ROPE)


def test_tp_saved_inputs_shard_keeps_no_gathered_norm_outputs_in_kept_blocks():
    # parallel/regather.py: the (t - 1) other shards of both gathered inputs are not kept; the
    # rest of the block is unchanged.
    layout = Layout(tensor=2, data_shard=2)
    gathered = fsdp.moments(workload(layout=layout))["backward of layer 3"]
    shard = fsdp.moments(workload(layout=layout, tp_saved_inputs="shard"))["backward of layer 3"]
    assert shard["tp_buffers"] == 0
    assert shard["activations"] == gathered["activations"]
    assert gathered["tp_buffers"] - shard["tp_buffers"] == 4 * 2 * 2 * 128 * 128


def test_tp_saved_inputs_shard_changes_nothing_under_full_checkpointing():
    # Checkpointed blocks are not given the regathering styles: their recomputation keeps what it gathers.
    layout = Layout(tensor=2, data_shard=2)
    full = {"layout": layout, "activation_checkpointing": "full"}
    assert fsdp.moments(workload(**full, tp_saved_inputs="shard")) == fsdp.moments(workload(**full))


def test_context_parallel_keeps_the_whole_sequence_k_and_v_only_where_the_masked_path_runs():
    # 128 local tokens; K and V of the other rank's 128 tokens, 64 wide each, per layer. The
    # fused path regathers them in backward instead (test_attention_memory.py).
    masked = fsdp.moments(workload(layout=Layout(context=2), document_masking=True))["backward of layer 3"]
    assert masked["cp_buffers"] == 4 * 2 * 128 * 2 * 64
    assert fsdp.moments(workload(layout=Layout(context=2)))["backward of layer 3"]["cp_buffers"] == 0


def test_pipeline_rank_holds_p_micro_batches_all_blocks_gathered_and_fp32_accumulated_grads():
    # torch.distributed.pipelining's own accumulation (grad_accumulation sync_last_gathered)
    w = workload(layout=Layout(pipeline=2, data_shard=2), grad_accum_steps=4, grad_accumulation="sync_last_gathered")
    moments = fsdp.moments(w, rank=0)
    first, second = moments["first backward (pipeline)"], moments["second backward (pipeline)"]
    # rank 0 of 2 in 1F1B: 2 micro-batches of its 2 layers in flight, and each one's output
    # (256 x 128, bf16), which the stage keeps for that micro-batch's backward, and its RoPE
    # table cast to bf16 (256 x head_dim 16), which every layer's rotation saves
    assert first["activations"] == 2 * 2 * SAVED_PER_LAYER + 2 * 2 * 256 * 128 + 2 * 2 * 256 * 16
    gathered = 2 * 2 * P_BLOCK + 2 * 512 * 128  # its blocks and the embedding, bf16
    assert first["fsdp_buffers"] == gathered + 2 * 128 * 352
    # after the first backward: fp32 unsharded gradients of everything the rank holds
    assert second["fsdp_buffers"] == first["fsdp_buffers"] + 4 * (2 * P_BLOCK + 512 * 128)
    # one gradient receive buffer, for the output of the micro-batch in backward
    assert first["working"] == PRODUCT + 2 * 2 * 256 * 352 + 2 * 256 * 128 + 2 * 256 * 128


def test_pipeline_rank_under_sync_each_holds_fp32_gradient_shards_and_no_unsharded_gradients():
    # grad_accumulation sync_each under PP (pipeline.py's _GradientSyncEachMicroBatch): after the
    # first backward the rank's gradients are in their fp32 shards (over data_shard 2), and the
    # gathered blocks stay as they were.
    w = workload(layout=Layout(pipeline=2, data_shard=2), grad_accum_steps=4, grad_accumulation="sync_each")
    moments = fsdp.moments(w, rank=0)
    first, second = moments["first backward (pipeline)"], moments["second backward (pipeline)"]
    assert first["gradients"] == 0 and second["fsdp_buffers"] == first["fsdp_buffers"]
    assert second["gradients"] == 4 * (2 * P_BLOCK + 512 * 128) / 2
    gathered = fsdp.moments(replace(w, grad_accumulation="sync_last_gathered"), rank=0)["second backward (pipeline)"]
    assert gathered["fsdp_buffers"] - second["fsdp_buffers"] == 4 * (2 * P_BLOCK + 512 * 128)


def test_peak_is_the_largest_moment_plus_device_overheads():
    w = workload()
    stage = fsdp.stage_peaks(w)[0]
    largest = max(fsdp.moments(w).values(), key=lambda b: sum(b.values()))
    assert stage.allocated_bytes == sum(largest.values())
    assert stage.breakdown["cuda_context"] == CUDA_CONTEXT_BYTES
    assert stage.breakdown["nccl"] == 2 * NCCL_BYTES_PER_COMMUNICATOR  # world + FSDP group
    assert stage.breakdown["fragmentation"] == round(FRAGMENTATION_FRACTION * stage.allocated_bytes)
    estimate = estimate_memory(w, P5)
    assert estimate.allocated_bytes == sum(estimate.breakdown[c] for c in ALLOCATED_COMPONENTS)
