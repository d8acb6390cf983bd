"""The CreateTrainingJob request: valid against botocore's model, complete, and what dry-run prints."""

from __future__ import annotations

import json
import re

import pytest

from launcher.backends import get_backend
from launcher.backends.images import default_image
from launcher.backends.sagemaker.aws_model import validate
from launcher.backends.sagemaker.backend import METRIC_DEFINITIONS
from launcher.errors import UsageError

from .helpers import PLACEHOLDER_ROLE, REPO, ROLE, spec_for

IMAGE_2_13 = "{account}.dkr.ecr.{region}.amazonaws.com{suffix}/pytorch:2.13.0-cu133-amzn2023-sagemaker"

SAGEMAKER_RECIPES = sorted(
    p.stem
    for p in (REPO / "recipes").glob("*.yaml")
    if "backend: sagemaker" in p.read_text() or "extends:" in p.read_text()
)


def request_for(recipe: str, **overrides) -> dict:
    spec = spec_for(recipe, "sagemaker", **overrides)
    return get_backend("sagemaker").render(spec).data["request"]


@pytest.mark.parametrize("recipe", SAGEMAKER_RECIPES)
def test_every_sagemaker_recipe_gives_a_request_the_service_model_accepts(recipe, fake_bundle, home):
    assert validate("sagemaker", "CreateTrainingJob", request_for(recipe)) == []


def test_the_request_carries_the_whole_job(fake_bundle, home):
    request = request_for("llama70b-128k")
    algorithm = request["AlgorithmSpecification"]
    assert algorithm["TrainingImage"] == IMAGE_2_13.format(account="763104351884", region="us-west-2", suffix="")
    assert algorithm["ContainerEntrypoint"][:2] == ["/bin/bash", "-c"]
    assert algorithm["ContainerArguments"] == [
        "python3",
        "entrypoints/bootstrap.py",
        "torchrun",
        "--nproc-per-node=8",
        "--max-restarts=1",
        "--shutdown-timeout=100",
        "entrypoints/train.py",
        "--config",
        "resolved.json",
    ]
    assert request["ResourceConfig"] == {"InstanceType": "ml.p5e.48xlarge", "InstanceCount": 4, "VolumeSizeInGB": 500}
    # Per lineage: a fresh job starts its own (its name); `--resume` continues another's. At 3 x 847
    # GB, CheckpointConfig would copy 2.5 TB to every host at each start: each host copies its own.
    assert "CheckpointConfig" not in request
    assert request["Environment"]["LAUNCHER_CHECKPOINT_S3"] == (
        f"s3://my-training-bucket/checkpoints/llama70b-128k/{request['TrainingJobName']}"
    )
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 4 * 86400}
    assert request["RoleArn"] == PLACEHOLDER_ROLE
    assert request["OutputDataConfig"] == {
        "S3OutputPath": "s3://sagemaker-us-west-2-111122223333/launcher/llama70b-128k",
        "CompressionType": "NONE",
    }
    assert {"Key": "project", "Value": "long-context"} in request["Tags"]
    assert request["EnableNetworkIsolation"] is False and request["EnableManagedSpotTraining"] is False
    assert request["Environment"]["FI_PROVIDER"] == "efa"
    channels = {c["ChannelName"]: c for c in request["InputDataConfig"]}
    assert channels["train"]["DataSource"]["S3DataSource"]["S3Uri"] == "s3://my-training-bucket/tokens/llama3-128k/"
    code_uri = channels["code"]["DataSource"]["S3DataSource"]["S3Uri"]
    assert re.fullmatch(r"s3://sagemaker-us-west-2-111122223333/launcher/code/[0-9a-f]{64}/code\.tar\.gz", code_uri)


@pytest.mark.parametrize(
    "export_hf, where",
    [(True, "/opt/ml/model/hf"), ("final", "/opt/ml/model/final"), ("/fsx/exports/final", "/fsx/exports/final")],
)
def test_an_hf_export_goes_to_the_model_artifact_uploaded_uncompressed(fake_bundle, home, export_hf, where):
    # /opt/ml/output/data would reach S3 only inside output.tar.gz, gzipped while the cluster is billed.
    spec = spec_for("llama70b-128k", "sagemaker", **{"checkpoint.export_hf": export_hf})
    assert spec.resolved["checkpoint"]["export_hf"] == where
    request = get_backend("sagemaker").render(spec).data["request"]
    assert request["OutputDataConfig"]["CompressionType"] == "NONE"
    assert validate("sagemaker", "CreateTrainingJob", request) == []


@pytest.mark.parametrize("backend", ["local", "slurm", "k8s", "docker"])
def test_other_backends_keep_an_hf_export_under_their_output_directory(backend):
    spec = spec_for("tiny-cpu", backend, **{"checkpoint.export_hf": True})
    assert spec.resolved["checkpoint"]["export_hf"] == "hf"  # the entrypoints put it under runtime.output_dir


