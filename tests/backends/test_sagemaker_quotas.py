"""The caller's SageMaker quotas, read before anything is uploaded or created, and a run longer
than one job may run, planned as a chain of jobs of one lineage.

Service Quotas answers come from botocore's Stubber, which checks each request and each answer
against botocore's `service-quotas` model (moto has no SageMaker quotas); S3 and SageMaker are the
moto server, which must stay empty when a job is refused.
"""

from __future__ import annotations

import json
import socket

import boto3
import pytest
from botocore.stub import Stubber

from launcher import api
from launcher.backends.sagemaker import aws as aws_clients
from launcher.backends.sagemaker import quotas
from launcher.backends.sagemaker.aws_model import validate
from launcher.registry import JobRef, save

from .helpers import MY_ROLE, REGION, REPO, recipe_path

FLAGSHIP = recipe_path("llama70b-128k")  # 4 x ml.p5e.48xlarge in us-west-2, max_run 4d
INSTANCES = "ml.p5e.48xlarge for training job usage"
# Codes as a real answer carries them; the launcher reads each from the answer, by the quota's name.
INSTANCES_CODE = "L-5A7C1E2B"
RUN_TIME_CODE = "L-33A961FD"
# 2000 steps of the 70B flagship are predicted at 6.6 days: longer than the default 5-day quota.
LONG_RUN = ["training.steps=2000", "cluster.max_run=5d"]


def quota(name: str, code: str, value: float) -> dict:
    return {
        "ServiceCode": "sagemaker",
        "ServiceName": "Amazon SageMaker",
        "QuotaCode": code,
        "QuotaName": name,
        "Value": value,
        "Adjustable": True,
        "GlobalQuota": False,
    }


def other_quotas(count: int) -> list[dict]:
    return [quota(f"ml.m5.{i}xlarge for endpoint usage", f"L-0000{i:04d}", 4) for i in range(count)]


def answer(stubber: Stubber, operation: str, *pages: list[dict]) -> None:
    """Queue the pages of one listing, each expected with the request the launcher must send."""
    for number, page in enumerate(pages):
        params = {"ServiceCode": "sagemaker", "MaxResults": 100}
        if number:
            params["NextToken"] = f"token-{number}"
        response = {"Quotas": page}
        if number + 1 < len(pages):
            response["NextToken"] = f"token-{number + 1}"
        stubber.add_response(operation, response, params)


@pytest.fixture
def service_quotas(aws):
    stubber = Stubber(quotas.client(REGION))
    stubber.activate()
    yield stubber
    stubber.deactivate()


def nothing_created(home) -> bool:
    s3 = boto3.client("s3", region_name=REGION)
    sm = boto3.client("sagemaker", region_name=REGION)
    return (
        not home.exists() and not s3.list_buckets()["Buckets"] and not sm.list_training_jobs()["TrainingJobSummaries"]
    )


def test_a_job_over_the_instance_quota_is_refused_by_name_before_anything_is_created(
    service_quotas, home, fake_bundle, cli
):
    # Applied values do not list the instance quota; AWS's default for the account does (2).
    answer(service_quotas, "list_service_quotas", [quota(quotas.RUN_TIME, RUN_TIME_CODE, 432000), *other_quotas(3)])
    answer(service_quotas, "list_aws_default_service_quotas", other_quotas(2), [quota(INSTANCES, INSTANCES_CODE, 2)])
    result = cli("submit", FLAGSHIP)
    assert result.code == 2
    assert result.err_lines[-1] == (
        f"llama70b-128k: the job needs 4 instances, over the SageMaker quota '{INSTANCES}' ({INSTANCES_CODE}) of "
        f"2 instances in {REGION}; request 4 with `aws service-quotas request-service-quota-increase --service-code "
        f"sagemaker --quota-code {INSTANCES_CODE} --desired-value 4 --region {REGION}`; nothing was submitted"
    )
    service_quotas.assert_no_pending_responses()
    assert nothing_created(home)


