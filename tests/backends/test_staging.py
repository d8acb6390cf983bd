"""s3:// data staged at submit, against a moto S3 server over HTTP, and one real local job on it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import boto3
import numpy as np
import pytest

from launcher.backends.staging import MANIFEST, stage, staging_dir
from launcher.errors import UsageError

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
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in directory.rglob("*")
        if p.is_file() and not p.name.startswith(".launcher-staging")
    }


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
    (target / "shard.bin.part").write_bytes(body[:150_000])
    (target / "shard.bin.part.etag").write_text(hashlib.md5(body).hexdigest())

    result = stage(URI, target)
    assert result.downloaded_bytes == 50_000
    assert (target / "shard.bin").read_bytes() == body
    assert not list(target.glob("*.part*"))


def test_a_damaged_download_is_refused_and_the_next_submit_fetches_it_whole(aws, tmp_path):
    body = os.urandom(10_000)
    put_dataset(s3(), {"shard.bin": body})
    target = tmp_path / "cache"
    target.mkdir()
    # Bytes left by an earlier attempt that do not match the object (a torn write).
    (target / "shard.bin.part").write_bytes(b"\0" * 4_000)
    (target / "shard.bin.part.etag").write_text(hashlib.md5(body).hexdigest())

    with pytest.raises(
        UsageError,
        match=r"^staging s3://stage-bucket/tokens/: s3://stage-bucket/tokens/shard.bin arrived damaged \(MD5 \w+ instead of the ETag \w+\); submit again$",
    ):
        stage(URI, target)
    assert not (target / "shard.bin").exists() and not (target / "shard.bin.part").exists()
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


@pytest.mark.torchrun
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
    assert sorted(json.loads((staged / MANIFEST).read_text())["objects"]) == ["shard-0.bin", "shard-1.bin"]
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
