"""s3:// training data for backends whose engine cannot fetch it: downloaded once, at submit.

SageMaker downloads a job's channels itself. The local, docker and Slurm backends instead
stage the data into a directory before the job starts (on a shared file system for Slurm),
and the job reads it there through SM_CHANNEL_TRAIN, as it would on SageMaker.

The directory is named after the URI (`<root>/data/<sha256 of the URI, 16 hex>`), so every job
of a dataset finds the same copy. A manifest beside the files records each object's ETag and
size: a later submit downloads only what changed in the bucket, deletes what the bucket no
longer holds, and resumes a download cut short from the byte where it stopped (ranged GETs
pinned to the ETag, so a file replaced in between is fetched again, never spliced). Whole
files are checked against the object's MD5 where its ETag is one (single-part uploads), and
against the size otherwise. A lock file keeps two submits from staging the same data at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from launcher.errors import UsageError

MANIFEST = ".launcher-staging.json"
LOCK = ".launcher-staging.lock"
PART_SUFFIX = ".part"
CHUNK = 8 << 20
_PLAIN_MD5 = re.compile(r"^[0-9a-f]{32}$")


def split_uri(uri: str) -> tuple[str, str]:
    """('bucket', 'key prefix') of an s3:// URI."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix


def staging_dir(uri: str, root: str | Path) -> Path:
    """Where `uri` is staged under `root`: one directory per URI, shared by every job that reads it."""
    return Path(root) / "data" / hashlib.sha256(uri.encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class S3Object:
    key: str
    relative: str
    """Its path inside the staging directory."""
    etag: str
    size: int


@dataclass(frozen=True, kw_only=True)
class StagingResult:
    directory: Path
    objects: int
    total_bytes: int
    downloaded_bytes: int
    removed: int


def list_objects(s3, uri: str) -> list[S3Object]:
    """Every object under the URI's prefix (or the one object it names), with safe relative paths."""
    bucket, prefix = split_uri(uri)
    base = prefix if prefix == "" or prefix.endswith("/") else prefix + "/"
    found = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            key = item["Key"]
            if key.endswith("/"):
                continue  # a console "folder" marker, not data
            if key == prefix:
                relative = PurePosixPath(key).name
            elif key.startswith(base):
                relative = key[len(base) :]
            else:
                continue  # s3://b/tokens also matches s3://b/tokens-old/...: not ours
            parts = PurePosixPath(relative).parts
            if not parts or any(part in ("..", ".") for part in parts) or relative.startswith("/"):
                raise UsageError(f"data.source: object key {key!r} in {uri} cannot be a file name; rename it in S3")
            found.append(S3Object(key=key, relative=relative, etag=item["ETag"].strip('"'), size=item["Size"]))
    return found


class Progress:
    """One status line on stderr: rewritten in place on a terminal, every 10% elsewhere."""

    def __init__(self, uri: str, total_bytes: int, objects: int):
        self.uri, self.total, self.objects = uri, max(total_bytes, 1), objects
        self.done, self.files, self.started = 0, 0, time.monotonic()
        self.tty = sys.stderr.isatty()
        self.last_decile = -1

    def advance(self, nbytes: int = 0, *, file_done: bool = False) -> None:
        self.done += nbytes
        self.files += file_done
        decile = int(10 * self.done / self.total)
        if self.tty or decile != self.last_decile or (file_done and self.files == self.objects):
            self.last_decile = decile
            rate = self.done / max(time.monotonic() - self.started, 1e-6) / 1e6
            line = (
                f"staging {self.uri}: {self.files}/{self.objects} files, "
                f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB ({rate:.0f} MB/s)"
            )
            print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def stage(uri: str, directory: str | Path, *, region: str | None = None) -> StagingResult:
    """Make `directory` hold exactly the objects under `uri`, downloading only what is missing."""
    from launcher.backends import aws

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    s3 = aws.client("s3", region)
    with _locked(directory):
        try:
            objects = list_objects(s3, uri)
            if not objects:
                raise UsageError(f"data.source: no objects under {uri}; check the bucket and prefix")
            manifest = _read_manifest(directory, uri)
            removed = _remove_stale(directory, manifest, {o.relative for o in objects})
            progress = Progress(uri, sum(o.size for o in objects), len(objects))
            downloaded = 0
            for obj in objects:
                if _is_current(directory, manifest, obj):
                    progress.advance(obj.size, file_done=True)
                    continue
                downloaded += _download(s3, uri, obj, directory / obj.relative, progress)
                manifest[obj.relative] = {"etag": obj.etag, "size": obj.size}
                _write_manifest(directory, uri, manifest)
            progress.close()
        except UsageError:
            raise
        except Exception as error:  # botocore's errors become one line saying what to do
            code = getattr(error, "response", {}).get("Error", {}).get("Code")
            if code == "NoSuchBucket":
                raise UsageError(f"data.source: bucket {split_uri(uri)[0]} does not exist; fix the s3:// URI") from None
            raise aws.explain(error, action=f"staging {uri}", region=region) from None
    total = sum(o.size for o in objects)
    return StagingResult(
        directory=directory, objects=len(objects), total_bytes=total, downloaded_bytes=downloaded, removed=removed
    )


def _download(s3, uri: str, obj: S3Object, target: Path, progress: Progress) -> int:
    """Fetch one object into `target`, resuming a `.part` left by an interrupted submit."""
    bucket, _ = split_uri(uri)
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + PART_SUFFIX)
    tag = target.with_name(target.name + PART_SUFFIX + ".etag")
    offset = part.stat().st_size if part.exists() and tag.exists() and tag.read_text() == obj.etag else 0
    if offset > obj.size:
        offset = 0
    tag.write_text(obj.etag)
    progress.advance(offset)
    fetched = 0
    with open(part, "ab" if offset else "wb") as out:
        if offset < obj.size:
            # IfMatch: if the object changed since it was listed, fail rather than splice two versions.
            response = s3.get_object(Bucket=bucket, Key=obj.key, Range=f"bytes={offset}-", IfMatch=obj.etag)
            for chunk in _chunks(response["Body"]):
                out.write(chunk)
                fetched += len(chunk)
                progress.advance(len(chunk))
    _verify(part, obj, uri)
    part.replace(target)
    tag.unlink(missing_ok=True)
    progress.advance(file_done=True)
    return fetched


