"""What a pipelined step keeps alive: torch's runtime as it is against entrypoints/parallel/pipeline.py.

One torchrun launch of tests/entrypoints/pipeline_memory_run.py (2 gloo ranks, the interleaved
schedule over 4 stages, 8 micro-batches) follows every receive buffer and every sent tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "tests" / "entrypoints" / "pipeline_memory_run.py"
MICRO_BATCHES = 8

pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("pipeline-memory") / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(RUN),
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(out.with_suffix(f".rank{rank}.json").read_text()) for rank in (0, 1)]


def test_a_gloo_send_keeps_its_tensor_alive_until_its_work_is_dropped(counts):
    # Why torch's runtime, which keeps every send's Work to the end of the step, keeps what it sent.
    assert counts[0]["work"] == {"alive_after_wait_while_work_is_held": True, "alive_after_work_is_dropped": False}


def test_the_entrypoints_pipeline_trains_exactly_as_torchs_runtime(counts):
    last = counts[1]  # rank 1 holds the last stage
    assert last["torch"]["micro_batches"] == MICRO_BATCHES
    assert last["ours"]["loss"] is not None and last["ours"]["loss"] == last["torch"]["loss"]
    assert {c["ours"]["stage_class"] for c in counts} == {"_OnDemandReceiveStage"}


def test_a_sent_output_is_let_go_and_its_backward_still_matches_torchs(counts):
    # _release_sent_outputs: each chunk output a stage sent is one element expanded to its shape
    # by the time its backward runs. The toy stage ends in tanh, which saves its own output, so
    # this also checks that such a backward still finds the values: the gradients are torch's.
    for rank, c in enumerate(counts):
        assert c["ours"]["grads"] == c["torch"]["grads"]
        outputs = c["ours"]["sent_outputs"]
        # Rank 0 sends from stages 0 and 2, rank 1 from stage 1 (stage 3 holds the loss).
        assert len(outputs) == MICRO_BATCHES * (2 if rank == 0 else 1)
        assert all(o == {"shape": [1, 4, 16], "storage_bytes": 4} for o in outputs), outputs


def test_receive_buffers_live_only_around_their_chunk_and_nothing_outlives_the_step(counts):
    for rank, c in enumerate(counts):
        torch_run, ours = c["torch"], c["ours"]
        # torch makes a buffer per micro-batch for each received input and gradient up front
        # (3 per micro-batch on each of these ranks) and keeps them after the step.
        assert torch_run["after_step"] >= 2 * MICRO_BATCHES, (rank, torch_run)
        assert ours["after_step"] == 0, (rank, ours)
        # At its most, the entrypoints' step holds at least those buffers fewer.
        assert ours["peak"] <= torch_run["peak"] - torch_run["after_step"], (rank, c)


def test_sync_each_reduces_every_micro_batchs_gradients_into_the_shards_and_sums_the_same(counts):
    """parallel.grad_accumulation sync_each under PP (pipeline.py's _GradientSyncEachMicroBatch):
    after each micro-batch's backward the gradients are in their shards and none is left
    unsharded; torch's own accumulation (sync_last_gathered) keeps them unsharded until the step's
    REDUCE_GRAD. Both end with the same gradients."""
    for rank, c in enumerate(counts):
        each, last = c["fsdp"]["sync_each"], c["fsdp"]["sync_last_gathered"]
        assert each["sync_each"] and not last["sync_each"]
        assert each["after_each_backward"] and last["after_each_backward"], rank
        assert all(s == {"sharded": True, "unsharded": False} for s in each["after_each_backward"]), (rank, each)
        assert all(s["unsharded"] and not s["sharded"] for s in last["after_each_backward"]), (rank, last)
        assert each["grads"].keys() == last["grads"].keys()
        for name, values in each["grads"].items():
            got, want = torch.tensor(values), torch.tensor(last["grads"][name])
            assert torch.allclose(got, want, atol=1e-6), (rank, name)
