"""Which processes are provably a local job's, read from /proc: the only ones `stop` may signal.

A job's process group is named in its `status.json`, a file that can be damaged or forged. A
group id read from it is trusted only when /proc shows that the group is the job's:
- it is above 1 (`killpg(1, sig)` is `kill(-1, sig)`: every process the user may signal) and
  is not the launcher's own group;
- its leader, while it lives, is the process the runner started: the same pid and the same start
  time (/proc/PID/stat field 22), so a recycled pid never passes;
- every member carries the job's marker in the environment it was started with
  (/proc/PID/environ), which the runner sets for torchrun and its workers inherit.
Standard library only: the runner imports it, and it must start fast.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import LauncherError

JOB_MARKER = "LAUNCHER_JOB_DIR"
"""Set by the runner to the job directory in torchrun's environment; its workers inherit it."""

_PROC = Path("/proc")


class ForeignProcessGroup(LauncherError):
    """A recorded process group that cannot be shown to be the job's: nothing is signalled."""


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    pgid: int
    start: int
    """Clock ticks since boot at which the process started: with the pid, it names one process."""
    zombie: bool


def process_info(pid: int) -> ProcessInfo | None:
    """The process's group and start time from /proc/PID/stat, or None when it is gone."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or parentheses.
    fields = stat.rsplit(")", 1)[1].split()
    return ProcessInfo(pid=pid, pgid=int(fields[2]), start=int(fields[19]), zombie=fields[0] in ("Z", "X"))


def process_start_time(pid: int) -> int | None:
    info = process_info(pid)
    return info.start if info else None


def carries_marker(pid: int, job_dir: str) -> bool:
    """Whether the process was started with `LAUNCHER_JOB_DIR=<job_dir>` in its environment."""
    try:
        environ = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return False
    return f"{JOB_MARKER}={job_dir}".encode() in environ.split(b"\0")


def group_members(pgid: int) -> list[ProcessInfo]:
    """The live (not zombie) processes whose process group is `pgid`."""
    members = []
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (info := process_info(int(entry.name))) and info.pgid == pgid:
            if not info.zombie:
                members.append(info)
    return members


@dataclass(frozen=True)
class JobGroup:
    """A job's process group as its status file records it, with what proves it is the job's."""

    pgid: object
    """As read from the file: anything, until `verified_members` has checked it."""
    leader_start: object
    job_dir: str

    def verified_members(self) -> list[ProcessInfo]:
        """The group's live members, all of them shown to be the job's; [] when the group is gone.
        Raises ForeignProcessGroup, naming the reason, for a group that is not provably the job's."""
        pgid = self.pgid
        if type(pgid) is not int or pgid <= 1:
            raise ForeignProcessGroup(f"process group {pgid!r} is not a job's (a group id is an integer above 1)")
        if pgid in (os.getpgrp(), os.getpid()):
            raise ForeignProcessGroup(f"process group {pgid} is the launcher's own")
        members = group_members(pgid)
        leader = next((m for m in members if m.pid == pgid), None)
        if leader is not None and (type(self.leader_start) is not int or leader.start != self.leader_start):
            raise ForeignProcessGroup(
                f"process group {pgid}'s leader started at tick {leader.start}, "
                f"not at {self.leader_start!r} as recorded: it is another process"
            )
        strangers = [m.pid for m in members if not carries_marker(m.pid, self.job_dir)]
        if strangers:
            raise ForeignProcessGroup(
                f"process group {pgid} holds process(es) {', '.join(map(str, strangers[:5]))} "
                f"started without this job's {JOB_MARKER}"
            )
        return members

    def alive(self) -> bool:
        """Whether the job's group still has live members (False for a group that is not the job's)."""
        try:
            return bool(self.verified_members())
        except ForeignProcessGroup:
            return False

    def signal(self, sig: signal.Signals) -> bool:
        """Signal the whole group once it is verified as the job's; False when it is already gone."""
        if not self.verified_members():
            return False
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            return False
        return True
