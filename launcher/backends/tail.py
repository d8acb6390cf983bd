"""Read a job's files as they grow: its log (until the job ends), its last metrics, its summary
line (local, Slurm and docker jobs write them where this machine can read them)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from launcher.contract.metrics import SUMMARY_PREFIX, VALIDATION_KEYS, parse_fields
from launcher.registry import DamagedRecord, open_regular


def follow_file(path: Path, *, follow: bool, is_done: Callable[[], bool], poll_s: float) -> Iterator[str]:
    """Lines of `path`; with `follow`, keep reading until `is_done()`, then drain and return.

    `is_done` is asked before each read, so the read after the job ends still sees its last lines.
    """
    position = 0
    pending = b""
    while True:
        done = (not follow) or is_done()
        opened = open_regular(path, "job log")  # a FIFO or /dev/zero in its place: one line, not a hang
        if opened is not None:
            with opened as f:
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


def last_metrics(path: Path) -> dict[str, float]:
    """The newest step's metrics, with the newest validation values of any step before it (a job
    evaluates every data.validation.every_steps steps, and logs in between)."""
    rows = metrics_file_rows(path)
    if not rows:
        return {}
    last = dict(rows[-1])
    for key in VALIDATION_KEYS:
        evaluated = [row[key] for row in rows if key in row]
        if evaluated and key not in last:
            last[key] = evaluated[-1]
    return last


def metrics_file_rows(path: Path) -> list[dict[str, float]]:
    """Every step a metrics.jsonl holds, in the order written; [] when there is none yet."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue  # a blank line, or the line being written right now
        if isinstance(row, dict):  # a damaged line may hold any JSON at all
            rows.append(row)
    return rows


def file_tail(path: Path, max_bytes: int) -> str:
    """The last `max_bytes` of a regular file; "" where there is none, or something else stands in
    its place (a FIFO would block the reader, /dev/zero would never end): what it serves are hints."""
    try:
        opened = open_regular(path, "file")
    except DamagedRecord:
        return ""
    if opened is None:
        return ""
    with opened as f:
        try:
            f.seek(max(0, os.fstat(f.fileno()).st_size - max_bytes))
            return f.read(max_bytes).decode(errors="replace")
        except OSError:
            return ""


def log_summary(log: Path, max_bytes: int = 65536) -> dict[str, float | str]:
    lines = file_tail(log, max_bytes).splitlines()
    for line in reversed(lines):
        if line.startswith(f"{SUMMARY_PREFIX} "):
            return parse_fields(line)
    return {}