def test_a_max_run_over_the_run_time_quota_is_refused_with_the_request_and_the_chain_as_fixes(
    service_quotas, home, fake_bundle, cli
):
    answer(
        service_quotas,
        "list_service_quotas",
        other_quotas(2),
        [quota(INSTANCES, INSTANCES_CODE, 8), quota(quotas.RUN_TIME, RUN_TIME_CODE, 432000)],
    )
    result = cli("submit", FLAGSHIP, "--set", "cluster.max_run=6d", "--dry-run")
    assert result.code == 2
    assert result.err_lines[-1] == (
        f"llama70b-128k: cluster.max_run needs 518400 s, over the SageMaker quota '{quotas.RUN_TIME}' "
        f"({RUN_TIME_CODE}) of 432000 s in {REGION}; request 518400 with `aws service-quotas "
        f"request-service-quota-increase --service-code sagemaker --quota-code {RUN_TIME_CODE} --desired-value 518400 "
        f"--region {REGION}`, or set cluster.max_run: 5d (a longer run then goes on in a chain of jobs); "
        "nothing was submitted"
    )
    service_quotas.assert_no_pending_responses()
    assert nothing_created(home)


def test_a_job_that_fits_the_accounts_quotas_runs_as_one_job_and_says_nothing_of_quotas(
    service_quotas, home, fake_bundle, cli
):
    # This account may run a job 10 days: 6.6 days of training fit one job of max_run 7d. The
    # first page is throttled once (the launcher waits and asks again), the instances are on page 2.
    service_quotas.add_client_error(
        "list_service_quotas",
        service_error_code="TooManyRequestsException",
        http_status_code=400,
        expected_params={"ServiceCode": "sagemaker", "MaxResults": 100},
    )
    answer(
        service_quotas,
        "list_service_quotas",
        [quota(quotas.RUN_TIME, RUN_TIME_CODE, 864000), *other_quotas(2)],
        [quota(INSTANCES, INSTANCES_CODE, 4)],
    )
    result = cli("submit", FLAGSHIP, "--set", "training.steps=2000", "--set", "cluster.max_run=7d", "--dry-run")
    assert result.code == 0, result.err
    assert '"MaxRuntimeInSeconds": 604800' in result.out
    assert not [line for line in result.err_lines if "quota" in line or "chain" in line]
    service_quotas.assert_no_pending_responses()
    assert nothing_created(home)


def test_denied_quotas_fall_back_to_the_documented_defaults_in_one_line(service_quotas, home, fake_bundle, cli):
    service_quotas.add_client_error(
        "list_service_quotas",
        service_error_code="AccessDeniedException",
        service_message="User: arn:aws:iam::111122223333:user/dev is not authorized to perform: "
        "servicequotas:ListServiceQuotas",
        http_status_code=400,
        expected_params={"ServiceCode": "sagemaker", "MaxResults": 100},
    )
    result = cli("submit", FLAGSHIP, "--set", "cluster.max_run=6d", "--dry-run")
    assert result.code == 0, result.err  # the account may have more than the defaults: a warning
    (line,) = [line for line in result.err_lines if "quota" in line]
    assert line == (
        "warning: quotas: AWS denied servicequotas:ListServiceQuotas (AccessDeniedException), so the documented "
        f"defaults were used ('{quotas.RUN_TIME}' 432000 s is below cluster.max_run 518400 s unless the account has "
        f"more: `aws service-quotas request-service-quota-increase --service-code sagemaker --quota-code "
        f"{RUN_TIME_CODE} --desired-value 518400 --region {REGION}`); '{INSTANCES}' (4 needed) differs per account "
        "and was not checked"
    )
    service_quotas.assert_no_pending_responses()


def test_unreachable_quotas_fall_back_to_the_defaults_at_once(aws, home, fake_bundle, cli, monkeypatch):
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL_SERVICE_QUOTAS", f"http://127.0.0.1:{port}")
    aws_clients.reset_clients()
    result = cli("submit", FLAGSHIP, "--dry-run")
    assert result.code == 0, result.err
    (line,) = [line for line in result.err_lines if "quota" in line]
    assert line == (
        f"warning: quotas: cannot reach Service Quotas in {REGION} (Could not connect to the endpoint URL: "
        f"\"http://127.0.0.1:{port}/\"), so the documented defaults were used ('{quotas.RUN_TIME}' 432000 s); "
        f"'{INSTANCES}' (4 needed) differs per account and was not checked"
    )


