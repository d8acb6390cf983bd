"""s3:// training data for backends whose engine cannot fetch it: downloaded once, at submit.

SageMaker downloads a job's channels itself. The local, docker and Slurm backends instead
stage the data into a directory before the job starts (on a shared file system for Slurm),
and the job reads it there through SM_CHANNEL_TRAIN, as it would on SageMaker.

The directory is named after the URI (`<root>/data/<sha256 of the URI, 16 hex>`), so every job
of a dataset finds the same copy, and it holds the objects and nothing else. Staging's own
files live in a sibling, `<directory>.staging/`, where no object key can reach them: a
manifest records each object's ETag and size, so a later submit downloads only what changed in
the bucket and deletes what the bucket no longer holds; partial downloads resume from the byte
where they stopped (ranged GETs pinned to the ETag, so a file replaced in between is fetched
again, never spliced); a lock keeps two submits from staging the same data at once. Whole files
are checked against the object's MD5 where its ETag is one (single-part uploads), and against
the size otherwise.

A directory without a readable manifest (a damaged one, or one staged before the bookkeeping
moved out of it) is reconciled: every file that is not one of the bucket's objects is removed,
and a manifest found inside it from the old layout is reused for the objects it still describes.
Errors are one line: S3's through `aws.explain` (exit 3, a timeout naming the endpoint), and the
local disk's (full, read-only, not permitted) naming the path (exit 2).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from launcher.errors import UsageError

BOOKKEEPING_SUFFIX = ".staging"
MANIFEST = "manifest.json"
LOCK = "lock"
PARTIAL = "partial"
PART_SUFFIX = ".part"
# Where staging kept its files before they moved out of the directory; read once, then removed.
LEGACY_MANIFEST = ".launcher-staging.json"
LEGACY_NAMES = (".launcher-staging.json", ".launcher-staging.lock")
CHUNK = 8 << 20
_PLAIN_MD5 = re.compile(r"^[0-9a-f]{32}$")


def split_uri(uri: str) -> tuple[str, str]:
    """('bucket', 'key prefix') of an s3:// URI."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix


def staging_dir(uri: str, root: str | Path) -> Path:
    """Where `uri` is staged under `root`: one directory per URI, shared by every job that reads it."""
    return Path(root) / "data" / hashlib.sha256(uri.encode()).hexdigest()[:16]


def bookkeeping_dir(directory: str | Path) -> Path:
    """Staging's own files for `directory`: beside it, so no object key can name one of them."""
    directory = Path(directory)
    return directory.with_name(directory.name + BOOKKEEPING_SUFFIX)


def manifest_path(directory: str | Path) -> Path:
    return bookkeeping_dir(directory) / MANIFEST


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
    from launcher.backends.sagemaker import aws

    directory = Path(directory)
    books = bookkeeping_dir(directory)
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    s3 = aws.client("s3", region)
    try:
        for made in (directory, books / PARTIAL):
            made.mkdir(parents=True, exist_ok=True)
        with _locked(books / LOCK):
            objects = list_objects(s3, uri)
            if not objects:
                raise UsageError(f"data.source: no objects under {uri}; check the bucket and prefix")
            current = {o.relative for o in objects}
            manifest = _read_manifest(books, uri)
            if manifest is None:
                manifest, removed = _reconcile(directory, uri, current)
            else:
                removed = _remove_stale(directory, manifest, current)
            _write_manifest(books, uri, manifest)  # what is on disk now, before any download
            downloaded = _fetch_missing(s3, uri, objects, directory, manifest)
    except UsageError:
        raise
    except Exception as error:
        raise _explain(error, uri, region, s3) from None
    total = sum(o.size for o in objects)
    return StagingResult(
        directory=directory, objects=len(objects), total_bytes=total, downloaded_bytes=downloaded, removed=removed
    )


def _fetch_missing(s3, uri: str, objects: list[S3Object], directory: Path, manifest: dict) -> int:
    """Download every object the manifest does not show as present; the bytes fetched."""
    progress = Progress(uri, sum(o.size for o in objects), len(objects))
    downloaded = 0
    for obj in objects:
        if _is_current(directory, manifest, obj):
            progress.advance(obj.size, file_done=True)
            continue
        downloaded += _download(s3, uri, obj, directory, progress)
        manifest[obj.relative] = {"etag": obj.etag, "size": obj.size}
        _write_manifest(bookkeeping_dir(directory), uri, manifest)
    progress.close()
    return downloaded


def _explain(error: Exception, uri: str, region: str, s3) -> Exception:
    """One line for a failure while staging: S3's (exit 3), or the local disk's naming the path."""
    from botocore.exceptions import BotoCoreError, ClientError

    from launcher.backends.sagemaker import aws

    if isinstance(error, ClientError) and error.response.get("Error", {}).get("Code") == "NoSuchBucket":
        return UsageError(f"data.source: bucket {split_uri(uri)[0]} does not exist; fix the s3:// URI")
    # botocore's timeouts are OSErrors too (through requests), so they are told apart first.
    if isinstance(error, OSError) and not isinstance(error, BotoCoreError | ClientError):
        return _disk_error(error, uri)
    return aws.explain(error, action=f"staging {uri}", region=region, endpoint=s3.meta.endpoint_url)


