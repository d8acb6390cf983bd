"""The request validator enforces botocore's SageMaker model: the checks moto and botocore skip."""

from __future__ import annotations

import ast
import copy
import re

import pytest

from launcher.backends.sagemaker.aws_model import unchecked_patterns, validate
from tests import REPO

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


# --- the IAM list of docs/sagemaker.md -----------------------------------------------------------

SAGEMAKER_BACKEND = REPO / "launcher" / "backends" / "sagemaker"
CALLED_SERVICES = ("sagemaker", "s3", "logs", "sts", "service-quotas")
# The calls whose IAM action is not named after them (the Service Authorization Reference).
IAM_ACTION = {
    ("s3", "HeadObject"): "s3:GetObject",
    ("s3", "HeadBucket"): "s3:ListBucket",
    ("sts", "GetCallerIdentity"): None,  # needs no permission (STS API reference)
    # The client is `service-quotas`; IAM's prefix is `servicequotas` (Service Authorization Reference).
    ("service-quotas", "ListServiceQuotas"): "servicequotas:ListServiceQuotas",
    ("service-quotas", "ListAWSDefaultServiceQuotas"): "servicequotas:ListAWSDefaultServiceQuotas",
}
# boto3's own methods that send an operation of the service (s3transfer's single PUT).
BOTO3_METHODS = {"upload_fileobj": ("s3", "PutObject")}
# Actions the list names that no call of the launcher's is named after, and why they are needed.
NEEDED_WITHOUT_A_CALL = {
    "iam:PassRole": "CreateTrainingJob passes the execution role",
    "sagemaker:AddTags": "CreateTrainingJob carries Tags",
    "kms:GenerateDataKey": "an SSE-KMS upload",
    "kms:Encrypt": "an SSE-KMS upload",
    "kms:Decrypt": "HeadObject's checksum of an SSE-KMS object",
}


def documented_user_actions() -> set[str]:
    """The `service:Action` names of docs/sagemaker.md's list for the user who submits."""
    text = (REPO / "docs" / "sagemaker.md").read_text()
    section = text.split("**The user who submits**", 1)[1].split("\n\n", 2)[1]
    return set(re.findall(r"`([a-z0-9-]+:[A-Za-z]+)`", section))


def operations_by_method() -> dict[str, list[tuple[str, str]]]:
    """boto3 method name -> (service, operation) for the services the backend calls."""
    import botocore.session
    from botocore import xform_name

    session = botocore.session.get_session()
    found: dict[str, list[tuple[str, str]]] = {}
    for service in CALLED_SERVICES:
        for operation in session.get_service_model(service).operation_names:
            found.setdefault(xform_name(operation), []).append((service, operation))
    for method, call in BOTO3_METHODS.items():
        found.setdefault(method, []).append(call)
    return found


def backend_calls() -> set[tuple[str, str]]:
    """(service, operation) of every AWS call in the SageMaker backend's source, read from its AST:
    each `x.method(...)` whose method is an operation of the services it uses, and each bound
    method `x.method` handed on to be called elsewhere (quotas.py pages through two listings)."""
    by_method = operations_by_method()
    calls = set()
    for path in sorted(SAGEMAKER_BACKEND.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        # `re.search(...)` is a module's function, not a client's call.
        modules = {alias.asname or alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in modules:
                continue
            if node.attr in by_method:
                candidates = by_method[node.attr]
                assert len(candidates) == 1, f"{path.name}:{node.lineno} {node.attr} is ambiguous: {candidates}"
                calls.add(candidates[0])
    return calls


def test_every_aws_call_of_the_sagemaker_backend_is_in_the_iam_list():
    calls = backend_calls()
    assert ("sagemaker", "ListTags") in calls and ("sts", "GetCallerIdentity") in calls  # the scan sees them
    needed = {IAM_ACTION.get(call, f"{call[0]}:{call[1]}") for call in calls} - {None}
    documented = documented_user_actions()
    assert needed - documented == set(), "calls whose permission docs/sagemaker.md does not list"
    # And the list names nothing the launcher does not need (but says which calls need nothing).
    free = {f"{service}:{operation}" for (service, operation), action in IAM_ACTION.items() if action is None}
    assert documented - needed - set(NEEDED_WITHOUT_A_CALL) - free == set(), "listed, but never called"
