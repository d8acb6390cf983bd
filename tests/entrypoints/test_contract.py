"""The contract both sides read: one stage split, one set of layout rules, one float8 condition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.contract.config import ConfigError, JobConfig
from launcher.contract.fp8 import collective_backend, float8_all_gather
from launcher.contract.layout import (
    Layout,
    checkpointed_layers,
    layers_by_rank,
    rank_stages,
    seq_len_divisor,
    stage_layer_counts,
    stage_layers,
)
from launcher.recipe import Recipe
from launcher.recipe.rules import layout_problems
from launcher.resolve import resolve

REPO = Path(__file__).resolve().parents[2]


def test_even_split_gives_each_stage_a_contiguous_run_and_each_rank_its_loop_stages():
    layout = Layout(pipeline=8)
    assert [stage_layers(32, layout, s) for s in (0, 3, 7)] == [range(0, 4), range(12, 16), range(28, 32)]
    interleaved = Layout(pipeline=4, virtual_stages=2)
    assert rank_stages(1, interleaved) == [1, 5] and layers_by_rank(32, interleaved) == [8] * 4


def test_balanced_split_gives_the_end_stages_a_layer_less_for_the_embedding_and_the_loss():
    # Llama 3.1 405B's 126 layers on 8 stages, as torchtitan splits them.
    assert stage_layer_counts(126, 8) == [15] + [16] * 6 + [15]
    assert stage_layers(126, Layout(pipeline=8), 7) == range(111, 126)
    assert stage_layer_counts(126, 16) == [7] + [8] * 14 + [7]
    assert layers_by_rank(126, Layout(pipeline=8)) == [15] + [16] * 6 + [15]


def test_the_end_stages_may_hold_only_the_embedding_and_only_the_output_layer():
    # The Llama 3 paper's 405B on 16 ranks x 8 stages (arXiv 2407.21783, section 3.3.2): "the first
    # model chunk on the first stage has only the embedding, and the last model chunk on the last
    # stage has only output projection and loss calculation".
    assert stage_layer_counts(126, 128) == [0] + [1] * 126 + [0]
    layout = Layout(pipeline=16, virtual_stages=8)
    assert stage_layers(126, layout, 0) == range(0, 0) and stage_layers(126, layout, 127) == range(126, 126)
    assert layers_by_rank(126, layout) == [7] + [8] * 14 + [7]
    assert stage_layer_counts(4, 6) == [0, 1, 1, 1, 1, 0] and stage_layer_counts(1, 2) == [0, 1]
    assert stage_layer_counts(5, 2, (0, 5)) == [0, 5]
    for counts in ((1, 0, 4), (3, -1, 3)):
        with pytest.raises(ValueError, match="with a layer on every stage but the end ones"):
            stage_layer_counts(5, 3, counts)
    with pytest.raises(ValueError, match="3 layers cannot fill 6 pipeline stages"):
        stage_layer_counts(3, 6)


@pytest.mark.parametrize(
    "layers, stages, expected",
    [
        (32, 8, [4] * 8),  # an even split stays even
        (80, 1, [80]),
        (5, 2, [2, 3]),  # the later stage keeps the extra layer: rank 0 holds the most micro-batches
        (5, 4, [1, 1, 2, 1]),
        (80, 3, [26, 27, 27]),
        (4, 4, [1, 1, 1, 1]),
    ],
)
def test_balanced_split_minimises_the_heaviest_stage_counting_embedding_and_output_as_a_layer(layers, stages, expected):
    counts = stage_layer_counts(layers, stages)
    assert counts == expected and sum(counts) == layers and min(counts) >= 1
    carried = [0] * stages
    carried[0] += 1
    carried[-1] += 1
    heaviest = max(c + w for c, w in zip(counts, carried, strict=True))
    assert heaviest == -(-(layers + 2) // stages)  # no split could do better


def test_selective_checkpointing_takes_every_other_layer_of_each_pipeline_rank():
    assert checkpointed_layers("selective", 8, Layout()) == {1, 3, 5, 7}
    assert checkpointed_layers("full", 3, Layout()) == {0, 1, 2} and checkpointed_layers("none", 3, Layout()) == set()
    # 126 layers on 16 x 8 one-layer stages: rank r holds layers r - 1, r + 15, ... (none on stage 0
    # or 127); by global id, the odd layers would all be on the even ranks.
    layout = Layout(pipeline=16, virtual_stages=8)
    chosen = checkpointed_layers("selective", 126, layout)
    for rank in range(16):
        held = [layer for s in rank_stages(rank, layout) for layer in stage_layers(126, layout, s)]
        assert [layer in chosen for layer in held] == [i % 2 == 1 for i in range(len(held))], rank


def test_an_explicit_split_overrides_the_balance_and_reaches_every_rank():
    layout = Layout(pipeline=2, virtual_stages=2, pipeline_layers=(3, 1, 1, 3))
    assert [stage_layers(8, layout, s) for s in range(4)] == [range(0, 3), range(3, 4), range(4, 5), range(5, 8)]
    assert layers_by_rank(8, layout) == [4, 4]
    with pytest.raises(ValueError, match=r"pipeline_layers \[3, 1\] is not 2 layer counts summing to 5"):
        stage_layer_counts(5, 2, (3, 1))
    with pytest.raises(ValueError, match="1 layers cannot fill 4 pipeline stages"):
        stage_layer_counts(1, 4)


def test_the_resolved_config_carries_pipeline_layers_to_the_entrypoints():
    recipe = Recipe.load(
        REPO / "recipes" / "tiny-cpu.yaml",
        {"parallel.pipeline": 2, "parallel.tensor": 1, "parallel.pipeline_layers": [1, 3]},
    )
    resolved = resolve(recipe).concrete.resolved().to_dict()
    assert resolved["parallel"]["pipeline_layers"] == [1, 3]
    cfg = JobConfig.from_dict(resolved)
    assert cfg.parallel.pipeline_layers == (1, 3) and layers_by_rank(4, cfg.parallel) == [1, 3]
    tiny = resolve(Recipe.load(REPO / "recipes" / "tiny-cpu.yaml")).concrete
    assert "pipeline_layers" not in tiny.resolved().to_dict()["parallel"]
    resolved["parallel"]["pipeline_layers"] = [2, 3]
    with pytest.raises(
        ConfigError, match=r"^parallel.pipeline_layers: \[2, 3\] sums to 5, but the model has 4 layers$"
    ):
        JobConfig.from_dict(resolved)


def test_sequence_divisor_is_2cp_tp_under_context_parallelism_and_tp_without():
    assert (seq_len_divisor(1, 4), seq_len_divisor(2, 4), seq_len_divisor(8, 1)) == (4, 16, 16)


def test_float8_gathers_only_tensorwise_on_nccl():
    assert collective_backend("cuda") == "nccl" and collective_backend("cpu") == "gloo"
    assert float8_all_gather(fp8=True, fp8_recipe="tensorwise", backend="nccl")
    assert not float8_all_gather(fp8=True, fp8_recipe="tensorwise", backend="gloo")
    assert not float8_all_gather(fp8=True, fp8_recipe="rowwise", backend="nccl")
    assert not float8_all_gather(fp8=False, fp8_recipe="tensorwise", backend="nccl")


@pytest.mark.parametrize(
    "change",
    [{"training": {"seq_len": 129}}, {"parallel": {"pipeline_schedule": "interleaved_1f1b"}}],
    ids=["seq-len", "interleaving-without-virtual-stages"],
)
def test_the_entrypoints_refuse_a_layout_with_the_recipe_rules_own_message(change):
    recipe = Recipe.load(REPO / "recipes" / "tiny-cpu.yaml")
    broken = resolve(recipe).concrete.resolved().to_dict()
    for section, values in change.items():
        broken[section].update(values)
    training, parallel = broken["training"], broken["parallel"]
    (expected,) = layout_problems(
        recipe.layout,
        recipe.arch,
        seq_len=training["seq_len"],
        global_batch_size=training["global_batch_size"],
        micro_batch_size=training["micro_batch_size"],
        gpus_per_node=recipe.hardware.procs_per_node,
        schedule=parallel["pipeline_schedule"],
    )
    with pytest.raises(ConfigError) as refused:
        JobConfig.from_dict(broken)
    assert str(refused.value) == f"{expected.path}: {expected.message}"
    assert "training.seq_len: 129 is not divisible by tensor 2" in str(
        refused.value
    ) or "interleaved_1f1b needs" in str(refused.value)


def test_parallel_config_is_a_layout_and_prints_like_one():
    cfg = resolve(Recipe.load(REPO / "recipes" / "tiny-cpu.yaml")).concrete.resolved()
    assert isinstance(cfg.parallel, Layout) and str(cfg.parallel) == "dp_shard2xtp2"


# --- which rank failed first (launcher.contract.failure), shared by the local runner and the bootstrap


def _torchrun_report(tmp_path, failures, root):
    """torchrun's failure report, in its own template's layout, with one error file per rank;
    `failures` maps a rank to (message, raise time) or (message, raise time, exit code; 1 if not given)."""

    def entry(index, rank):
        message, raised_at, *exitcode = failures[rank]
        extra = {"py_callstack": f'Traceback:\n  File "train.py", line {rank}, in main\n{message}', "timestamp": "1"}
        if raised_at is not None:
            extra["raised_at"] = f"{raised_at:.6f}"
        path = tmp_path / f"error-{rank}.json"
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))
        return (
            f"[{index}]:\n  time      : 2026-11-30_06:00:00\n  host      : ip-10-0-0-{11 + rank // 2}\n"
            f"  rank      : {rank} (local_rank: {rank % 2})\n  exitcode  : {exitcode[0] if exitcode else 1} (pid: {100 + rank})\n"
            f"  error_file: {path}\n  traceback : {message}"
        )

    others = "\n".join(entry(i, r) for i, r in enumerate(failures, 1) if r != root)
    text = f"{'=' * 20}\ntrain.py FAILED\n{'-' * 20}\nFailures:\n{others}\n{'-' * 20}\n"
    text += f"Root Cause (first observed failure):\n{entry(0, root)}\n{'=' * 20}"
    return text.splitlines()


def test_the_first_failure_is_the_rank_that_raised_first_not_torchruns_first_exit(tmp_path):
    from launcher.contract.failure import first_failure

    closed = "RuntimeError: Connection closed by peer"
    lines = _torchrun_report(tmp_path, {0: ("ValueError: bad shard", 10.2), 2: (closed, 10.5), 3: (closed, 10.3)}, 3)
    first = first_failure(lines)
    assert (first.rank, first.host, first.exitcode, first.headline) == (0, "ip-10-0-0-11", 1, "ValueError: bad shard")
    untimed = _torchrun_report(tmp_path, {0: ("ValueError: bad shard", None), 3: (closed, None)}, 3)
    assert first_failure(untimed).rank == 3  # without raise times: torchrun's root cause


def test_the_bootstrap_failure_file_names_the_rank_that_raised_first(tmp_path):
    from entrypoints.bootstrap import root_cause

    closed = "RuntimeError: Connection closed by peer"
    lines = _torchrun_report(tmp_path, {1: ("OSError: disk full", 5.0), 2: (closed, 5.1)}, 2)
    text, code = root_cause(str(tmp_path / "missing.json"), lines)
    assert text.splitlines()[0] == "rank 1 on ip-10-0-0-11 failed: OSError: disk full"
    assert code == 1


def test_a_rank_killed_by_torchruns_teardown_after_it_raised_does_not_set_the_exit_status(tmp_path):
    """Both ranks raise the same bad-config error within milliseconds; torchrun SIGTERMs the one
    that had not exited yet. The cause is the first raise, the exit status the one a rank chose."""
    from entrypoints.bootstrap import root_cause

    error = "ConfigError: format: 'x' is not a resolved config format"
    lines = _torchrun_report(tmp_path, {1: (error, 7.001, -15), 0: (error, 7.004, 2)}, 0)
    text, code = root_cause(str(tmp_path / "missing.json"), lines)
    assert text.splitlines()[0] == f"rank 1 on ip-10-0-0-11 failed: {error}"
    assert code == 2
    killed_alone = _torchrun_report(tmp_path, {1: (error, 7.001, -15)}, 1)
    assert root_cause(str(tmp_path / "missing.json"), killed_alone)[1] == 128 + 15  # no rank chose one


@pytest.mark.timeout(30)  # a regression blocks on the FIFO: fail it here, not at the suite's limit
def test_an_error_file_that_is_no_regular_file_reads_as_no_failure_and_never_blocks(tmp_path):
    """The error file's path comes from the log (torchrun's report), which the job writes: a FIFO
    or /dev/zero there would block the reader or never end."""
    import os

    from launcher.contract.failure import RankFailure, read_error_file

    fifo = tmp_path / "error.json"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero"), tmp_path):
        assert read_error_file(path) == RankFailure(rank=None)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"message": {"message": "ValueError: bad", "extraInfo": {"raised_at": 5}}}))
    assert read_error_file(good).message == "ValueError: bad"
