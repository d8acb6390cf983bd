"""SIGTERM (a spot interruption) ends training with a complete checkpoint that resumes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.recipe import Recipe
from launcher.resolve import resolve

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "entrypoints" / "train.py"

pytestmark = pytest.mark.torchrun


def write_config(tmp_path: Path, steps: int, every_steps: int = 0, keep: int = 3) -> Path:
    recipe = Recipe.load(
        REPO / "recipes" / "tiny-cpu.yaml",
        {
            "cluster.nproc_per_node": 1,
            "parallel.tensor": 1,
            "training.seq_len": 64,
            "training.global_batch_size": 2,
            "training.micro_batch_size": 2,
            "training.steps": steps,
            "checkpoint.every_steps": every_steps,
            "checkpoint.keep": keep,
        },
    )
    resolved = resolve(recipe).concrete.resolved(
        checkpoint_dir=str(tmp_path / "checkpoints"), output_dir=str(tmp_path / "output")
    )
    path = tmp_path / f"resolved-{steps}.json"
    path.write_text(json.dumps(resolved.to_dict()))
    return path


def test_sigterm_saves_a_final_checkpoint_exits_143_and_the_job_resumes_after_it(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    metrics = tmp_path / "output" / "metrics.jsonl"
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN), "--config", str(write_config(tmp_path, 100_000))],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no metrics within 120 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    last = steps[-1]
    assert f"interrupted by SIGTERM after step {last}; checkpoint saved" in out
    checkpoint = tmp_path / "checkpoints" / f"step-{last:08d}"
    assert json.loads((checkpoint / "COMPLETE.node-0-of-1").read_text())["step"] == last
    assert json.loads((checkpoint / "train_state.json").read_text())["data"] == {"samples_seen": 2 * last}

    resumed = subprocess.run(
        [sys.executable, str(TRAIN), "--config", str(write_config(tmp_path, last + 1))],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed_from_step={last}" in resumed.stdout
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()][-1] == last + 1


def run_train(tmp_path: Path, steps: int, keep: int = 3, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env}
    config = write_config(tmp_path, steps, every_steps=2, keep=keep)
    argv = [sys.executable, str(TRAIN), "--config", str(config)]
    return subprocess.run(argv, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)


def nan_inside_a_weight(step_dir: Path) -> Path:
    """Overwrite 1 KiB in the middle of a model weight's bytes with 0xFF (fp32 NaN), in place:
    the shard keeps its size and stays readable; returns the shard."""
    import io
    import pickle

    import torch

    metadata = pickle.loads((step_dir / ".metadata").read_bytes())  # the test's own checkpoint
    weights = [(i, s) for i, s in metadata.storage_data.items() if i.fqn.startswith("model.layers.")]
    _, where = max(weights, key=lambda item: item[1].length)
    shard = step_dir / where.relative_path
    blob = bytearray(shard.read_bytes())
    saved = torch.load(io.BytesIO(bytes(blob[where.offset : where.offset + where.length])), weights_only=True)
    data = blob.find(saved.numpy().tobytes(), where.offset)
    assert data > 0 and saved.numel() * 4 > 4096
    middle = data + saved.numel() * 2
    blob[middle : middle + 1024] = b"\xff" * 1024
    shard.write_bytes(bytes(blob))
    return shard


def rerecord(step_dir: Path, shard: Path, *, digests: bool) -> None:
    """Rewrite the marker for the shard as it is now (digests=True), or as a launcher from before
    digests wrote it (sizes only)."""
    marker = step_dir / "COMPLETE.node-0-of-1"
    record = json.loads(marker.read_text())
    if digests:
        record["sha256"][shard.name] = file_digest(shard)
    else:
        record.pop("sha256", None)
    marker.write_text(json.dumps(record))


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_damaged_newest_checkpoint_gives_way_to_the_previous_one_and_past_the_end_nothing_runs(tmp_path):
    first = run_train(tmp_path, 4)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000002", "step-00000004"]
    # Each marker holds the SHA-256 of every file, taken as it was written: step 2 by the
    # asynchronous save, step 4 (the last) by the blocking one.
    for step_dir in checkpoints.glob("step-*"):
        recorded = json.loads((step_dir / "COMPLETE.node-0-of-1").read_text())["sha256"]
        assert sorted(recorded) == [".metadata", "__0_0.distcp", "rng/rank-00000.pt", "train_state.json"]
        assert all(file_digest(step_dir / name) == digest for name, digest in recorded.items())

    # A torn write: the newest checkpoint's shard lost its tail (its marker recorded the full size).
    shard = next((checkpoints / "step-00000004").glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    resumed = run_train(tmp_path, 6)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"warning: checkpoint step-00000004 is damaged ({shard.name} is " in resumed.stdout
    assert "resumed_from_step=2" in resumed.stdout

    # 1 KiB of the newest checkpoint overwritten at the same size: loaded, it would give NaN. Its
    # digest differs, so it is skipped before a step runs. The one before was written without
    # digests (an older launcher) and zeroed: only reading finds that, and the loader falls back.
    shard = nan_inside_a_weight(checkpoints / "step-00000006")
    older = next((checkpoints / "step-00000004").glob("__0_*.distcp"))
    rerecord(checkpoints / "step-00000004", older, digests=False)
    older.write_bytes(b"\0" * older.stat().st_size)
    again = run_train(tmp_path, 8)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        f"warning: checkpoint step-00000006 is damaged ({shard.name} on host 0 differs from the sha256 that "
        "COMPLETE.node-0-of-1 recorded); skipped"
    ) in again.stdout
    assert "warning: checkpoint step-00000004 cannot be read (" in again.stdout
    assert "resuming from step-00000002 instead" in again.stdout and "resumed_from_step=2" in again.stdout
    losses = [json.loads(line)["loss"] for line in (tmp_path / "output" / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(loss, float) for loss in losses), losses  # never NaN (written as null)

    # NaN weights whose digests match (the state was already NaN when it was saved): the first
    # step's loss is NaN, and the job fails with the reason instead of completing.
    shard = nan_inside_a_weight(checkpoints / "step-00000008")
    rerecord(checkpoints / "step-00000008", shard, digests=True)
    diverged = run_train(tmp_path, 10)
    assert diverged.returncode == 3, diverged.stderr[-3000:]
    assert (
        "error: training: the loss is nan and the gradient norm is nan at step 9; 1 step(s) after resuming from "
        "checkpoint step-00000008, which may hold damaged values"
    ) in diverged.stderr
    assert sorted(p.name for p in checkpoints.glob("step-*"))[-1] == "step-00000008"  # nothing of step 9 saved

    # Run once more with no steps left: it says so and fails rather than report a 0-step success.
    past = run_train(tmp_path, 8)
    assert past.returncode == 2
    assert (
        "checkpoint: the newest checkpoint is at step 8, and training.steps is 8: nothing is left to train; "
        "raise training.steps, or set checkpoint.resume: never to start over"
    ) in past.stdout + past.stderr


def test_a_second_job_on_a_checkpoint_dir_in_use_is_refused_in_one_line(tmp_path):
    from entrypoints.checkpoint_files import write_lease

    write_lease(tmp_path / "checkpoints", "other-job-1234", time.time())
    refused = run_train(tmp_path, 2, LAUNCHER_JOB_NAME="this-job-5678")
    assert refused.returncode == 2
    assert "checkpoint.dir: " in refused.stderr + refused.stdout
    assert "is in use by job other-job-1234" in refused.stderr + refused.stdout
    assert not list((tmp_path / "checkpoints").glob("step-*"))  # it wrote nothing
    # The same job restarted (a requeue) takes its own lease back, and releases it at the end.
    write_lease(tmp_path / "checkpoints", "this-job-5678", time.time())
    assert run_train(tmp_path, 2, LAUNCHER_JOB_NAME="this-job-5678").returncode == 0
    assert not (tmp_path / "checkpoints" / "LEASE.json").exists()


def test_a_full_checkpoint_disk_fails_the_job_in_one_line_keeps_the_last_checkpoint_and_a_rerun_resumes(tmp_path):
    from entrypoints.checkpoint_files import checkpoint_fault, digest_fault, recorded_digests
    from launcher.contract.checkpoint_dirs import complete_checkpoints, is_complete
    from tests.disks import small_disk

    checkpoints = tmp_path / "checkpoints"
    # A checkpoint of this model is 11.2 MB (measured): 16 MiB holds one; the second (step 4,
    # an asynchronous save) runs out of space in its shard. keep=1: pruning step 2 before step 4
    # is complete would leave nothing.
    with small_disk(checkpoints, "16m"):
        full = run_train(tmp_path, 6, keep=1)
        assert full.returncode == 4, full.stderr[-3000:]
        assert "Traceback" not in full.stderr
        torn = checkpoints / "step-00000004"
        assert full.stderr.strip().splitlines() == [
            f"error: checkpoint: step 4 could not be written to {torn}: ENOSPC (No space left on device) writing "
            f"{torn}/__0_0.distcp; it has no COMPLETE marker, so a resume skips it; the newest complete "
            f"checkpoint, {checkpoints / 'step-00000002'}, is kept; free space in {checkpoints} and rerun to resume"
        ]
        kept = checkpoints / "step-00000002"
        recorded, fault = recorded_digests(kept)
        assert is_complete(kept) and fault is None and checkpoint_fault(kept) is None
        assert sorted(recorded) == [".metadata", "__0_0.distcp", "rng/rank-00000.pt", "train_state.json"]
        assert all(digest_fault(kept, relative, recorded, 0) is None for relative in recorded)
        assert not is_complete(torn) and not list(torn.glob("COMPLETE*"))
        metrics = tmp_path / "output" / "metrics.jsonl"
        # Every step logged before the failure surfaced (step 5 or 6: when the background save ends) is kept.
        logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert logged == list(range(1, len(logged) + 1)) and logged[-1] >= 5, logged

        # Space freed: the rerun skips the torn step 4, resumes from step 2 and completes.
        subprocess.run(["mount", "-o", "remount,size=64m", str(checkpoints)], check=True)
        rerun = run_train(tmp_path, 6, keep=1)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert "warning: checkpoint step-00000004 is incomplete (no host wrote its COMPLETE marker); skipped" in (
            rerun.stdout
        )
        assert "resumed_from_step=2" in rerun.stdout
        assert [step for step, _ in complete_checkpoints(checkpoints)] == [6]  # the torn one pruned too
        assert [path.name for path in checkpoints.glob("step-*")] == ["step-00000006"]
        # The failed run's metrics are kept; the rerun appends steps 3 to 6 after them.
        assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [*logged, 3, 4, 5, 6]
