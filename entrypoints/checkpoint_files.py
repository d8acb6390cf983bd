"""Which host owns which checkpoint file, per-host completion markers, and pruning by owner.

Standard library only, so the rules can be tested without torch.

Checkpoint directories must be right in two storage models:
- shared (local disk, Slurm on a shared file system): every host sees one directory;
- per host (SageMaker): /opt/ml/checkpoints is local to each host, uploaded to one S3 prefix as
  files appear, deleted in S3 when deleted locally, and downloaded to every host at job start.
  Host B's copy of a file host A wrote is only a download: if B deleted it, the deletion could
  reach S3 after A uploaded a newer file of the same name and erase it.

So every file name in a step directory has exactly one owner host, and only its owner writes or
deletes it. Ranks are placed on hosts as torchrun places them, `procs_per_node` consecutive ranks
per host:
- `__<r>_<i>.distcp` (DCP's shards of rank r) and `rng/rank-<r>.pt`: the host of rank r;
- `COMPLETE.node-<k>-of-<n>`: host k, written by its first rank after its ranks' files are durable;
  it records the size and SHA-256 of every file the host owns (digests taken as the bytes were
  written, so saving reads nothing back), and resume checks what it loads against them;
- `.metadata`, `train_state.json` and anything else: host 0 (global rank 0 writes them).
A name that maps to no host of this run (a bigger earlier run) belongs to host 0.

A checkpoint counts when the markers of all n hosts of one run exist (`is_complete`, in the
contract: launcher/contract/checkpoint_dirs.py, which the launcher reads by too).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from launcher.contract.checkpoint_dirs import MARKER, marker_name

_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng/rank-(\d+)\.pt)$")


@dataclass(frozen=True)
class RankHosts:
    """Where this process sits: its rank and how ranks are spread over hosts."""

    rank: int
    world_size: int
    procs_per_node: int

    def __post_init__(self):
        if self.procs_per_node < 1 or self.world_size % self.procs_per_node:
            raise ValueError(f"{self.world_size} ranks do not split into hosts of {self.procs_per_node}")

    @classmethod
    def from_env(cls, rank: int, world_size: int) -> RankHosts:
        """torchrun's LOCAL_WORLD_SIZE ranks per host (one host when run without torchrun)."""
        return cls(rank, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))

    @property
    def instance_count(self) -> int:
        return self.world_size // self.procs_per_node

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def is_node_leader(self) -> bool:
        """The host's first rank: writes the host's marker and prunes the host's files."""
        return self.rank % self.procs_per_node == 0

    def node_of(self, rank: int) -> int:
        return rank // self.procs_per_node if rank < self.world_size else 0

    def owner(self, relative: str) -> int:
        """The host that writes and deletes `relative`, a path inside a step directory."""
        match = _RANK_FILE.match(relative)
        if match:
            return self.node_of(int(match.group(1) or match.group(2)))
        match = MARKER.match(relative)
        if match and int(match.group(1)) < self.instance_count:
            return int(match.group(1))
        return 0

    @property
    def marker(self) -> str:
        return marker_name(self.node, self.instance_count)


def own_files(path: Path, rank_hosts: RankHosts) -> list[Path]:
    """The files in step directory `path` that this host owns; its marker first."""
    files = []
    for root, _, names in os.walk(path):
        for name in names:
            full = Path(root) / name
            if rank_hosts.owner(full.relative_to(path).as_posix()) == rank_hosts.node:
                files.append(full)
    # The marker goes first: a host's part must stop counting before any of its files disappear.
    return sorted(files, key=lambda f: (not MARKER.match(f.name), f.as_posix()))


def remove_own_files(path: Path, rank_hosts: RankHosts) -> None:
    for file in own_files(path, rank_hosts):
        file.unlink(missing_ok=True)
    if path.is_dir():
        fsync_dir(path)


def remove_empty_dirs(path: Path) -> None:
    """Remove `path` and its subdirectories where they are empty (other hosts' files stay)."""
    # Another host may remove the same directories at the same moment (a shared checkpoint dir),
    # so a directory that vanishes while it is walked is not an error.
    subdirs = []
    for root, dirs, _ in os.walk(path):
        subdirs += [Path(root, d) for d in dirs]
    for sub in sorted(subdirs, reverse=True):
        _try_rmdir(sub)
    _try_rmdir(path)


def _try_rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:  # not empty (another host's files), or already removed by another host
        pass


def write_durable(path: Path, data: bytes) -> str:
    """Write `data` and fsync the file and its directory: on disk before anyone is told.
    Returns the data's digest, for the host's marker. A write that fails (a full disk) leaves
    no file: a torn marker must not make its checkpoint count as complete."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        path.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return hashlib.new(DIGEST, data).hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- what a marker records, and checking it before a resume ------------------------------------

DIGEST = "sha256"
"""The digest of every checkpoint file. SHA-256 rather than BLAKE2b: OpenSSL's SHA-256 runs on
the CPU's SHA extensions (x86 SHA-NI, ARMv8 crypto: every instance type we launch on), measured
here at 1.56 GB/s against 0.81 GB/s for hashlib's blake2b; and it is what S3's checksums and
`sha256sum` compute, so a file can be checked by hand or against its upload."""


class CheckpointDamaged(Exception):
    """A checkpoint file differs from what its host recorded (resume skips the checkpoint)."""


def marker_content(step: int, files: dict[str, int], digests: dict[str, str] | None = None) -> bytes:
    """A host's marker: the step, and the size and SHA-256 of every file the host owns in it."""
    record = {"step": step, "files": files, DIGEST: digests or {}}
    return (json.dumps(record, sort_keys=True) + "\n").encode()


