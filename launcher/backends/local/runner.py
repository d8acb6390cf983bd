"""The detached process that runs one local job: `python -m launcher.backends.local.runner JOB_DIR`.

It starts torchrun in a new process group (so `stop` can signal torchrun and all its workers
at once), waits for it, and is the only writer of `status.json` while it lives. Besides the
standard library it uses only the registry's checked JSON reads and atomic writes: it must start
fast and never depend on torch or the cloud SDKs.

When torchrun ends, its exit code goes to `exit.json` before `status.json` is updated, so the
outcome is on disk whenever the runner dies; `status` reads it (or the trainer's summary line)
once it sees the runner gone. A runner that cannot go on (a full disk, a damaged file) says why in
its last line of runner.log.

A failed job's reason is the error of the rank that failed first (launcher.contract.failure:
by the raise times in the ranks' error files, not torchrun's first observed exit, which is often
another rank's symptom such as gloo's "Connection closed by peer"); torchrun's own root-cause
error file is copied to `error.json` in the job directory as the fallback.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

from launcher.backends.processes import JOB_MARKER, process_start_time
from launcher.backends.tail import file_tail
from launcher.contract.failure import first_failure
from launcher.errors import LauncherError
from launcher.registry import DamagedRecord, checked_object, os_error_line, read_json, write_json

STATUS = "status.json"
LAUNCH = "launch.json"
LOG = "output.log"
RUNNER_LOG = "runner.log"
STOP_REQUESTED = "stop_requested"
STOP_KILLED = "stop_killed"
"""Written by `stop` when SIGTERM was not enough and the group got SIGKILL."""
ERROR_FILE = "error.json"
EXIT_FILE = "exit.json"
"""torchrun's exit code, written by the runner the moment torchrun ends, before status.json: a
small file of its own, so the outcome is on disk even if the runner dies before the status."""
STATES = ("InProgress", "Stopping", "Completed", "Failed", "Stopped")
RUNNER_FAILED = "local_runner failed: "
"""How the runner's last line in runner.log starts when it could not go on (a full disk)."""
_ERROR_LINE = re.compile(r"^\s*(?:\[[^\]]*\]:?\s*)?([A-Za-z_.]*(?:Error|Exception)\b.*)$")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


def write_status(job_dir: Path, status: dict) -> None:
    write_json(job_dir / STATUS, status)


LAUNCH_KEYS = ("argv", "cwd", "env")
_OPTIONAL_INT = (int, type(None))
_OPTIONAL_TEXT = (str, type(None))
_STATUS_TYPES = {
    "name": (str,),
    "state": (str,),
    "secondary": _OPTIONAL_TEXT,
    "created": (str,),
    "ended": _OPTIONAL_TEXT,
    "transitions": (list,),
    "runner_pid": _OPTIONAL_INT,
    "exit_code": _OPTIONAL_INT,
    "failure_reason": _OPTIONAL_TEXT,
}
_TRANSITION_TYPES = {"status": (str,), "start": _OPTIONAL_TEXT, "end": _OPTIONAL_TEXT, "message": (str,)}


def read_status(job_dir: Path) -> dict:
    """status.json, checked: its keys hold what the runner writes there, or a DamagedRecord line.
    (pgid and pgid_start are left to launcher.backends.processes, which trusts neither.)"""
    path = job_dir / STATUS
    data = read_json(path, "job status")
    if data is None:
        raise DamagedRecord(f"{path}: missing: the job's status file is gone")
    status = checked_object(data, path, "job status", _STATUS_TYPES, ("state", "created"))
    if status["state"] not in STATES:
        raise DamagedRecord(f"{path}: damaged job status: state {status['state']!r} is not one of {', '.join(STATES)}")
    try:
        datetime.datetime.fromisoformat(status["created"])
    except ValueError:
        raise DamagedRecord(f"{path}: damaged job status: created {status['created']!r} is not a time") from None
    for transition in status.get("transitions", []):
        checked_object(transition, path, "job status (a transition)", _TRANSITION_TYPES, ("status", "start"))
        if set(transition) - set(_TRANSITION_TYPES):
            raise DamagedRecord(f"{path}: damaged job status: a transition has keys {sorted(transition)}")
    return status


def read_exit(job_dir: Path) -> int | None:
    """torchrun's exit code as the runner recorded it in exit.json; None before it ended."""
    path = job_dir / EXIT_FILE
    data = read_json(path, "exit record")
    if data is None:
        return None
    return checked_object(data, path, "exit record", {"exit_code": (int,)}, ("exit_code",))["exit_code"]


def transition(status: dict, secondary: str, message: str = "") -> None:
    stamp = now()
    if status.get("transitions"):
        status["transitions"][-1]["end"] = status["transitions"][-1].get("end") or stamp
    status.setdefault("transitions", []).append({"status": secondary, "start": stamp, "end": None, "message": message})
    status["secondary"] = secondary


