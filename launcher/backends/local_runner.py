"""The detached process that runs one local job: `python -m launcher.backends.local_runner JOB_DIR`.

It starts torchrun in a new process group (so `stop` can signal torchrun and all its workers
at once), waits for it, and is the only writer of `status.json` while it lives. Besides the
standard library it uses only the registry's atomic JSON write: it must start fast and never
depend on torch or the cloud SDKs.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from launcher.registry import write_json

STATUS = "status.json"
LAUNCH = "launch.json"
LOG = "output.log"
STOP_REQUESTED = "stop_requested"
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
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - max_bytes))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(tail):
        match = _ERROR_LINE.match(line)
        if match and "ChildFailedError" not in line:
            return match.group(1).strip()[:500]
    return None


def run(job_dir: Path) -> int:
    launch = json.loads((job_dir / LAUNCH).read_text())
    status = read_status(job_dir)
    status["runner_pid"] = os.getpid()
    if (job_dir / STOP_REQUESTED).exists():
        return finish(job_dir, status, None, stopped=True)
    with (job_dir / LOG).open("ab") as log:
        process = subprocess.Popen(
            launch["argv"],
            cwd=launch["cwd"],
            env={**os.environ, **launch["env"]},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        status.update(pid=process.pid, pgid=process.pid)
        transition(status, "Training")
        write_status(job_dir, status)
        returncode = process.wait()
    return finish(job_dir, status, returncode, stopped=(job_dir / STOP_REQUESTED).exists())


def finish(job_dir: Path, status: dict, returncode: int | None, *, stopped: bool) -> int:
    if returncode == 0:
        state, reason = "Completed", None
    elif stopped:
        state, reason = "Stopped", None
    else:
        error = last_error(job_dir / LOG)
        reason = f"torchrun exited with code {returncode}" + (f": {error}" if error else "")
        state = "Failed"
    transition(status, state, reason or "")
    status["transitions"][-1]["end"] = status["transitions"][-1]["start"]
    status.update(state=state, exit_code=returncode, failure_reason=reason, ended=now())
    write_status(job_dir, status)
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
