"""Helpers for backend tests: recipes from recipes/ and the JobSpecs `submit` would build."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
from tests import REPO  # noqa: E402

FAKE_ENTRYPOINTS = HERE / "fake_entrypoints"
REGION = "us-west-2"
ACCOUNT = "314159265358"
"""The tests' AWS account: the moto server's (MOTO_ACCOUNT_ID), so STS answers it as the caller's."""
ROLE = f"arn:aws:iam::{ACCOUNT}:role/SageMakerTrainingRole"
"""An execution role of the caller's own account: one that submit accepts."""
PLACEHOLDER_ROLE = "arn:aws:iam::111122223333:role/SageMakerTrainingRole"
"""The shipped recipes' role: AWS's documentation account, which submit refuses."""
MY_ROLE = f"sagemaker.role_arn={ROLE}"
"""The --set that a submit of a shipped SageMaker recipe needs, as a user's would."""


def recipe_path(name: str) -> Path:
    return REPO / "recipes" / f"{name}.yaml"


def load(name: str, **overrides):
    from launcher.recipe import Recipe

    return Recipe.load(recipe_path(name), overrides or None)


def spec_for(name: str, backend: str, **overrides):
    """The JobSpec `submit` would build for recipe `name` on `backend`, named `<recipe>-job`."""
    from launcher.api import load as api_load
    from launcher.backends import get_backend

    recipe = api_load(
        recipe_path(name), backend=backend, set_options=[f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    )
    target = get_backend(backend)
    job = f"{recipe.name.lower()}-job"
    from launcher.resolve import resolve
    from launcher.spec import JobSpec

    concrete = resolve(recipe).concrete
    placement = target.placement(concrete, job)
    return JobSpec.create(concrete, backend=backend, placement=placement, engine=target.settings(concrete), name=job)


def submit(**kwargs):
    """Submit the tiny CPU recipe (with the stand-in trainer under `no_torchrun`)."""
    from launcher import api

    return api.submit(recipe_path("tiny-cpu"), **kwargs)


def wait_for_line(job, text: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in line for line in job.logs()):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in the logs of {job.name}")


def runner_record(home: Path, name: str, timeout: float = 20.0) -> dict:
    """status.json once the local runner has started the job: the trainer can print before the
    runner records itself (Popen returns, then runner.run writes runner_pid, pid and pgid in one
    write), so a test that read it on the trainer's first line could find no pid yet. The
    runner_pid is checked to be this job's runner (its command line) before a test signals it."""
    from launcher.backends.local import runner

    directory = home / "jobs" / name
    deadline = time.monotonic() + timeout
    while "runner_pid" not in (status := runner.read_status(directory)):
        assert time.monotonic() < deadline, f"the runner never recorded its pid in {directory}"
        time.sleep(0.05)
    command = Path(f"/proc/{status['runner_pid']}/cmdline").read_bytes().split(b"\0")
    assert b"launcher.backends.local.runner" in command and str(directory).encode() in command, command
    return status


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split()[2] == "Z"
