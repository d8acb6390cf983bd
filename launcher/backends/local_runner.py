"""The detached process that runs one local job: `python -m launcher.backends.local_runner JOB_DIR`.

It starts torchrun in a new process group (so `stop` can signal torchrun and all its workers
at once), waits for it, and is the only writer of `status.json` while it lives. Besides the
standard library it uses only the registry's atomic JSON write: it must start fast and never
depend on torch or the cloud SDKs.

A failed job's reason is the error of the rank that failed first, not the last error line of
the log (often another rank's symptom, such as gloo's "Connection closed by peer" after rank 0
died). Every worker writes its error to its TORCHELASTIC_ERROR_FILE with the moment it was
raised (entrypoints/failure.py); torchrun lists each failed rank with its error file in its
failure report, and the runner takes the earliest. torchrun's own "Root Cause (first observed
failure)" is the first process it saw exit, which among ranks failing within a second is often
a symptom; it is the fallback (its error file is copied to `error.json` in the job directory).
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
    """'rank R: Error: message' of the rank that failed first, else the log's last error line."""
    failures = _failures(job_dir / LOG)
    timed = [(raised_at, rank, message) for rank, (raised_at, message) in failures.items() if raised_at is not None]
    if timed:
        _, rank, message = min(timed)
    elif failures:
        # Without raise times (an older entrypoint, a killed rank), torchrun's choice: the first listed
        # under "Root Cause", whose error file torchrun also copied to ERROR_FILE.
        rank = next(iter(failures))
        message = _error_file(job_dir / ERROR_FILE)[1] or failures[rank][1]
    else:
        rank, message = None, _error_file(job_dir / ERROR_FILE)[1] or last_error(job_dir / LOG)
    if message is None:
        return None
    return (f"rank {rank}: " if rank is not None else "") + message[:500]


def _error_file(path: Path | str) -> tuple[float | None, str | None]:
    """(raised_at, first line of the message) of a torchelastic error file; Nones if unreadable."""
    try:
        message = json.loads(Path(path).read_text())["message"]
        text = message["message"] if isinstance(message, dict) else message
        raised_at = message.get("extraInfo", {}).get("raised_at") if isinstance(message, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    lines = str(text).strip().splitlines()
    return (float(raised_at) if raised_at else None), (lines[0] if lines else None)


def _failures(log: Path, max_bytes: int = 262144) -> dict[int, tuple[float | None, str | None]]:
    """rank -> (raised_at, message) for every rank in torchrun's failure report, root cause first."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    entries: list[tuple[int, str]] = []  # (rank, error_file) in report order
    rank = None
    for line in lines:
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "rank" and value.split() and value.split()[0].isdigit():
            rank = int(value.split()[0])
        elif key == "error_file" and rank is not None:
            entries.append((rank, value))
            rank = None
    roots = [i for i, line in enumerate(lines) if "Root Cause (first observed failure)" in line]
    ordered: dict[int, tuple[float | None, str | None]] = {}
    if roots:  # torchrun prints the root cause after the other failures; list it first
        root_rank = _rank_after(lines, roots[-1])
        entries.sort(key=lambda entry: entry[0] != root_rank)
    for rank, path in entries:
        ordered.setdefault(rank, _error_file(path))
    return ordered


def _rank_after(lines: list[str], start: int) -> int | None:
    for line in lines[start:]:
        key, _, value = line.strip().partition(":")
        if key.strip() == "rank" and value.split() and value.split()[0].isdigit():
            return int(value.split()[0])
    return None


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
