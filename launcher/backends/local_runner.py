"""The detached process that runs one local job: `python -m launcher.backends.local_runner JOB_DIR`.

It starts torchrun in a new process group (so `stop` can signal torchrun and all its workers
at once), waits for it, and is the only writer of `status.json` while it lives. Standard
library only: it must start fast and survive whatever the launcher's own imports do.

A failed job's reason is torchrun's root cause, the first failing rank's error, not the last
error line of the log (often another rank's symptom, such as gloo's "Connection closed by
peer" after rank 0 died). The runner points TORCHELASTIC_ERROR_FILE at `error.json` in the job
directory; torchrun copies the first failed worker's error file there (the workers write
theirs through `@record` on entrypoints/train.py's main) and prints a "Root Cause (first
observed failure)" block naming the rank.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

STATUS = "status.json"
LAUNCH = "launch.json"
LOG = "output.log"
STOP_REQUESTED = "stop_requested"
ERROR_FILE = "error.json"
_ERROR_LINE = re.compile(r"^\s*(?:\[[^\]]*\]:?\s*)?([A-Za-z_.]*(?:Error|Exception)\b.*)$")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


def write_status(job_dir: Path, status: dict) -> None:
    path = job_dir / STATUS
    temporary = path.with_name(f".{STATUS}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(status, indent=2) + "\n")
    temporary.replace(path)


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


def root_cause(job_dir: Path) -> str | None:
    """'rank R: Error: message' of torchrun's first observed failure, else the log's last error."""
    rank, traceback_head = _root_cause_block(job_dir / LOG)
    message = _error_file_message(job_dir / ERROR_FILE) or traceback_head or last_error(job_dir / LOG)
    if message is None:
        return None
    return (f"rank {rank}: " if rank is not None else "") + message[:500]


def _error_file_message(path: Path) -> str | None:
    try:
        data = json.loads(path.read_text())
        message = data["message"]
        text = message["message"] if isinstance(message, dict) else message
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(text).strip().splitlines()[0] if str(text).strip() else None


def _root_cause_block(log: Path, max_bytes: int = 65536) -> tuple[int | None, str | None]:
    """The rank and the first traceback line of torchrun's "Root Cause" block in the log."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None, None
    starts = [i for i, line in enumerate(lines) if "Root Cause (first observed failure)" in line]
    if not starts:
        return None, None
    rank = head = None
    for line in lines[starts[-1] + 1 :]:
        key, sep, value = line.strip().partition(":")
        key, value = key.strip(), value.strip()
        if not sep or line.startswith("=="):
            continue
        if key == "rank" and rank is None:
            digits = value.split()[0] if value.split() else ""
            rank = int(digits) if digits.isdigit() else None
        elif key == "traceback" and head is None:
            # "Traceback (most recent call last):" when there is an error file; "Signal 9 ..." when killed.
            head = None if value.startswith("Traceback") or value.startswith("To enable") else value or None
            break
    return rank, head


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
            env={**os.environ, **launch["env"], "TORCHELASTIC_ERROR_FILE": str(job_dir / ERROR_FILE)},
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
