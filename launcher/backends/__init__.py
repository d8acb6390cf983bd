"""Backends by name. Modules import lazily; none imports boto3 or torch at module level."""

from __future__ import annotations

from launcher.backends.base import (
    NAMES,
    Backend,
    Capabilities,
    JobRef,
    JobStatus,
    Rendering,
    backend_class,
    backends_with,
    get_backend,
)

__all__ = [
    "NAMES",
    "Backend",
    "Capabilities",
    "JobRef",
    "JobStatus",
    "Rendering",
    "backend_class",
    "backends_with",
    "get_backend",
]
