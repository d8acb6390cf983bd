"""Job handles: a submitted job on any backend, found again by name, and how jobs print.

`Job` is the handle `submit` returns and `launcher status NAME` finds through the registry
(`launcher.registry`, below the backends); it asks the job's backend for status, logs and stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from launcher.backends import get_backend
from launcher.backends.base import Backend, JobStatus
from launcher.errors import EXIT_JOB_FAILED, EXIT_OK, LauncherError, UsageError
from launcher.registry import JobRef, launcher_home, load, records

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
        return self.backend.status(self.ref)

    def logs(self, *, follow: bool = False, poll_s: float = 5.0) -> Iterator[str]:
        return self.backend.logs(self.ref, follow=follow, poll_s=poll_s)

    def stop(self, *, grace_s: float = 30.0) -> JobStatus:
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

    def __repr__(self) -> str:
        return f"Job({self.name!r}, backend={self.ref.backend!r})"


def list_jobs(*, backend: str | None = None, region: str | None = None, limit: int = 50) -> list[JobStatus]:
    """Jobs on one backend (as that engine lists them), or every job submitted from here."""
    if backend is not None:
        return get_backend(backend).list(region=region, limit=limit)
    statuses = []
    for ref in records()[:limit]:
        try:
            statuses.append(get_backend(ref.backend).status(ref))
        except LauncherError as error:
            statuses.append(
                JobStatus(
                    name=ref.name,
                    backend=ref.backend,
                    state="Unknown",
                    created=ref.created,
                    details={"error": str(error)},
                )
            )
    return statuses


# --- how jobs print ----------------------------------------------------------------------------

_HEADLINE_METRICS = ("loss", "tokens_per_s_per_gpu", "mfu", "step")


def outcome_exit_code(status: JobStatus) -> int:
    """What `submit --wait` and `logs --follow` exit with: 0 when the job completed, 1 when it
    failed or was stopped (its own exit code is in `status`); README "Exit codes"."""
    return EXIT_OK if status.state == "Completed" else EXIT_JOB_FAILED


def status_text(status: JobStatus) -> str:
    state = status.state + (f" ({status.secondary})" if status.secondary and status.secondary != status.state else "")
    lines = [f"{status.name}  [{status.backend}]  {state}"]
    if status.created:
        lines.append(f"  created  {status.created}" + (f"   ended  {status.ended}" if status.ended else ""))
    if status.failure_reason:
        lines.append(f"  failure  {status.failure_reason}")
    if status.exit_code is not None:
        lines.append(f"  exit     {status.exit_code}")
    for t in status.transitions:
        message = f"  {t.message}" if t.message else ""
        lines.append(f"  - {t.status:<24} {t.start or ''}{message}")
    result = result_text(status)
    if result:
        lines.append(f"  result   {result}")
    for key, value in status.details.items():
        if value not in (None, {}, "") and key != "summary":
            lines.append(f"  {key:<8} {value}")
    return "\n".join(lines)


def result_text(status: JobStatus) -> str:
    """`loss 3.21, tokens/s/GPU 1530, ...`: the job's summary line, else its last metrics."""
    summary = status.details.get("summary") or {}
    metrics = {key.removeprefix("train:"): value for key, value in status.metrics.items()}
    parts = []
    for key in _HEADLINE_METRICS:
        candidates = (summary.get(f"final_{key}"), summary.get(f"mean_{key}"), metrics.get(key))
        value = next((v for v in candidates if isinstance(v, int | float) and v == v), None)  # v == v: not NaN
        if value is not None:
            label = {"tokens_per_s_per_gpu": "tokens/s/GPU"}.get(key, key)
            parts.append(f"step {int(value)}" if key == "step" else f"{label} {value:.4g}")
    return ", ".join(parts)


def list_text(statuses: list[JobStatus]) -> str:
    if not statuses:
        return "no jobs"
    rows = [("NAME", "BACKEND", "STATE", "DETAIL", "CREATED")]
    rows += [(s.name, s.backend, s.state, s.secondary or "", s.created or "") for s in statuses]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
