"""The caller's SageMaker quotas, read before anything is uploaded or created.

Two quotas decide whether CreateTrainingJob would answer ResourceLimitExceeded for a job:
"<instance type> for training job usage" (spot: "for spot training job usage"), the instances
of that type all the account's training jobs may hold at once, and "Longest run time for a
training job", the largest MaxRuntimeInSeconds. They are found by *name* in the Service Quotas
API's answer (ServiceCode `sagemaker`), never by a guessed code: ListServiceQuotas gives the
values applied to the account, and a quota it leaves out ("If the applied quota value is not
available for a quota, the quota is not retrieved", botocore's service-quotas model) is read
from ListAWSDefaultServiceQuotas. Each answer's QuotaCode goes into the request command.

Where the API is denied or unreachable, or there are no credentials (a dry run on a laptop),
the documented defaults stand in, and one line says so; a job over a default is then a warning,
not a refusal, since the account may have more.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

from launcher.backends.sagemaker import aws
from launcher.contract.text import terminal_safe
from launcher.errors import UsageError

SERVICE_CODE = "sagemaker"
RUN_TIME = "Longest run time for a training job"
# The documented default (AWS General Reference, "Amazon SageMaker AI endpoints and quotas";
# SageMaker Developer Guide, "Feature Processor restrictions, limits, and quotas": "Longest run
# time for a training job – 432,000 seconds"), and the code Service Quotas lists it under.
RUN_TIME_DEFAULT_S = 432_000
RUN_TIME_CODE = "L-33A961FD"

# Listing pages (Service Quotas' largest), and retries of a throttled page: any other failure
# falls back to the defaults at once, so an unreachable endpoint delays a submit by one timeout.
PAGE_SIZE = 100
MAX_PAGES = 100  # SageMaker has about 2,000 quotas: 20 pages; an answer that never ends is cut off
THROTTLE_WAITS_S = (0.5, 1.0, 2.0)
THROTTLED = ("TooManyRequestsException", "ThrottlingException")
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 15
_QUOTA_CODE_RE = re.compile(r"[a-zA-Z][a-zA-Z0-9-]{1,128}")  # botocore's QuotaCode pattern


class QuotaExceeded(UsageError):
    """The job needs more than the account's SageMaker quota: CreateTrainingJob would refuse it."""


class QuotasUnavailable(Exception):
    """Service Quotas could not be asked; `reason` is one line for the user."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Quota:
    name: str
    code: str
    value: float


@dataclass(frozen=True, slots=True)
class Needs:
    """What one job asks of the account."""

    region: str
    instance_type: str
    instance_count: int
    spot: bool
    max_run_s: int
    recipe_name: str
    check_instances: bool = True

    @property
    def instance_quota(self) -> str:
        return instance_quota_name(self.instance_type, spot=self.spot)


@dataclass(frozen=True, slots=True)
class QuotaCheck:
    """The job fits its quotas: the longest one job may run, and what to tell (defaults used)."""

    longest_run_s: int
    lines: tuple[str, ...] = ()


def instance_quota_name(instance_type: str, *, spot: bool) -> str:
    return f"{instance_type} for {'spot ' if spot else ''}training job usage"


def exceeded_quota_name(message: str, *, instance_type: str, spot: bool) -> str:
    """The quota a ResourceLimitExceeded answer of CreateTrainingJob that quotes none is about:
    the run-time quota when it speaks of run time, else the instance quota."""
    if re.search(r"run ?time|MaxRuntime", message, re.IGNORECASE):
        return RUN_TIME
    return instance_quota_name(instance_type, spot=spot)


def client(region: str):
    """A Service Quotas client that does not retry by itself (throttling is retried here)."""
    return aws.client(
        "service-quotas", region, attempts=1, connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S
    )


def check(needs: Needs) -> QuotaCheck:
    """Refuse (QuotaExceeded) a job over the account's quotas; where they cannot be read, check
    the documented defaults and say so in one line."""
    wanted = {RUN_TIME, *([needs.instance_quota] if needs.check_instances else [])}
    try:
        if not aws.credentials_available():
            raise QuotasUnavailable("no AWS credentials")
        found = read(needs.region, wanted)
    except QuotasUnavailable as unavailable:
        return _against_defaults(needs, unavailable.reason)
    lines = []
    instances = found.get(needs.instance_quota)
    if needs.check_instances and instances is None:
        lines.append(f"quotas: Service Quotas lists no '{needs.instance_quota}' in {needs.region}; not checked")
    elif needs.check_instances and instances.value < needs.instance_count:
        raise QuotaExceeded(_over(needs, instances, needs.instance_count, "the job", " instances"))
    run_time = found.get(RUN_TIME)
    if run_time is None:
        lines.append(f"quotas: Service Quotas lists no '{RUN_TIME}' in {needs.region}; not checked")
        return QuotaCheck(longest_run_s=RUN_TIME_DEFAULT_S, lines=tuple(lines))
    if run_time.value < needs.max_run_s:
        raise QuotaExceeded(_over(needs, run_time, needs.max_run_s, "cluster.max_run", " s"))
    return QuotaCheck(longest_run_s=math.floor(run_time.value), lines=tuple(lines))


def _over(needs: Needs, quota: Quota, needed: int, what: str, unit: str) -> str:
    fix = ""
    if quota.name == RUN_TIME and quota.value >= 3600:
        fix = f", or set cluster.max_run: {_whole(quota.value)} (a longer run then goes on in a chain of jobs)"
    command = request_command(quota.code, needed, needs.region)
    return (
        f"{needs.recipe_name}: {what} needs {needed}{unit}, over the SageMaker quota '{quota.name}' ({quota.code}) "
        f"of {_number(quota.value)}{unit} in {needs.region}; request {needed} with `{command}`{fix}; nothing was submitted"
    )


def request_command(code: str, desired: int, region: str) -> str:
    return (
        f"aws service-quotas request-service-quota-increase --service-code {SERVICE_CODE} --quota-code {code} "
        f"--desired-value {desired} --region {region}"
    )


def _against_defaults(needs: Needs, reason: str) -> QuotaCheck:
    """One line: why the defaults, what they say of this job, and the quota left unchecked."""
    run_time = f"'{RUN_TIME}' {RUN_TIME_DEFAULT_S} s"
    if needs.max_run_s > RUN_TIME_DEFAULT_S:
        run_time += (
            f" is below cluster.max_run {needs.max_run_s} s unless the account has more: `"
            f"{request_command(RUN_TIME_CODE, needs.max_run_s, needs.region)}`"
        )
    line = f"quotas: {reason}, so the documented defaults were used ({run_time})"
    if needs.check_instances:
        line += f"; '{needs.instance_quota}' ({needs.instance_count} needed) differs per account and was not checked"
    return QuotaCheck(longest_run_s=RUN_TIME_DEFAULT_S, lines=(line,))


def read(region: str, names: set[str]) -> dict[str, Quota]:
    """The quotas of these names: applied values first, AWS's defaults for the ones not applied."""
    sq = client(region)
    found = _find(sq, sq.list_service_quotas, "ListServiceQuotas", names)
    missing = names - set(found)
    if missing:
        found.update(_find(sq, sq.list_aws_default_service_quotas, "ListAWSDefaultServiceQuotas", missing))
    return found


