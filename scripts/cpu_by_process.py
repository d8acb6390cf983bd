"""Where a command's CPU time goes, process by process, through the kernel's process accounting.

    sudo .venv/bin/python scripts/cpu_by_process.py -- .venv/bin/pytest -q      # the whole suite
    sudo .venv/bin/python scripts/cpu_by_process.py --top 30 -- launcher submit recipes/tiny-cpu.yaml --backend local --wait

The suite is CPU-bound on CI's 2 cores, and much of its CPU is spent where pytest's own timing
and rusage cannot see it: in torchrun's ranks, in processes the engines start (slurmstepd's
steps, podman's conmon, the namespaces of the simulations) and in background launches. The
kernel writes one record for every process that ends, wherever it ran (acct(2); a record in a
child PID namespace is written to the accounting file of every namespace above it), with its
CPU time, parent and start. This turns accounting on for the command and off after it, then
sums the records by kind:

- `rank`: a process started by a torchrun agent; `agent`: a torchrun agent;
- `python >= 2.5 s`: other Python processes that used as much as an import of torch costs;
- everything else by its command name.

A process's name in the record is the one its last thread had when it ended: a rank often ends
as `pt_gloo_runloop` or `gloo_tcp_loop`, an agent as `pt_elastic`; the kinds follow parents, so
they do not depend on it. The records are of every process on the machine that ends while the command runs: measure on a
quiet machine, and one measurement at a time (accounting has one file). Needs root (CAP_SYS_PACCT) and a kernel with BSD process accounting
(version 3 records, /proc/sys/kernel/acct present).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# struct acct_v3 of include/uapi/linux/acct.h: flag, version, tty, exitcode, uid, gid, pid, ppid,
# btime, etime (a float in user space), then eight comp_t fields and a 16-byte command name.
_RECORD = struct.Struct("<ccHIIIIIIf8H16s")
_TICKS = 100  # AHZ: comp_t and etime count in hundredths of a second
IMPORT_OF_TORCH_S = 2.5
# Set for the measured command: where its records go, so that a run inside it reads them there.
ACCOUNTING_FILE_ENV = "CPU_BY_PROCESS_ACCOUNTING_FILE"


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    started: int  # seconds since the epoch
    wall_s: float
    cpu_s: float
    name: str


def _comp(value: int) -> int:
    """comp_t: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def read_records(path: Path, start: int = 0) -> list[Process]:
    """The records of `path` from byte `start` on (a record's boundary)."""
    data = path.read_bytes()
    found = []
    for offset in range(start, len(data) - _RECORD.size + 1, _RECORD.size):
        fields = _RECORD.unpack_from(data, offset)
        if fields[1] != b"\x03":
            raise SystemExit(f"error: {path}: record version {fields[1][0]}, expected 3 (acct_v3)")
        pid, ppid, started, etime, utime, stime, name = (
            fields[6],
            fields[7],
            fields[8],
            fields[9],
            fields[10],
            fields[11],
            fields[-1],
        )
        cpu = (_comp(utime) + _comp(stime)) / _TICKS
        found.append(Process(pid, ppid, started, etime / _TICKS, cpu, name.split(b"\0")[0].decode(errors="replace")))
    return found


def kind(process: Process, agents: set[int]) -> str:
    if process.pid in agents:
        return "agent"
    if process.ppid in agents:
        return "rank"
    if process.name.startswith("python") and process.cpu_s >= IMPORT_OF_TORCH_S:
        return f"python >= {IMPORT_OF_TORCH_S} s"
    return process.name


def torchrun_agents(processes: list[Process]) -> set[int]:
    """Agents: the processes whose children include a rank. A rank is a Python process whose parent
    ended as `pt_elastic` (the agent's thread) or was started as `torchrun`."""
    named = {p.pid for p in processes if p.name in ("pt_elastic", "torchrun")}
    return {p.ppid for p in processes if p.ppid in named}


def report(processes: list[Process], top: int) -> str:
    parents = {p.pid: p for p in processes}
    agents = torchrun_agents(processes)
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for process in processes:
        entry = by_kind[kind(process, agents)]
        entry[0] += 1
        entry[1] += process.cpu_s
    total = sum(p.cpu_s for p in processes)
    lines = [f"{len(processes)} processes, {total / 60:.1f} CPU minutes", "", "CPU min  processes  kind"]
    for name, (count, cpu) in sorted(by_kind.items(), key=lambda item: -item[1][1])[:top]:
        lines.append(f"{cpu / 60:7.2f}  {count:9d}  {name}")
    first = min((p.started for p in processes), default=0)
    lines += ["", f"the {top} that used most:", "  CPU s   wall s  start s  name < parents"]
    for process in sorted(processes, key=lambda p: -p.cpu_s)[:top]:
        chain, parent = [], parents.get(process.ppid)
        while parent is not None and len(chain) < 4:
            chain.append(parent.name)
            parent = parents.get(parent.ppid)
        lines.append(
            f"{process.cpu_s:7.1f}  {process.wall_s:7.1f}  {process.started - first:7d}  {process.name} < {' < '.join(chain)}"
        )
    return "\n".join(lines)


def account(command: list[str], path: Path) -> tuple[int, Path, int]:
    """Run `command` with accounting on: (its exit code, the accounting file, the byte offset of
    the first record written while it ran).

    The kernel keeps one accounting file, and acct(NULL) ends it for everyone. So a run inside a
    measured command (the suite's own test of this script, under `cpu_by_process.py -- pytest`)
    leaves the outer run's accounting on and reads the outer file from where it stood: before,
    it turned accounting off 60 s into the suite, and the report held 0.8 of its 36 CPU minutes."""
    outer = os.environ.get(ACCOUNTING_FILE_ENV)
    if outer:
        start = Path(outer).stat().st_size // _RECORD.size * _RECORD.size
        return subprocess.call(command), Path(outer), start
    libc = ctypes.CDLL(None, use_errno=True)
    path.touch()
    if libc.acct(str(path).encode()) != 0:
        error = ctypes.get_errno()
        raise SystemExit(f"error: cannot turn process accounting on ({os.strerror(error)}); run as root")
    try:
        return subprocess.call(command, env={**os.environ, ACCOUNTING_FILE_ENV: str(path)}), path, 0
    finally:
        libc.acct(None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=20, help="kinds and processes to list (default 20)")
    parser.add_argument("--keep", type=Path, help="keep the accounting file here (default: a temporary one)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    if not Path("/proc/sys/kernel/acct").exists():
        raise SystemExit("error: this kernel has no BSD process accounting (/proc/sys/kernel/acct)")
    with tempfile.TemporaryDirectory(prefix="cpu-by-process-") as scratch:
        path = args.keep or Path(scratch) / "pacct"
        began = time.monotonic()
        code, path, start = account(command, path)
        wall = time.monotonic() - began
        print(f"\n{' '.join(command)}: exit {code}, {wall:.0f} s wall", file=sys.stderr)
        print(report(read_records(path, start), args.top))
    return code


if __name__ == "__main__":
    sys.exit(main())
