"""entrypoints/checkpoint_mirror.py against moto's S3 over HTTP: each host uploads only its own
files (its marker last) and prunes its own objects to `keep`; a resume downloads only what the
host reads of the newest checkpoint that every host finished uploading.

The step directories are laid out as two hosts of two ranks write them (checkpoint_files.py's
ownership rule): host 0 holds ranks 0-1's shards, `.metadata` and `train_state.json`; host 1
ranks 2-3's. What is downloaded is counted from the GetObject answers on the client itself.
"""

from __future__ import annotations

import boto3
import pytest

from entrypoints.checkpoint_files import RankHosts, marker_content, own_file_sizes
from entrypoints.checkpoint_mirror import MirrorFailed, S3Mirror
from launcher.contract.checkpoint_dirs import marker_name, step_dir_name

BUCKET = "ckpt-bucket"
URI = f"s3://{BUCKET}/checkpoints/job-1"


def write_host_files(directory, step: int, host: RankHosts) -> None:
    """Host `host.node`'s files of checkpoint `step`, then its marker (sizes as recorded)."""
    path = directory / step_dir_name(step)
    (path / "rng").mkdir(parents=True, exist_ok=True)
    for rank in range(host.node * host.procs_per_node, (host.node + 1) * host.procs_per_node):
        (path / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * (10_000 + 1_000 * rank + step))
        (path / "rng" / f"rank-{rank:05d}.pt").write_bytes(b"r" * 100)
    if host.node == 0:
        (path / ".metadata").write_bytes(b"m" * 500)
        (path / "train_state.json").write_bytes(b'{"step": %d}' % step)
    marker = marker_content(step, own_file_sizes(path, host))
    (path / marker_name(host.node, host.instance_count)).write_bytes(marker)


def hosts(count: int = 2, procs: int = 2) -> list[RankHosts]:
    return [RankHosts(node * procs, count * procs, procs) for node in range(count)]


def counting_client(fetched: list, put: list):
    client = boto3.client("s3")
    client.meta.events.register(
        "after-call.s3.GetObject", lambda http_response, parsed, model, **_: fetched.append(parsed["ContentLength"])
    )
    client.meta.events.register("before-parameter-build.s3.PutObject", lambda params, **_: put.append(params["Key"]))
    return client


@pytest.fixture
def bucket(aws):
    boto3.client("s3").create_bucket(
        Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": boto3.session.Session().region_name}
    )
    return BUCKET


def push_all(tmp_path, steps, *, skip=(), keep: int = 2) -> list[list[str]]:
    """Every host writes and pushes each step (except the (step, host) pairs in `skip`)."""
    put = [[], []]
    mirrors = [S3Mirror(URI, host, client=counting_client([], put[host.node])) for host in hosts()]
    done = []
    for step in steps:
        done.append(step)
        for host, mirror in zip(hosts(), mirrors, strict=True):
            if (step, host.node) in skip:
                continue
            write_host_files(tmp_path / f"host{host.node}", step, host)
            mirror.push(tmp_path / f"host{host.node}" / step_dir_name(step), step, keep=set(done[-keep:]))
            mirror.wait()
    return put


def test_each_host_uploads_its_own_files_marker_last_and_prunes_its_own_objects_to_keep(tmp_path, bucket):
    put = push_all(tmp_path, [2, 4, 6], keep=2)
    listing = S3Mirror(URI, hosts()[0]).listing()
    assert sorted(listing) == [4, 6]  # step 2 is gone from S3, every host's part of it
    assert sorted(listing[6]) == sorted(
        [".metadata", "train_state.json", "COMPLETE.node-0-of-2", "COMPLETE.node-1-of-2"]
        + [f"__{r}_0.distcp" for r in range(4)]
        + [f"rng/rank-{r:05d}.pt" for r in range(4)]
    )
    # Host 1 never uploads host 0's files, and each host's marker goes up after its files.
    assert {key.rsplit("/", 1)[-1] for key in put[1]} == {
        "__2_0.distcp",
        "__3_0.distcp",
        "rank-00002.pt",
        "rank-00003.pt",
        "COMPLETE.node-1-of-2",
    }
    for node, keys in enumerate(put):
        per_step = [key for key in keys if f"/{step_dir_name(6)}/" in key]
        assert [key for key in per_step if "COMPLETE" in key] == [per_step[-1]]
        assert per_step[-1].endswith(f"/COMPLETE.node-{node}-of-2")


def test_a_resume_downloads_only_the_hosts_own_files_of_the_newest_checkpoint_every_host_finished(tmp_path, bucket):
    # Step 8 is torn: host 1 was killed before it uploaded anything of it.
    push_all(tmp_path, [4, 6, 8], skip={(8, 1)}, keep=3)
    fetched = []
    second = hosts()[1]
    mirror = S3Mirror(URI, second, client=counting_client(fetched, []))
    listing = mirror.listing()
    assert mirror.newest_complete(listing) == 6
    fresh = tmp_path / "new-host1"
    downloaded = mirror.restore(fresh, 6, listing[6])
    path = fresh / step_dir_name(6)
    got = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert got == sorted(
        [".metadata", "train_state.json", "COMPLETE.node-0-of-2", "COMPLETE.node-1-of-2"]
        + ["__2_0.distcp", "__3_0.distcp", "rng/rank-00002.pt", "rng/rank-00003.pt"]
    )
    own = sum(size for relative, size in listing[6].items() if second.owner(relative) == 1)
    metadata = sum(listing[6][name] for name in (".metadata", "train_state.json", "COMPLETE.node-0-of-2"))
    assert sum(fetched) == downloaded == own + metadata
    assert sum(fetched) < sum(listing[6].values()) * 0.75  # host 0's shards stay in S3


def test_a_checkpoint_written_by_another_number_of_hosts_is_downloaded_whole(tmp_path, bucket):
    push_all(tmp_path, [4], keep=1)
    one_host = RankHosts(0, 2, 2)  # the job now runs on 1 host of 2 ranks: DCP reshards from all 4 files
    mirror = S3Mirror(URI, one_host)
    listing = mirror.listing()
    assert mirror.needed(listing[4]) == set(listing[4])


def test_a_failed_upload_is_one_line_naming_the_key(tmp_path, aws):
    write_host_files(tmp_path, 2, hosts()[0])
    mirror = S3Mirror("s3://no-such-bucket/ckpt", hosts()[0])
    mirror.push(tmp_path / step_dir_name(2), 2, keep={2})
    with pytest.raises(
        MirrorFailed, match=r"^checkpoint: uploading s3://no-such-bucket/ckpt/step-00000002/\S+ failed: "
    ):
        mirror.wait()
