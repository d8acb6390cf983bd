"""Waiting on a job's progress rather than on the clock.

A loaded 2-core machine slows a job's start-up and every step, sometimes to minutes, but stops
none of them: a job whose log keeps growing is alive. These waits fail only when the log stays
silent for longer than a generous limit, or when the job ends without what was awaited.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

QUIET_LIMIT_S = 300.0  # the longest a job's log may stay silent: torch imported by 4 processes on a loaded machine


def log_size(log: Path) -> int:
    return log.stat().st_size if log.exists() else 0


def wait_while_growing(condition: Callable[[], bool], log: Path, what: str, quiet_limit_s: float = QUIET_LIMIT_S):
    """Until `condition()` holds; AssertionError naming `what` once `log` is silent for `quiet_limit_s` s."""
    seen, quiet_since = -1, time.monotonic()
    while not condition():
        size = log_size(log)
        if size != seen:
            seen, quiet_since = size, time.monotonic()
        elif time.monotonic() - quiet_since > quiet_limit_s:
            raise AssertionError(f"{what}: {log} was silent for {quiet_limit_s:.0f} s")
        time.sleep(0.2)


def communicate_while_growing(
    process: subprocess.Popen, log: Path, quiet_limit_s: float = QUIET_LIMIT_S
) -> tuple[str, str]:
    """`process.communicate()` (a `launcher logs --follow`, say) once it exits, as long as `log`
    keeps growing; ends the process and fails after `quiet_limit_s` s without a new byte."""
    output: list[tuple[str, str]] = []
    reader = threading.Thread(target=lambda: output.append(process.communicate()), daemon=True)
    reader.start()
    try:
        wait_while_growing(lambda: not reader.is_alive(), log, f"pid {process.pid} still running", quiet_limit_s)
    except AssertionError:
        process.kill()
        reader.join()
        raise
    return output[0]
