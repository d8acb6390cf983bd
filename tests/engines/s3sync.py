"""S3 the way SageMaker moves files for a training job: channels in, checkpoints both ways.

- `download_channel`: an S3Prefix channel is copied into /opt/ml/input/data/<channel>/ before the
  container starts. The local path of an object is its key after the prefix's last "/", so the
  code channel `s3://b/launcher/code/<sha>/code.tar.gz` becomes `<channel>/code.tar.gz`.
- `CheckpointSync`: /opt/ml/checkpoints <-> CheckpointConfig.S3Uri. Everything under the URI is
  downloaded at start; while the job runs, files that appear or change are uploaded and files
  deleted locally are deleted in S3 (polled, as SageMaker's agent does, so an upload trails the
  write by up to one poll); a final pass runs when the container has stopped. An instance that
  dies (`abandon`) uploads nothing more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path


def split_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri}: not an s3:// URI")
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def list_keys(s3, uri: str) -> list[str]:
    """Every key under the prefix of `uri`, sorted."""
    bucket, prefix = split_uri(uri)
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [item["Key"] for item in page.get("Contents", [])]
    return sorted(keys)


def download_channel(s3, uri: str, destination: Path) -> list[Path]:
    """Copy every object under the S3Prefix `uri` into `destination`; returns the local files."""
    bucket, prefix = split_uri(uri)
    strip = prefix.rsplit("/", 1)[0] + "/" if "/" in prefix else ""
    files = []
    for key in list_keys(s3, uri):
        if key.endswith("/"):
            continue  # a "folder" placeholder object
        local = destination / key.removeprefix(strip)
        local.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, key, str(local))
        files.append(local)
    return files


def _signature(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


class CheckpointSync:
    """Mirror `local` to the S3 prefix `uri` in a background thread (see the module docstring).

    `hold(relative_path)` models an upload still under way: files it matches are not uploaded
    until the sync finishes (a multi-GB shard takes minutes to reach S3). An instance lost in
    that window (`abandon`) never uploads them.
    """

    def __init__(self, s3, local: Path, uri: str, *, poll_s: float = 0.2, hold: Callable[[str], bool] | None = None):
        self.s3, self.local, self.poll_s = s3, local, poll_s
        self.bucket, prefix = split_uri(uri.rstrip("/") + "/")
        self.prefix = prefix
        self.hold = hold
        self.uploaded: dict[str, tuple[int, int]] = {}  # relative path -> signature in S3
        self.halted = False
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"checkpoint-sync {local}", daemon=True)

    def download(self) -> int:
        """Start of the job: everything under the URI lands in `local`. Returns the file count."""
        self.local.mkdir(parents=True, exist_ok=True)
        for key in list_keys(self.s3, f"s3://{self.bucket}/{self.prefix}"):
            relative = key.removeprefix(self.prefix)
            if not relative or relative.endswith("/"):
                continue
            path = self.local / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            self.s3.download_file(self.bucket, key, str(path))
            self.uploaded[relative] = _signature(path)
        return len(self.uploaded)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.sync_once()
            except Exception as error:  # a file vanished mid-scan: the next pass sees the truth
                self.errors.append(repr(error))

    def sync_once(self, *, final: bool = False) -> None:
        with self._lock:
            if self.halted:
                return
            present = {}
            for path in sorted(self.local.rglob("*")):
                if path.is_file():
                    present[path.relative_to(self.local).as_posix()] = _signature(path)
            for relative, signature in present.items():
                if self.uploaded.get(relative) == signature:
                    continue
                if not final and self.hold is not None and self.hold(relative):
                    continue
                self.s3.upload_file(str(self.local / relative), self.bucket, self.prefix + relative)
                self.uploaded[relative] = signature
            for relative in sorted(set(self.uploaded) - set(present)):
                self.s3.delete_object(Bucket=self.bucket, Key=self.prefix + relative)
                del self.uploaded[relative]

    def finish(self) -> None:
        """The container stopped: one last pass uploads and deletes what is left."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.sync_once(final=True)

    def abandon(self) -> None:
        """The instance is gone: stop without another upload."""
        with self._lock:
            self.halted = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
