"""What moto cannot show: status progressions, failures, stop, AWS errors and throttling.

botocore's Stubber checks each stubbed call's parameters and responses against the same
service model the real client uses.
"""

from __future__ import annotations

import json

import pytest
from botocore.awsrequest import AWSResponse

from launcher import api
from launcher.backends.sagemaker import aws as aws_clients

from .helpers import MY_ROLE, REGION, recipe_path
from .sagemaker_stubs import NAME, T0, description, stub


def test_status_shows_every_transition_and_the_failure_reason(registered, cli):
    sm = stub("sagemaker")
    failed = description(
        "Failed",
        "Failed",
        transitions=[
            ("Starting", "Preparing the instances"),
            ("Training", "Training image download completed"),
            ("Failed", ""),
        ],
        failure="AlgorithmError: ExecuteUserScriptError: exit code 1",
    )
    sm.add_response("describe_training_job", failed, {"TrainingJobName": NAME})
    sm.add_response("describe_training_job", failed, {"TrainingJobName": NAME})
    text = cli("status", NAME)
    assert text.code == 0, text.err
    assert "failure  AlgorithmError: ExecuteUserScriptError: exit code 1" in text.out
    assert "- Training                 2026-11-09T15:31:00+00:00  Training image download completed" in text.out
    as_json = json.loads(cli("status", NAME, "--json").out)
    assert [t["status"] for t in as_json["transitions"]] == ["Starting", "Training", "Failed"]
    assert as_json["state"] == "Failed" and as_json["terminal"] is True and as_json["exit_code"] == 1
    sm.assert_no_pending_responses()


def test_following_logs_reads_until_the_job_ends_then_stops(registered):
    sm, logs = stub("sagemaker"), stub("logs")
    sm.add_response("describe_training_job", description("InProgress", "Starting", count=2), {"TrainingJobName": NAME})
    sm.add_response("describe_training_job", description("InProgress", "Training", count=2), {"TrainingJobName": NAME})
    sm.add_response("describe_training_job", description("Completed", "Completed", count=2), {"TrainingJobName": NAME})
    group = "/aws/sagemaker/TrainingJobs"
    streams = {
        "logStreams": [{"logStreamName": f"{NAME}/algo-1-1700000000"}, {"logStreamName": f"{NAME}/algo-2-1700000000"}]
    }
    prefix = {"logGroupName": group, "logStreamNamePrefix": f"{NAME}/"}

    def events(stream: str, token: str | None, messages: list[tuple[int, str]], new_token: str):
        params = {"logGroupName": group, "logStreamName": f"{NAME}/{stream}-1700000000", "startFromHead": True}
        if token:
            params["nextToken"] = token
        response = {"events": [{"timestamp": t, "message": m} for t, m in messages], "nextForwardToken": new_token}
        logs.add_response("get_log_events", response, params)

    # First poll: the job is training. Each stream is read until its token stops moving.
    logs.add_response("describe_log_streams", streams, prefix)
    events("algo-1", None, [(1, "step 1")], "f1")
    events("algo-1", "f1", [], "f1")
    events("algo-2", None, [(2, "host 2 up")], "g1")
    events("algo-2", "g1", [], "g1")
    # Second poll: the job has ended; this read drains the last lines and following returns.
    logs.add_response("describe_log_streams", streams, prefix)
    events("algo-1", "f1", [(3, "summary steps=1")], "f2")
    events("algo-1", "f2", [], "f2")
    events("algo-2", "g1", [], "g1")

    lines = list(api.logs(NAME, follow=True, poll_s=0))
    assert lines == ["[algo-1] step 1", "[algo-2] host 2 up", "[algo-1] summary steps=1"]
    sm.assert_no_pending_responses()
    logs.assert_no_pending_responses()


