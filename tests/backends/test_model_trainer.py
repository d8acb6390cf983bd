"""to_model_trainer(spec): the same job through the SageMaker SDK's ModelTrainer, under moto."""

from __future__ import annotations

import os

import boto3
import pytest

from launcher.backends.sagemaker.model_trainer import to_model_trainer

from .helpers import REGION, spec_for

pytest.importorskip("sagemaker.train", reason="the sagemaker extra is not installed")


def test_model_trainer_submits_the_same_resources_image_and_command(aws, home, fake_bundle, monkeypatch):
    monkeypatch.setenv("SAGEMAKER_VALIDATE_ROLE", "false")  # moto has no iam:SimulatePrincipalPolicy
    spec = spec_for("llama70b-128k", "sagemaker")
    trainer = to_model_trainer(spec)
    assert trainer.source_code.command == " ".join(spec.command)
    assert trainer.training_image == spec.image

    trainer.train(wait=False, logs=False)

    sm = boto3.client("sagemaker", region_name=REGION)
    (summary,) = sm.list_training_jobs()["TrainingJobSummaries"]
    job = sm.describe_training_job(TrainingJobName=summary["TrainingJobName"])
    assert job["TrainingJobName"].startswith("llama70b-128k")
    assert job["ResourceConfig"]["InstanceType"] == "ml.p5e.48xlarge"
    assert job["ResourceConfig"]["InstanceCount"] == 4
    assert job["AlgorithmSpecification"]["TrainingImage"] == spec.image
    lineage_uri = f"{spec.engine.checkpoint_uri}/{spec.lineage}"
    assert "CheckpointConfig" not in job  # 70B: each host copies its own checkpoint files
    assert trainer.environment["LAUNCHER_CHECKPOINT_S3"] == lineage_uri
    assert job["StoppingCondition"]["MaxRuntimeInSeconds"] == spec.max_run_s
    assert job["RoleArn"] == spec.engine.role_arn
    assert "train" in {c["ChannelName"] for c in job["InputDataConfig"]}


def test_only_sagemaker_specs_convert(home, fake_bundle):
    from launcher.errors import UsageError

    with pytest.raises(UsageError, match="needs a sagemaker spec, not local"):
        to_model_trainer(spec_for("tiny-cpu", "local"))


def test_without_credentials_the_error_is_one_line_not_a_botocore_traceback(home, fake_bundle, monkeypatch):
    from launcher.backends.sagemaker import aws
    from launcher.errors import LauncherError

    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    aws.reset_clients()
    with pytest.raises(LauncherError) as raised:
        to_model_trainer(spec_for("llama70b-128k", "sagemaker"))
    assert str(raised.value) == (
        "to_model_trainer(llama70b-128k-job): no AWS credentials found; run `aws configure`, set AWS_PROFILE, "
        "or run on a machine with an IAM role"
    )
