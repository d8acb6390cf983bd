"""docs/tutorial.py, the notebook as a percent-format script, runs from top to bottom: it loads,
estimates, plans, trains the tiny model for a few steps with one process on the local backend,
follows the job and plots its metrics."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import REPO

pytestmark = pytest.mark.torchrun

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.engines
def test_the_tutorial_runs_and_draws_its_three_pictures(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "LAUNCHER_HOME": str(tmp_path / "home"), "TUTORIAL_OUT": str(out), "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "docs" / "tutorial.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "Completed" in lines
    steps = [line for line in lines if line.startswith("metrics step=")]
    assert len(steps) == 4
    assert lines[-1].startswith("4 steps, last loss ")
    for name in ("memory.png", "plans.png", "metrics.png"):
        picture = (out / name).read_bytes()
        assert picture[:8] == PNG and len(picture) > 10_000, name


def test_the_readme_says_where_a_jobs_metrics_are():
    readme = (REPO / "README.md").read_text()
    for mention in (
        "`launcher metrics NAME`",
        "`job.metrics()`",
        "$LAUNCHER_HOME/jobs/NAME/metrics.jsonl",
        "docs/tutorial.py",
    ):
        assert mention in readme, mention
