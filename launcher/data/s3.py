"""The few S3 calls data preparation makes: list a prefix, download an object, upload a file.

boto3 is imported inside each function, so `launcher --help` never loads it. Every botocore
error becomes one line naming the URI.
"""

from __future__ import annotations

import fnmatch
import functools
import os
from pathlib import Path

from launcher.errors import UsageError, service_error, service_text

GLOB_CHARS = "*?["


def split(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def _client():
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return _cached_client(region, os.environ.get("AWS_ENDPOINT_URL"), os.environ.get("AWS_PROFILE"))


@functools.cache
def _cached_client(region: str, endpoint: str | None, profile: str | None):
    """One client per setting: building one costs more than most of the calls made with it."""
    import boto3

    return boto3.client("s3", region_name=region)


def _one_line(error: Exception, what: str) -> UsageError:
    code = service_error(error)[0] or type(error).__name__
    return UsageError(f"{what}: S3 refused ({code}): {service_text(str(error))}")


def list_keys(uri: str) -> list[str]:
    """Keys under an s3:// prefix, sorted; a glob in the last part (s3://b/dir/*.jsonl) filters them."""
    bucket, key = split(uri)
    pattern = key if any(c in key for c in GLOB_CHARS) else None
    prefix = key[: min(key.find(c) for c in GLOB_CHARS if c in key)] if pattern else key
    keys = []
    try:
        pages = _client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            keys += [item["Key"] for item in page.get("Contents", ()) if not item["Key"].endswith("/")]
    except Exception as error:  # botocore's many error classes: one line each
        raise _one_line(error, uri) from None
    return sorted(k for k in keys if pattern is None or fnmatch.fnmatchcase(k, pattern))


def download(bucket: str, key: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        _client().download_file(bucket, key, str(target))
    except Exception as error:
        raise _one_line(error, f"s3://{bucket}/{key}") from None


def head(bucket: str, key: str) -> dict | None:
    """The object's size and sha256 metadata, or None when it does not exist."""
    try:
        found = _client().head_object(Bucket=bucket, Key=key)
    except Exception as error:
        if getattr(error, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise _one_line(error, f"s3://{bucket}/{key}") from None
    return {"size": found["ContentLength"], "sha256": found.get("Metadata", {}).get("sha256")}


def upload(path: Path, bucket: str, key: str, sha256: str) -> None:
    try:
        _client().upload_file(str(path), bucket, key, ExtraArgs={"Metadata": {"sha256": sha256}})
    except Exception as error:
        raise _one_line(error, f"s3://{bucket}/{key}") from None
