"""Job handles: a submitted job on any backend, found again by name (how they print: launcher.display.text).

`Job` is the handle `submit` returns and `launcher status NAME` finds through the registry
(`launcher.registry`, below the backends); it asks the job's backend for status, logs and stop.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from launcher.backends import NAMES, get_backend
from launcher.backends.base import Backend, JobStatus
from launcher.backends.history import MetricsHistory
from launcher.backends.processes import process_info
from launcher.display import html
from launcher.display.text import result_text, speed_text
from launcher.errors import EXIT_JOB_FAILED, EXIT_OK, EngineError, LauncherError, UsageError
from launcher.registry import DamagedRecord, JobRef, NoSuchJob, discard, job_dir, launcher_home, load, scan

# SageMaker's secondary statuses before the training script runs (DescribeTrainingJob), and
# "Pending" (Slurm, Kubernetes): phases that write no log lines.
STARTING_PHASES = frozenset(
    {"Pending", "Starting", "LaunchingMLInstances", "PreparingTrainingStack", "Downloading", "DownloadingTrainingImage"}
)


class Job:
    """A submitted job on any backend: status, logs, stop and wait, like SageMaker's."""

    def __init__(self, ref: JobRef):
        self.ref = ref

    @classmethod
    def find(cls, name: str, *, backend: str | None = None, region: str | None = None) -> Job:
        """The job this machine submitted, or one named on `backend` (e.g. a SageMaker job from elsewhere)."""
        ref = load(name)
        if ref is not None and backend in (None, ref.backend):
            return cls(ref if region is None else JobRef(**{**ref.to_dict(), "region": region}))
        if backend is None:
            raise UsageError(
                f"no job named {name} was submitted from here ({launcher_home() / 'jobs'}); "
                "pass --backend to look it up there (SageMaker: in --region, else the AWS CLI's region)"
            )
        return cls(JobRef(name=name, backend=backend, region=region))

    @property
    def name(self) -> str:
        return self.ref.name

    @property
    def backend(self) -> Backend:
        return get_backend(self.ref.backend)

    def status(self) -> JobStatus:
        return record_status(self.ref)

    def logs(self, *, follow: bool = False, poll_s: float = 5.0) -> Iterator[str]:
        return self.backend.logs(self.ref, follow=follow, poll_s=poll_s)

    def stop(self, *, grace_s: float = 30.0) -> JobStatus:
        # Refused before anything is signalled: a NaN or negative grace would skip SIGTERM's wait
        # (SIGKILL at once, no final checkpoint), an infinite one overflows kubectl's and docker's
        # whole seconds.
        if not (isinstance(grace_s, int | float) and math.isfinite(grace_s) and grace_s >= 0):
            shown = f"{grace_s:g}" if isinstance(grace_s, int | float) else repr(grace_s)
            raise UsageError(f"--grace {shown}: use a number of seconds, 0 or more")
        return self.backend.stop(self.ref, grace_s=grace_s)

    def wait(
        self,
        *,
        on_line: Callable[[str], None] | None = None,
        on_status: Callable[[JobStatus], None] | None = None,
        poll_s: float = 5.0,
    ) -> JobStatus:
        """Follow the logs until the job ends (`on_line` gets each line); return the final status.

        `on_status` hears each change of state while the job starts (SageMaker's secondary status:
        Starting, Downloading, ...: minutes with no log line), then the final status.
        """
        if on_status is not None:
            self._report_start(on_status, poll_s)
        for line in self.logs(follow=True, poll_s=poll_s):
            if on_line is not None:
                on_line(line)
        final = self.status()
        if on_status is not None:
            on_status(final)
        return final

    def _report_start(self, on_status: Callable[[JobStatus], None], poll_s: float) -> None:
        seen = None
        while True:
            status = self.status()
            if (status.state, status.secondary) != seen:
                on_status(status)
                seen = (status.state, status.secondary)
            if status.terminal or status.secondary not in STARTING_PHASES:
                return
            time.sleep(poll_s)

    def metrics(self) -> MetricsHistory:
        """Every step the job has logged so far (`.to_rows()`, `.last`, `.plot(path)`)."""
        return self.backend.metrics(self.ref)

    def plot_metrics(self, path: str | Path) -> Path:
        """Loss, tokens/s/GPU, MFU and memory against step, as a PNG (the `plot` extra)."""
        return self.metrics().plot(path)

    @property
    def links(self) -> list[tuple[str, str]]:
        """(title, url) of the pages that show this job (a SageMaker job's console); [] where the engine has none."""
        return self.backend.links(self.ref)

    def __repr__(self) -> str:
        handle = f"Job({self.name!r}, backend={self.ref.backend!r})"
        if not self.ref.predicted:  # nothing to compare with: no call to the engine
            return handle
        try:
            speed = speed_text(self.status())
        except LauncherError:  # the handle still prints when the engine is away
            return handle
        return f"{handle}: {speed}" if speed else handle

    def _repr_html_(self) -> str:
        rows = [("job", self.name), ("backend", self.ref.backend)]
        rows += [(k, v) for k, v in (("region", self.ref.region), ("submitted", self.ref.created)) if v]
        try:
            status = self.status()
        except LauncherError as error:  # a notebook cell should show the handle even when the engine is away
            rows.append(("status", f"unknown: {error}"))
        else:
            rows.append(("state", status.state + (f" ({status.secondary})" if status.secondary else "")))
            result = result_text(status)
            rows += [("result", result)] if result else []
            speed = speed_text(status)
            rows += [("speed", speed)] if speed else []
        raw = [("links", html.links(self.links))] if self.links else []
        return html.table(rows, title=f"Job {self.name}", raw=raw)


