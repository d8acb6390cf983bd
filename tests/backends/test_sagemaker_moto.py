"""SageMaker submit, status, logs and list against a moto server (S3, SageMaker, CloudWatch Logs)."""

from __future__ import annotations

import hashlib
import json
import re
import time

import boto3
import pytest

from launcher import api
from launcher.backends.sagemaker import aws as aws_clients
from launcher.backends.sagemaker.aws_model import validate

from .helpers import ACCOUNT, MY_ROLE, REGION, recipe_path


def boto(service: str):
    return boto3.client(service, region_name=REGION)


def recorded(service: str, operation: str) -> list[dict]:
    """Parameters of every `operation` call the launcher's own client sends from now on."""
    calls: list[dict] = []
    client = aws_clients.client(service, REGION)
    client.meta.events.register(
        f"provide-client-params.{service}.{operation}", lambda params, **_: calls.append(params)
    )
    return calls


def test_submit_uploads_the_bundle_and_creates_the_job(aws, home, fake_bundle):
    result = api.submit(recipe_path("llama70b-128k"), yes=True, set_options=[MY_ROLE])
    name = result.spec.name
    code_uri = result.rendering.data["bundle"]["uri"]
    bucket, key = code_uri.removeprefix("s3://").split("/", 1)
    body = boto("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    assert hashlib.sha256(body).hexdigest() == result.rendering.data["bundle"]["sha256"] in key

    job = boto("sagemaker").describe_training_job(TrainingJobName=name)
    assert job["ResourceConfig"]["InstanceType"] == "ml.p5e.48xlarge"
    assert job["ResourceConfig"]["InstanceCount"] == 4
    assert "CheckpointConfig" not in job  # 3 x 847 GB to every host at each start: each host copies its own
    assert job["RoleArn"] == result.spec.engine.role_arn
    record = json.loads((home / "jobs" / name / "job.json").read_text())
    assert record["backend"] == "sagemaker" and record["region"] == REGION
    assert json.loads((home / "jobs" / name / "resolved.json").read_text()) == result.spec.resolved


def test_submit_sends_byte_for_byte_what_dry_run_printed(aws, home, fake_bundle, fixed_names, cli):
    dry = cli("submit", recipe_path("llama70b-128k"), "--set", MY_ROLE, "--dry-run", "--json")
    assert dry.code == 0, dry.err
    sent = recorded("sagemaker", "CreateTrainingJob")
    submitted = cli("submit", recipe_path("llama70b-128k"), "--set", MY_ROLE, "--json", "--yes")
    assert submitted.code == 0, submitted.err
    assert json.dumps(sent) == json.dumps([json.loads(dry.out)["request"]])


def test_dry_run_prints_request_and_bundle_and_creates_nothing(aws, home, cli):
    # The real entrypoints: the README's dry-run command, exactly.
    result = cli("submit", recipe_path("llama70b-128k"), "--dry-run", "--json")
    assert result.code == 0, result.err
    printed = json.loads(result.out)
    assert set(printed) == {"request", "bundle", "wheels", "warnings", "notes"}
    # The recipe's role is still the documentation's: dry-run prints the request, and says so.
    assert printed["warnings"] == [
        "sagemaker.role_arn: 111122223333 is an example account of AWS's documentation, not yours; set your "
        "execution role, e.g. --set sagemaker.role_arn=arn:aws:iam::<your account>:role/<name>; submit refuses it"
    ]
    prefix = printed["request"]["Environment"]["LAUNCHER_CHECKPOINT_S3"]
    assert printed["notes"] == [
        f"checkpoints: {prefix}, written to /opt/ml/checkpoints and copied there by each host, which reads back "
        "only its own files (no CheckpointConfig: it would copy every checkpoint to every host)"
    ]
    assert validate("sagemaker", "CreateTrainingJob", printed["request"]) == []
    assert "entrypoints/train.py" in printed["bundle"]["files"] and "resolved.json" in printed["bundle"]["files"]
    assert boto("s3").list_buckets()["Buckets"] == []
    assert boto("sagemaker").list_training_jobs()["TrainingJobSummaries"] == []
    assert not home.exists()


def test_an_unchanged_bundle_is_uploaded_once(aws, home, fake_bundle):
    puts = recorded("s3", "PutObject")
    first = api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE, MY_ROLE])
    second = api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE, MY_ROLE])
    assert first.spec.name != second.spec.name
    assert first.rendering.data["bundle"]["uri"] == second.rendering.data["bundle"]["uri"]
    assert len(puts) == 1


def test_status_and_list_read_sagemaker(aws, home, fake_bundle, cli):
    name = api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE, MY_ROLE]).spec.name
    status = cli("status", name, "--json")
    assert status.code == 0, status.err
    assert json.loads(status.out)["state"] == "Completed" and json.loads(status.out)["backend"] == "sagemaker"
    listed = cli("list", "--backend", "sagemaker", "--region", REGION, "--json")
    assert [job["name"] for job in json.loads(listed.out)] == [name]
    mine = cli("list", "--json")
    assert [(job["name"], job["state"]) for job in json.loads(mine.out)] == [(name, "Completed")]


def test_a_job_from_elsewhere_is_found_with_backend_and_region(aws, home, fake_bundle, cli):
    name = api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE, MY_ROLE]).spec.name
    (home / "jobs" / name / "job.json").unlink()
    assert "no job named" in cli("status", name).err
    found = cli("status", name, "--backend", "sagemaker", "--region", REGION, "--json")
    assert json.loads(found.out)["name"] == name


