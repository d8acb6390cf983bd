"""The README's main job, exactly: `launcher submit recipes/tiny-cpu.yaml --backend local --wait`.

One real torchrun launch: a tiny Llama trained by 4 gloo processes (FSDP 2 x TP 2) through the
installed CLI, the real entrypoints and the local backend's runner.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.backends.sagemaker import METRIC_DEFINITIONS

from .helpers import REPO

pytestmark = pytest.mark.torchrun


def launcher(*args: str, home: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    executable = Path(sys.executable).with_name("launcher")
    env = {**os.environ, "LAUNCHER_HOME": str(home)}
    return subprocess.run([str(executable), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_readme_main_job_trains_and_ends_with_loss_and_throughput(tmp_path):
    home = tmp_path / "home"
    result = launcher("submit", "recipes/tiny-cpu.yaml", "--backend", "local", "--wait", home=home)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"tiny-cpu-\S+: Completed\. loss [\d.]+, tokens/s/GPU [\d.]+, step 20", lines[-1]), lines[-1]
    name = lines[-1].split(":")[0]

    # Every metric line of the run is readable by the SageMaker MetricDefinitions.
    metric_lines = [line for line in lines if line.startswith("metrics ")]
    assert len(metric_lines) == 20
    for definition in METRIC_DEFINITIONS:
        if definition["Name"] != "train:mfu":  # nan on the CPU
            assert all(re.search(definition["Regex"], line) for line in metric_lines), definition
    losses = [float(re.search(METRIC_DEFINITIONS[1]["Regex"], line).group(1)) for line in metric_lines]
    assert losses[-1] < losses[0]

    directory = home / "jobs" / name
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    status = json.loads(launcher("status", name, "--json", home=home).stdout)
    assert (status["state"], status["exit_code"]) == ("Completed", 0)
    assert status["details"]["summary"]["steps"] == 20


def test_a_failed_job_names_the_rank_that_failed_first_not_a_peers_symptom(tmp_path):
    # Rank 0 alone creates the checkpoint directory (for its lease); under a regular file that fails,
    # while ranks 1-3 wait for its resume decision and then fail with gloo's "Connection closed by peer" (the symptom).
    (tmp_path / "a-file").write_text("")
    home = tmp_path / "home"
    overrides = ["training.steps=2", "checkpoint.every_steps=1", f"checkpoint.dir={tmp_path / 'a-file' / 'ckpt'}"]
    args = [arg for override in overrides for arg in ("--set", override)]
    # `python -m launcher` from the checkout: the code under test, whichever environment runs it.
    env = {**os.environ, "LAUNCHER_HOME": str(home)}
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "submit", "recipes/tiny-cpu.yaml", "--backend", "local", "--wait", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0
    assert "Connection closed by peer" in result.stdout  # the symptom is in the log...
    name = result.stdout.splitlines()[-1].split(":")[0]
    status = json.loads(
        subprocess.run(
            [sys.executable, "-m", "launcher", "status", name, "--json"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
    # ...but the reason is rank 0's error.
    assert status["state"] == "Failed"
    assert status["failure_reason"] == (
        f"torchrun exited with code 1: rank 0: NotADirectoryError: [Errno 20] Not a directory: "
        f"'{tmp_path / 'a-file' / 'ckpt'}'"
    )
