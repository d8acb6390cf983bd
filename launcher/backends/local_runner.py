"""The detached process that runs one local job: `python -m launcher.backends.local_runner JOB_DIR`.

It starts torchrun in a new process group (so `stop` can signal torchrun and all its workers
at once), waits for it, and is the only writer of `status.json` while it lives. Besides the
standard library it uses only the registry's atomic JSON write: it must start fast and never
depend on torch or the cloud SDKs.

A failed job's reason is the error of the rank that failed first (launcher.contract.failure:
by the raise times in the ranks' error files, not torchrun's first observed exit, which is often
another rank's symptom such as gloo's "Connection closed by peer"); torchrun's own root-cause
error file is copied to `error.json` in the job directory as the fallback.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from launcher.backends.processes import JOB_MARKER, process_start_time
from launcher.contract.failure import first_failure
from launcher.registry import write_json

STATUS = "status.json"
LAUNCH = "launch.json"
LOG = "output.log"
STOP_REQUESTED = "stop_requested"
STOP_KILLED = "stop_killed"
"""Written by `stop` when SIGTERM was not enough and the group got SIGKILL."""
ERROR_FILE = "error.json"
_ERROR_LINE = re.compile(r"^\s*(?:\[[^\]]*\]:?\s*)?([A-Za-z_.]*(?:Error|Exception)\b.*)$")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


def write_status(job_dir: Path, status: dict) -> None:
    write_json(job_dir / STATUS, status)


def read_status(job_dir: Path) -> dict:
    return json.loads((job_dir / STATUS).read_text())


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


def _tail(log: Path, max_bytes: int) -> list[str]:
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - max_bytes))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def run(job_dir: Path) -> int:
    launch = json.loads((job_dir / LAUNCH).read_text())
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
    return finish(job_dir, status, returncode, stopped=(job_dir / STOP_REQUESTED).exists())


def job_marker(job_dir: Path) -> str:
    """The value of JOB_MARKER in the job's processes: its directory, absolute."""
    return os.path.abspath(job_dir)


def finish(job_dir: Path, status: dict, returncode: int | None, *, stopped: bool) -> int:
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
    transition(status, state, reason or "")
    status["transitions"][-1]["end"] = status["transitions"][-1]["start"]
    status.update(state=state, exit_code=returncode, failure_reason=reason, ended=now())
    write_status(job_dir, status)
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
