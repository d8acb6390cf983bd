"""What only a SageMaker training job reads: the JobSpec's engine part for this backend."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from launcher.catalog.engines import capabilities
from launcher.recipe.schema import SAGEMAKER_MAX_RUN_S
from launcher.spec import EngineSettings

if TYPE_CHECKING:
    from launcher.recipe import Recipe


@dataclass(frozen=True, kw_only=True)
class Networking:
    subnets: tuple[str, ...] = ()
    security_group_ids: tuple[str, ...] = ()
    isolation: bool = False
    encrypt_inter_node: bool = False


@dataclass(frozen=True, kw_only=True)
class SageMakerSettings(EngineSettings):
    """Where the job runs, as whom, where its files go (the recipe's sagemaker: section)."""

    region: str
    role_arn: str | None
    output_uri: str | None
    checkpoint_uri: str | None
    kms_key_id: str | None
    networking: Networking
    volume_size_gb: int
    """The ML storage volume of each instance (ResourceConfig.VolumeSizeInGB)."""
    training_plan_arn: str | None = None
    """A SageMaker training plan's ARN: the job runs on that plan's reserved capacity."""
    infra_check: bool = False
    """InfraCheckConfig.EnableInfraCheck: SageMaker checks the instances and their network first."""
    per_host_checkpoints: bool = False
    """Each host copies its own checkpoint files to S3 and back (LAUNCHER_CHECKPOINT_S3,
    entrypoints/checkpoint_mirror.py) instead of CheckpointConfig copying all to every host."""

    @classmethod
    def of(cls, recipe: Recipe) -> SageMakerSettings:
        sm = recipe.sagemaker
        max_wait = None
        if sm.spot:
            max_run = recipe.cluster.max_run
            max_wait = sm.max_wait or max(max_run, min(2 * max_run, SAGEMAKER_MAX_RUN_S))
        return cls(
            retries=sm.retries,
            spot=sm.spot,
            max_wait_s=max_wait,
            tags=tuple(sorted(sm.tags.items())),
            region=sm.region,
            role_arn=sm.role_arn,
            output_uri=sm.output_uri,
            checkpoint_uri=sm.checkpoint_uri,
            kms_key_id=sm.kms_key_id,
            volume_size_gb=sm.volume_size_gb,
            training_plan_arn=sm.training_plan_arn,
            infra_check=_infra_check(recipe),
            per_host_checkpoints=capabilities("sagemaker").per_host_checkpoints(
                recipe.checkpoint_bytes, recipe.checkpoint.keep, sm.checkpoint_copy
            ),
            networking=Networking(
                subnets=tuple(sm.subnets),
                security_group_ids=tuple(sm.security_group_ids),
                isolation=sm.network_isolation,
                encrypt_inter_node=sm.encrypt_inter_container_traffic,
            ),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SageMakerSettings:
        networking = {f.name: data["networking"][f.name] for f in fields(Networking)}
        networking = Networking(**{k: tuple(v) if isinstance(v, list) else v for k, v in networking.items()})
        return super().from_dict({**data, "networking": networking})


def _infra_check(recipe: Recipe) -> bool:
    """sagemaker.infra_check, by default on for multi-node GPU jobs on EFA instances: the ones whose
    hosts must all be healthy and reach each other at full speed for any step to finish."""
    chosen = recipe.sagemaker.infra_check
    if chosen is not None:
        return chosen
    cluster = recipe.cluster
    return cluster.instance_count > 1 and cluster.device == "cuda" and recipe.hardware.instance.has_efa