def _chunks(body) -> Iterator[bytes]:
    while chunk := body.read(CHUNK):
        yield chunk


def _verify(path: Path, obj: S3Object, uri: str) -> None:
    size = path.stat().st_size
    problem = None
    if size != obj.size:
        problem = f"{size} bytes instead of {obj.size}"
    elif _PLAIN_MD5.match(obj.etag):
        digest = hashlib.md5(usedforsecurity=False)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != obj.etag:
            problem = f"MD5 {digest.hexdigest()} instead of the ETag {obj.etag}"
    if problem:
        path.unlink(missing_ok=True)
        raise UsageError(f"staging {uri}: s3://{split_uri(uri)[0]}/{obj.key} arrived damaged ({problem}); submit again")


def _is_current(directory: Path, manifest: dict, obj: S3Object) -> bool:
    entry = manifest.get(obj.relative)
    path = directory / obj.relative
    return (
        bool(entry)
        and entry == {"etag": obj.etag, "size": obj.size}
        and path.is_file()
        and (path.stat().st_size == obj.size)
    )


def _remove_stale(directory: Path, manifest: dict, current: set[str]) -> int:
    """Delete files of objects the bucket no longer holds, so the job never reads them."""
    stale = [relative for relative in manifest if relative not in current]
    for relative in stale:
        (directory / relative).unlink(missing_ok=True)
        del manifest[relative]
    return len(stale)


def _read_manifest(directory: Path, uri: str) -> dict:
    path = directory / MANIFEST
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data["objects"] if data.get("uri") == uri else {}


def _write_manifest(directory: Path, uri: str, objects: dict) -> None:
    temporary = directory / f".{MANIFEST}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps({"uri": uri, "objects": objects}, indent=1, sort_keys=True))
    temporary.replace(directory / MANIFEST)


class _locked:
    """An exclusive lock on the staging directory for the duration of one stage()."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK

    def __enter__(self):
        self.file = open(self.path, "w")
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def describe(source: str, staged_at: str, read_at: str) -> str:
    """The dry-run line for one staged input."""
    where = "" if read_at == staged_at else f"; the job reads it at {read_at}"
    return (
        f"data: {source} is downloaded at submit into {staged_at} (resumable, checksummed, reused by later jobs){where}"
    )
