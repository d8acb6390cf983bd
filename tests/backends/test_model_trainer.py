"""to_model_trainer(spec): the same job through the SageMaker SDK's ModelTrainer, under moto."""

from __future__ import annotations

import boto3
import pytest

from launcher.backends.model_trainer import to_model_trainer

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
    lineage_uri = f"{spec.sagemaker.checkpoint_uri}/{spec.lineage}"
    assert job["CheckpointConfig"] == {"S3Uri": lineage_uri, "LocalPath": "/opt/ml/checkpoints"}
    assert job["StoppingCondition"]["MaxRuntimeInSeconds"] == spec.max_run_s
    assert job["RoleArn"] == spec.sagemaker.role_arn
    assert "train" in {c["ChannelName"] for c in job["InputDataConfig"]}


def test_only_sagemaker_specs_convert(home, fake_bundle):
    from launcher.errors import UsageError

    with pytest.raises(UsageError, match="needs a sagemaker spec, not local"):
        to_model_trainer(spec_for("tiny-cpu", "local"))
