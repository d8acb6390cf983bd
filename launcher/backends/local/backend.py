"""The local backend: torchrun on this machine as a managed job.

`submit` unpacks the bundle into `$LAUNCHER_HOME/jobs/<name>/code/` and starts a detached
runner (`runner.py`) that runs torchrun there and records its status; the job outlives the
command that submitted it. `status`, `logs --follow`, `stop` and `list` read and signal that
directory the way the SageMaker backend talks to SageMaker.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from launcher.backends.base import Backend, JobRef, JobStatus, Rendering, Transition, utc_now
from launcher.backends.history import MetricsHistory
from launcher.backends.local import runner
from launcher.backends.processes import ForeignProcessGroup, JobGroup
from launcher.backends.staging import staging_dir
from launcher.backends.tail import file_tail, follow_file, last_metrics, log_summary
from launcher.bundle import Bundle
from launcher.contract.metrics import METRICS_FILE
from launcher.errors import LauncherError, UsageError
from launcher.registry import NoSuchJob, job_dir, job_dir_placement, launcher_home, write_json
from launcher.spec import JobSpec, Placement

CODE_DIR = "code"


def torchrun_argv(command: tuple[str, ...]) -> list[str]:
    """The spec's argv with `torchrun` run by this Python, so the job uses this environment's torch,
    through the bundle's entrypoints/torchrun.py, so a stop ends with one line, not a traceback."""
    assert command[0] == "torchrun", command
    return [sys.executable, "-m", "entrypoints.torchrun", *command[1:]]


