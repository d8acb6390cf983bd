"""s3:// data staged at submit, against a moto S3 server over HTTP, and one real local job on it.

The faults are real too: a server on 127.0.0.1 that takes the connection and never answers, and
small tmpfs mounts (this suite runs as root) that fill up or are read-only.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
import numpy as np
import pytest

from launcher.backends import staging
from launcher.backends.sagemaker import aws as aws_clients
from launcher.backends.staging import (
    LEGACY_MANIFEST,
    bookkeeping_dir,
    manifest_path,
    partial_download,
    stage,
    staging_dir,
)
from launcher.errors import EXIT_ENGINE, EXIT_USAGE, UsageError

from .helpers import REGION, REPO

BUCKET = "stage-bucket"
URI = f"s3://{BUCKET}/tokens/"


def s3():
    return boto3.client("s3", region_name=REGION, endpoint_url=os.environ["AWS_ENDPOINT_URL"])


def put_dataset(client, files: dict[str, bytes], prefix: str = "tokens/") -> None:
    client.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
    for name, body in files.items():
        client.put_object(Bucket=BUCKET, Key=prefix + name, Body=body)


def put_multipart(client, key: str, parts: list[bytes]) -> str:
    upload = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    done = [
        {
            "PartNumber": n,
            "ETag": client.upload_part(Bucket=BUCKET, Key=key, UploadId=upload, PartNumber=n, Body=body)["ETag"],
        }
        for n, body in enumerate(parts, 1)
    ]
    client.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload, MultipartUpload={"Parts": done})
    return client.head_object(Bucket=BUCKET, Key=key)["ETag"].strip('"')


def files_in(directory) -> dict[str, bytes]:
    """Every file in the directory: the objects, and nothing of staging's own."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@contextmanager
