"""The request validator enforces botocore's SageMaker model: the checks moto and botocore skip."""

from __future__ import annotations

import copy

import pytest

from launcher.backends.sagemaker.aws_model import unchecked_patterns, validate

ROLE = "arn:aws:iam::111122223333:role/SageMakerTrainingRole"
MINIMAL = {
    "TrainingJobName": "ok-job-1",
    "RoleArn": ROLE,
    "AlgorithmSpecification": {"TrainingImage": "img:1", "TrainingInputMode": "File"},
    "OutputDataConfig": {"S3OutputPath": "s3://bucket/out"},
    "ResourceConfig": {"InstanceType": "ml.p5e.48xlarge", "InstanceCount": 1, "VolumeSizeInGB": 100},
    "StoppingCondition": {"MaxRuntimeInSeconds": 3600},
}


def problems_with(path: str, value) -> list[str]:
    request = copy.deepcopy(MINIMAL)
    *parents, last = path.split(".")
    node = request
    for key in parents:
        node = node.setdefault(key, {})
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return validate("sagemaker", "CreateTrainingJob", request)


def test_accepts_a_minimal_valid_request():
    assert validate("sagemaker", "CreateTrainingJob", MINIMAL) == []


@pytest.mark.parametrize(
    "path, value, expected",
    [
        ("RoleArn", KeyError, "CreateTrainingJob.RoleArn: required member missing"),
        ("TrainingJobName", "bad_name!", "does not match the pattern"),
        ("TrainingJobName", "x" * 64, "64 characters, more than the maximum 63"),
        ("AlgorithmSpecification.TrainingInputMode", "Stream", "'Stream' is not one of Pipe, File, FastFile"),
        ("ResourceConfig.InstanceType", "ml.bogus.huge", "'ml.bogus.huge' is not one of"),
        ("ResourceConfig.InstanceCount", "2", "expected an integer, got str"),
        ("ResourceConfig.InstanceCount", True, "expected an integer, got bool"),
        ("RetryStrategy", {"MaximumRetryAttempts": 31}, "31 is above the maximum 30"),
        ("RetryStrategy", {"MaximumRetryAttempts": 0}, "0 is below the minimum 1"),
        ("StoppingCondition.MaxPendingTimeInSeconds", 60, "60 is below the minimum 1800"),
        ("Environment", {f"K{i}": "v" for i in range(101)}, "101 entries, more than the maximum 100"),
        ("Environment", {"1BAD": "v"}, "does not match the pattern"),
        ("Environment", {"OK": "v" * 513}, "513 characters, more than the maximum 512"),
        ("HyperParameters", {"config": "x" * 2501}, "2501 characters, more than the maximum 2500"),
        ("Tags", [{"Key": "k", "Value": "a$(b)"}], "does not match the pattern"),
        ("Tags", [{"Key": f"k{i}", "Value": "v"} for i in range(51)], "51 items, more than the maximum 50"),
        ("VpcConfig", {"Subnets": [], "SecurityGroupIds": ["sg-1"]}, "0 items, fewer than the minimum 1"),
        ("EnableNetworkIsolation", "true", "expected true or false, got str"),
        ("AlgorithmSpecification.ContainerArguments", ["x" * 257], "257 characters, more than the maximum 256"),
        ("OutputDataConfig.S3OutputPath", "bucket/out", "does not match the pattern"),
        ("Bogus", 1, "CreateTrainingJob.Bogus: not a member of CreateTrainingJobRequest"),
    ],
)
def test_rejects_what_sagemaker_would_reject(path, value, expected):
    problems = problems_with(path, value)
    assert any(expected in p for p in problems), problems


def test_every_pattern_of_a_full_request_is_checked():
    # \p{L}-style Java classes in the Tags patterns need the `regex` module; none may be skipped.
    request = {**MINIMAL, "Tags": [{"Key": "launcher:recipe", "Value": "x"}], "Environment": {"A": "b"}}
    assert unchecked_patterns("sagemaker", "CreateTrainingJob", request) == []