def test_logs_of_a_job_whose_hosts_have_not_started_say_so(registered, cli):
    sm, logs = stub("sagemaker"), stub("logs")
    sm.add_response("describe_training_job", description("InProgress", "Starting"), {"TrainingJobName": NAME})
    prefix = {"logGroupName": "/aws/sagemaker/TrainingJobs", "logStreamNamePrefix": f"{NAME}/"}
    logs.add_response("describe_log_streams", {"logStreams": []}, prefix)
    result = cli("logs", NAME)
    assert (result.code, result.out) == (1, "")
    assert result.err_lines == [
        f"{NAME}: no log streams yet in /aws/sagemaker/TrainingJobs/{NAME} (the job is InProgress, Starting): each "
        f"host opens one when its container starts; `launcher logs {NAME} --follow` waits for them"
    ]
    sm.assert_no_pending_responses()
    logs.assert_no_pending_responses()


def test_stop_asks_sagemaker_and_reports_stopping(registered, cli):
    sm = stub("sagemaker")
    sm.add_response("describe_training_job", description("InProgress", "Training"), {"TrainingJobName": NAME})
    sm.add_response("stop_training_job", {}, {"TrainingJobName": NAME})
    sm.add_response("describe_training_job", description("Stopping", "Stopping"), {"TrainingJobName": NAME})
    result = cli("stop", NAME, "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["state"] == "Stopping"
    sm.assert_no_pending_responses()


@pytest.mark.parametrize("state", ["Completed", "Failed", "Stopped"])
def test_stop_of_a_job_that_has_ended_says_so_and_sends_no_stop(registered, cli, state):
    sm = stub("sagemaker")  # a StopTrainingJob call would be one the Stubber was not told of: an error
    ended = description(state, state)
    ended["TrainingEndTime"] = T0
    sm.add_response("describe_training_job", ended, {"TrainingJobName": NAME})
    result = cli("stop", NAME)
    assert result.code == 0, result.err
    assert f"  stop     not sent: the job had already ended ({state} at {T0.isoformat()})" in result.out.splitlines()
    sm.assert_no_pending_responses()


def test_a_job_that_ends_while_stop_is_sent_is_reported_as_ended(registered, cli):
    sm = stub("sagemaker")
    sm.add_response("describe_training_job", description("InProgress", "Uploading"), {"TrainingJobName": NAME})
    sm.add_client_error(
        "stop_training_job",
        service_error_code="ValidationException",
        service_message="The request was rejected because the training job is in status Completed.",
        expected_params={"TrainingJobName": NAME},
    )
    sm.add_response("describe_training_job", description("Completed", "Completed"), {"TrainingJobName": NAME})
    result = cli("stop", NAME, "--json")
    assert result.code == 0, result.err
    stopped = json.loads(result.out)
    assert (stopped["state"], stopped["details"]["stop"]) == (
        "Completed",
        "not sent: the job had already ended (Completed)",
    )
    sm.assert_no_pending_responses()


def test_waiting_returns_the_final_state_and_exit_code(registered):
    from launcher.jobs import Job

    sm, logs = stub("sagemaker"), stub("logs")
    sm.add_response("describe_training_job", description("InProgress", "Training"), {"TrainingJobName": NAME})
    sm.add_response("describe_training_job", description("Failed", "Failed", failure="boom"), {"TrainingJobName": NAME})
    sm.add_response("describe_training_job", description("Failed", "Failed", failure="boom"), {"TrainingJobName": NAME})
    logs.add_client_error("describe_log_streams", service_error_code="ResourceNotFoundException", http_status_code=400)
    final = Job.find(NAME).wait(poll_s=0)
    assert (final.state, final.failure_reason, final.exit_code) == ("Failed", "boom", 1)


QUOTA_MESSAGE = (
    "The account-level service limit 'ml.p5.48xlarge for training job usage' is 0 Instances, with current "
    "utilization of 0 Instances and a request delta of 1 Instances. Please use AWS Service Quotas to request an "
    "increase for this quota."
)


@pytest.mark.parametrize(
    "code, message, expected",
    [
        (
            "ResourceLimitExceeded",
            QUOTA_MESSAGE,
            f"CreateTrainingJob llama3-8b-8k-job: SageMaker quota 'ml.p5.48xlarge for training job usage' in {REGION} is too low",
        ),
        (
            # A limit on run time that quotes no quota name: the hint names the run-time quota,
            # not the instance quota.
            "ResourceLimitExceeded",
            "MaxRuntimeInSeconds 172800 is more than the account's limit on run time for a training job",
            f"CreateTrainingJob llama3-8b-8k-job: SageMaker quota 'Longest run time for a training job' in {REGION} "
            "is too low",
        ),
        (
            "AccessDeniedException",
            "User: arn:aws:iam::1:user/x is not authorized to perform: sagemaker:CreateTrainingJob",
            "CreateTrainingJob llama3-8b-8k-job: AWS denied access (User: arn:aws:iam::1:user/x is not authorized",
        ),
        (
            "ValidationException",
            "Could not assume role arn:aws:iam::111122223333:role/SageMakerTrainingRole.",
            "CreateTrainingJob llama3-8b-8k-job: SageMaker rejected the request: Could not assume role",
        ),
        (
            "ResourceInUse",
            "Training job names must be unique within an AWS account and region",
            f"CreateTrainingJob llama3-8b-8k-job: a training job named llama3-8b-8k-job already exists in {REGION}",
        ),
    ],
)
def test_aws_errors_become_one_clear_line(aws, home, fake_bundle, fixed_names, cli, code, message, expected):
    sm = stub("sagemaker")
    sm.add_client_error("create_training_job", service_error_code=code, service_message=message, http_status_code=400)
    result = cli("submit", recipe_path("llama3-8b-8k"), "--set", MY_ROLE)
    assert result.code == 3  # a cloud error
    assert result.err_lines[-1].startswith(expected), result.err_lines
    assert "Traceback" not in result.err
    if code == "ResourceLimitExceeded":
        assert "Service Quotas console" in result.err_lines[-1] and "--service-code sagemaker" in result.err_lines[-1]


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_):
        yield self.data


