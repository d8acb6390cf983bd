"""Backends by name. Modules import lazily; none imports boto3 or torch at module level."""

from __future__ import annotations

from importlib import import_module

from launcher.backends.base import Backend, Capabilities, JobRef, JobStatus, Rendering
from launcher.catalog import choices
from launcher.errors import UsageError

_BACKENDS = {
    "sagemaker": "launcher.backends.sagemaker:SageMakerBackend",
    "local": "launcher.backends.local:LocalBackend",
    "docker": "launcher.backends.docker:DockerBackend",
    "slurm": "launcher.backends.slurm:SlurmBackend",
    "k8s": "launcher.backends.k8s:KubernetesBackend",
    "accelerate": "launcher.backends.accelerate:AccelerateBackend",
}
NAMES = tuple(_BACKENDS)


def backend_class(name: str) -> type[Backend]:
    if name not in _BACKENDS:
        raise UsageError(f"'{name}' is not a backend; use {choices(_BACKENDS)}")
    module, _, attribute = _BACKENDS[name].partition(":")
    return getattr(import_module(module), attribute)


def get_backend(name: str) -> Backend:
    return backend_class(name)()


def backends_with(capability: str) -> list[str]:
    return [name for name in _BACKENDS if getattr(backend_class(name).capabilities, capability)]


__all__ = ["NAMES", "Backend", "Capabilities", "JobRef", "JobStatus", "Rendering", "backends_with", "get_backend"]
