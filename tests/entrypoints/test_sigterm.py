"""SIGTERM (a spot interruption) ends training with a complete checkpoint that resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.recipe import Recipe

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "entrypoints" / "train.py"

pytestmark = pytest.mark.torchrun


def write_config(tmp_path: Path, steps: int, every_steps: int = 0) -> Path:
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
        },
    )
    resolved = recipe.resolved(checkpoint_dir=str(tmp_path / "checkpoints"), output_dir=str(tmp_path / "output"))
    path = tmp_path / f"resolved-{steps}.json"
    path.write_text(json.dumps(resolved))
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


def run_train(tmp_path: Path, steps: int, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env}
    config = write_config(tmp_path, steps, every_steps=2)
    argv = [sys.executable, str(TRAIN), "--config", str(config)]
    return subprocess.run(argv, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)


def test_a_damaged_newest_checkpoint_gives_way_to_the_previous_one_and_past_the_end_nothing_runs(tmp_path):
    first = run_train(tmp_path, 4)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000002", "step-00000004"]

    # A torn write: the newest checkpoint's shard lost its tail (its marker recorded the full size).
    shard = next((checkpoints / "step-00000004").glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    resumed = run_train(tmp_path, 6)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"warning: checkpoint step-00000004 is damaged ({shard.name} is " in resumed.stdout
    assert "resumed_from_step=2" in resumed.stdout

    # Bytes flipped at the same size: only reading finds it, and the loader falls back the same way.
    newest = next((checkpoints / "step-00000006").glob("__0_*.distcp"))
    newest.write_bytes(b"\0" * newest.stat().st_size)
    again = run_train(tmp_path, 8)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "warning: checkpoint step-00000006 cannot be read (" in again.stdout
    assert "resuming from step-00000004 instead" in again.stdout and "resumed_from_step=4" in again.stdout

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
