"""The traces test_traced.py compares the estimator with, run beside the serial tests
(tests/background.py): one background piece of work per selected config, in CONFIGS order."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

from launcher.resolve import resolve

from .memory_tracing import Traced, start_tracer, trace_in_subprocess
from .traced_configs import CONFIGS, TracedConfig

TEST = "test_estimate_is_within_2_percent_of_the_traced_peak"


def work_name(config: TracedConfig) -> str:
    return f"traced peak of {config.name}"


def wants_traces(item: pytest.Item) -> bool:
    return getattr(item, "originalname", "") == TEST


def trace_work(items: Iterable[pytest.Item], tmp_path_factory, background) -> dict[str, Callable[[], Traced]]:
    """The traces of the configs the selected tests check: each resolved here, in the
    foreground, and traced in the tracer process when the work runs."""
    wanted = {item.callspec.params["config"].name for item in items if wants_traces(item)}
    work = {}
    for config in CONFIGS:
        if config.name in wanted:
            resolved = resolve(config.recipe()).concrete.resolved().to_dict()
            work[work_name(config)] = lambda resolved=resolved, stage=config.stage: trace_in_subprocess(
                resolved, stage=stage
            )
    if work:
        start_tracer()  # now, with the session's environment, not a later test's
    return work