def last_error(log: Path, max_bytes: int = 65536) -> str | None:
    """The last `SomethingError: ...` line of the log, the most useful one-line failure reason."""
    for line in reversed(_tail(log, max_bytes)):
        match = _ERROR_LINE.match(line)
        if match and "ChildFailedError" not in line:
            return match.group(1).strip()[:500]
    return None


def root_cause(job_dir: Path, max_bytes: int = 262144) -> str | None:
    """'rank R: Error: message' of the rank that failed first (launcher.contract.failure), else the
    log's last error line."""
    failure = first_failure(_tail(job_dir / LOG, max_bytes), fallback_error_file=job_dir / ERROR_FILE)
    message = failure.headline if failure else None
    if message is None:
        return last_error(job_dir / LOG)
    return (f"rank {failure.rank}: " if failure.rank is not None else "") + message[:500]


def runner_failure(job_dir: Path) -> str | None:
    """Why the runner gave up, as its last line in runner.log says (see `main`); None if it did not say."""
    lines = [line for line in _tail(job_dir / RUNNER_LOG, 8192) if line.startswith(RUNNER_FAILED)]
    return lines[-1].removeprefix(RUNNER_FAILED).strip()[:500] if lines else None


def _tail(log: Path, max_bytes: int) -> list[str]:
    return file_tail(log, max_bytes).splitlines()


def read_launch(job_dir: Path) -> dict:
    """launch.json (what submit asked the runner to run), checked before anything is started."""
    path = job_dir / LAUNCH
    data = read_json(path, "launch file")
    if data is None:
        raise DamagedRecord(f"{path}: missing: submit did not finish writing the job")
    launch = checked_object(data, path, "launch file", {"argv": (list,), "cwd": (str,), "env": (dict,)}, LAUNCH_KEYS)
    texts = [*launch["argv"], *launch["env"], *launch["env"].values()]
    if not launch["argv"] or not all(isinstance(text, str) for text in texts):
        raise DamagedRecord(f"{path}: damaged launch file: argv and env must hold strings only")
    return launch


def run(job_dir: Path) -> int:
    # A first line in runner.log: on a full disk, the last line (why the runner stopped) still
    # fits in the space this one took.
    print(f"local_runner: pid {os.getpid()} runs {job_dir}", file=sys.stderr, flush=True)
    launch = read_launch(job_dir)
    status = read_status(job_dir)
    status["runner_pid"] = os.getpid()
    if (job_dir / STOP_REQUESTED).exists():
        return finish(job_dir, status, None, stopped=True)
    (job_dir / ERROR_FILE).unlink(missing_ok=True)
    with (job_dir / LOG).open("ab") as log:
        process = subprocess.Popen(
            launch["argv"],
            cwd=launch["cwd"],
            env={
                **os.environ,
                **launch["env"],
                "TORCHELASTIC_ERROR_FILE": str(job_dir / ERROR_FILE),
                JOB_MARKER: job_marker(job_dir),  # what `stop` checks before it signals the group
            },
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        status.update(pid=process.pid, pgid=process.pid, pgid_start=process_start_time(process.pid))
        transition(status, "Training")
        write_status(job_dir, status)
        returncode = process.wait()
    write_json(job_dir / EXIT_FILE, {"exit_code": returncode, "ended": now()})
    return finish(job_dir, status, returncode, stopped=(job_dir / STOP_REQUESTED).exists())


def job_marker(job_dir: Path) -> str:
    """The value of JOB_MARKER in the job's processes: its directory, absolute."""
    return os.path.abspath(job_dir)


def finish(job_dir: Path, status: dict, returncode: int | None, *, stopped: bool) -> int:
    write_status(job_dir, outcome(job_dir, status, returncode, stopped=stopped))
    return 0


def outcome(job_dir: Path, status: dict, returncode: int | None, *, stopped: bool, message: str = "") -> dict:
    """`status` as it ends, given torchrun's exit code (None: it never ran, or is not known)."""
    if returncode == 0:
        state, reason = "Completed", None
    elif stopped:
        # The shell's convention, as docker and SageMaker report it: 128 + the signal that ended it.
        state, reason = "Stopped", None
        returncode = 137 if (job_dir / STOP_KILLED).exists() else 143
    else:
        error = root_cause(job_dir)
        reason = f"torchrun exited with code {returncode}" + (f": {error}" if error else "")
        state = "Failed"
    transition(status, state, reason or message)
    status["transitions"][-1]["end"] = status["transitions"][-1]["start"]
    status.update(state=state, exit_code=returncode, failure_reason=reason, ended=status.get("ended") or now())
    return status


def main(job_dir: Path) -> int:
    """Run the job; a failure of the runner itself (a full disk, a damaged file) is its last line
    in runner.log, which `status` shows once it sees the runner gone."""
    try:
        return run(job_dir)
    except (LauncherError, OSError) as error:
        text = str(error) if isinstance(error, LauncherError) else os_error_line(error, "at")
        print(f"{RUNNER_FAILED}{text}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
