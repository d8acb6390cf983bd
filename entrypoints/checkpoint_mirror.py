"""Each host's own checkpoint files in S3, where SageMaker's CheckpointConfig would copy too much.

CheckpointConfig copies the whole S3 prefix to every host before each start: `keep` times the
checkpoint (2.5 TB per host for Llama 3.1 70B, docs/checkpoints.md). With the prefix in
LAUNCHER_CHECKPOINT_S3 instead, the job keeps writing its checkpoints to the local checkpoint
directory (local NVMe, entrypoints/checkpoint.py) and each host's first rank copies them itself:

- `push`: after a checkpoint is complete, the files this host owns (checkpoint_files.py's
  ownership rule) go to `<prefix>/step-N/<file>`, its COMPLETE marker last, from a background
  thread; then the host deletes its own objects of the checkpoints outside the newest `keep`
  (marker first). S3 thus holds what CheckpointConfig would have synced, in the same layout. The
  next save starts only once every host's copy is done (checkpoint.py `save`): one checkpoint in
  flight to S3 at a time.
- `restore`: before a resume, rank 0 lists the prefix and picks the newest checkpoint whose
  markers of every host are there (a host killed mid-upload leaves a torn one, skipped); each
  host then downloads only what it reads: its own files of that checkpoint, `.metadata`,
  `train_state.json` and the markers. A checkpoint written by another number of hosts is
  downloaded whole, since DCP may reshard any rank's file into any other. One that then fails to
  load (a file's digest differs) is dropped and the newest complete one below it is restored
  (checkpoint.py `resume`).

boto3 is the image's own (the PyTorch DLC's base dependencies, docker/pytorch/2.13/cuda/
pyproject.toml in aws/deep-learning-containers); it is imported only when the prefix is set.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path

from entrypoints.checkpoint_files import RankHosts, own_files
from launcher.contract.checkpoint_dirs import MARKER, STEP_DIR, has_every_marker, step_dir_name

PREFIX_ENV = "LAUNCHER_CHECKPOINT_S3"
SHARED_FILES = (".metadata", "train_state.json")
"""What every host reads whole, whoever owns it."""


class MirrorFailed(Exception):
    """An upload, download or delete of checkpoint files in S3 failed (one line, with the key)."""


class S3Mirror:
    def __init__(self, uri: str, rank_hosts: RankHosts, client=None):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = uri.rstrip("/")
        self.rank_hosts = rank_hosts
        self._client = client
        self._pushing: threading.Thread | None = None
        self._failure: str | None = None
        self.downloaded_bytes = 0

    @classmethod
    def from_env(cls, rank_hosts: RankHosts) -> S3Mirror | None:
        uri = os.environ.get(PREFIX_ENV)
        return cls(uri, rank_hosts) if uri else None

    @property
    def client(self):
        if self._client is None:
            import boto3  # the image's (see the module docstring); only where the prefix is set

            self._client = boto3.client("s3")
        return self._client

    def _key(self, step: int, relative: str) -> str:
        return "/".join(part for part in (self.prefix, step_dir_name(step), relative) if part)

    # --- after a save --------------------------------------------------------------------------

    def push(self, path: Path, step: int, keep: set[int]) -> None:
        """Upload this host's files of complete checkpoint `path` in the background, then delete
        its objects of steps outside `keep`. Waits for the previous push first."""
        self.wait()
        self._pushing = threading.Thread(target=self._push, args=(path, step, set(keep)), daemon=True)
        self._pushing.start()

    def wait(self) -> None:
        """Wait for the push in flight; raises MirrorFailed if it (or an earlier one) failed."""
        if self._pushing is not None:
            self._pushing.join()
            self._pushing = None
        if self._failure:
            failure, self._failure = self._failure, None
            raise MirrorFailed(failure)

    def _push(self, path: Path, step: int, keep: set[int]) -> None:
        try:
            files = own_files(path, self.rank_hosts)  # the marker first: it must go up last
            for file in [*files[1:], *files[:1]]:
                relative = file.relative_to(path).as_posix()
                key = self._key(step, relative)
                self._call("uploading", key, lambda f=file, k=key: self.client.upload_file(str(f), self.bucket, k))
            self._prune(keep)
        except MirrorFailed as failure:
            self._failure = str(failure)
        except Exception as error:  # a file gone from under the upload, say: still one line, at wait()
            self._failure = f"checkpoint: copying {path} to {self.uri} failed: {_one_line(error)}"

    def _prune(self, keep: set[int]) -> None:
        for step, files in self.listing().items():
            if step in keep:
                continue
            own = [relative for relative in files if self.rank_hosts.owner(relative) == self.rank_hosts.node]
            for relative in sorted(own, key=lambda r: (not MARKER.match(r), r)):  # the marker first
                key = self._key(step, relative)
                self._call("deleting", key, lambda k=key: self.client.delete_object(Bucket=self.bucket, Key=k))

    # --- before a resume -----------------------------------------------------------------------

    def listing(self) -> dict[int, dict[str, int]]:
        """{step: {file inside the step directory: size}} of every step under the prefix."""
        found: dict[int, dict[str, int]] = defaultdict(dict)
        base = f"{self.prefix}/" if self.prefix else ""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base)
        try:
            for page in pages:
                for item in page.get("Contents", ()):
                    step_name, _, relative = item["Key"][len(base) :].partition("/")
                    match = STEP_DIR.match(step_name)
                    if match and relative:
                        found[int(match.group(1))][relative] = int(item["Size"])
        except Exception as error:  # botocore's ClientError, EndpointConnectionError, ...
            raise MirrorFailed(f"checkpoint: listing {self.uri}/ failed: {_one_line(error)}") from None
        return dict(found)

    def complete_steps(self, listing: dict[int, dict[str, int]]) -> list[int]:
        """The steps whose markers of every host of one run are all in S3, oldest first."""
        return sorted(step for step, files in listing.items() if has_every_marker(files))

    def newest_complete(self, listing: dict[int, dict[str, int]], *, below: int | None = None) -> int | None:
        """The newest complete step (under `below`, where given)."""
        return max((step for step in self.complete_steps(listing) if below is None or step < below), default=None)

    def restore(self, directory: Path, step: int, files: dict[str, int]) -> int:
        """Download what this host reads of checkpoint `step` into `directory`; returns the bytes."""
        needed = self.needed(files)
        target = directory / step_dir_name(step)
        total = 0
        for relative in sorted(needed):
            local = target / relative
            local.parent.mkdir(parents=True, exist_ok=True)
            key = self._key(step, relative)
            self._call("downloading", key, lambda k=key, f=local: self.client.download_file(self.bucket, k, str(f)))
            total += files[relative]
        self.downloaded_bytes += total
        return total

    def read_range(self, step: int, relative: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of a file another host owns: DCP reads a replicated
        tensor (an optimizer's step count) from whichever rank wrote it, maybe on another host."""
        key = self._key(step, relative)
        box = []
        get = lambda: box.append(  # noqa: E731
            self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")[
                "Body"
            ].read()
        )
        self._call("reading", key, get)
        self.downloaded_bytes += len(box[0])
        return box[0]

    def needed(self, files: dict[str, int]) -> set[str]:
        """The files of one checkpoint this host reads: its own, the shared ones and the markers;
        every file when another number of hosts wrote it (DCP reshards across any ranks)."""
        totals = {int(m.group(2)) for m in map(MARKER.match, files) if m}
        if totals != {self.rank_hosts.instance_count}:
            return set(files)
        node = self.rank_hosts.node
        return {
            relative
            for relative in files
            if relative in SHARED_FILES or MARKER.match(relative) or self.rank_hosts.owner(relative) == node
        }

    def _call(self, doing: str, key: str, call) -> None:
        """One S3 call on `key`; its failure as one line naming the key."""
        try:
            call()
        except Exception as error:  # boto3's S3UploadFailedError, ClientError, connection errors
            raise MirrorFailed(f"checkpoint: {doing} s3://{self.bucket}/{key} failed: {_one_line(error)}") from None


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]