NEVER_SUBMITTED = "NeverSubmitted"
"""The state of a record whose submit died before the backend took the job."""
SUBMITTING = "Submitting"
# What an engine answers for a job it does not have (SageMaker's DescribeTrainingJob: botocore's
# model lists ResourceNotFound; the service itself answers ValidationException "not found").
_NOT_FOUND_CODES = ("ResourceNotFound", "ValidationException")


def record_status(ref: JobRef) -> JobStatus:
    """The job's status from its backend; a record still marked `submitting` is a submit under way
    while its process lives, and "never submitted" once that process is gone and the backend says
    it has no such job (an engine that cannot be asked leaves it undecided: an error)."""
    if ref.backend not in NAMES:  # the registry, below the backends, cannot know their names
        raise DamagedRecord(
            f"{job_dir(ref.name) / 'job.json'}: damaged job record: backend {ref.backend!r} is not one of {', '.join(NAMES)}"
        )
    submitter = _submitter(ref)
    if submitter == "running":
        detail = f"submit (pid {ref.submitting['pid']}) still under way"
        return JobStatus(name=ref.name, backend=ref.backend, state=SUBMITTING, secondary=detail, created=ref.created)
    try:
        status = get_backend(ref.backend).status(ref)
    except LauncherError as error:
        if submitter != "gone" or not _no_such_job(error):
            raise
    else:
        # What the planner predicted at submit, beside the live metrics (launcher.display.text.speed_text).
        return (
            dataclasses.replace(status, details={**status.details, "predicted": ref.predicted})
            if ref.predicted
            else status
        )
    detail = f"its submit (pid {ref.submitting['pid']}) ended before {ref.backend} took the job"
    return JobStatus(
        name=ref.name,
        backend=ref.backend,
        state=NEVER_SUBMITTED,
        secondary=f"never submitted: {detail}; `launcher list --clean` removes the record",
        created=ref.created,
    )


def _submitter(ref: JobRef) -> str | None:
    """None: the record is of a submitted job; "running", "gone", or "elsewhere" (another host,
    whose processes this one cannot see): the process that is submitting it."""
    if ref.submitting is None:
        return None
    pid, start, host = (ref.submitting.get(key) for key in ("pid", "start", "host"))
    if type(pid) is not int or pid < 1 or type(start) not in (int, type(None)) or not isinstance(host, str):
        raise DamagedRecord(
            f"{job_dir(ref.name) / 'job.json'}: damaged job record: submitting is {ref.submitting!r}, "
            "not {pid, start, host} of the submitting process"
        )
    if host != socket.gethostname():
        return "elsewhere"
    info = process_info(pid)
    if start is None:  # no /proc where it ran: the pid alone, which a later process may reuse
        return "running" if info is not None and not info.zombie else "gone"
    return "running" if info is not None and not info.zombie and info.start == start else "gone"


def _no_such_job(error: LauncherError) -> bool:
    return isinstance(error, NoSuchJob) or (
        isinstance(error, EngineError) and getattr(error, "code", None) in _NOT_FOUND_CODES
    )


def list_jobs(
    *,
    backend: str | None = None,
    region: str | None = None,
    limit: int = 50,
    on_damaged: Callable[[str], None] | None = None,
) -> list[JobStatus]:
    """Jobs on one backend (as that engine lists them), or every job submitted from here. A record
    that cannot be read is not listed: `on_damaged` hears one line naming it (default: a warning)."""
    warn = on_damaged or (lambda line: warnings.warn(line, stacklevel=3))
    if not (isinstance(limit, int) and limit >= 1):
        raise UsageError(f"--limit {limit}: use 1 or more")  # 0 would print "no jobs"; -1 would drop the oldest
    if backend is not None:
        statuses = get_backend(backend).list(region=region, limit=limit)
    else:
        found = scan()
        for damaged in found.damaged:
            warn(str(damaged))
        statuses = [_listed(ref) for ref in found.refs[:limit]]
    for status in statuses:
        if "damaged" in status.details:
            warn(status.details["damaged"])
    return [status for status in statuses if "damaged" not in status.details]


def _listed(ref: JobRef) -> JobStatus:
    try:
        return record_status(ref)
    except DamagedRecord as error:
        return JobStatus(name=ref.name, backend=ref.backend, state="Unknown", details={"damaged": str(error)})
    except LauncherError as error:
        return JobStatus(
            name=ref.name, backend=ref.backend, state="Unknown", created=ref.created, details={"error": str(error)}
        )


def clean_records() -> list[str]:
    """Remove the records (and job directories) of submits that died before the backend took the
    job; one line per record removed. A submit still under way, or one the engine cannot be asked
    about, is left alone."""
    removed = []
    for ref in scan().refs:
        status = _listed(ref)
        if status.state == NEVER_SUBMITTED:
            discard(ref.name)
            removed.append(f"removed {ref.name}: {status.secondary.split('; ')[0]}")
    return removed


def outcome_exit_code(status: JobStatus) -> int:
    """What `submit --wait` and `logs --follow` exit with: 0 when the job completed, 1 when it
    failed or was stopped (its own exit code is in `status`); README "Exit codes"."""
    return EXIT_OK if status.state == "Completed" else EXIT_JOB_FAILED