def tmpfs(path, options: str):
    """A tmpfs mounted at `path` with `options` (e.g. size=64k, ro), unmounted on the way out."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "staging-test", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_staging_copies_exactly_the_prefix_and_then_only_what_changed(aws, tmp_path):
    client = s3()
    data = {"a.bin": b"a" * 1000, "sub/b.bin": os.urandom(3000)}
    put_dataset(client, data)
    client.put_object(Bucket=BUCKET, Key="tokens/empty-folder/", Body=b"")  # a console folder marker
    client.put_object(Bucket=BUCKET, Key="tokens-old/stale.bin", Body=b"not ours")  # shares the prefix text
    big = [os.urandom(5 << 20), os.urandom(1 << 20)]
    etag = put_multipart(client, "tokens/big.bin", big)
    assert "-" in etag  # a multipart ETag is no MD5: checked by size

    target = tmp_path / "cache"
    first = stage(URI, target)
    expected = {**data, "big.bin": b"".join(big)}
    assert files_in(target) == expected
    assert (first.objects, first.downloaded_bytes) == (3, sum(map(len, expected.values())))

    again = stage(URI, target)
    assert again.downloaded_bytes == 0 and files_in(target) == expected

    client.put_object(Bucket=BUCKET, Key="tokens/a.bin", Body=b"A" * 10)
    client.delete_object(Bucket=BUCKET, Key="tokens/sub/b.bin")
    third = stage(URI, target)
    assert (third.downloaded_bytes, third.removed) == (10, 1)
    assert files_in(target) == {"a.bin": b"A" * 10, "big.bin": b"".join(big)}


def test_an_interrupted_download_resumes_from_the_byte_where_it_stopped(aws, tmp_path):
    body = os.urandom(200_000)
    put_dataset(s3(), {"shard.bin": body})
    target = tmp_path / "cache"
    target.mkdir()
    part, tag = partial_download(target, "shard.bin")
    part.parent.mkdir(parents=True)
    part.write_bytes(body[:150_000])
    tag.write_text(hashlib.md5(body).hexdigest())

    result = stage(URI, target)
    assert result.downloaded_bytes == 50_000
    assert files_in(target) == {"shard.bin": body}
    assert not part.exists() and not tag.exists()


def test_a_damaged_download_is_refused_and_the_next_submit_fetches_it_whole(aws, tmp_path):
    body = os.urandom(10_000)
    put_dataset(s3(), {"shard.bin": body})
    target = tmp_path / "cache"
    target.mkdir()
    # Bytes left by an earlier attempt that do not match the object (a torn write).
    part, tag = partial_download(target, "shard.bin")
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * 4_000)
    tag.write_text(hashlib.md5(body).hexdigest())

    with pytest.raises(
        UsageError,
        match=r"^staging s3://stage-bucket/tokens/: s3://stage-bucket/tokens/shard.bin arrived damaged \(MD5 \w+ instead of the ETag \w+\); submit again$",
    ):
        stage(URI, target)
    assert not (target / "shard.bin").exists() and not part.exists()
    assert stage(URI, target).downloaded_bytes == 10_000
    assert (target / "shard.bin").read_bytes() == body


def test_missing_data_and_missing_buckets_are_one_line_each(aws, tmp_path):
    put_dataset(s3(), {"x.bin": b"1"})
    with pytest.raises(
        UsageError, match=r"^data.source: no objects under s3://stage-bucket/nothing/; check the bucket and prefix$"
    ):
        stage(f"s3://{BUCKET}/nothing/", tmp_path / "a")
    with pytest.raises(UsageError, match=r"^data.source: bucket no-such-bucket does not exist; fix the s3:// URI$"):
        stage("s3://no-such-bucket/x/", tmp_path / "b")


def test_one_object_uri_stages_that_file(aws, tmp_path):
    put_dataset(s3(), {"one.bin": b"12345678", "two.bin": b"x"})
    stage(f"s3://{BUCKET}/tokens/one.bin", tmp_path / "c")
    assert files_in(tmp_path / "c") == {"one.bin": b"12345678"}


def test_the_directory_is_named_by_the_uri(tmp_path):
    assert staging_dir(URI, tmp_path) == staging_dir(URI, tmp_path)
    assert staging_dir(URI, tmp_path) != staging_dir(URI + "x", tmp_path)
    assert staging_dir(URI, tmp_path).parent == tmp_path / "data"


def test_object_keys_named_like_stagings_own_files_are_plain_data(aws, tmp_path):
    data = {
        ".launcher-staging.json": b'{"not": "a manifest"}',
        ".launcher-staging.lock": b"a lock-shaped object",
        "manifest.json": b"[1, 2]",
        "lock": b"x",
        "shard.bin": os.urandom(5000),
        "shard.bin.part": b"an object, not a partial download",
        "shard.bin.part.etag": b"neither",
        "sub/.launcher-staging.json": b"deeper",
    }
    put_dataset(s3(), data)
    target = tmp_path / "cache"
    assert stage(URI, target).downloaded_bytes == sum(map(len, data.values()))
    assert files_in(target) == data
    again = stage(URI, target)
    assert (again.downloaded_bytes, again.removed) == (0, 0)
    assert files_in(target) == data
    assert sorted(p.name for p in bookkeeping_dir(target).iterdir()) == ["lock", "manifest.json", "partial"]


def test_a_directory_staged_in_the_old_layout_is_reused_and_left_holding_only_the_objects(aws, tmp_path):
    kept = {"a.bin": os.urandom(3000), "sub/b.bin": os.urandom(2000)}
    put_dataset(s3(), kept)
    etags = {name: hashlib.md5(body).hexdigest() for name, body in kept.items()}
    target = tmp_path / "cache"
    (target / "sub").mkdir(parents=True)
    for name, body in kept.items():
        (target / name).write_bytes(body)
    (target / "gone.bin").write_bytes(b"an object the bucket no longer holds")
    (target / "c.bin.part").write_bytes(b"half")  # an interrupted download, old style
    (target / "c.bin.part.etag").write_text("0" * 32)
    (target / ".launcher-staging.lock").write_text("")
    objects = {name: {"etag": etags[name], "size": len(body)} for name, body in kept.items()}
    objects["gone.bin"] = {"etag": "1" * 32, "size": 36}
    (target / LEGACY_MANIFEST).write_text(json.dumps({"uri": URI, "objects": objects}))

    result = stage(URI, target)
    assert (result.downloaded_bytes, result.removed) == (0, 1)  # reused, not fetched again
    assert files_in(target) == kept
    assert sorted(json.loads(manifest_path(target).read_text())["objects"]) == ["a.bin", "sub/b.bin"]


def test_a_damaged_manifest_restages_cleanly_and_removes_what_it_no_longer_knows(aws, tmp_path):
    data = {"a.bin": os.urandom(1000)}
    put_dataset(s3(), data)
    target = tmp_path / "cache"
    stage(URI, target)
    (target / "stray.bin").write_bytes(b"left by nobody knows what")
    escape = tmp_path / "outside.txt"
    escape.write_text("must survive")
    # Truncated JSON, then a manifest whose entry points outside the directory.
    manifest_path(target).write_text('{"uri": "s3://stage-bucket/tok')
    assert stage(URI, target).downloaded_bytes == 1000
    assert files_in(target) == data
    manifest_path(target).write_text(json.dumps({"uri": URI, "objects": {"../outside.txt": {"etag": "e", "size": 1}}}))
    stage(URI, target)
    assert escape.read_text() == "must survive" and files_in(target) == data


def test_a_stalled_s3_server_is_one_aws_error_naming_the_endpoint(aws, tmp_path, monkeypatch):
    # A listening socket that is never accept()ed: the kernel completes the connection, the
    # request sits unread, and no answer ever comes.
    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setattr(aws_clients, "READ_TIMEOUT_S", 0.5)
        monkeypatch.setattr(aws_clients, "MAX_ATTEMPTS", 2)
        aws_clients.reset_clients()
        started = time.monotonic()
        with pytest.raises(aws_clients.AwsError) as raised:
            stage(URI, tmp_path / "cache")
    assert time.monotonic() - started < 10
    assert raised.value.exit_code == EXIT_ENGINE
    assert str(raised.value) == (
        f"staging {URI}: {endpoint} did not answer within 0.5 s; the network or the service is stalled: "
        "retry later, or check the network and AWS_ENDPOINT_URL"
    )


@contextmanager
def s3_that_stalls_mid_object(body: bytes, sent: int):
    """An HTTP server on 127.0.0.1 that lists one object (`tokens/shard.bin`, as ListObjectsV2
    answers) and, asked for it, sends its headers and `sent` bytes, then nothing more."""
    etag = hashlib.md5(body).hexdigest()
    listing = (
        '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Name>{BUCKET}</Name><Prefix>tokens/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
        f"<IsTruncated>false</IsTruncated><Contents><Key>tokens/shard.bin</Key>"
        f"<LastModified>2026-12-01T00:00:00.000Z</LastModified><ETag>&quot;{etag}&quot;</ETag>"
        f"<Size>{len(body)}</Size><StorageClass>STANDARD</StorageClass></Contents></ListBucketResult>"
    ).encode()
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            listing_asked = "list-type=2" in self.path
            self.send_response(200 if listing_asked else 206)
            self.send_header("Content-Length", str(len(listing if listing_asked else body)))
            self.send_header("ETag", f'"{etag}"')
            if not listing_asked:
                self.send_header("Content-Range", f"bytes 0-{len(body) - 1}/{len(body)}")
            self.end_headers()
            self.wfile.write(listing if listing_asked else body[:sent])
            self.wfile.flush()
            if not listing_asked:
                release.wait(30)  # the stall, until the test is done with it

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_an_object_that_stalls_mid_download_is_one_aws_error_and_keeps_what_arrived(aws, tmp_path, monkeypatch):
    body = os.urandom(50_000)
    with s3_that_stalls_mid_object(body, sent=1000) as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setattr(aws_clients, "READ_TIMEOUT_S", 0.5)
        # Bytes are written a chunk at a time: with 500-byte chunks the 1,000 that arrived are two.
        monkeypatch.setattr(staging, "CHUNK", 500)
        aws_clients.reset_clients()
        target = tmp_path / "cache"
        with pytest.raises(aws_clients.AwsError) as raised:
            stage(URI, target)
    assert str(raised.value) == (
        f"staging {URI}: {endpoint} did not answer within 0.5 s; the network or the service is stalled: "
        "retry later, or check the network and AWS_ENDPOINT_URL"
    )
    part, _ = partial_download(target, "shard.bin")
    assert part.read_bytes() == body[:1000]  # kept: the next submit resumes from byte 1000
    assert files_in(target) == {}


def test_a_full_disk_is_a_local_error_naming_the_file_and_the_download_then_resumes(aws, tmp_path):
    body = os.urandom(300_000)
    put_dataset(s3(), {"shard.bin": body})
    with tmpfs(tmp_path / "small", "size=64k") as mount:
        target = mount / "data" / "cache"
        part, _ = partial_download(target, "shard.bin")
        with pytest.raises(UsageError) as raised:
            stage(URI, target)
        assert raised.value.exit_code == EXIT_USAGE
        assert str(raised.value) == (
            f"staging {URI}: {part}: No space left on device (ENOSPC); "
            "free space on that file system, then submit again (the download resumes)"
        )
        written = part.stat().st_size
        assert 0 < written < len(body)
        assert sorted(p.name for p in bookkeeping_dir(target).iterdir()) == ["lock", "manifest.json", "partial"]
        subprocess.run(["mount", "-o", "remount,size=1m", str(mount)], check=True)
        assert stage(URI, target).downloaded_bytes == len(body) - written
        assert files_in(target) == {"shard.bin": body}


def test_a_read_only_file_system_is_a_local_error_naming_the_path(aws, tmp_path):
    put_dataset(s3(), {"x.bin": b"1"})
    with tmpfs(tmp_path / "ro", "ro,size=64k") as mount:
        with pytest.raises(UsageError) as raised:
            stage(URI, mount / "cache")
    assert raised.value.exit_code == EXIT_USAGE
    assert str(raised.value) == (
        f"staging {URI}: {mount / 'cache'}: Read-only file system (EROFS); stage onto a writable file system"
    )


@pytest.mark.torchrun
@pytest.mark.engines
def test_a_local_job_trains_on_s3_data_staged_at_submit(aws, tmp_path):
    vocab = 512  # llama-tiny's vocabulary
    tokens = np.random.default_rng(0).integers(0, vocab, size=40_000, dtype=np.uint16)
    put_dataset(s3(), {"shard-0.bin": tokens[:20_000].tobytes(), "shard-1.bin": tokens[20_000:].tobytes()})
    home = tmp_path / "home"
    # One process: the launch is what is tested here, not the layout.
    sets = [f"data.source={URI}", "training.steps=4", "cluster.nproc_per_node=1", "parallel.tensor=1"]
    common = ["recipes/tiny-cpu.yaml", "--backend", "local", *(arg for s in sets for arg in ("--set", s))]
    env = {**os.environ, "LAUNCHER_HOME": str(home)}
    launcher = [sys.executable, "-m", "launcher"]

    dry = subprocess.run([*launcher, "submit", *common, "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True)
    staged = staging_dir(URI, home)
    assert dry.returncode == 0, dry.stderr
    assert f"data: {URI} is downloaded at submit into {staged} (resumable, checksummed" in dry.stderr
    assert not staged.exists()  # a dry run downloads nothing

    run = subprocess.run(
        [*launcher, "submit", *common, "--wait"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert sorted(json.loads(manifest_path(staged).read_text())["objects"]) == ["shard-0.bin", "shard-1.bin"]
    name = run.stdout.splitlines()[-1].split(":")[0]
    spec = json.loads((home / "jobs" / name / "spec.json").read_text())
    assert spec["environment"]["SM_CHANNEL_TRAIN"] == str(staged)

    # The job really reads the staged copy: a shard changed in the bucket is fetched again at the
    # next submit, and its out-of-vocabulary token fails that job with the reader's own message.
    poisoned = tokens[:20_000].copy()
    poisoned[7] = 600
    s3().put_object(Bucket=BUCKET, Key="tokens/shard-0.bin", Body=poisoned.tobytes())
    bad = subprocess.run(
        [*launcher, "submit", *common, "--wait"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert bad.returncode != 0
    assert "data.source: token id 600 is outside the model's vocabulary of 512" in bad.stdout + bad.stderr