def _find(sq, method, operation: str, names: set[str]) -> dict[str, Quota]:
    """Page through one listing until every name is found or the pages end."""
    found: dict[str, Quota] = {}
    kwargs = {"ServiceCode": SERVICE_CODE, "MaxResults": PAGE_SIZE}
    for _ in range(MAX_PAGES):
        page = _call(method, operation, region=sq.meta.region_name, **kwargs)
        for entry in page.get("Quotas", []):
            quota = _checked(entry)
            if quota is not None and quota.name in names:
                found[quota.name] = quota
        token = page.get("NextToken")
        if set(found) == names or not isinstance(token, str) or not token or token == kwargs.get("NextToken"):
            break
        kwargs["NextToken"] = token
    return found


def _checked(entry: dict) -> Quota | None:
    """A listed quota, if its fields are what the model says (the answer is not trusted)."""
    name, code, value = entry.get("QuotaName"), entry.get("QuotaCode"), entry.get("Value")
    if not isinstance(name, str) or not isinstance(code, str) or not _QUOTA_CODE_RE.fullmatch(code):
        return None
    if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return Quota(name=name, code=code, value=float(value))


def _call(method, operation: str, *, region: str, **kwargs) -> dict:
    from botocore.exceptions import BotoCoreError, ClientError

    waits = iter(THROTTLE_WAITS_S)
    while True:
        try:
            return method(**kwargs)
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", "")) or "an error"
            wait = next(waits, None) if code in THROTTLED else None
            if wait is not None:
                time.sleep(wait)
                continue
            if code in ("AccessDeniedException", "AccessDenied"):
                raise QuotasUnavailable(f"AWS denied servicequotas:{operation} ({code})") from None
            # The code alone: a service's body may be HTML or XML, which never reaches the user.
            code = terminal_safe(code, one_line=True)
            raise QuotasUnavailable(f"Service Quotas answered {operation} with {code}") from None
        except BotoCoreError as error:
            raise QuotasUnavailable(
                f"cannot reach Service Quotas in {region} ({terminal_safe(str(error), one_line=True)})"
            ) from None


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else f"{value:g}"


def _whole(seconds: float) -> str:
    """A time limit as a recipe writes it, rounded down: 5d, 12h."""
    return f"{math.floor(seconds / 86400)}d" if seconds >= 86400 else f"{math.floor(seconds / 3600)}h"