@pytest.mark.parametrize(
    "recipe, overrides, checked",
    [
        ("llama70b-128k", {}, True),  # 4 x ml.p5e.48xlarge: auto checks them
        ("llama3-8b-8k", {}, False),  # one host: no network between hosts to check
        ("llama3-8b-8k", {"cluster.instance_count": 2}, True),
        ("llama70b-128k", {"sagemaker.infra_check": False}, False),
        ("llama3-8b-8k", {"sagemaker.infra_check": True}, True),
    ],
)
def test_multi_node_gpu_jobs_get_the_infrastructure_health_check(fake_bundle, home, recipe, overrides, checked):
    request = request_for(recipe, **overrides)
    assert request.get("InfraCheckConfig") == ({"EnableInfraCheck": True} if checked else None)
    assert validate("sagemaker", "CreateTrainingJob", request) == []


def test_a_multi_node_job_in_a_vpc_is_warned_of_the_security_group_rule_efa_needs(fake_bundle, home):
    vpc = {
        "sagemaker.subnets": ["subnet-0abc"],
        "sagemaker.security_group_ids": ["sg-0def"],
        "sagemaker.role_arn": ROLE,
    }
    spec = spec_for("llama70b-128k", "sagemaker", **vpc)
    assert get_backend("sagemaker").render(spec).data["warnings"] == [
        "sagemaker.security_group_ids: the 4 instances' EFA and NCCL traffic flows through sg-0def: a group must "
        "allow all traffic in from and out to itself, or the job stalls at its first collective "
        "(docs/sagemaker.md, 'Security groups for EFA')"
    ]
    # One instance has no traffic between instances; no VPC, no security groups of the user's.
    assert "warnings" not in get_backend("sagemaker").render(spec_for("llama3-8b-8k", "sagemaker", **vpc)).data
    mine = spec_for("llama70b-128k", "sagemaker", **{"sagemaker.role_arn": ROLE})
    assert "warnings" not in get_backend("sagemaker").render(mine).data


def test_the_recipe_never_becomes_hyperparameters(fake_bundle, home):
    request = request_for("llama405b-128k")
    assert "HyperParameters" not in request
    assert "resolved.json" in json.dumps(request)


def test_spot_vpc_kms_isolation_encryption_and_retries(fake_bundle, home):
    request = request_for(
        "llama3-8b-8k",
        **{
            "sagemaker.spot": True,
            "sagemaker.max_wait": "3d",
            "sagemaker.subnets": ["subnet-0abc"],
            "sagemaker.security_group_ids": ["sg-0def"],
            "sagemaker.kms_key_id": "alias/training",
            "sagemaker.network_isolation": True,
            "sagemaker.encrypt_inter_container_traffic": True,
            "sagemaker.retries": 3,
        },
    )
    assert request["EnableManagedSpotTraining"] is True
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 2 * 86400, "MaxWaitTimeInSeconds": 3 * 86400}
    assert request["VpcConfig"] == {"Subnets": ["subnet-0abc"], "SecurityGroupIds": ["sg-0def"]}
    assert request["OutputDataConfig"]["KmsKeyId"] == "alias/training"
    assert "VolumeKmsKeyId" not in request["ResourceConfig"]  # p5: local NVMe (see below)
    assert request["EnableNetworkIsolation"] is True and request["EnableInterContainerTrafficEncryption"] is True
    assert request["RetryStrategy"] == {"MaximumRetryAttempts": 3}
    assert validate("sagemaker", "CreateTrainingJob", request) == []


def test_a_recipe_image_and_output_uri_are_used_as_given(fake_bundle, home):
    request = request_for(
        "llama3-8b-8k",
        **{
            "cluster.image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/mine:1",
            "sagemaker.output_uri": "s3://my-bucket/p",
        },
    )
    assert request["AlgorithmSpecification"]["TrainingImage"] == "123456789012.dkr.ecr.us-west-2.amazonaws.com/mine:1"
    assert request["OutputDataConfig"]["S3OutputPath"] == "s3://my-bucket/p/llama3-8b-8k"
    assert (
        request["CheckpointConfig"]["S3Uri"]
        == f"s3://my-bucket/p/llama3-8b-8k/checkpoints/{request['TrainingJobName']}"
    )


@pytest.mark.parametrize(
    "region, uri",
    [
        ("us-east-1", IMAGE_2_13.format(account="763104351884", region="us-east-1", suffix="")),
        ("ap-east-1", IMAGE_2_13.format(account="871362719292", region="ap-east-1", suffix="")),
        ("cn-north-1", IMAGE_2_13.format(account="727897471807", region="cn-north-1", suffix=".cn")),
        ("us-gov-west-1", IMAGE_2_13.format(account="442386744353", region="us-gov-west-1", suffix="")),
    ],
)
def test_the_default_image_is_the_regions_pytorch_dlc(region, uri):
    assert default_image(region) == uri


def test_a_region_without_a_known_image_asks_for_one():
    with pytest.raises(UsageError, match="no PyTorch training image is known for xx-mars-1; set cluster.image"):
        default_image("xx-mars-1")


def test_a_missing_role_says_how_to_set_it(fake_bundle, home):
    spec = spec_for("llama3-8b-8k", "sagemaker", **{"sagemaker.role_arn": None})
    with pytest.raises(UsageError) as error:
        get_backend("sagemaker").render(spec)
    assert "sagemaker.role_arn: not set" in str(error.value)
    assert "--set sagemaker.role_arn=arn:aws:iam::<account>:role/" in str(error.value)


