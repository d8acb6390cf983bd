"""Fixtures of the backend tests: a SageMaker job in the registry for the Stubber tests."""

from __future__ import annotations

import pytest

from launcher.backends.sagemaker import aws as aws_clients

from .helpers import REGION
from .sagemaker_stubs import NAME


@pytest.fixture
def registered(home, monkeypatch):
    """A SageMaker job recorded in the job registry, and fake credentials (Stubber sends nothing)."""
    from launcher.backends.base import JobRef
    from launcher.registry import write_json

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    aws_clients.reset_clients()
    write_json(home / "jobs" / NAME / "job.json", JobRef(name=NAME, backend="sagemaker", region=REGION).to_dict())
    yield NAME
    aws_clients.reset_clients()
