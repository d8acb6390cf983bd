"""Read a growing log file, optionally until its job ends (local and Slurm jobs write files)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path


def follow_file(path: Path, *, follow: bool, is_done: Callable[[], bool], poll_s: float) -> Iterator[str]:
    """Lines of `path`; with `follow`, keep reading until `is_done()`, then drain and return.

    `is_done` is asked before each read, so the read after the job ends still sees its last lines.
    """
    position = 0
    pending = b""
    while True:
        done = (not follow) or is_done()
        if path.exists():
            with path.open("rb") as f:
                f.seek(position)
                chunk = f.read()
            position += len(chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                yield line.decode(errors="replace")
        if done:
            if pending:
                yield pending.decode(errors="replace")
            return
        time.sleep(poll_s)
