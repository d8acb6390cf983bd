"""What the SageMaker request asks the container to run: the bootstrap, its wheels, its rendezvous,
and the ResourceConfig rules (local NVMe and KMS, training plans)."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import subprocess

import pytest

from launcher import api
from launcher.backends import get_backend
from launcher.backends.sagemaker.aws_model import validate
from launcher.backends.sagemaker.backend import Locations, create_training_job_request
from launcher.backends.wheelhouse import pinned
from launcher.bundle import Bundle, unpack_entrypoint
from launcher.errors import LauncherError

from .helpers import MY_ROLE, REGION, ROLE, recipe_path, spec_for

PLAN = "arn:aws:sagemaker:us-west-2:111122223333:training-plan/llama70b-march"


def rendering_for(recipe: str, **overrides):
    return get_backend("sagemaker").render(spec_for(recipe, "sagemaker", **overrides))


def test_a_multi_host_request_leaves_the_rendezvous_to_the_bootstrap(fake_bundle, home):
    algorithm = rendering_for("llama70b-128k").data["request"]["AlgorithmSpecification"]
    arguments = algorithm["ContainerArguments"]
    assert arguments[:3] == ["python3", "entrypoints/bootstrap.py", "torchrun"]
    assert not [a for a in arguments if a.startswith(("--rdzv", "--nnodes", "--standalone", "--master"))]
    assert "algo-1" not in json.dumps(algorithm)


def test_fp8_jobs_carry_the_pinned_torchao_wheel_on_their_own_channel(fake_bundle, home, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a dry run must not download anything"))
    rendering = rendering_for("llama70b-128k")
    request = rendering.data["request"]
    channels = {c["ChannelName"]: c for c in request["InputDataConfig"]}
    uri = channels["wheels"]["DataSource"]["S3DataSource"]["S3Uri"]
    assert re.fullmatch(r"s3://sagemaker-us-west-2-111122223333/launcher/wheels/[0-9a-f]{64}/", uri)
    assert channels["wheels"]["InputMode"] == "File"
    assert request["Environment"]["LAUNCHER_REQUIREMENTS"] == "torchao==0.18.0"
    assert request["Environment"]["LAUNCHER_WHEELHOUSE"] == "/opt/ml/input/data/wheels"
    assert rendering.data["wheels"] == {"uri": uri, "files": [pinned("torchao").file]}


def test_bf16_jobs_install_nothing(fake_bundle, home):
    request = rendering_for("llama3-8b-8k").data["request"]
    assert "wheels" not in {c["ChannelName"] for c in request["InputDataConfig"]}
    assert not {"LAUNCHER_REQUIREMENTS", "LAUNCHER_WHEELHOUSE"} & set(request["Environment"])


def test_the_container_entrypoint_unpacks_the_bundle_and_runs_through_the_images_entrypoint(tmp_path):
    bundle = Bundle.build('{"name": "t"}\n', entrypoints=recipe_path("tiny-cpu").parents[1] / "entrypoints")
    archive = bundle.write(tmp_path / "code" / "code.tar.gz")
    image_entrypoint = tmp_path / "entrypoint.sh"
    image_entrypoint.write_text('#!/bin/bash\necho "image entrypoint saw: $*"\nexec "$@"\n')
    image_entrypoint.chmod(0o755)
    argv = [*unpack_entrypoint(image_entrypoint=str(image_entrypoint)), "sh", "-c", "pwd; ls entrypoints/bootstrap.py"]
    env = {"PATH": "/usr/bin:/bin", "LAUNCHER_BUNDLE": str(archive), "LAUNCHER_CODE": str(tmp_path / "opt_ml_code")}
    env["LAUNCHER_BUNDLE_SHA256"] = bundle.sha256
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "image entrypoint saw: sh -c pwd; ls entrypoints/bootstrap.py",
        str(tmp_path / "opt_ml_code"),
        "entrypoints/bootstrap.py",
    ]
    # An image without that entrypoint runs the arguments directly.
    image_entrypoint.unlink()
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines() == [str(tmp_path / "opt_ml_code"), "entrypoints/bootstrap.py"]


def test_local_nvme_instances_get_no_volume_kms_key_and_the_render_says_why(fake_bundle, home, cli):
    rendering = rendering_for("llama70b-128k", **{"sagemaker.kms_key_id": "alias/training", "sagemaker.role_arn": ROLE})
    request = rendering.data["request"]
    assert request["OutputDataConfig"]["KmsKeyId"] == "alias/training"
    assert "VolumeKmsKeyId" not in request["ResourceConfig"]
    assert rendering.data["warnings"] == [
        "sagemaker.kms_key_id: not used for the training volumes: ml.p5e.48xlarge stores them on local NVMe, "
        "which its hardware encrypts, and SageMaker rejects VolumeKmsKeyId for it; the key still encrypts "
        "the output and the code upload"
    ]
    result = cli("submit", recipe_path("llama70b-128k"), "--dry-run", "--set", "sagemaker.kms_key_id=alias/training")
    assert result.code == 0, result.err
    assert (
        "warning: sagemaker.kms_key_id: not used for the training volumes: ml.p5e.48xlarge" in result.out + result.err
    )


def test_an_instance_without_local_storage_keeps_the_volume_kms_key(fake_bundle, home):
    spec = spec_for("llama3-8b-8k", "sagemaker", **{"sagemaker.kms_key_id": "alias/training"})
    spec = spec.replace(resources=dataclasses.replace(spec.resources, instance_type="ml.g5.48xlarge"))
    request = create_training_job_request(
        spec, code_uri="s3://b/code.tar.gz", bundle_sha256="0" * 64, locations=Locations.of(spec)
    )
    assert request["ResourceConfig"]["VolumeKmsKeyId"] == "alias/training"
    assert validate("sagemaker", "CreateTrainingJob", request) == []


def test_a_training_plan_goes_to_the_resource_config(fake_bundle, home):
    request = rendering_for("llama70b-128k", **{"sagemaker.training_plan_arn": PLAN}).data["request"]
    assert request["ResourceConfig"]["TrainingPlanArn"] == PLAN
    assert validate("sagemaker", "CreateTrainingJob", request) == []
    assert "TrainingPlanArn" not in rendering_for("llama70b-128k").data["request"]["ResourceConfig"]


@pytest.mark.parametrize(
    "arn",
    [
        "arn:aws:sagemaker:us-west-2:111122223333:training-job/llama70b",  # a job, not a plan
        "arn:aws:sagemaker:us-west-2:1111:training-plan/short-account",
        "llama70b-march",
    ],
)
def test_a_training_plan_arn_that_the_api_would_reject_stops_at_load(arn, cli):
    result = cli("validate", recipe_path("llama70b-128k"), "--set", f"sagemaker.training_plan_arn={arn}")
    assert result.code == 2
    assert "sagemaker.training_plan_arn" in result.out + result.err
    assert "Traceback" not in result.out + result.err


def test_submit_uploads_the_real_wheel_once_beside_the_bundle(aws, home, fake_bundle, torchao_wheel):
    import boto3

    first = api.submit(recipe_path("llama70b-128k"), yes=True, set_options=[MY_ROLE])
    uri = first.rendering.data["wheels"]["uri"]
    bucket, key = (uri + pinned("torchao").file).removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3", region_name=REGION)
    head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    assert head["ContentLength"] == torchao_wheel.stat().st_size
    assert head["ChecksumSHA256"] == base64.b64encode(bytes.fromhex(pinned("torchao").sha256)).decode()
    modified = head["LastModified"]

    api.submit(
        recipe_path("llama70b-128k"), yes=True, set_options=[MY_ROLE]
    )  # the same content address: not uploaded again
    assert s3.head_object(Bucket=bucket, Key=key)["LastModified"] == modified


def test_submit_stops_with_one_line_when_the_wheel_cannot_be_fetched(aws, home, fake_bundle, monkeypatch, tmp_path):
    monkeypatch.setenv("LAUNCHER_WHEEL_CACHE", str(tmp_path / "empty-cache"))
    # pip with no config files, no local wheel directories and an index where nothing listens.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for key in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(LauncherError, match=r"^cannot fetch torchao==0\.18\.0 \(torchao-0\.18\.0-cp310-abi3-"):
        api.submit(recipe_path("llama70b-128k"), yes=True, set_options=[MY_ROLE])