def test_logs_merge_every_hosts_stream_and_follow_ends_with_the_job(aws, home, fake_bundle, cli):
    name = api.submit(recipe_path("llama70b-128k"), yes=True, set_options=[MY_ROLE]).spec.name
    logs = boto("logs")
    group = "/aws/sagemaker/TrainingJobs"
    logs.create_log_group(logGroupName=group)
    now = int(time.time() * 1000)  # CloudWatch drops events older than its retention
    hosts = {"algo-1": [(now, "metrics step=1 loss=3.0"), (now + 2, "summary steps=2")], "algo-2": [(now + 1, "ready")]}
    for host, events in hosts.items():
        stream = f"{name}/{host}-1700000000"
        logs.create_log_stream(logGroupName=group, logStreamName=stream)
        logs.put_log_events(
            logGroupName=group, logStreamName=stream, logEvents=[{"timestamp": t, "message": m} for t, m in events]
        )
    result = cli("logs", name, "--follow")
    assert result.code == 0, result.err
    assert result.out.splitlines() == ["[algo-1] metrics step=1 loss=3.0", "[algo-2] ready", "[algo-1] summary steps=2"]
    as_json = cli("logs", name, "--json")
    assert json.loads(as_json.out.splitlines()[0]) == {"line": "[algo-1] metrics step=1 loss=3.0"}


def test_logs_of_a_job_that_ended_without_streams_say_so(aws, home, fake_bundle, cli):
    name = api.submit(
        recipe_path("llama3-8b-8k"), set_options=[MY_ROLE, MY_ROLE]
    ).spec.name  # moto's jobs complete at once
    result = cli("logs", name)
    assert (result.code, result.out) == (1, "")
    assert result.err_lines == [
        f"{name}: no log streams in /aws/sagemaker/TrainingJobs/{name}: the job ended (Completed) before any "
        f"host wrote one; `launcher status {name}` shows why"
    ]
    followed = cli("logs", name, "--follow")  # following ends with the job, and its exit code
    assert (followed.code, followed.out, followed.err) == (0, "", "")


def test_a_user_bucket_that_does_not_exist_is_one_clear_line(aws, home, fake_bundle, cli):
    result = cli(
        "submit", recipe_path("llama3-8b-8k"), "--set", MY_ROLE, "--set", "sagemaker.output_uri=s3://no-such-bucket/x"
    )
    assert result.code != 0
    assert result.err_lines[-1].startswith("uploading the code bundle to bucket no-such-bucket: ")
    assert boto("sagemaker").list_training_jobs()["TrainingJobSummaries"] == []


@pytest.mark.parametrize("region", ["us-east-1", "eu-west-1"])
def test_the_default_bucket_is_created_in_the_jobs_region(aws, home, fake_bundle, region):
    api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE, f"sagemaker.region={region}"])
    bucket = f"sagemaker-{region}-{ACCOUNT}"  # the caller's account: STS's answer
    location = boto3.client("s3", region_name=region).get_bucket_location(Bucket=bucket)["LocationConstraint"]
    assert (location or "us-east-1") == region


def test_a_resume_reads_which_checkpoint_it_starts_from_in_s3_and_refuses_one_past_the_last_step(
    aws, home, fake_bundle
):
    """`submit --resume` on SageMaker lists the lineage's S3 prefix (ListObjectsV2, as the job's
    checkpoints lie there: step directories, every host's COMPLETE marker) before any instance
    starts: the newest complete step is said, and one at or past training.steps is refused."""
    from launcher.backends import get_backend
    from launcher.errors import UsageError

    first = api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE], yes=True).spec
    prefix = get_backend("sagemaker").checkpoint_location(first)
    bucket, key = prefix.removeprefix("s3://").split("/", 1)

    def resume(*options: str) -> list[str]:
        told = []
        report = lambda stage, message: told.append(message)  # noqa: E731
        api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE, *options], resume=first.name, dry_run=True,
                   report=report)  # fmt: skip
        return told

    assert f"warning: --resume {first.name}: no complete checkpoint in {prefix}; the job starts from step 0" in resume()
    s3 = boto("s3")
    for step, markers in ((10, 2), (20, 1)):  # step 20: host 1 never finished its upload
        directory = f"{key}/step-{step:08d}"
        s3.put_object(Bucket=bucket, Key=f"{directory}/__0_0.distcp", Body=b"shard")
        for node in range(markers):
            s3.put_object(Bucket=bucket, Key=f"{directory}/COMPLETE.node-{node}-of-2", Body=b"{}")
    s3.put_object(Bucket=bucket, Key=f"{key}/step-junk/COMPLETE.node-0-of-1", Body=b"{}")  # not a step
    listed = recorded("s3", "ListObjectsV2")
    start = (
        f"resumes from {prefix}/step-00000010, the newest complete checkpoint (step 10; an older one if it is damaged)"
    )
    told = resume("training.steps=100")
    assert start in told
    # Time and cost are those of the 90 steps after the checkpoint, not of all 100.
    assert any(re.match(r"time: \S+ s/step x 90 steps after step 10 = ", line) for line in told), told
    assert listed and all(call["ExpectedBucketOwner"] == ACCOUNT for call in listed)  # the default bucket
    with pytest.raises(
        UsageError, match=rf"^checkpoint: the newest complete checkpoint in {prefix} is at step 10, and "
    ):
        resume("training.steps=10")
