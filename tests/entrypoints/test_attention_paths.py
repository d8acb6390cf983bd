"""Context-parallel attention (all-gather and Ulysses) and document masking across 2 ranks.

One torchrun launch (attention_paths_run.py) runs every check; these tests read its result.
Numerics are fp32 on gloo and must match one process to 1e-5 relative: Ulysses forward and
backward against full causal attention (MHA and GQA); a tiny Llama with document masking at cp 2
over both paths against one process (loss and every gradient); and whole training jobs
(cp 2 Ulysses with full checkpointing, pipeline 2) whose first logged loss must equal one process's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.entrypoint_jobs import REPO, write_job

RUNNER = REPO / "tests" / "entrypoints" / "attention_paths_run.py"
TOLERANCE = 1e-5
# Small jobs: 2 steps, seq 64, documents of 1 to 16 tokens from synthetic data.
DOCUMENT_JOB = {
    "training.seq_len": 64,
    "training.global_batch_size": 4,
    "training.steps": 2,
    "data.document_masking": True,
}
TRAIN_JOBS = {
    # Full checkpointing: the recomputed blocks must reuse the forward's document masks.
    "cp2_ulysses_documents_full_ac": {
        **DOCUMENT_JOB,
        "parallel.context": 2,
        "parallel.cp_attention": "ulysses",
        "parallel.activation_checkpointing": "full",
    },
    "pp2_documents_global_positions": {
        **DOCUMENT_JOB,
        "parallel.pipeline": 2,
        "data.document_positions": "global",
    },
}


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("attention_paths")
    jobs = {name: write_job(root, name, changes, procs=2) for name, changes in TRAIN_JOBS.items()}
    plan = {
        "result": str(root / "result.json"),
        "train": [{"name": name, "config": str(job.config)} for name, job in jobs.items()],
    }
    (root / "plan.json").write_text(json.dumps(plan))
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc_per_node=2", str(RUNNER), str(root / "plan.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        pytest.fail(f"launch exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    found = json.loads((root / "result.json").read_text())
    for name, job in jobs.items():
        found["train"][name]["losses"] = job.losses()
    return found


@pytest.mark.parametrize("case", ["4/4", "4/2", "8/2", "6/2"])
def test_ulysses_attention_matches_full_causal_attention_forward_and_backward(result, case):
    errors = result["ulysses"][case]
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.parametrize("path", ["allgather", "ulysses"])
def test_document_masking_at_cp2_matches_one_process_loss_and_gradients(result, path):
    errors = result["documents"][path]
    assert len(errors) > 10  # the loss and every parameter's gradient
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, f"{worst}: {errors[worst]:.2e}"


@pytest.mark.parametrize("job", list(TRAIN_JOBS))
def test_training_with_document_masking_starts_at_the_one_process_loss(result, job):
    found = result["train"][job]
    first, reference = found["losses"][0], found["reference_loss"]
    assert abs(first - reference) <= TOLERANCE * reference, (first, reference)
    # The mask matters at this tolerance: the same tokens unmasked start elsewhere.
    assert abs(found["unmasked_loss"] - reference) > 3 * TOLERANCE * reference
    assert len(found["losses"]) == 2