def own_file_sizes(path: Path, rank_hosts: RankHosts) -> dict[str, int]:
    return {
        file.relative_to(path).as_posix(): file.stat().st_size
        for file in own_files(path, rank_hosts)
        if not MARKER.match(file.name)
    }


def read_markers(path: Path) -> tuple[dict[str, dict], str | None]:
    """{marker name: its record} of the markers in step directory `path`, and why one cannot be
    trusted (or None). A marker from before files were recorded holds only its step: {}."""
    records = {}
    for marker in sorted(path.glob("COMPLETE.node-*-of-*")):
        try:
            recorded = json.loads(marker.read_text())
        except (OSError, ValueError):
            return records, f"{marker.name} is unreadable"
        if isinstance(recorded, int):
            recorded = {}
        if not (
            isinstance(recorded, dict)
            and isinstance(recorded.get("files", {}), dict)
            and isinstance(recorded.get(DIGEST, {}), dict)
        ):
            return records, f"{marker.name} is not a marker record"
        records[marker.name] = recorded
    return records, None


def checkpoint_fault(path: Path, only_host: RankHosts | None = None) -> str | None:
    """Why a complete checkpoint cannot be trusted (a marker unreadable, a file missing or of
    another size than its host recorded), or None. Reads no file's content: resume verifies the
    digests of what it loads (`digest_fault`). `only_host`: where a host holds only its own
    files and the shared ones (checkpoint_mirror.py), only those are looked for."""
    records, fault = read_markers(path)
    if fault:
        return fault
    for name, recorded in records.items():
        for relative, size in recorded.get("files", {}).items():
            if only_host is not None and only_host.owner(relative) != only_host.node:
                continue
            file = path / relative
            if not file.is_file():
                return f"{relative} is missing"
            if file.stat().st_size != size:
                return f"{relative} is {file.stat().st_size} bytes, but {name} recorded {size}"
    return None


def recorded_digests(path: Path) -> tuple[dict[str, tuple[str, str]], str | None]:
    """{relative path: (marker name, SHA-256)} from the markers this host sees, and a fault.

    Empty for a checkpoint written before markers held digests: it loads unverified."""
    records, fault = read_markers(path)
    digests = {}
    for name, recorded in records.items():
        for relative, digest in recorded.get(DIGEST, {}).items():
            digests[relative] = (name, digest)
    return digests, fault


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, DIGEST).hexdigest()


def digest_fault(path: Path, relative: str, recorded: dict[str, tuple[str, str]], node: int) -> str | None:
    """Why file `relative` of step directory `path` differs from what its host recorded, or None.
    `node` (the host reading it) goes into the reason: on SageMaker each host has its own copy."""
    if not recorded:
        return None  # written before digests: nothing to compare with
    if relative not in recorded:
        return f"{relative} has no {DIGEST} in any COMPLETE marker (on host {node})"
    marker, digest = recorded[relative]
    try:
        actual = file_digest(path / relative)
    except OSError as err:
        return f"{relative} cannot be read on host {node}: {err.strerror or err}"
    if actual != digest:
        return f"{relative} on host {node} differs from the {DIGEST} that {marker} recorded"
    return None


def missing_markers(path: Path) -> str:
    """'hosts 1, 2 of 3 wrote no marker' for an incomplete checkpoint (or 'no host wrote a marker')."""
    totals: dict[int, set[int]] = defaultdict(set)
    for name in os.listdir(path):
        match = MARKER.match(name)
        if match:
            totals[int(match.group(2))].add(int(match.group(1)))
    if not totals:
        return "no host wrote its COMPLETE marker"
    total, nodes = max(totals.items())
    missing = ", ".join(str(n) for n in sorted(set(range(total)) - nodes))
    return f"host(s) {missing} of {total} wrote no COMPLETE marker"


# --- the lease: one job writes a checkpoint directory at a time ---------------------------------

LEASE = "LEASE.json"
LEASE_RENEW_S = 30.0
LEASE_STALE_S = 120.0
"""A lease whose holder has not renewed it for this long is abandoned (its job was killed)."""


def read_lease(directory: Path) -> dict | None:
    try:
        lease = json.loads((directory / LEASE).read_text())
    except (OSError, ValueError):
        return None
    return lease if isinstance(lease, dict) else None


def write_lease(directory: Path, owner: str, now: float) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{LEASE}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps({"owner": owner, "heartbeat": now, "host": socket.gethostname()}) + "\n")
    temporary.replace(directory / LEASE)


def acquire_lease(directory: Path, owner: str, now: float) -> str | None:
    """Take the directory for `owner` (a job name); the reason it cannot, or None.

    The same job restarted (a requeue, a retry) takes its own lease back; another job's lease
    holds until its holder stops renewing it for LEASE_STALE_S."""
    held = read_lease(directory)
    if held and held.get("owner") != owner:
        age = now - float(held.get("heartbeat", 0))
        if age < LEASE_STALE_S:
            return (
                f"checkpoint.dir: {directory} is in use by job {held.get('owner')} on {held.get('host')} "
                f"(its lease was renewed {age:.0f} s ago); give this job its own checkpoint.dir, or stop that job "
                f"(a killed job's lease lapses after {LEASE_STALE_S:.0f} s)"
            )
    write_lease(directory, owner, now)
    return None


def release_lease(directory: Path, owner: str) -> None:
    held = read_lease(directory)
    if held and held.get("owner") == owner:
        (directory / LEASE).unlink(missing_ok=True)
