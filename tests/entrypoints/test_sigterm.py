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


def write_config(tmp_path: Path, steps: int) -> Path:
    recipe = Recipe.load(
        REPO / "recipes" / "tiny-cpu.yaml",
        {
            "cluster.nproc_per_node": 1,
            "parallel.tensor": 1,
            "training.seq_len": 64,
            "training.global_batch_size": 2,
            "training.micro_batch_size": 2,
            "training.steps": steps,
            "checkpoint.every_steps": 0,
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
    assert (checkpoint / "COMPLETE.node-0-of-1").read_text() == f"{last}\n"
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