def throttle(times: int):
    """A before-send hook answering the first `times` requests with HTTP 400 ThrottlingException."""
    sent = []

    def hook(request, **_):
        sent.append(request.url)
        if len(sent) <= times:
            body = json.dumps({"__type": "ThrottlingException", "message": "Rate exceeded"}).encode()
            return AWSResponse(request.url, 400, {"x-amzn-requestid": "r"}, _Body(body))
        return None

    return hook, sent


def test_throttled_calls_are_retried(aws, home, fake_bundle, monkeypatch):
    import botocore.retries.standard

    # Standard mode: adaptive adds a client-side rate limiter that would sleep between the retries.
    mode = "standard"
    monkeypatch.setenv("AWS_RETRY_MODE", mode)
    monkeypatch.setattr(botocore.retries.standard.ExponentialBackoff, "delay_amount", lambda self, context: 0)
    name = api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE, MY_ROLE]).spec.name
    aws_clients.reset_clients()
    hook, sent = throttle(2)
    client = aws_clients.client("sagemaker", REGION)
    assert client.meta.config.retries["mode"] == mode
    client.meta.events.register("before-send.sagemaker.DescribeTrainingJob", hook)
    assert api.status(name).state == "Completed"
    assert len(sent) == 3


def test_throttling_that_never_ends_is_one_clear_line(aws, home, fake_bundle, monkeypatch, cli):
    import botocore.retries.standard

    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    monkeypatch.setattr(botocore.retries.standard.ExponentialBackoff, "delay_amount", lambda self, context: 0)
    name = api.submit(recipe_path("llama3-8b-8k"), set_options=[MY_ROLE, MY_ROLE]).spec.name
    aws_clients.reset_clients()
    hook, sent = throttle(1000)
    aws_clients.client("sagemaker", REGION).meta.events.register("before-send.sagemaker.DescribeTrainingJob", hook)
    result = cli("status", name)
    assert result.code == 3 and len(sent) == aws_clients.MAX_ATTEMPTS
    assert result.err_lines == [
        f"DescribeTrainingJob {name}: AWS kept throttling the requests after 10 attempts (Rate exceeded); wait and retry"
    ]


def test_the_default_retry_mode_is_adaptive(monkeypatch):
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    assert aws_clients.retry_config() == {"mode": "adaptive", "total_max_attempts": 10}
