"""launcher.api.submit: load -> estimate -> spec -> render -> submit, and what stops it early.

Refusals happen before anything is uploaded or created: the tests check the moto server and
$LAUNCHER_HOME stay empty.
"""

from __future__ import annotations

import json
import os
import sys

import boto3
import pytest

from launcher import api
from launcher.errors import RecipeError, UsageError
from tests.backends.helpers import MY_ROLE, REGION, ROLE, load, recipe_path

OOM = {"parallel.context": 1, "parallel.tensor": 1, "parallel.activation_checkpointing": "none"}


def nothing_created(home) -> bool:
    s3 = boto3.client("s3", region_name=REGION)
    sm = boto3.client("sagemaker", region_name=REGION)
    return (
        not home.exists() and not s3.list_buckets()["Buckets"] and not sm.list_training_jobs()["TrainingJobSummaries"]
    )


def test_an_oom_recipe_is_refused_before_any_upload(aws, home, fake_bundle, cli):
    options = [f"--set={k}={v}" for k, v in OOM.items()]
    result = cli("submit", recipe_path("llama70b-128k"), "--set", MY_ROLE, *options)
    assert result.code == 2
    (line,) = result.err_lines
    assert line.startswith("llama70b-128k: would run out of memory: needs ")
    assert "per h200-141gb" in line and "; try: " in line and line.endswith("; nothing was submitted")
    assert nothing_created(home)


def test_a_risky_recipe_needs_force(aws, home, fake_bundle):
    recipe = load("llama3-8b-8k", **{"sagemaker.role_arn": ROLE})
    threshold = api.estimate(recipe).utilization / 2  # same peak, a stricter margin: risky, not oom
    with pytest.raises(api.WontFit, match="risky: needs .* pass --force to submit anyway"):
        api.submit(recipe, threshold=threshold)
    assert nothing_created(home)
    forced = api.submit(recipe, threshold=threshold, force=True)
    assert forced.estimate.verdict == "risky" and forced.job is not None


def test_dry_run_stops_after_render_and_creates_nothing(aws, home, fake_bundle):
    stages = []
    told = []
    report = lambda stage, message: (stages.append(stage), told.append(message))  # noqa: E731
    result = api.submit(recipe_path("llama70b-128k"), dry_run=True, set_options=[MY_ROLE], report=report)
    assert result.dry_run and result.job is None
    # Memory, then run time and cost, then the checkpoint's size and save time, all before the spec;
    # the rendering then says where the checkpoints go.
    assert list(dict.fromkeys(stages)) == [api.Stage.ESTIMATE, api.Stage.SPEC, api.Stage.RENDER]
    assert [m.split(" ")[0] for m in told[:3]] == ["memory:", "time:", "checkpoint"]
    assert told[-1].startswith("checkpoints: s3://")
    assert set(result.rendering.data) == {"request", "bundle", "wheels", "notes"}  # wheels: FP8 needs torchao
    assert nothing_created(home)


def test_submit_runs_every_stage_in_order(aws, home, fake_bundle):
    stages = []
    api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE], report=lambda stage, _: stages.append(stage))
    assert list(dict.fromkeys(stages)) == [api.Stage.ESTIMATE, api.Stage.SPEC, api.Stage.RENDER, api.Stage.SUBMIT]


def test_the_job_runs_the_accumulation_mode_whose_memory_submit_checked(home, fake_bundle):
    # Full checkpointing on one p5: sync_last needs 68% of an H100, sync_each 34%. Under a 50%
    # margin RESOLVE settles auto to sync_each, and that is both what the memory check measured
    # and what resolved.json tells the job to run.
    recipe = load("llama3-8b-8k", **{"parallel.activation_checkpointing": "full"})
    strict = api.submit(recipe, backend="docker", dry_run=True, threshold=0.5)
    assert strict.spec.resolved["parallel"]["grad_accumulation"] == "sync_each"
    assert strict.estimate.per_gpu_peak_bytes == api.estimate(recipe, threshold=0.5).per_gpu_peak_bytes
    assert f"{strict.estimate.utilization:.0%}" == "34%"
    usual = api.submit(recipe, backend="docker", dry_run=True)
    assert usual.spec.resolved["parallel"]["grad_accumulation"] == "sync_last"
    assert f"{usual.estimate.utilization:.0%}" == "68%"
    assert strict.recipe == usual.recipe and strict.recipe.parallel.grad_accumulation == "auto"  # as given