def test_restarts_inside_the_job_are_on_only_where_a_restart_finds_the_newest_checkpoint(fake_bundle, home):
    def restarts(**overrides) -> str:
        spec = spec_for("llama3-8b-8k", "sagemaker", **overrides)
        return [a for a in spec.command if a.startswith("--max-restarts=")][0]

    # One host holds every file of its checkpoints; per-host copies restore from S3 before a resume.
    assert restarts() == "--max-restarts=1"
    assert restarts(**{"cluster.instance_count": 2, "sagemaker.checkpoint_copy": "per_host"}) == "--max-restarts=1"
    # CheckpointConfig copies the other hosts' files only when the job starts.
    several = {"cluster.instance_count": 2, "sagemaker.checkpoint_copy": "checkpoint_config"}
    assert restarts(**several) == "--max-restarts=0"
    spec = spec_for("llama3-8b-8k", "sagemaker", **several, **{"cluster.max_restarts": 2})
    with pytest.raises(UsageError) as error:
        get_backend("sagemaker").render(spec)
    assert (
        "cluster.max_restarts: 2 on 2 SageMaker hosts would restart from the checkpoint the job started with: "
        "CheckpointConfig downloads the other hosts' files only when the job starts; set "
        "sagemaker.checkpoint_copy: per_host (each host restores its files from S3) or cluster.max_restarts: 0"
    ) in str(error.value)


def test_a_request_that_breaks_the_model_is_refused_before_sending(fake_bundle, home):
    spec = spec_for("llama3-8b-8k", "sagemaker", **{"sagemaker.tags": {"owner": "a;b"}})
    with pytest.raises(UsageError, match=r"Tags\[0\]\.Value: 'a;b' does not match the pattern"):
        get_backend("sagemaker").render(spec)


METRIC_LINE = (
    "metrics step=12 loss=2.3456 grad_norm=0.8123 lr=0.0003 tokens_per_s_per_gpu=5321.4 mfu=0.3712 "
    "step_time_s=1.5394 mem_alloc_gib=61.2 mem_reserved_gib=70.5"
)
EVALUATED = " val_loss=2.5012 val_perplexity=12.198"  # what a step that evaluated held-out data adds


def test_metric_definitions_read_every_field_of_the_metric_line():
    values = {m["Name"]: re.search(m["Regex"], METRIC_LINE + EVALUATED).group(1) for m in METRIC_DEFINITIONS}
    assert values == {
        "train:step": "12",
        "train:loss": "2.3456",
        "train:grad_norm": "0.8123",
        "train:lr": "0.0003",
        "train:tokens_per_s_per_gpu": "5321.4",
        "train:mfu": "0.3712",
        "train:step_time_s": "1.5394",
        "train:mem_alloc_gib": "61.2",
        "train:mem_reserved_gib": "70.5",
        "validation:loss": "2.5012",
        "validation:perplexity": "12.198",
    }


def test_validation_definitions_read_nothing_from_a_step_that_did_not_evaluate():
    validation = [m for m in METRIC_DEFINITIONS if m["Name"].startswith("validation:")]
    assert [m["Name"] for m in validation] == ["validation:loss", "validation:perplexity"]
    assert all(re.search(m["Regex"], METRIC_LINE) is None for m in validation)
    # and `loss` is not read out of val_loss
    train_loss = next(m for m in METRIC_DEFINITIONS if m["Name"] == "train:loss")
    assert re.search(train_loss["Regex"], "metrics step=3 grad_norm=1 val_loss=9.5") is None


def test_metric_definitions_ignore_other_lines_and_nan():
    for line in ("summary steps=3 final_loss=1.5", "loss=1.0 step=3", "metrics step=1 loss=nan grad_norm=1"):
        assert not re.search(METRIC_DEFINITIONS[1]["Regex"], line)
    assert re.search(METRIC_DEFINITIONS[5]["Regex"], "[algo-1] metrics step=1 loss=2 mfu=1e-3").group(1) == "1e-3"


def test_metric_definitions_read_every_key_of_the_line_the_entrypoints_print():
    # Read entrypoints/metrics.py as text (importing it would import torch): it prints its lines
    # with the contract's metrics_line, so the definitions read what the entrypoints print.
    import ast

    from launcher.contract.metrics import METRIC_KEYS, SAGEMAKER_METRIC_NAMES, VALIDATION_KEYS, metrics_line

    tree = ast.parse((REPO / "entrypoints" / "metrics.py").read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "launcher.contract.metrics"
        for alias in node.names
    }
    assert "metrics_line" in imported
    keys = (*METRIC_KEYS, *VALIDATION_KEYS)
    record = {key: 7 if key == "step" else 0.25 * (i + 1) for i, key in enumerate(keys)}
    line = metrics_line(record)
    values = {m["Name"]: float(re.search(m["Regex"], line).group(1)) for m in METRIC_DEFINITIONS}
    assert values == {SAGEMAKER_METRIC_NAMES[key]: float(value) for key, value in record.items()}
