"""DCP's file writer and reader with digests: every file's SHA-256 taken as it is written, and
the files a load reads verified against the hosts' markers before their data is used.

    writer = DigestingWriter(path)            # dcp.save / dcp.async_save(..., storage_writer=writer)
    writer.digests                            # {file name: sha256}, once the save has finished
    reader = VerifyingReader(path, rank_hosts, recorded)   # dcp.load(..., storage_reader=reader)

Where the hooks sit (torch 2.13, torch/distributed/checkpoint/filesystem.py):
- `_FileSystemWriter` opens every file through `self.fs.create_stream(path, "wb")` (each rank's
  `__<r>_<i>.distcp` in `_write_files_from_queue`, rank 0's `.metadata.tmp` in `finish`, then
  `self.fs.rename` to `.metadata`). It only appends (`write`, `tell`, `fileno` for the fsync;
  torch.save reaches the stream through `NoCloseWriter.write`), so hashing every `write` gives the
  digest of the file's bytes without reading them back. An async save runs the same writer in
  DCP's background thread; hashlib releases the GIL while it hashes.
- `dcp.load` calls `prepare_global_plan` with every rank's read plan on the coordinator and
  `read_data` on every rank inside a collective, so a file that fails its check raises on one
  rank and DCP raises `CheckpointException` on all of them alike: every rank takes the same
  fallback. Each host verifies every file that one of its ranks reads (its own copy: on
  SageMaker each host has one), each file once, spread over the host's ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import threading
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter

from entrypoints.checkpoint_files import DIGEST, CheckpointDamaged, RankHosts, digest_fault


class _HashingStream:
    """A file opened for writing that hashes every byte written to it, and keeps the first OSError
    a write raised: torch.save turns it into "unexpected pos" (its zip writer ignores the error)."""

    def __init__(self, raw, failed):
        self._raw, self.hash, self._failed = raw, hashlib.new(DIGEST), failed

    def write(self, data) -> int:
        self.hash.update(data)
        try:
            return self._raw.write(data)
        except OSError as error:
            self._failed(error)
            raise

    def __getattr__(self, name):  # tell, fileno, flush, close: the file's own
        return getattr(self._raw, name)


class _DigestingFileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.digests: dict[str, str] = {}
        self.write_error: OSError | None = None  # the first, e.g. ENOSPC on a full disk
        self._lock = threading.Lock()  # DCP writes with thread_count threads

    def _failed(self, path, error: OSError) -> None:
        if error.filename is None:  # a failed write names no file: name the one written
            error.filename = str(path)
        with self._lock:
            self.write_error = self.write_error or error

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as raw:
                yield raw
            return
        try:  # the open, DCP's fsync inside the block, and the final flush at close can fail too
            with super().create_stream(path, mode) as raw:
                stream = _HashingStream(raw, lambda error: self._failed(path, error))
                yield stream
        except OSError as error:
            self._failed(path, error)
            raise
        with self._lock:
            self.digests[Path(path).name] = stream.hash.hexdigest()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.digests:
                self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


class DigestingWriter(FileSystemWriter):
    """DCP's FileSystemWriter (same files, same staging for async saves), recording digests."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.fs = _DigestingFileSystem()

    @property
    def digests(self) -> dict[str, str]:
        """{file name in the checkpoint directory: digest} of the files this rank wrote."""
        return dict(self.fs.digests)

    @property
    def write_error(self) -> OSError | None:
        """The first OSError this rank's writes raised (None when none did)."""
        return self.fs.write_error


class _Remote:
    """A file of the checkpoint that is not on this host (entrypoints/checkpoint_mirror.py): DCP
    reads its items as byte ranges, through `VerifyingReader._slice_file`."""

    def __init__(self, relative: str):
        self.relative = relative


class _RemoteFallbackFileSystem(FileSystem):
    @contextmanager
    def create_stream(self, path, mode: str):
        if "r" in mode and not Path(path).exists():
            yield _Remote(Path(path).name)
            return
        with super().create_stream(path, mode) as stream:
            yield stream


class VerifyingReader(FileSystemReader):
    """DCP's FileSystemReader that verifies, before reading, the files assigned to this rank.

    `recorded`: {relative path: (marker, digest)} from the markers this host sees (empty for a
    checkpoint from before digests: nothing is verified). `read_range(relative, offset, length)`,
    where a host has only its own files (checkpoint_mirror.py), reads the items of another host's
    file from S3; those ranges are not hashed here, since their file is never read whole: its
    owner verified the file when it was written, and S3 checks each upload's integrity."""

    def __init__(self, path: Path, rank_hosts: RankHosts, recorded: dict[str, tuple[str, str]], read_range=None):
        super().__init__(path)
        self.rank_hosts, self.recorded = rank_hosts, recorded
        self.read_range = read_range
        if read_range is not None:
            self.fs = _RemoteFallbackFileSystem()

    def _slice_file(self, file, sinfo):
        if isinstance(file, _Remote):
            return io.BytesIO(self.read_range(file.relative, sinfo.offset, sinfo.length))
        return super()._slice_file(file, sinfo)

    def prepare_global_plan(self, plans):
        """Coordinator: give each file a host's ranks read to one of them (the least loaded)."""
        plans = super().prepare_global_plan(plans)
        assigned: list[list[str]] = [[] for _ in plans]
        load = [0] * len(plans)
        for node in sorted({self.rank_hosts.node_of(rank) for rank in range(len(plans))}):
            ranks = [rank for rank in range(len(plans)) if self.rank_hosts.node_of(rank) == node]
            read = {self.storage_data[item.storage_index].relative_path for rank in ranks for item in plans[rank].items}
            for relative in sorted(read, key=lambda r: (-self._size(r), r)):
                rank = min(ranks, key=lambda r: (load[r], r))
                assigned[rank].append(relative)
                load[rank] += self._size(relative)
        return [dataclasses.replace(plan, storage_data=files) for plan, files in zip(plans, assigned, strict=True)]

    def _size(self, relative: str) -> int:
        try:
            return (Path(self.path) / relative).stat().st_size
        except OSError:
            return 0

    def read_data(self, plan, planner):
        for relative in plan.storage_data or []:
            if self.read_range is not None and not (Path(self.path) / relative).is_file():
                continue  # another host's file: read as ranges from S3 (see the class docstring)
            fault = digest_fault(Path(self.path), relative, self.recorded, self.rank_hosts.node)
            if fault:
                raise CheckpointDamaged(fault)
        return super().read_data(plan, planner)
