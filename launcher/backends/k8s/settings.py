"""What only the Kubernetes backend reads: the JobSpec's engine part for this backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from launcher.spec import EngineSettings

if TYPE_CHECKING:
    from launcher.recipe import Recipe


@dataclass(frozen=True, kw_only=True)
class KubernetesSettings(EngineSettings):
    """The recipe's k8s: section. The defaults are the section's own, so a spec saved before it
    had this part reads as the recipe's defaults."""

    namespace: str | None = None
    checkpoint_claim: str | None = None
    storage_class: str | None = None
    storage_size: str = "1Ti"

    @classmethod
    def of(cls, recipe: Recipe) -> KubernetesSettings:
        return cls(**recipe.k8s.model_dump())
