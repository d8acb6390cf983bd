"""The multi-process runs shared by this directory's tests (entrypoint_jobs.py).

`launched` plans the jobs of every selected test that needs one of the shared results (`runs`,
`hf_runs`, `attention_paths`) and runs them all in one torchrun launch per world size, so a
module that runs alone launches only its own jobs, and the whole directory launches three times.
"""

from __future__ import annotations

import pytest

from .attention_jobs import plan_attention
from .entrypoint_jobs import Runs, launch_together, plan_runs
from .hf_jobs import HFRuns, plan_hf

SHARED = {"runs": plan_runs, "hf_runs": plan_hf, "attention_paths": plan_attention}


@pytest.fixture(scope="session")
def launched(request, tmp_path_factory) -> dict:
    wanted = {name for item in request.session.items for name in item.fixturenames if name in SHARED}
    return launch_together(tmp_path_factory.mktemp("entrypoints"), {name: SHARED[name] for name in sorted(wanted)})


@pytest.fixture(scope="session")
def runs(launched) -> Runs:
    return launched["runs"]


@pytest.fixture(scope="session")
def hf_runs(launched) -> HFRuns:
    return launched["hf_runs"]


@pytest.fixture(scope="session")
def attention_paths(launched) -> dict:
    return launched["attention_paths"]


@pytest.fixture(scope="session")
def metric_definitions() -> list[dict]:
    """The SageMaker backend's MetricDefinitions: the regexes CloudWatch applies to these lines."""
    from launcher.backends.sagemaker.backend import METRIC_DEFINITIONS

    return METRIC_DEFINITIONS