def test_a_run_longer_than_the_quota_is_a_chain_and_resume_continues_it_without_edits(home, fake_bundle, cli):
    # No credentials: the default 5-day quota, so 6.6 days take two jobs of 5 days each.
    told = []
    first = api.submit(FLAGSHIP, set_options=LONG_RUN, dry_run=True, report=lambda stage, line: told.append(line))
    name = first.spec.name
    assert first.rendering.data["request"]["StoppingCondition"] == {"MaxRuntimeInSeconds": 5 * 86400}
    assert [line for line in told if line.startswith("chain: ")] == [
        "chain: the run takes 2 jobs of cluster.max_run 5.0 days, since one job may run at most 5.0 days here; "
        "each continues the checkpoints of the one before",
        f"chain: when {name} ends at its time limit, the same `launcher submit` with `--resume {name}` continues "
        "it from its last checkpoint",
    ]
    # That job ran, and SageMaker stopped it at MaxRuntimeInSeconds (Stopped, MaxRuntimeExceeded):
    # the printed command, unchanged, continues its lineage, and nothing refuses the second job.
    save(JobRef(name=name, backend="sagemaker", region=REGION), first.spec)
    sets = [arg for option in LONG_RUN for arg in ("--set", option)]
    resumed = cli("submit", FLAGSHIP, *sets, "--resume", name, "--dry-run", "--json")
    assert resumed.code == 0, resumed.err
    second = json.loads(resumed.out)["request"]
    assert second["TrainingJobName"] != name
    # The same checkpoint prefix: past 500 GB per host the flagship's hosts copy their own files there.
    before = first.rendering.data["request"]
    assert "CheckpointConfig" not in second and "CheckpointConfig" not in before
    prefix = before["Environment"]["LAUNCHER_CHECKPOINT_S3"]
    assert second["Environment"]["LAUNCHER_CHECKPOINT_S3"] == prefix and prefix.endswith(f"/{name}")
    assert [line for line in resumed.err_lines if line.startswith("chain: ")][-1] == (
        f"chain: continues {name}'s lineage; when {second['TrainingJobName']} ends at its time limit, the same "
        f"`launcher submit` with `--resume {second['TrainingJobName']}` continues it from its last checkpoint"
    )


def test_a_run_that_saves_no_periodic_checkpoints_is_no_chain_it_is_refused_with_the_fix(home, fake_bundle, cli):
    # Each job of a chain would start from nothing: refused as an overrun, naming what would chain.
    result = cli(
        "submit", FLAGSHIP, *[a for o in LONG_RUN for a in ("--set", o)], "--set", "checkpoint.every_minutes=0"
    )
    assert result.code == 2
    assert result.err_lines[-1].endswith(
        "exceeds cluster.max_run 5.0 days, so the job would be stopped before its last step; training.steps: 1563 or "
        "checkpoint.every_minutes: 60 with resume: auto (then a chain of jobs runs it); nothing was submitted "
        "(pass --force to submit anyway)"
    )
    assert not home.exists()


GPU_RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml") if p.stem != "tiny-cpu")


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_every_shipped_gpu_recipes_dry_run_is_a_valid_request_within_the_default_quotas(home, recipe):
    # As a user runs it with no credentials: the botocore model's shapes, and the documented
    # 5-day default of 'Longest run time for a training job' (no --force, so nothing is waived).
    told = []
    submission = api.submit(
        REPO / "recipes" / f"{recipe}.yaml",
        set_options=[MY_ROLE],
        dry_run=True,
        report=lambda _, line: told.append(line),
    )
    request = submission.rendering.data["request"]
    assert validate("sagemaker", "CreateTrainingJob", request) == []
    assert request["StoppingCondition"]["MaxRuntimeInSeconds"] <= quotas.RUN_TIME_DEFAULT_S
    assert not any(line.startswith("chain: ") for line in told)  # each fits in one job
