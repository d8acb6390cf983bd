"""Which rank failed first, from torchrun's failure report and the ranks' error files.

Each training process writes its exception to its TORCHELASTIC_ERROR_FILE with the moment it was
raised (`extraInfo.raised_at`, entrypoints/failure.py). When workers fail, torchrun prints a report
that lists every failed rank (host, exit code, error file) and a "Root Cause (first observed
failure)": the first process torchrun saw exit. Among ranks failing within the same second that is
often a peer's symptom (gloo's "Connection closed by peer" after rank 0 raised), so the first
failure is the rank that raised first; torchrun's root cause only where no raise times exist.

Both sides read failures this way: the local runner (launcher/backends/local/runner.py) for a
local job's failure reason, and the container bootstrap (entrypoints/bootstrap.py) for SageMaker's
/opt/ml/output/failure. Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from launcher.contract.regular_files import open_regular_file

ROOT_CAUSE = "Root Cause (first observed failure)"


@dataclass(frozen=True, slots=True)
class RankFailure:
    rank: int | None
    host: str | None = None
    exitcode: int | None = None
    """As torchrun reports it: negative for a signal."""
    raised_at: float | None = None
    message: str | None = None
    stack: str = ""

    @property
    def headline(self) -> str | None:
        """The first line of the message: `Error: text`."""
        lines = (self.message or "").strip().splitlines()
        return lines[0] if lines else None


def read_error_file(path: str | Path | None) -> RankFailure:
    """What a torchelastic error file says (rank unknown); an empty failure if it is unreadable."""
    try:
        data = json.loads(_regular_file_text(Path(path)))["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return RankFailure(rank=None)
    if not isinstance(data, dict):
        return RankFailure(rank=None, message=str(data))
    extra = data.get("extraInfo") or {}
    raised_at = extra.get("raised_at")
    code = data.get("errorCode")
    return RankFailure(
        rank=None,
        exitcode=int(code) if str(code or "").lstrip("-").isdigit() else None,
        raised_at=float(raised_at) if raised_at else None,
        message=str(data.get("message", "")),
        stack=str(extra.get("py_callstack", "")),
    )


def _regular_file_text(path: Path, max_bytes: int = 1 << 20) -> str:
    """A regular file's text, at most `max_bytes` (NotRegularFile, an OSError, for anything else)."""
    with open_regular_file(path) as file:
        return file.read(max_bytes).decode(errors="replace")


def reported_failures(lines: list[str]) -> list[RankFailure]:
    """Every rank torchrun's report lists, its error file read; torchrun's root cause first."""
    entries: list[dict[str, str]] = []
    root_index = None
    for line in lines:
        if ROOT_CAUSE in line:
            root_index = len(entries)
        key, sep, value = line.strip().partition(":")
        key, value = key.strip(), value.strip()
        if not sep or key not in ("host", "rank", "exitcode", "error_file"):
            continue
        if key == "host" or not entries or key in entries[-1]:
            entries.append({})
        entries[-1][key] = value
    failures = [_failure(entry) for entry in entries if _first_int(entry.get("rank")) is not None]
    if root_index is not None:  # torchrun prints its root cause after the other failures
        root_rank = _first_int(entries[root_index].get("rank")) if root_index < len(entries) else None
        failures.sort(key=lambda f: f.rank != root_rank)
    return failures


def first_failure(lines: list[str], *, fallback_error_file: str | Path | None = None) -> RankFailure | None:
    """The rank that raised first; else torchrun's root cause; else what the fallback file says."""
    failures = reported_failures(lines)
    timed = [f for f in failures if f.raised_at is not None]
    if timed:
        return min(timed, key=lambda f: f.raised_at)
    fallback = read_error_file(fallback_error_file) if fallback_error_file else RankFailure(rank=None)
    if failures:
        first = failures[0]
        if first.message is None and fallback.message is not None:
            first = replace(first, message=fallback.message, stack=fallback.stack)
        return first
    return fallback if fallback.message is not None else None


def _failure(entry: dict[str, str]) -> RankFailure:
    from_file = read_error_file(entry.get("error_file")) if entry.get("error_file") else RankFailure(rank=None)
    return replace(
        from_file,
        rank=_first_int(entry.get("rank")),
        host=entry.get("host") or None,
        exitcode=_first_int(entry.get("exitcode")),
    )


def _first_int(value: str | None) -> int | None:
    word = (value or "").split(" ")[0]
    return int(word) if word.lstrip("-").isdigit() else None