class LocalBackend(Backend):
    name = "local"

    def placement(self, recipe, name: str, lineage: str | None = None) -> Placement:
        # Nothing reruns a failed local job, so torchrun restarts its workers once by default.
        placement = dataclasses.replace(job_dir_placement(recipe, name, lineage), max_restarts=1)
        init_from = getattr(recipe.model, "init_from", None) or ""
        if init_from.startswith("s3://"):  # staged like s3:// data, and read through SM_CHANNEL_MODEL
            model = str(staging_dir(init_from, launcher_home()))
            placement = dataclasses.replace(placement, s3_model_dir=model, s3_model_staging_dir=model)
        if not recipe.data.source.startswith("s3://"):
            return placement
        staged = str(staging_dir(recipe.data.source, launcher_home()))
        return dataclasses.replace(placement, s3_data_dir=staged, s3_staging_dir=staged)

    # --- render and submit -----------------------------------------------------------------

    def _render(self, spec: JobSpec) -> Rendering:
        bundle = Bundle.of(spec)
        directory = job_dir(spec.name)
        code = directory / CODE_DIR
        argv = torchrun_argv(spec.command)
        data = {
            "job_dir": str(directory),
            "cwd": str(code),
            "command": argv,
            "environment": spec.env,
            "bundle": bundle.describe(),
        }
        assignments = " ".join(f"{key}={shlex.quote(value)}" for key, value in spec.environment)
        text = f"cd {shlex.quote(str(code))} && env {assignments} {shlex.join(argv)}\n"
        return Rendering(spec=spec, data=data, text=text, payload={"bundle": bundle, "argv": argv})

    def _submit(self, rendering: Rendering) -> JobRef:
        spec = rendering.spec
        directory = job_dir(spec.name)
        if (directory / runner.STATUS).exists() or (directory / CODE_DIR).exists():
            raise LauncherError(f"a job named {spec.name} already exists in {directory.parent}; submit again")
        directory.mkdir(parents=True, exist_ok=True)
        created = utc_now()
        try:
            code = rendering.payload["bundle"].extract(directory / CODE_DIR)
            launch = {"argv": rendering.payload["argv"], "cwd": str(code), "env": spec.env}
            write_json(directory / runner.LAUNCH, launch)
            status = {"name": spec.name, "state": "InProgress", "created": created, "transitions": []}
            runner.transition(status, "Starting")
            runner.write_status(directory, status)
        except BaseException:
            # Nothing runs yet: take back what this submit wrote (a full disk leaves half a code/).
            shutil.rmtree(directory / CODE_DIR, ignore_errors=True)
            for name in (runner.LAUNCH, runner.STATUS):
                (directory / name).unlink(missing_ok=True)
            raise
        with (directory / "runner.log").open("ab") as runner_log:
            subprocess.Popen(
                [sys.executable, "-m", "launcher.backends.local.runner", str(directory)],
                stdin=subprocess.DEVNULL,
                stdout=runner_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        return JobRef(name=spec.name, backend=self.name, created=created)

    # --- status, logs, stop, list ------------------------------------------------------------

    def _directory(self, ref: JobRef) -> Path:
        directory = job_dir(ref.name)
        if not os.path.lexists(directory / runner.STATUS):
            raise NoSuchJob(f"no local job named {ref.name} in {directory.parent}")
        return directory

    def _status(self, ref: JobRef) -> JobStatus:
        directory = self._directory(ref)
        status = runner.read_status(directory)
        if (
            status["state"] == "InProgress"
            and not _runner_alive(status.get("runner_pid"))
            and _started_long_ago(status)
        ):
            status = _without_runner(directory, status)
        if status["state"] == "InProgress" and (directory / runner.STOP_REQUESTED).exists():
            status.update(state="Stopping", secondary="Stopping")
        metrics = last_metrics(directory / METRICS_FILE)
        summary = log_summary(directory / runner.LOG)
        return JobStatus(
            name=ref.name,
            backend=self.name,
            state=status["state"],
            secondary=status.get("secondary"),
            transitions=tuple(Transition(**t) for t in status.get("transitions", [])),
            failure_reason=status.get("failure_reason"),
            exit_code=status.get("exit_code"),
            created=status.get("created"),
            ended=status.get("ended"),
            metrics=metrics,
            details={"job_dir": str(directory), "log": str(directory / runner.LOG), "summary": summary},
        )

    def _logs(self, ref: JobRef, *, follow: bool, poll_s: float) -> Iterator[str]:
        directory = self._directory(ref)
        return follow_file(
            directory / runner.LOG, follow=follow, is_done=lambda: self._status(ref).terminal, poll_s=min(poll_s, 0.5)
        )

    def _metrics(self, ref: JobRef) -> MetricsHistory:
        return self._file_or_log_metrics(ref, self._directory(ref) / METRICS_FILE)

    def _stop(self, ref: JobRef, *, grace_s: float) -> JobStatus:
        directory = self._directory(ref)
        status = self._status(ref)
        if status.terminal:
            return status
        recorded = runner.read_status(directory)
        if recorded.get("pgid") is not None:
            _verified_group(directory, recorded)  # refuse a forged record before anything is written
        (directory / runner.STOP_REQUESTED).touch()
        recorded = _wait_for_pgid(directory)
        if recorded is not None:
            group = _verified_group(directory, recorded)
            group.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s  # the grace runs from SIGTERM, as docker stop's -t
            while group.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            if group.alive() and _workers_done_after_sigterm(directory):
                # They did what SIGTERM asks (the line follows their last save): what is left is
                # their exit, which a short --grace would turn into a SIGKILL and exit 137.
                exit_deadline = time.monotonic() + EXIT_AFTER_STOP_LINE_S
                while group.alive() and time.monotonic() < exit_deadline:
                    time.sleep(0.1)
            if group.alive():
                (directory / runner.STOP_KILLED).touch()
                _verified_group(directory, recorded).signal(signal.SIGKILL)
        # The runner records the end; if it is gone, record it here.
        settle = time.monotonic() + 10
        while not (status := self._status(ref)).terminal and time.monotonic() < settle:
            if not _runner_alive(runner.read_status(directory).get("runner_pid")):
                raw = runner.read_status(directory)
                runner.finish(directory, raw, raw.get("exit_code"), stopped=True)
            time.sleep(0.1)
        return status

    def _list(self, *, region: str | None, limit: int) -> list[JobStatus]:
        """Every job directory with a status; one that cannot be read is a row whose details say
        why (`damaged`), so one bad file never hides the other jobs."""
        root = launcher_home() / "jobs"
        names = sorted((p.parent.name for p in root.glob(f"*/{runner.STATUS}")), reverse=True)
        statuses = []
        for name in names:
            try:
                statuses.append(self._status(JobRef(name=name, backend=self.name)))
            except UsageError as error:  # a damaged status.json, or a directory whose name is no job's
                statuses.append(
                    JobStatus(name=name, backend=self.name, state="Unknown", details={"damaged": str(error)})
                )
        return sorted(statuses, key=lambda s: s.created or "", reverse=True)[:limit]


def _without_runner(directory: Path, status: dict) -> dict:
    """An InProgress status once its runner is gone, as the job's own files show it: processes
    still running, torchrun's exit code in exit.json, the trainer's summary line in the log (it
    prints one only when training finished), a stop that was asked for; else the runner's failure."""
    stopped = (directory / runner.STOP_REQUESTED).exists()
    if _training_alive(directory, status):
        return {**status, "secondary": "Training (the runner died; state read from the processes)"}
    exit_code = runner.read_exit(directory)
    if exit_code is not None:
        return runner.outcome(directory, status, exit_code, stopped=stopped, message=RUNNER_GONE)
    if log_summary(directory / runner.LOG):
        return runner.outcome(directory, status, 0, stopped=stopped, message=f"{RUNNER_GONE}: the log's summary line")
    if stopped:
        return runner.outcome(directory, status, None, stopped=True)
    failure = runner.runner_failure(directory)
    reason = f"the launcher's runner failed: {failure}" if failure else "the launcher's runner process died"
    if not failure and _disk_full(directory):
        reason += f" and the disk holding {directory} is full (ENOSPC)"
    return {**status, "state": "Failed", "failure_reason": f"{reason}; see {runner.RUNNER_LOG}"}


RUNNER_GONE = "the runner died; outcome read from the job's files"


def _disk_full(directory: Path) -> bool:
    try:
        return os.statvfs(directory).f_bavail == 0
    except OSError:
        return False


# --- processes ---------------------------------------------------------------------------------


def _runner_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    cmdline = Path(f"/proc/{pid}/cmdline")
    # A recycled pid belongs to some other program; only our runner counts (its module's name
    # before and after the backends became packages, so a job submitted by either is found).
    command = cmdline.read_bytes() if cmdline.exists() else b"launcher.backends.local.runner"
    return b"launcher.backends.local.runner" in command or b"launcher.backends.local_runner" in command


RUNNER_STARTUP_S = 30.0
"""How long a runner that has not recorded itself yet may still be starting: submit writes
status.json before it starts the runner, which records its pid with torchrun's group."""


def _started_long_ago(status: dict, seconds: float = RUNNER_STARTUP_S) -> bool:
    """A runner that has not written its pid yet may still be starting."""
    if status.get("runner_pid"):
        return True
    import datetime

    created = datetime.datetime.fromisoformat(status["created"])
    return (datetime.datetime.now(datetime.UTC) - created).total_seconds() > seconds


def _job_group(directory: Path, status: dict) -> JobGroup:
    """The process group `status.json` names, to be checked against /proc before any signal."""
    return JobGroup(
        pgid=status.get("pgid"), leader_start=status.get("pgid_start"), job_dir=runner.job_marker(directory)
    )


STOP_LINE = "interrupted by SIGTERM after step "
"""What rank 0 of entrypoints/train.py prints once it has stopped for SIGTERM, after its last save."""
EXIT_AFTER_STOP_LINE_S = 10.0
"""How long a stop waits past its grace for workers that printed STOP_LINE to exit."""
_LOG_TAIL_BYTES = 65536


def _workers_done_after_sigterm(directory: Path) -> bool:
    """Whether the end of the job's log holds STOP_LINE (a hint to wait, never more: bounded)."""
    tail = file_tail(directory / runner.LOG, _LOG_TAIL_BYTES)
    return any(line.startswith(STOP_LINE) for line in tail.splitlines())


def _verified_group(directory: Path, status: dict) -> JobGroup:
    """The recorded group once /proc shows it is the job's; otherwise one line and no signal."""
    group = _job_group(directory, status)
    try:
        group.verified_members()
    except ForeignProcessGroup as error:
        raise ForeignProcessGroup(
            f"not stopping {directory.name}: {directory / runner.STATUS}: {error}; nothing was signalled"
        ) from None
    return group


def _training_alive(directory: Path, status: dict) -> bool:
    """Whether torchrun's process group still runs, as far as /proc can show it is the job's: its
    leader (the same process, by start time) or, after the leader exited, members with its marker."""
    return status.get("pgid") is not None and _job_group(directory, status).alive()


def _wait_for_pgid(directory: Path) -> dict | None:
    """The status once the runner has recorded torchrun's process group; None if the job ended
    first, or if no runner recorded one while a runner could still be starting.

    Not bounded by the stop's grace: the trainer can run (and be asked to stop) before its
    runner has written the group, and a stop that gave up then would leave it training. A runner
    that is up answers in milliseconds, and one that saw the stop request first never starts it."""
    while True:
        status = runner.read_status(directory)
        if status["state"] != "InProgress":
            return None
        if status.get("pgid") is not None:
            return status
        if _started_long_ago(status):
            return None
        time.sleep(0.05)
