"""The multi-process runs shared by this directory's tests (see entrypoint_jobs.py)."""

from __future__ import annotations

import pytest

from .entrypoint_jobs import Runs, run_all


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    return run_all(tmp_path_factory.mktemp("entrypoints"))


@pytest.fixture(scope="session")
def metric_definitions() -> list[dict]:
    """The SageMaker backend's MetricDefinitions: the regexes CloudWatch applies to these lines."""
    from launcher.backends.sagemaker.backend import METRIC_DEFINITIONS

    return METRIC_DEFINITIONS
