"""What only the Kubernetes backend reads: the JobSpec's engine part for this backend."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from launcher.spec import EngineSettings

if TYPE_CHECKING:
    from launcher.recipe import Recipe

# The SageMaker HyperPod CLI's default --max-retry when --auto-resume is on (docs.aws.amazon.com/
# sagemaker/latest/dg/sagemaker-hyperpod-eks-run-jobs-hyperpod-cli.html, "Enabling job auto-resume").
AUTO_RESUME_RETRIES = 1


@dataclass(frozen=True, kw_only=True)
class Toleration:
    """A core/v1 Toleration as the recipe gave it (already validated by the recipe schema)."""

    key: str | None = None
    operator: str = "Equal"
    value: str | None = None
    effect: str | None = None
    toleration_seconds: int | None = None

    def to_kubernetes(self) -> dict[str, Any]:
        fields_ = {"key": self.key, "operator": self.operator, "value": self.value, "effect": self.effect}
        fields_["tolerationSeconds"] = self.toleration_seconds
        return {k: v for k, v in fields_.items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class KubernetesSettings(EngineSettings):
    """The recipe's k8s: section. The defaults are the section's own, so a spec saved before it
    had this part reads as the recipe's defaults."""

    namespace: str | None = None
    checkpoint_claim: str | None = None
    storage_class: str | None = None
    storage_size: str = "1Ti"
    api: str = "pytorchjob"
    """pytorchjob (kubeflow.org/v1) or trainjob (trainer.kubeflow.org/v1alpha1)."""
    runtime: str = "torch-distributed"
    """The ClusterTrainingRuntime a TrainJob references."""
    auto_resume: bool = False
    """HyperPod EKS job auto-resume: its annotations and restartPolicy OnFailure."""
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    hugepages: bool = False
    """Request 2 MiB huge pages on EFA instance types."""
    region: str | None = None
    """The recipe's AWS region: Mountpoint's `region` mount option for s3:// data."""

    @classmethod
    def of(cls, recipe: Recipe) -> KubernetesSettings:
        k8s = recipe.k8s
        retries = k8s.retries if k8s.retries is not None else (AUTO_RESUME_RETRIES if k8s.auto_resume else 0)
        return cls(
            retries=retries,
            namespace=k8s.namespace,
            checkpoint_claim=k8s.checkpoint_claim,
            storage_class=k8s.storage_class,
            storage_size=k8s.storage_size,
            api=k8s.api,
            runtime=k8s.runtime,
            auto_resume=k8s.auto_resume,
            node_selector=tuple(sorted(k8s.node_selector.items())),
            tolerations=tuple(
                Toleration(**{("toleration_seconds" if k == "tolerationSeconds" else k): v for k, v in t})
                for t in k8s.tolerations
            ),
            hugepages=k8s.hugepages,
            region=recipe.sagemaker.region,
        )

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["tolerations"] = [asdict(t) for t in self.tolerations]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KubernetesSettings:
        """`to_dict`'s JSON back: lists become the tuples the fields hold; the base class checks each type."""
        if not isinstance(data, dict):
            raise TypeError(f"engine: expected a mapping, got {type(data).__name__}")
        data = dict(data)
        selector = data.get("node_selector", [])
        if isinstance(selector, list):
            data["node_selector"] = tuple(tuple(pair) if isinstance(pair, list) else pair for pair in selector)
        tolerations = data.get("tolerations", [])
        if isinstance(tolerations, list):
            known = {f.name for f in fields(Toleration)}
            if not all(isinstance(t, dict) and set(t) <= known for t in tolerations):
                raise TypeError(f"engine.tolerations: expected Toleration mappings, got {tolerations!r:.80}")
            data["tolerations"] = tuple(Toleration(**t) for t in tolerations)
        return super().from_dict(data)
