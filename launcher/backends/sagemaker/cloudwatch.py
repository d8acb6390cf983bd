"""Read a SageMaker training job's CloudWatch logs across all of its hosts' streams.

Each host writes `/aws/sagemaker/TrainingJobs/<job>/algo-<n>-<epoch>`. Following polls every
stream; it asks whether the job has ended *before* each read and returns after the read that
follows the end, so it always terminates and never drops the last lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from launcher.contract.text import terminal_safe

LOG_GROUP = "/aws/sagemaker/TrainingJobs"


@dataclass
class _Cursor:
    tokens: dict[str, str] = field(default_factory=dict)


def _streams(logs, job: str) -> list[str]:
    from botocore.exceptions import ClientError

    names: list[str] = []
    kwargs = {"logGroupName": LOG_GROUP, "logStreamNamePrefix": f"{job}/"}
    try:
        while True:
            page = logs.describe_log_streams(**kwargs)
            names += [s["logStreamName"] for s in page.get("logStreams", [])]
            if not page.get("nextToken"):
                return sorted(names)
            kwargs["nextToken"] = page["nextToken"]
    except ClientError as error:
        # The group appears with the first job of the account: before that there is nothing.
        if error.response["Error"]["Code"] == "ResourceNotFoundException":
            return []
        raise


def _read(logs, stream: str, cursor: _Cursor) -> list[tuple[int, str, str]]:
    events = []
    while True:
        kwargs = {"logGroupName": LOG_GROUP, "logStreamName": stream, "startFromHead": True}
        if stream in cursor.tokens:
            kwargs["nextToken"] = cursor.tokens[stream]
        page = logs.get_log_events(**kwargs)
        events += [(e["timestamp"], stream, e["message"]) for e in page.get("events", [])]
        token = page.get("nextForwardToken")
        # CloudWatch returns the same forward token when a stream has nothing newer.
        if token is None or token == cursor.tokens.get(stream):
            return events
        cursor.tokens[stream] = token


def log_lines(
    logs,
    job: str,
    *,
    follow: bool,
    is_done: Callable[[], bool],
    poll_s: float,
    label_hosts: bool,
    sleep: Callable[[float], None] = time.sleep,
    no_streams: Callable[[], Exception] | None = None,
) -> Iterator[str]:
    """The job's lines, oldest first, host-labelled on a multi-host job. Without `follow`, a job
    with no stream yet raises `no_streams()` rather than print nothing."""
    cursor = _Cursor()
    while True:
        done = (not follow) or is_done()
        events = []
        streams = _streams(logs, job)
        if not streams and not follow and no_streams is not None:
            raise no_streams()
        for stream in streams:
            events += _read(logs, stream, cursor)
        for _, stream, message in sorted(events, key=lambda e: e[0]):
            host = stream.split("/", 1)[-1].rsplit("-", 1)[0]
            for line in terminal_safe(message).splitlines() or [""]:
                yield f"[{host}] {line}" if label_hosts else line
        if done:
            return
        sleep(poll_s)


def console_links(job: str, region: str) -> list[tuple[str, str]]:
    """The AWS console pages of a SageMaker training job: the job, and its log streams in CloudWatch."""
    console = f"https://{region}.console.aws.amazon.com"
    return [
        ("SageMaker console", f"{console}/sagemaker/home?region={region}#/jobs/{job}"),
        (
            "CloudWatch logs",
            f"{console}/cloudwatch/home?region={region}#logStream:group={LOG_GROUP};prefix={job};streamFilter=typeLogStreamPrefix",
        ),
    ]
