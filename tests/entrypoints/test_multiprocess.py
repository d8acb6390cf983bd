"""The entrypoints on several gloo processes agree with one process (fixture `runs`, conftest.py)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from launcher.contract.metrics import SAGEMAKER_METRIC_NAMES

from .entrypoint_jobs import ACCUMULATION, CP_CASES, FP8_STEPS, LAYOUTS, UNEVEN, VALIDATED

pytestmark = pytest.mark.torchrun

TOLERANCE = 1e-4


def assert_same_model(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        diff = (got[name] - want[name]).abs().max().item()
        assert diff <= atol, f"{name} differs by {diff:.3g}"


def test_reference_trains(runs):
    losses = runs.reference.losses()
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process_losses(runs, layout):
    got, want = runs.layouts[layout].losses(), runs.reference.losses()
    assert got == pytest.approx(want, abs=TOLERANCE)


# fp32 on gloo: the same per-micro-batch means, summed over the ranks in another order.
VALIDATION_TOLERANCE = 1e-6


def test_validation_loss_matches_the_single_process_value_under_dp_tp_cp_and_pp(runs):
    want = {m["step"]: m for m in runs.reference.metrics() if "val_loss" in m}
    assert sorted(want) == [2, 3]  # every_steps 2, and after the last step
    assert want[3]["val_loss"] != want[2]["val_loss"]  # the model changed between them
    for layout in VALIDATED:
        got = {m["step"]: m for m in runs.layouts[layout].metrics() if "val_loss" in m}
        assert sorted(got) == [2, 3], layout
        for step in got:
            assert abs(got[step]["val_loss"] - want[step]["val_loss"]) <= VALIDATION_TOLERANCE, (layout, step)
            assert got[step]["val_perplexity"] == pytest.approx(math.exp(got[step]["val_loss"]), rel=1e-12)
    # The metric lines SageMaker reads: 2 evaluations of each validated 4-rank layout.
    assert len(re.findall(r"^metrics step=[23] .* val_loss=\S+ val_perplexity=\S+$", runs.stdout, re.M)) == 8


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process_final_parameters(runs, layout):
    assert_same_model(runs.layouts[layout].final_model(3), runs.reference.final_model(3), TOLERANCE)


def test_grad_norm_and_lr_are_layout_independent(runs):
    want = runs.reference.metrics()
    for layout, job in runs.layouts.items():
        for got_step, want_step in zip(job.metrics(), want, strict=True):
            assert got_step["grad_norm"] == pytest.approx(want_step["grad_norm"], abs=TOLERANCE), layout
            assert got_step["lr"] == want_step["lr"], layout


@pytest.mark.parametrize("name", UNEVEN)
def test_uneven_pipeline_stages_match_single_process(runs, name):
    job, reference = runs.uneven[name], runs.five_layers
    assert job.losses() == pytest.approx(reference.losses(), abs=TOLERANCE)
    for got, want in zip(job.metrics(), reference.metrics(), strict=True):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], abs=TOLERANCE)
    assert_same_model(job.final_model(3), reference.final_model(3), TOLERANCE)


# The same sums in another order: gradients summed over micro-batches before the reduce-scatter.
SAME_SUMS = 1e-5
# Which sync_each run each accumulation job is compared with: the same layout.
SYNC_EACH_OF = {
    "hsdp_sync_last_gathered": "data_replicate2_data_shard2",
    "pp2_dp_shard2_sync_last_gathered": "pp2_dp_shard2",
    "pp2_tp2_interleaved_sync_last_gathered": "pp2_tp2_interleaved",
}


@pytest.mark.parametrize("name", [n for n in ACCUMULATION if "bf16" not in n])
def test_accumulation_modes_match_sync_each_losses_grad_norms_and_parameters(runs, name):
    job, sync_each = runs.accumulation[name], runs.layouts[SYNC_EACH_OF.get(name, "dp_shard2_tp2")]
    assert json.loads(job.config.read_text())["parallel"]["grad_accum_steps"] >= 2
    assert job.losses() == pytest.approx(sync_each.losses(), abs=SAME_SUMS)
    got_norms = [m["grad_norm"] for m in job.metrics()]
    assert got_norms == pytest.approx([m["grad_norm"] for m in sync_each.metrics()], abs=SAME_SUMS)
    assert_same_model(job.final_model(3), sync_each.final_model(3), SAME_SUMS)
    assert_same_model(job.final_model(3), runs.reference.final_model(3), TOLERANCE)


def test_bf16_gradient_reduction_trains_close_to_fp32(runs):
    job, fp32 = runs.accumulation["dp_shard2_tp2_sync_last_bf16_reduce"], runs.layouts["dp_shard2_tp2"]
    # bf16 keeps 8 bits of mantissa, so each gradient value moves by up to 0.4%; over three
    # steps the losses moved by about 1e-6 and the gradient norms by about 5e-5 (relative).
    assert job.losses() == pytest.approx(fp32.losses(), rel=1e-4)
    got_norms = [m["grad_norm"] for m in job.metrics()]
    assert got_norms == pytest.approx([m["grad_norm"] for m in fp32.metrics()], rel=1e-3)
    assert job.losses() != fp32.losses()  # the gradients really went through bf16


def test_tied_embeddings_under_tensor_parallel_match_single_process(runs):
    assert runs.tied_tp.losses() == pytest.approx(runs.tied_reference.losses(), abs=TOLERANCE)
    got, want = runs.tied_tp.final_model(3), runs.tied_reference.final_model(3)
    assert "output.weight" not in want
    assert_same_model(got, want, TOLERANCE)


def test_compiled_blocks_that_regather_their_inputs_match_single_process(runs):
    # parallel.tp_saved_inputs shard under training.compile: the attention's and MLP's forwards
    # compiled, their regathering hooks eager around them (parallelize.compile_blocks).
    job = runs.compiled_shard_saved
    assert job.losses() == pytest.approx(runs.reference.losses(), abs=TOLERANCE)
    assert_same_model(job.final_model(3), runs.reference.final_model(3), TOLERANCE)


def test_a_saved_float8_input_is_rebuilt_from_its_regathered_shard(runs):
    found = runs.float8_regather
    assert found["tokenised"] and found["other_passed_through"]
    assert found["types"] == ["DTensor", "Float8TrainingTensor"]
    assert found["placements"] == ["Replicate"] and found["shape"] == [16, 16]
    assert found["same_scale"] and found["same_bytes"] and found["max_abs_error"] == 0


def test_four_rank_checkpoint_resumes_on_two_ranks_like_the_uninterrupted_run(runs):
    uninterrupted = runs.layouts["dp_shard2_tp2"]
    resumed = runs.resumed
    # The resumed job starts after step 2 and runs step 3 only.
    assert [m["step"] for m in resumed.metrics()] == [3]
    assert resumed.losses()[0] == pytest.approx(uninterrupted.losses()[2], abs=1e-5)
    assert resumed.metrics()[0]["lr"] == uninterrupted.metrics()[2]["lr"]
    assert_same_model(resumed.final_model(3), uninterrupted.final_model(3), 1e-5)
    assert_same_model(resumed.final_model(3), runs.reference.final_model(3), TOLERANCE)


def test_bf16_moments_resume_a_checkpoint_of_fp32_moments_and_save_their_own(runs):
    from torch.distributed.checkpoint import FileSystemReader

    uninterrupted, resumed = runs.layouts["dp_shard2_tp2"], runs.resumed_bf16_moments
    # Step 3's loss comes from the loaded weights alone; its update from the fp32 moments loaded
    # into bf16 ones (rounded, 2^-9 relative), so the weights differ from the uninterrupted run's
    # by a fraction of one step's update (lr 3e-4 at most) and no more.
    assert resumed.losses()[0] == pytest.approx(uninterrupted.losses()[2], abs=1e-5)
    got, want = resumed.final_model(3), uninterrupted.final_model(3)
    assert_same_model(got, want, 3e-6)
    assert any(not torch.equal(got[name], want[name]) for name in want)  # the moments really were rounded
    metadata = FileSystemReader(str(resumed.checkpoint_dir / "step-00000003")).read_metadata()
    moments = {k: v for k, v in metadata.state_dict_metadata.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments and {v.properties.dtype for v in moments.values()} == {torch.bfloat16}
    weights = [v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")]
    assert {v.properties.dtype for v in weights} == {torch.float32}


def test_checkpoints_are_marked_complete_and_keep_the_newest(runs):
    directory = runs.layouts["dp_shard2_tp2"].checkpoint_dir
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["step-00000002", "step-00000003"]
    for name in names:
        # One host of 4 ranks: one marker, and each rank's shard and RNG state.
        path = directory / name
        marker = json.loads((path / "COMPLETE.node-0-of-1").read_text())
        assert marker["step"] == int(name[-8:])
        # It records the size of every file the host wrote: what resume checks before loading.
        files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith("COMPLETE.")]
        assert marker["files"] == {p.relative_to(path).as_posix(): p.stat().st_size for p in files}
        assert sorted(p.name for p in (directory / name / "rng").iterdir()) == [f"rank-{r:05d}.pt" for r in range(4)]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads", [f"{h}/{kv}" for h, kv in CP_CASES])
@pytest.mark.parametrize("regather", [True, False])
def test_context_parallel_attention_matches_full_attention(runs, cp, heads, regather):
    result = runs.cp_attention[cp]
    assert result["cp"] == cp
    errors = result["max_abs_error"][f"{heads} regather={regather}"]
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads", [f"{h}/{kv}" for h, kv in CP_CASES])
def test_regathering_attention_saves_only_the_ranks_own_kv(runs, cp, heads):
    # Saved for backward, by storage: q, K and V as the rank holds them, the output and the LSE;
    # kept gathered, K and V of the whole sequence instead: (cp - 1) x the rank's K and V more.
    heads_q, kv_heads = (int(n) for n in heads.split("/"))
    batch, local_tokens, dim = 2, 8 * 3, 16  # multirun.run_cp_attention: 8 x cp x 3 tokens over cp ranks
    own_kv = 2 * 4 * batch * kv_heads * local_tokens * dim
    saved = runs.cp_attention[cp]["saved_bytes"]
    regathered, kept = saved[f"{heads} regather=True"], saved[f"{heads} regather=False"]
    assert kept - regathered == (cp - 1) * own_kv, saved
    # What remains: q, K, V and the output in fp32, the fp32 LSE.
    assert regathered == 4 * batch * local_tokens * (2 * heads_q * dim + 2 * kv_heads * dim + heads_q), saved


def test_fp8_trains_on_cpu_with_decreasing_loss(runs):
    losses = runs.fp8.losses()
    assert len(losses) == FP8_STEPS and all(math.isfinite(x) for x in losses)
    # Noise between steps is allowed; the trend over the run is not optional.
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.1, losses


def test_fp8_under_tensor_parallel_adds_no_collectives_and_still_multiplies_in_float8(runs):
    # One forward and backward of the same TP 2 model in fp32 and in FP8 (torchao, tensorwise).
    # Scaling each shard by its own amax needs no all-reduce per cast (parallel/float8_shards.py);
    # scaling by the whole tensor's cost four per linear and micro-batch.
    fp32, fp8 = runs.fp8_collectives["fp32"], runs.fp8_collectives["fp8"]
    assert fp8["gloo:all_reduce"] == fp32["gloo:all_reduce"] > 0, runs.fp8_collectives
    assert fp8["gloo:all_gather"] == fp32["gloo:all_gather"], runs.fp8_collectives
    # Three float8 matmuls (output, grad_input, grad_weight) for each of a block's 7 linears.
    layers = json.loads(runs.fp8.config.read_text())["model"]["num_layers"]
    assert fp8["float8_matmuls"] == 3 * 7 * layers and fp32["float8_matmuls"] == 0, runs.fp8_collectives
    assert fp8["float8_matmul_operands"] == ["torch.float8_e4m3fn", "torch.float8_e5m2"], runs.fp8_collectives
    assert abs(fp8["loss"] - fp32["loss"]) < 1e-3 * fp32["loss"], runs.fp8_collectives


def test_final_parameters_are_finite(runs):
    for job in [runs.reference, *runs.layouts.values()]:
        for name, tensor in job.final_model(3).items():
            assert torch.isfinite(tensor).all(), (job.name, name)


def test_vocab_parallel_fused_loss_matches_the_unfused_loss(runs):
    result = runs.vocab_parallel_loss
    assert result["tp"] == 2
    assert max(result["max_abs_error"].values()) <= 1e-5, result


def test_vocab_parallel_embedding_matches_nn_embedding_and_holds_only_its_rows(runs):
    """37 rows over tp 2 (19 | 18): the output slice and the whole weight gradient equal
    nn.Embedding's, and each rank's gradient storage holds its own rows, not the vocabulary
    (DTensor's RowwiseParallel kept the shard as a view of a dense 37-row gradient)."""
    result = runs.vocab_parallel_loss
    assert max(result["embedding_max_abs_error"].values()) <= 1e-6, result
    assert result["embedding_grad_rows"] == [19, 18]


KEY_OF_METRIC_NAME = {name: key for key, name in SAGEMAKER_METRIC_NAMES.items()}


def test_metrics_lines_parse_with_the_sagemaker_metric_definitions(runs, metric_definitions):
    lines = [line for line in runs.stdout.splitlines() if line.startswith("metrics ")]
    records = [m for job in [*runs.layouts.values(), *runs.accumulation.values()] for m in job.metrics()]
    records += (
        runs.resumed.metrics()
        + runs.resumed_bf16_moments.metrics()
        + runs.fp8.metrics()
        + runs.tied_tp.metrics()
        + runs.compiled_shard_saved.metrics()
    )
    records += [m for job in runs.uneven.values() for m in job.metrics()]
    assert len(lines) == len(records) > 20
    for line, record in zip(lines, records, strict=True):
        for definition in metric_definitions:
            key = KEY_OF_METRIC_NAME[definition["Name"]]
            match = re.search(definition["Regex"], line)
            if key not in record:  # validation, on the steps that evaluated only
                assert match is None, line
                continue
            if record[key] is None:
                # mfu=nan (no known peak, CPU): CloudWatch stores no NaN, so no datapoint is right too.
                assert match is None or match.group(1) == "nan", line
                continue
            assert match, f"{definition['Name']} does not parse {line!r}"
            assert float(match.group(1)) == pytest.approx(record[key], rel=1e-5, abs=1e-12)
