"""`parallel.grad_accumulation` and `parallel.reduce_dtype`: what each mode costs in the fsdp
estimate (hand-computed on llama-tiny, as in test_fsdp.py), what `auto` resolves to, and
`training.compile` dropping the eager FP8 cast temporaries."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.contract.config import ConfigError, JobConfig
from launcher.contract.layout import Layout
from launcher.errors import RecipeError, UsageError
from launcher.estimate import choose_grad_accumulation, estimate_memory, fsdp
from launcher.estimate.workload import Workload
from launcher.recipe import Recipe
from launcher.resolve import resolve

from .test_fsdp import P5, P_BLOCK, P_RANK, P_ROOT, workload

REPO = Path(__file__).resolve().parents[2]
OUTPUT_GRAD = 2 * 512 * 128  # the output weight's bf16 gradient
W2_GRAD = 2 * 128 * 352  # w2's bf16 weight gradient in the MLP backward


def test_sync_last_holds_every_unsharded_fp32_gradient_and_no_shards_before_the_last_reduce():
    moments = fsdp.moments(workload(grad_accum_steps=2, grad_accumulation="sync_last"))
    loss = moments["loss backward"]
    assert loss["gradients"] == 0
    assert loss["fsdp_buffers"] == 2 * P_ROOT + OUTPUT_GRAD + 2 * P_BLOCK + 4 * P_RANK
    # Layer 2, the second block reached: layer 3 is reduce-scattered (its fp32 shard and its
    # reduce-scatter input exist), the other three blocks and the root are still unsharded.
    layer = moments["backward of layer 2"]
    assert layer["gradients"] == 4 * P_BLOCK // 2
    unsharded = 4 * (P_ROOT + 3 * P_BLOCK)
    assert layer["fsdp_buffers"] == 2 * P_ROOT + OUTPUT_GRAD + 2 * 2 * P_BLOCK + unsharded + 4 * P_BLOCK + W2_GRAD


def test_bf16_reduce_halves_unsharded_gradients_and_the_reduce_scatter_input():
    fp32 = fsdp.moments(workload(grad_accum_steps=2, grad_accumulation="sync_last"))["backward of layer 2"]
    bf16 = fsdp.moments(workload(grad_accum_steps=2, grad_accumulation="sync_last", reduce_dtype="bf16"))
    saved = fp32["fsdp_buffers"] - bf16["backward of layer 2"]["fsdp_buffers"]
    # Half of the unsharded gradients and of the reduce-scatter input, and the micro-batch's own
    # output-weight and w2 gradients: in bf16 each is added into the accumulated one as it is
    # made (FSDP2 keeps no fp32 accumulator to add it to later).
    assert saved == 2 * (P_ROOT + 3 * P_BLOCK) + 2 * P_BLOCK + OUTPUT_GRAD + W2_GRAD
    # In the loss's backward both are alive.
    assert bf16["loss backward"]["fsdp_buffers"] - 2 * (P_ROOT + 4 * P_BLOCK) == 2 * P_ROOT + OUTPUT_GRAD + 2 * P_BLOCK
    sync_each = fsdp.moments(workload(reduce_dtype="bf16"))["backward of layer 2"]
    assert sync_each["fsdp_buffers"] == 2 * P_ROOT + OUTPUT_GRAD + 2 * 2 * P_BLOCK + 2 * P_BLOCK + W2_GRAD


def test_sync_last_gathered_keeps_every_block_gathered_until_the_last_backward_reaches_it():
    moments = fsdp.moments(workload(grad_accum_steps=2, grad_accumulation="sync_last_gathered"))
    assert moments["loss forward"]["fsdp_buffers"] == 2 * P_ROOT + 4 * 2 * P_BLOCK + 4 * P_RANK
    # Layer 1: layers 3 and 2 are resharded after their reduce-scatter; 1 and 0 still gathered.
    layer = moments["backward of layer 1"]
    unsharded = 4 * (P_ROOT + 2 * P_BLOCK)
    assert layer["fsdp_buffers"] == 2 * P_ROOT + OUTPUT_GRAD + 2 * 2 * P_BLOCK + unsharded + 4 * P_BLOCK + W2_GRAD


def test_one_micro_batch_costs_the_same_in_every_mode():
    modes = ("sync_each", "sync_last", "sync_last_gathered")
    assert len({str(fsdp.moments(workload(grad_accumulation=mode))) for mode in modes}) == 1


def test_compiled_fp8_has_no_eager_cast_temporaries():
    eager = fsdp.moments(workload(fp8=True))["backward of layer 3"]
    compiled = fsdp.moments(workload(fp8=True, compile=True))["backward of layer 3"]
    assert eager["fp8"] > 0
    assert compiled["fp8"] == 0
    # The block's bf16 MLP backward is its moment again, with w2's weight gradient.
    assert compiled["working"] == 2 * 2 * 256 * 352 + 2 * 256 * 128
    assert compiled["fsdp_buffers"] == eager["fsdp_buffers"] + W2_GRAD


def big(**changes) -> Workload:
    """Llama 3.1 8B at 8K on 8 H100s, 4 micro-batches per step."""
    from launcher.catalog import models

    base = dict(
        arch=models()["llama3.1-8b"], layout=Layout(data_shard=8), seq_len=8192, micro_batch_size=1, grad_accum_steps=4
    )
    return Workload(**(base | changes))


def test_auto_picks_the_fastest_mode_that_fits_under_80_percent():
    # Estimated share of an 80 GB H100, full checkpointing: sync_each 34%, sync_last 68%
    # (+ 32 GB of unsharded fp32 gradients), sync_last_gathered 84% (+ 16 GB of bf16 weights).
    assert choose_grad_accumulation(big(activation_checkpointing="full"), P5) == "sync_last"
    # FSDP over 16 GPUs halves the 16 bytes per parameter of states: all modes fit.
    sixteen = big(activation_checkpointing="full", layout=Layout(data_shard=16))
    assert choose_grad_accumulation(sixteen, P5) == "sync_last_gathered"
    # Selective checkpointing: sync_each 59%, sync_last 94%.
    assert choose_grad_accumulation(big(activation_checkpointing="selective"), P5) == "sync_each"


def test_auto_under_pipelining_weighs_sync_last_gathered_against_sync_each_and_takes_the_least_if_none_fits():
    piped = {"layout": Layout(pipeline=2, data_shard=4), "grad_accum_steps": 4}
    # fp32 gradients over 4 shards: sync_each holds a quarter of the unsharded sum.
    each = estimate_memory(workload(**piped, grad_accumulation="sync_each"), P5).per_gpu_peak_bytes
    last = estimate_memory(workload(**piped, grad_accumulation="sync_last_gathered"), P5).per_gpu_peak_bytes
    assert each < last
    assert choose_grad_accumulation(workload(**piped), P5) == "sync_last_gathered"  # the tiny model fits
    assert choose_grad_accumulation(workload(**piped), P5, threshold=1e-6) == "sync_each"  # nothing fits
    # When nothing fits, the least memory, the faster mode on a tie: fp32 shards over 2 ranks
    # against bf16 unsharded gradients tie, over 1 rank sync_each holds more.
    for shard, reduce_dtype, least in ((2, "fp32", "sync_each"), (2, "bf16", "sync_last_gathered"),
                                       (1, "bf16", "sync_last_gathered")):  # fmt: skip
        kw = {"layout": Layout(pipeline=2, data_shard=shard), "grad_accum_steps": 4, "reduce_dtype": reduce_dtype}
        peaks = {
            m: estimate_memory(workload(**kw, grad_accumulation=m), P5).per_gpu_peak_bytes
            for m in ("sync_each", "sync_last_gathered")
        }
        assert (peaks["sync_each"] < peaks["sync_last_gathered"]) == (least == "sync_each"), (kw, peaks)
        assert choose_grad_accumulation(workload(**kw), P5, threshold=1e-6) == least, kw


def test_an_auto_estimate_is_the_estimate_of_the_chosen_mode():
    auto = estimate_memory(big(activation_checkpointing="full", grad_accumulation="auto"), P5)
    chosen = estimate_memory(big(activation_checkpointing="full", grad_accumulation="sync_last"), P5)
    assert auto.per_gpu_peak_bytes == chosen.per_gpu_peak_bytes


def recipe(**overrides) -> Recipe:
    return Recipe.load(REPO / "recipes" / "llama3-8b-8k.yaml", overrides)


def job_config(recipe: Recipe) -> dict:
    return resolve(recipe).concrete.resolved().to_dict()


def test_resolved_config_carries_the_estimators_choice_never_auto():
    two_nodes = {"parallel.activation_checkpointing": "full", "cluster.instance_count": 2}
    resolved = job_config(recipe(**two_nodes))
    assert resolved["parallel"]["grad_accumulation"] == "sync_last_gathered"
    assert resolved["parallel"]["reduce_dtype"] == "fp32"
    assert JobConfig.from_dict(resolved).parallel.grad_accumulation == "sync_last_gathered"


def test_the_threshold_of_the_resolve_stage_is_the_one_the_choice_fits_under():
    # Full checkpointing on one node: sync_last needs 68% of an H100, sync_each 34%.
    full = recipe(**{"parallel.activation_checkpointing": "full"})
    assert resolve(full).settled["parallel.grad_accumulation"] == "sync_last"
    assert resolve(full, threshold=0.5).settled["parallel.grad_accumulation"] == "sync_each"


def test_a_recipe_that_says_auto_has_no_job_config_of_its_own():
    with pytest.raises(UsageError) as refused:
        recipe().resolved()
    assert str(refused.value) == (
        "llama3-8b-8k: parallel.data_shard, parallel.cp_attention, parallel.grad_accumulation still say auto; "
        "the job config is that of the concrete recipe, launcher.resolve.resolve(recipe).concrete"
    )
    explicit = job_config(recipe(**{"parallel.grad_accumulation": "sync_last", "parallel.reduce_dtype": "bf16"}))
    assert (explicit["parallel"]["grad_accumulation"], explicit["parallel"]["reduce_dtype"]) == ("sync_last", "bf16")


def test_one_micro_batch_resolves_to_sync_each():
    single = recipe(**{"training.global_batch_size": 8, "parallel.grad_accumulation": "sync_last_gathered"})
    assert single.grad_accum_steps == 1
    assert job_config(single)["parallel"]["grad_accumulation"] == "sync_each"


def test_pipeline_parallelism_runs_sync_last_as_sync_last_gathered_and_keeps_sync_each():
    # Pipelining keeps blocks gathered between micro-batches in every mode: sync_last's resharding
    # does not happen, so it runs as sync_last_gathered; sync_each still reduces every micro-batch.
    piped = {"parallel.pipeline": 2}
    assert job_config(recipe(**piped, **{"parallel.grad_accumulation": "sync_each"}))["parallel"][
        "grad_accumulation"
    ] == ("sync_each")
    last = recipe(**piped, **{"parallel.grad_accumulation": "sync_last"})
    assert job_config(last)["parallel"]["grad_accumulation"] == "sync_last_gathered"
    # auto: the faster sync_last_gathered, where it fits (8B at 8K on a p5 does)
    assert job_config(recipe(**piped))["parallel"]["grad_accumulation"] == "sync_last_gathered"


def test_an_unknown_mode_names_the_key_and_the_valid_modes():
    with pytest.raises(RecipeError) as error:
        recipe(**{"parallel.grad_accumulation": "sometimes"})
    text = str(error.value)
    assert "parallel.grad_accumulation" in text
    assert all(mode in text for mode in ("auto", "sync_each", "sync_last", "sync_last_gathered"))


def test_the_entrypoints_refuse_auto_in_a_resolved_config():
    resolved = job_config(recipe())
    resolved["parallel"]["grad_accumulation"] = "auto"
    with pytest.raises(ConfigError, match=r"parallel\.grad_accumulation: 'auto' is not one of sync_each"):
        JobConfig.from_dict(resolved)


def test_gradients_under_tp_hold_only_the_ranks_vocabulary_rows_of_the_embedding():
    # VocabParallelEmbedding (entrypoints/parallel/tensor.py) accumulates the embedding gradient
    # into the rank's V / tp rows: fp32 and bf16 reduce differ by exactly 2 bytes per unsharded
    # value the rank holds, the embedding's shard included and no dense V x h beyond it.
    tp = dict(layout=Layout(tensor=2, data_shard=2), grad_accum_steps=2, grad_accumulation="sync_last")
    bf16 = fsdp.moments(workload(**tp, reduce_dtype="bf16"))["loss forward"]["fsdp_buffers"]
    fp32 = fsdp.moments(workload(**tp))["loss forward"]["fsdp_buffers"]
    p_rank_tp2 = 4 * (P_BLOCK - 256) // 2 + 4 * 256 + P_ROOT // 2 + 64  # linear weights and vocab split; norms not
    assert fp32 - bf16 == 2 * p_rank_tp2
