"""The multi-process runs shared by this directory's tests (entrypoint_jobs.py).

`launch_work` plans the jobs of every selected test that needs one of the shared results (`runs`,
`hf_runs`, `attention_paths`, `expert_runs`) and runs them all in one torchrun launch per world size, so a
module that runs alone launches only its own jobs, and the whole directory launches three times.
The root conftest starts them before the first test, beside the serial tests (tests/background.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

from .attention_jobs import plan_attention
from .entrypoint_jobs import Runs, launch_together, plan_runs, plan_together
from .expert_jobs import plan_experts
from .hf_jobs import HFRuns, plan_hf

SHARED = {"runs": plan_runs, "hf_runs": plan_hf, "attention_paths": plan_attention, "expert_runs": plan_experts}
LAUNCHED = "the entrypoint tests' shared launches"


def wants_launches(item: pytest.Item) -> bool:
    return any(name in SHARED for name in item.fixturenames)


def launch_work(items: Iterable[pytest.Item], tmp_path_factory, background) -> dict[str, Callable[[], dict]]:
    """The shared launches the selected tests need, planned now and run when the work runs."""
    wanted = sorted({name for item in items for name in item.fixturenames if name in SHARED})
    if not wanted:
        return {}
    root = tmp_path_factory.mktemp("entrypoints")
    parts = plan_together(root, {name: SHARED[name] for name in wanted})
    return {LAUNCHED: lambda: launch_together(root, parts, background.run)}


@pytest.fixture(scope="session")
def launched(_background) -> dict:
    return _background.result(LAUNCHED)


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
def expert_runs(launched) -> dict:
    return launched["expert_runs"]


@pytest.fixture(scope="session")
def metric_definitions() -> list[dict]:
    """The SageMaker backend's MetricDefinitions: the regexes CloudWatch applies to these lines."""
    from launcher.backends.sagemaker.backend import METRIC_DEFINITIONS

    return METRIC_DEFINITIONS
