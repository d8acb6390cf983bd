"""`megatron` mode reproduces Fujii et al. 2024's formulas term by term, on hand-computed values.

The model is llama-tiny (h 128, L 4, a 8, k 4, f 352, V 512) at s 256, b 1 on
t 2 x c 2 x p 2 x d 2, 4 micro-batches per step; every expected number below is worked out
by hand in the comment beside it.
"""

from __future__ import annotations

import pytest

from launcher.catalog import models
from launcher.contract.layout import Layout
from launcher.estimate import Workload, estimate_memory, megatron
from launcher.recipe.hardware import hardware_for

TINY = models()["llama-tiny"]
LAYOUT = Layout(tensor=2, context=2, pipeline=2, data_shard=2)


def workload(**changes) -> Workload:
    base = dict(
        arch=TINY,
        layout=LAYOUT,
        seq_len=256,
        micro_batch_size=1,
        grad_accum_steps=4,
        activation_checkpointing="none",
        pipeline_schedule="1f1b",
    )
    return Workload(**(base | changes))


def test_block_params_is_2h2_1_plus_k_over_a_over_t_plus_3hf_over_t_plus_2h():
    # 2*128^2*(1 + 4/8)/2 + 3*128*352/2 + 2*128 = 24576 + 67584 + 256
    assert megatron.block_params(TINY, 2) == 92416


def test_embedding_is_hV_over_t():
    assert megatron.embedding_params(TINY, 2) == 128 * 512 / 2 == 32768


def test_each_end_stage_holds_its_layers_and_one_vocabulary_matrix():
    # (L/p) * 92416 + 32768: the embedding on stage 0, the untied output layer on stage 1
    assert megatron.stage_params(TINY, LAYOUT, 0) == 2 * 92416 + 32768
    assert megatron.stage_params(TINY, LAYOUT, 1) == 2 * 92416 + 32768


def test_a_single_stage_holds_embedding_and_untied_output():
    single = Layout(tensor=2, context=2, data_shard=2)
    assert megatron.stage_params(TINY, single, 0) == 4 * 92416 + 2 * 32768


def test_bytes_per_parameter_is_6_plus_12_over_dc_with_the_distributed_optimizer():
    assert megatron.bytes_per_param(LAYOUT) == 6 + 12 / (2 * 2) == 9
    assert megatron.bytes_per_param(LAYOUT, distributed_optimizer=False) == 18


def test_layer_activations_are_sbh_12_plus_4k_over_a_plus_8f_over_h_over_tc():
    # 256*1*128*(12 + 4*4/8 + 8*352/128)/(2*2) = 32768*36/4
    assert megatron.layer_activation_bytes(TINY, 256, 1, 2, 2) == 294912


def test_materialised_scores_add_5as2b_over_tc():
    assert megatron.attention_score_bytes(TINY, 256, 1, 2, 2) == 5 * 8 * 256 * 256 / 4 == 655360


def test_full_recomputation_keeps_2sbh_over_tc_per_layer():
    assert megatron.layer_input_bytes(TINY, 256, 1, 2, 2) == 2 * 256 * 128 / 4 == 16384


def test_logits_and_their_gradients_are_two_fp32_sbV_over_tc():
    assert megatron.logits_bytes(TINY, 256, 1, 2, 2) == 2 * 4 * 256 * 512 / 4 == 262144


def test_interleaving_factor():
    assert megatron.interleave_factor(4, 2) == 1 + 3 / 8


def test_first_1f1b_stage_keeps_p_microbatches_and_the_last_adds_logits():
    stage0, stage1 = megatron.stage_peaks(workload())
    state_bytes = (2 * 92416 + 32768) * 9  # 1,958,400
    # stage 0: 2 layers x 294912 x p=2 in flight
    assert stage0.peak_bytes == state_bytes + 2 * 294912 * 2 == 3_138_048
    # stage 1: 1 micro-batch in flight, plus logits and their gradients
    assert stage1.peak_bytes == state_bytes + 2 * 294912 + 262144 == 2_810_368
    assert stage0.breakdown["parameters"] == 2 * 217600
    assert stage0.breakdown["gradients"] == 4 * 217600
    assert stage0.breakdown["optimizer_states"] == 12 * 217600 / 4


def test_interleaved_first_stage_multiplies_activations_by_the_published_factor():
    layout = Layout(tensor=2, context=2, pipeline=2, data_shard=2, virtual_stages=2)
    stage0 = megatron.stage_peaks(workload(layout=layout, pipeline_schedule="interleaved_1f1b"))[0]
    assert stage0.breakdown["activations"] == 2 * 294912 * 2 * megatron.interleave_factor(2, 2) == 1_474_560


def test_full_recomputation_keeps_inputs_plus_one_layer_working_set():
    stage0 = megatron.stage_peaks(workload(activation_checkpointing="full"))[0]
    assert stage0.breakdown["activations"] == 2 * 16384 * 2
    assert stage0.breakdown["working"] == 294912


def test_selective_recomputation_drops_only_the_materialised_scores():
    none = megatron.stage_peaks(workload(), attention="materialized")[0]
    selective = megatron.stage_peaks(workload(activation_checkpointing="selective"), attention="materialized")[0]
    assert none.breakdown["activations"] == 2 * (294912 + 655360) * 2
    assert selective.breakdown["activations"] == 2 * 294912 * 2


@pytest.mark.parametrize("fp8", [False, True])
def test_the_estimate_is_the_sum_of_the_terms_with_no_device_overheads(fp8):
    result = estimate_memory(workload(fp8=fp8), hardware_for("ml.p5.48xlarge"), mode="megatron")
    assert result.per_gpu_peak_bytes == result.allocated_bytes == 3_138_048
    assert result.breakdown["cuda_context"] == result.breakdown["nccl"] == result.breakdown["fragmentation"] == 0


def test_llama3_8b_without_parallelism_matches_the_formula_in_gib():
    # h 4096, L 32, a 32, k 8, f 14336, V 128256, s 8192, b 1, one GPU, no sharding:
    # params 32*(2*4096^2*1.25 + 3*4096*14336 + 8192) + 2*4096*128256 = 8,030,257,152
    arch = models()["llama3-8b"]
    params = megatron.stage_params(arch, Layout(), 0)
    assert params == 8_030_257_152
    layer = 8192 * 4096 * (12 + 4 * 8 / 32 + 8 * 14336 / 4096)
    stage = megatron.stage_peaks(
        Workload(arch=arch, layout=Layout(), seq_len=8192, micro_batch_size=1, grad_accum_steps=1),
        distributed_optimizer=False,
    )[0]
    assert stage.peak_bytes == round(2 * params) + round(4 * params) + round(12 * params) + round(32 * layer) + round(
        2 * 4 * 8192 * 128256
    )