def test_backend_overrides_the_recipes_cluster_backend(home, fake_bundle):
    result = api.submit(recipe_path("tiny-cpu"), backend="docker", dry_run=True)
    assert result.spec.backend == "docker" and result.recipe.cluster.backend == "docker"
    assert result.rendering.data["command"][:2] == ["docker", "run"]


def test_backend_override_is_checked_like_the_recipe(home, fake_bundle):
    with pytest.raises(RecipeError) as error:
        api.submit(recipe_path("llama70b-128k"), backend="local", dry_run=True)
    assert any(p.path == "cluster.instance_count" for p in error.value.problems)


@pytest.mark.parametrize(
    "recipe, backend, overrides, message",
    [
        (
            "llama70b-128k",
            "docker",
            {},
            "the docker backend runs one node, not cluster.instance_count 4; use sagemaker",
        ),
    ],
)
def test_unsupported_requests_fail_before_any_aws_call(aws, home, fake_bundle, recipe, backend, overrides, message):
    with pytest.raises(UsageError) as error:
        api.submit(recipe_path(recipe), backend=backend, set_options=[f"{k}={v}" for k, v in overrides.items()])
    assert message in str(error.value)
    assert nothing_created(home)


def test_accelerate_only_renders(home, fake_bundle, cli):
    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "accelerate")
    assert result.code == 2
    assert result.err_lines[-1] == "the accelerate backend only renders a config; use --dry-run to print it"


def test_docker_without_an_engine_is_one_clear_line(home, fake_bundle, cli, monkeypatch, tmp_path):
    # A docker CLI whose daemon is down. DOCKER_HOST alone would not do: podman's `docker` ignores it.
    down = tmp_path / "docker"
    down.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon at unix:///x.sock.' >&2\nexit 1\n")
    down.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "docker")
    assert result.code == 3  # an engine error
    (line,) = result.err_lines[-1:]
    assert line.startswith("asking the Docker engine: ") and "--dry-run" in line


def test_slurm_without_sbatch_is_one_clear_line(home, fake_bundle, cli, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm")
    assert result.code == 3  # an engine error
    assert "`sbatch` is not installed here" in result.err_lines[-1]


def test_an_unknown_backend_lists_the_real_ones(home, cli):
    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "ray")
    assert result.code == 2
    assert result.err_lines == ["'ray' is not a backend; use sagemaker, local, docker, slurm, k8s or accelerate"]


def test_submit_json_describes_the_job(aws, home, fake_bundle, cli):
    result = cli("submit", recipe_path("llama3-8b-8k"), "--set", MY_ROLE, "--json")
    printed = json.loads(result.out)
    assert printed["backend"] == "sagemaker" and printed["dry_run"] is False
    assert printed["estimate"]["verdict"] == "fits"
    assert printed["job"]["region"] == REGION and printed["spec"]["name"] == printed["name"]


def test_the_cli_imports_no_boto3_or_torch_until_a_verb_needs_them():
    import subprocess

    code = "import sys, launcher.cli; print(sorted(m for m in ('boto3', 'torch', 'sagemaker') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_local_dry_run_imports_no_boto3_or_torch(home):
    import subprocess

    code = (
        "import sys; from launcher import api; "
        f"api.submit({str(recipe_path('tiny-cpu'))!r}, dry_run=True); "
        "print(sorted(m for m in ('boto3', 'torch', 'sagemaker') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_missing_credentials_are_one_clear_line(aws, home, fake_bundle, cli, monkeypatch):
    from launcher.backends.sagemaker import aws as aws_clients

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    aws_clients._session.cache_clear()  # the process-wide session remembers credentials it found
    aws_clients.reset_clients()
    result = cli("submit", recipe_path("llama3-8b-8k"), "--set", MY_ROLE)
    aws_clients._session.cache_clear()
    assert result.code == 2
    assert result.err_lines[-1].endswith(
        ": no AWS credentials found; run `aws configure`, set AWS_PROFILE, or run on a machine with an IAM role"
    )
