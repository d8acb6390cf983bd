"""`to_model_trainer(spec)`: the same job as a SageMaker SDK `ModelTrainer`, for notebooks.

    from launcher.backends.sagemaker.model_trainer import to_model_trainer
    trainer = to_model_trainer(spec)          # spec built with backend="sagemaker"

The trainer runs the spec's torchrun argv as its SourceCode command from the bundle root,
with the spec's image, resources, environment, S3 locations, spot, networking and tags; it
differs from `launcher submit` only in the job name, which the SDK makes from base_job_name.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from launcher.backends.sagemaker import aws
from launcher.backends.sagemaker.backend import CHECKPOINT_PREFIX_ENV, METRIC_DEFINITIONS, Locations, settings
from launcher.backends.sagemaker.settings import SageMakerSettings
from launcher.bundle import Bundle
from launcher.errors import UsageError
from launcher.registry import job_dir
from launcher.spec import JobSpec


def to_model_trainer(spec: JobSpec, *, sagemaker_session=None, source_dir: str | Path | None = None):
    """The equivalent `sagemaker.train.ModelTrainer` (needs the `sagemaker` extra)."""
    if not isinstance(spec.engine, SageMakerSettings):
        raise UsageError(
            f"to_model_trainer() needs a sagemaker spec, not {spec.backend}; build it with backend='sagemaker'"
        )
    try:
        import sagemaker.train  # noqa: F401  (the SDK; imported for real in _trainer)
    except ImportError:
        raise UsageError("to_model_trainer() needs the SageMaker SDK: pip install 'launcher[sagemaker]'") from None

    locations, cloud = Locations.of(spec), settings(spec)
    if source_dir is None:
        source_dir = Bundle.of(spec).extract(job_dir(spec.name) / "code")
    from botocore.exceptions import BotoCoreError, ClientError

    # The SDK asks AWS for the account and the default bucket as it builds the trainer: without
    # credentials that is a botocore traceback, which the API turns into one line.
    try:
        return _trainer(spec, locations, cloud, sagemaker_session, source_dir)
    except (BotoCoreError, ClientError) as error:
        raise aws.explain(error, action=f"to_model_trainer({spec.name})", region=cloud.region) from None


def _trainer(spec: JobSpec, locations: Locations, cloud, sagemaker_session, source_dir):
    """The ModelTrainer itself; every SDK call that may reach AWS is made in here."""
    from sagemaker.core.training.configs import (
        CheckpointConfig,
        Compute,
        InputData,
        MetricDefinition,
        Networking,
        OutputDataConfig,
        RetryStrategy,
        SourceCode,
        StoppingCondition,
        Tag,
    )
    from sagemaker.train import ModelTrainer

    if sagemaker_session is None:
        import boto3
        from sagemaker.core.helper.session_helper import Session

        sagemaker_session = Session(
            boto_session=boto3.Session(region_name=cloud.region), default_bucket=locations.bucket
        )

    r, net = spec.resources, cloud.networking
    trainer = ModelTrainer(
        sagemaker_session=sagemaker_session,
        role=cloud.role_arn,
        base_job_name=spec.recipe_name,
        training_image=spec.image,
        source_code=SourceCode(source_dir=str(source_dir), command=shlex.join(spec.command)),
        compute=Compute(
            instance_type=r.instance_type,
            instance_count=r.instance_count,
            volume_size_in_gb=cloud.volume_size_gb,
            volume_kms_key_id=cloud.kms_key_id,
            enable_managed_spot_training=spec.spot,
        ),
        networking=Networking(
            subnets=list(net.subnets) or None,
            security_group_ids=list(net.security_group_ids) or None,
            enable_network_isolation=net.isolation,
            enable_inter_container_traffic_encryption=net.encrypt_inter_node,
        ),
        stopping_condition=StoppingCondition(
            max_runtime_in_seconds=spec.max_run_s, max_wait_time_in_seconds=cloud.max_wait_s
        ),
        output_data_config=OutputDataConfig(s3_output_path=locations.output, kms_key_id=cloud.kms_key_id),
        # Above the size where CheckpointConfig's copy to every host costs too much, each host
        # copies its own files (create_training_job_request does the same).
        checkpoint_config=None
        if cloud.per_host_checkpoints
        else CheckpointConfig(s3_uri=locations.checkpoints, local_path=spec.checkpoint_dir),
        input_data_config=[InputData(channel_name=d.name, data_source=d.source) for d in spec.inputs] or None,
        environment={**spec.env, CHECKPOINT_PREFIX_ENV: locations.checkpoints}
        if cloud.per_host_checkpoints
        else spec.env,
        tags=[Tag(key=k, value=v) for k, v in (*spec.tags, ("launcher:recipe", spec.recipe_name))],
    )
    trainer = trainer.with_metric_definitions(
        [MetricDefinition(name=m["Name"], regex=m["Regex"]) for m in METRIC_DEFINITIONS]
    )
    if spec.retries:
        trainer = trainer.with_retry_strategy(RetryStrategy(maximum_retry_attempts=spec.retries))
    return trainer
