"""s3:// inputs and output, against a moto S3 server over HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import os

import boto3

from launcher.data.prepare import PrepareSettings, prepare
from tests.backends.helpers import REGION

from .conftest import files_of

BUCKET = "corpus-bucket"


def s3():
    return boto3.client("s3", region_name=REGION, endpoint_url=os.environ["AWS_ENDPOINT_URL"])


def test_s3_inputs_prepared_to_an_s3_prefix_match_a_local_run_and_a_rerun_uploads_nothing(
    aws, corpus, tokenizer_file, tmp_path
):
    corpus_glob, docs = corpus
    client = s3()
    client.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
    for path in sorted(tmp_path.glob("corpus/*.jsonl")):
        client.upload_file(str(path), BUCKET, f"raw/{path.name}")
    client.put_object(Bucket=BUCKET, Key="raw/README.md", Body=b"not a part of the corpus")

    def run(inputs: str, out: str):
        given = PrepareSettings(inputs=(inputs,), tokenizer=str(tokenizer_file), shard_tokens=12000)
        return prepare(given, out=out, workers=1, work_dir=tmp_path / "work")

    local = run(corpus_glob, str(tmp_path / "local"))
    remote = run(f"s3://{BUCKET}/raw/*.jsonl", f"s3://{BUCKET}/tokens/")
    assert [i["uri"] for i in remote.manifest["inputs"]] == [f"s3://{BUCKET}/raw/part-{n}.jsonl" for n in range(3)]
    assert [i["sha256"] for i in remote.manifest["inputs"]] == [i["sha256"] for i in local.manifest["inputs"]]

    listed = client.list_objects_v2(Bucket=BUCKET, Prefix="tokens/")["Contents"]
    uploaded = {
        o["Key"].removeprefix("tokens/"): client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listed
    }
    shards = {k: v for k, v in files_of(tmp_path / "local").items() if k.startswith("shard-")}
    assert {k: v for k, v in uploaded.items() if k != "manifest.json"} == shards
    manifest = json.loads(uploaded["manifest.json"])
    assert (manifest["documents"], manifest["shards"]) == (len(docs), local.manifest["shards"])

    # A re-run keeps the local work copy and puts back only what the prefix lost.
    client.delete_object(Bucket=BUCKET, Key="tokens/shard-000001.bin")
    again = run(f"s3://{BUCKET}/raw/*.jsonl", f"s3://{BUCKET}/tokens/")
    assert (again.written_shards, again.reused_shards) == (0, len(shards) // 2)
    restored = client.get_object(Bucket=BUCKET, Key="tokens/shard-000001.bin")["Body"].read()
    assert restored == shards["shard-000001.bin"]


def test_an_empty_s3_prefix_is_one_line(aws, tokenizer_file, tmp_path, cli):
    s3().create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
    result = cli("data", "prepare", f"s3://{BUCKET}/nothing/", "--tokenizer", tokenizer_file, "--out", tmp_path / "o")
    assert (result.code, result.err_lines) == (
        2,
        [f"INPUT s3://{BUCKET}/nothing/: no files found; give files, a directory, a glob or an s3:// prefix"],
    )