_DISK_FIXES = {
    errno.ENOSPC: "free space on that file system, then submit again (the download resumes)",
    errno.EDQUOT: "free space within the disk quota, then submit again (the download resumes)",
    errno.EROFS: "stage onto a writable file system",
    errno.EACCES: "this user may not write there; fix the permissions or stage elsewhere",
    errno.EPERM: "this user may not write there; fix the permissions or stage elsewhere",
}


def _disk_error(error: OSError, uri: str) -> UsageError:
    """A local file-system failure while staging: the path, the errno's meaning and name, the fix."""
    path = error.filename if error.filename is not None else "the staging directory"
    name = errno.errorcode.get(error.errno, "") if error.errno else ""
    meaning = error.strerror or (os.strerror(error.errno) if error.errno else str(error))
    fix = _DISK_FIXES.get(error.errno, "fix the local file system and submit again")
    return UsageError(f"staging {uri}: {path}: {meaning}{f' ({name})' if name else ''}; {fix}")


@contextmanager
def _naming(path: Path):
    """Local OSErrors inside name `path` when they name no file themselves, as a write or a close
    that meets a full disk does. botocore's errors (OSErrors too) pass unchanged."""
    from botocore.exceptions import BotoCoreError

    try:
        yield
    except OSError as error:
        if error.filename is not None or isinstance(error, BotoCoreError):
            raise
        raise OSError(error.errno, error.strerror, str(path)) from None


def _download(s3, uri: str, obj: S3Object, directory: Path, progress: Progress) -> int:
    """Fetch one object into the directory, resuming a partial download left by an interrupted submit."""
    bucket, _ = split_uri(uri)
    target = directory / obj.relative
    target.parent.mkdir(parents=True, exist_ok=True)
    part, tag = partial_download(directory, obj.relative)
    offset = part.stat().st_size if part.exists() and tag.exists() and tag.read_text() == obj.etag else 0
    if offset > obj.size:
        offset = 0
    with _naming(tag):
        tag.write_text(obj.etag)
    progress.advance(offset)
    fetched = 0
    with _naming(part), open(part, "ab" if offset else "wb") as out:
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


def partial_download(directory: Path, relative: str) -> tuple[Path, Path]:
    """Where the object at `relative` is downloaded before it is whole, and the file holding the
    ETag those bytes belong to; named by a digest of the path, in the bookkeeping directory."""
    name = hashlib.sha256(relative.encode()).hexdigest()[:32]
    partial = bookkeeping_dir(directory) / PARTIAL
    return partial / (name + PART_SUFFIX), partial / (name + PART_SUFFIX + ".etag")


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


def _read_manifest(books: Path, uri: str) -> dict | None:
    """The manifest's entries for `uri`, or None when there is none that can be trusted."""
    return _manifest_entries(books / MANIFEST, uri)


def _manifest_entries(path: Path, uri: str) -> dict | None:
    """The well-formed entries of the manifest at `path` (read back from disk: checked, not
    trusted), or None when it is missing, damaged or for another URI."""
    try:
        data = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("uri") != uri or not isinstance(data.get("objects"), dict):
        return None
    return {
        relative: entry
        for relative, entry in data["objects"].items()
        if _safe_relative(relative)
        and isinstance(entry, dict)
        and set(entry) == {"etag", "size"}
        and isinstance(entry["etag"], str)
        and type(entry["size"]) is int
    }


def _safe_relative(relative: str) -> bool:
    parts = PurePosixPath(relative).parts
    return bool(parts) and not relative.startswith("/") and not any(part in ("..", ".") for part in parts)


def _reconcile(directory: Path, uri: str, current: set[str]) -> tuple[dict, int]:
    """For a directory whose manifest is missing or damaged: remove every file that is not one of
    the bucket's objects; return the entries still usable from an old in-directory manifest, and
    how many data files were removed. The old layout's bookkeeping names (and `.part` names) may
    have been overwritten by staging itself, so objects with those names are fetched again."""
    legacy = _manifest_entries(directory / LEGACY_MANIFEST, uri) or {}
    kept = {
        relative: entry
        for relative, entry in legacy.items()
        if relative in current
        and PurePosixPath(relative).name not in LEGACY_NAMES
        and not relative.endswith((PART_SUFFIX, PART_SUFFIX + ".etag"))
    }
    removed = 0
    for root, _, names in os.walk(directory):
        for name in names:
            path = Path(root, name)
            if path.relative_to(directory).as_posix() not in kept:
                path.unlink(missing_ok=True)
                removed += name not in LEGACY_NAMES and not name.endswith((PART_SUFFIX, PART_SUFFIX + ".etag"))
    return kept, removed


def _write_manifest(books: Path, uri: str, objects: dict) -> None:
    temporary = books / f".{MANIFEST}.{os.getpid()}.tmp"
    try:
        with _naming(temporary):
            temporary.write_text(json.dumps({"uri": uri, "objects": objects}, indent=1, sort_keys=True))
        temporary.replace(books / MANIFEST)
    finally:
        temporary.unlink(missing_ok=True)


class _locked:
    """An exclusive lock on the staging directory for the duration of one stage()."""

    def __init__(self, path: Path):
        self.path = path

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
