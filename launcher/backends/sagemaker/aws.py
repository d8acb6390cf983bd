"""boto3 clients with retries, and AWS errors turned into one clear line each.

The service's own words in those lines (an error message that echoes a job name back) go
through `launcher.errors.service_error`: an HTML or XML body becomes its message, and nothing
can move the cursor or forge lines on a terminal.

boto3 is imported here, inside functions, so `launcher --help` never pays for it. Clients
honour AWS_ENDPOINT_URL (the tests point it at a moto server) and AWS_PROFILE as boto3 does.
"""

from __future__ import annotations

import os
import re
from functools import cache
from urllib.parse import urlsplit

from launcher.contract.text import terminal_safe
from launcher.errors import EngineError, LauncherError, UsageError, service_error, service_text

# Adaptive mode adds client-side rate limiting on top of standard retries, which keeps `logs
# --follow` and `list` polling within the CloudWatch and SageMaker request quotas.
DEFAULT_RETRY_MODE = "adaptive"
MAX_ATTEMPTS = 10
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60
"""Seconds without an answer before a call is tried again (MAX_ATTEMPTS in all)."""


def retry_config() -> dict:
    mode = os.environ.get("AWS_RETRY_MODE", DEFAULT_RETRY_MODE)
    if mode not in ("standard", "adaptive"):
        mode = DEFAULT_RETRY_MODE
    return {"mode": mode, "total_max_attempts": MAX_ATTEMPTS}


@cache
def _session():
    """One boto3 session for the process, so service models are parsed once, not per client."""
    import boto3

    return boto3.session.Session()


@cache
def client(
    service: str,
    region: str,
    *,
    attempts: int | None = None,
    connect_timeout: float | None = None,
    read_timeout: float | None = None,
):
    """A client of `service` in `region`; `attempts` 1 makes botocore retry nothing itself. What
    is not given follows MAX_ATTEMPTS, CONNECT_TIMEOUT_S and READ_TIMEOUT_S as they are now."""
    from botocore.config import Config

    config = Config(
        retries={**retry_config(), "total_max_attempts": attempts or MAX_ATTEMPTS},
        user_agent_extra="launcher",
        connect_timeout=connect_timeout or CONNECT_TIMEOUT_S,
        read_timeout=read_timeout or READ_TIMEOUT_S,
    )
    return _session().client(service, region_name=region, config=config)


def credentials_available() -> bool:
    """Whether boto3 would find credentials now (the environment, a profile, a role). Resolved
    afresh, not from the process's session, which keeps the first credentials it found."""
    import botocore.session

    try:
        return botocore.session.get_session().get_credentials() is not None
    except Exception:  # a broken profile: no usable credentials, as the calls would find
        return False


def reset_clients() -> None:
    """Forget cached clients, so the next ones read AWS_* settings again (tests change them)."""
    client.cache_clear()


def caller_account(region: str) -> str:
    """The account of the credentials in use (STS GetCallerIdentity, which needs no permission)."""
    try:
        account = str(client("sts", region).get_caller_identity().get("Account", ""))
    except Exception as error:
        raise explain(error, action="GetCallerIdentity (STS)", region=region) from None
    if not re.fullmatch(r"\d{12}", account):  # read from the network: an account id, or nothing
        raise AwsError(f"GetCallerIdentity (STS): answered {service_text(account)!r}, not a 12-digit account id")
    return account


class AwsError(EngineError):
    """An AWS call failed; the message is one line saying what to do."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


def explain(
    error: Exception,
    *,
    action: str,
    region: str,
    job: str | None = None,
    quota_hint: str = "",
    endpoint: str | None = None,
) -> LauncherError:
    """One line for an AWS failure: which call, why, and how to fix it. `endpoint` names the
    service's URL when the error itself does not (a timeout while reading a response body)."""
    from botocore.exceptions import (
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
        ReadTimeoutError,
    )

    action = terminal_safe(action, one_line=True)
    job = terminal_safe(job, one_line=True) if job is not None else None
    if isinstance(error, ReadTimeoutError | ConnectTimeoutError):
        return _timed_out(error, action, region, endpoint, connecting=isinstance(error, ConnectTimeoutError))
    if isinstance(error, NoCredentialsError | PartialCredentialsError):
        return UsageError(
            f"{action}: no AWS credentials found; run `aws configure`, set AWS_PROFILE, or run on a machine with an IAM role"
        )
    if isinstance(error, EndpointConnectionError):
        return AwsError(
            f"{action}: cannot reach AWS ({service_text(str(error))}); check the network and sagemaker.region {region}"
        )
    if not isinstance(error, ClientError):
        return AwsError(f"{action}: {service_text(str(error))}")
    code, message = service_error(error)
    if code == "ResourceLimitExceeded":
        quota = _quoted(message) or quota_hint or "the SageMaker training quota"
        return AwsError(
            f"{action}: SageMaker quota '{quota}' in {region} is too low ({message}); request an increase in the "
            f"Service Quotas console (Amazon SageMaker > '{quota}') or with `aws service-quotas "
            f"request-service-quota-increase --service-code sagemaker --quota-code <code> --desired-value <n> "
            f"--region {region}` (list codes with `aws service-quotas list-service-quotas --service-code sagemaker`)",
            code,
        )
    if code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "403"):
        return AwsError(
            f"{action}: AWS denied access ({message or code}); the caller needs the permission named there"
            f"{' and iam:PassRole on the job role' if 'Training' in action else ''}",
            code,
        )
    if code == "ResourceInUse" or "already exists" in message or "must be unique" in message:
        return AwsError(
            f"{action}: a training job named {job} already exists in {region}; submit again for a new name", code
        )
    if (
        code in ("ResourceNotFound", "ValidationException")
        and job
        and ("not found" in message or "does not exist" in message)
    ):
        return AwsError(f"{action}: no training job named {job} in {region}; check the name and --region", code)
    if code == "ValidationException":
        return AwsError(f"{action}: SageMaker rejected the request: {message}", code)
    if code in ("ThrottlingException", "Throttling", "TooManyRequestsException", "SlowDown"):
        return AwsError(
            f"{action}: AWS kept throttling the requests after {MAX_ATTEMPTS} attempts ({message}); wait and retry",
            code,
        )
    if code in ("NoSuchBucket", "404") and "bucket" in action:
        return UsageError(f"{action}: the bucket does not exist in {region}; create it or fix sagemaker.output_uri")
    return AwsError(f"{action}: {code or 'error'}: {message}", code)


def _timed_out(error, action: str, region: str, endpoint: str | None, *, connecting: bool) -> AwsError:
    """A call that got no connection or no answer in time (after the retries botocore makes)."""
    url = error.kwargs.get("endpoint_url") or endpoint
    parts = urlsplit(url) if url else None
    # The endpoint alone: the request's path and query say nothing the action does not.
    where = terminal_safe(f"{parts.scheme}://{parts.netloc}", one_line=True) if parts and parts.netloc else "AWS"
    seconds, what = (CONNECT_TIMEOUT_S, "accept a connection") if connecting else (READ_TIMEOUT_S, "answer")
    check = "AWS_ENDPOINT_URL" if os.environ.get("AWS_ENDPOINT_URL") else f"the region {region}"
    return AwsError(
        f"{action}: {where} did not {what} within {seconds:g} s; the network or the service is stalled: "
        f"retry later, or check the network and {check}",
        "Timeout",
    )


def _quoted(message: str) -> str | None:
    match = re.search(r"'([^']+)'", message)
    return match.group(1) if match else None
