"""launcher: validate, size and launch long-context LLM training jobs.

The public API is imported lazily, so `import launcher` (and `launcher --help`) stays fast and
never pulls in torch, boto3 or sagemaker.

    from launcher import Recipe
    recipe = Recipe.load("recipes/llama70b-128k.yaml", overrides={"parallel.context": 16})
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "Recipe": "launcher.recipe",
    "Layout": "launcher.contract.layout",
    "LauncherError": "launcher.errors",
    "RecipeError": "launcher.errors",
    "JobSpec": "launcher.spec",
    "Job": "launcher.jobs",
    "JobStatus": "launcher.backends.base",
    "list_jobs": "launcher.jobs",
    "submit": "launcher.api",
    "prepare_data": "launcher.api",
    "to_model_trainer": "launcher.backends.sagemaker.model_trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
