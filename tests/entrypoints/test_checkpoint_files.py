"""Checkpoint bookkeeping in one process: file ownership per host, per-host markers, resume, pruning.

The multi-host behaviour on real torchrun processes is in test_multihost_checkpoints.py.
"""

from __future__ import annotations

import pytest

from entrypoints.checkpoint_files import RankHosts, own_files, remove_empty_dirs, remove_own_files
from launcher.contract.checkpoint_dirs import complete_checkpoints, is_complete, marker_name

# Two hosts of two ranks: ranks 0, 1 on host 0; ranks 2, 3 on host 1.
HOST0 = RankHosts(rank=0, world_size=4, procs_per_node=2)
HOST1 = RankHosts(rank=2, world_size=4, procs_per_node=2)
HOST0_ALONE = RankHosts(rank=0, world_size=1, procs_per_node=1)


def make_checkpoint(directory, step: int, nodes: list[int], instance_count: int = 2, ranks: int = 4):
    """A step directory with every rank's files, and markers for `nodes` of `instance_count`."""
    path = directory / f"step-{step:08d}"
    (path / "rng").mkdir(parents=True)
    for rank in range(ranks):
        (path / f"__{rank}_0.distcp").write_bytes(b"shard")
        (path / "rng" / f"rank-{rank:05d}.pt").write_bytes(b"rng")
    (path / ".metadata").write_bytes(b"meta")
    (path / "train_state.json").write_text("{}")
    for node in nodes:
        (path / marker_name(node, instance_count)).write_text(f"{step}\n")
    return path


@pytest.mark.parametrize(
    "name, owner",
    [
        ("__0_0.distcp", 0),
        ("__1_0.distcp", 0),
        ("__2_0.distcp", 1),
        ("__3_1.distcp", 1),
        ("rng/rank-00003.pt", 1),
        ("rng/rank-00001.pt", 0),
        ("COMPLETE.node-1-of-2", 1),
        ("COMPLETE.node-0-of-2", 0),
        (".metadata", 0),
        ("train_state.json", 0),
        ("__9_0.distcp", 0),  # a rank of a bigger earlier run: host 0 cleans it up
        ("COMPLETE.node-5-of-8", 0),
    ],
)
def test_every_file_has_exactly_one_owner_host(name, owner):
    assert HOST0.owner(name) == HOST1.owner(name) == owner


def test_placement_follows_torchrun_consecutive_ranks_per_host():
    assert (HOST1.node, HOST1.instance_count, HOST1.is_node_leader, HOST1.marker) == (
        1,
        2,
        True,
        "COMPLETE.node-1-of-2",
    )
    assert not RankHosts(rank=3, world_size=4, procs_per_node=2).is_node_leader
    with pytest.raises(ValueError, match="do not split into hosts"):
        RankHosts(rank=0, world_size=4, procs_per_node=3)


def test_a_checkpoint_counts_only_with_every_hosts_marker(tmp_path):
    make_checkpoint(tmp_path, 10, [0, 1])
    make_checkpoint(tmp_path, 20, [0])  # host 1 was killed mid-save
    make_checkpoint(tmp_path, 30, [1])
    single = make_checkpoint(tmp_path, 40, [0], instance_count=1, ranks=1)
    (tmp_path / "notes").mkdir()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [10, 40]
    # Markers of two different runs (2 and 3 hosts) never add up to one complete set.
    (single / marker_name(0, 1)).unlink()
    (single / marker_name(1, 3)).write_text("40\n")
    (single / marker_name(0, 2)).write_text("40\n")
    assert not is_complete(single)


def test_a_host_owns_its_ranks_shards_and_its_marker_which_goes_first(tmp_path):
    path = make_checkpoint(tmp_path, 10, [0, 1])
    names = [p.relative_to(path).as_posix() for p in own_files(path, HOST1)]
    assert names == ["COMPLETE.node-1-of-2", "__2_0.distcp", "__3_0.distcp", "rng/rank-00002.pt", "rng/rank-00003.pt"]


def test_on_a_shared_directory_both_hosts_together_remove_everything(tmp_path):
    path = make_checkpoint(tmp_path, 10, [0, 1])
    remove_own_files(path, HOST1)
    assert not is_complete(path) and (path / ".metadata").exists()
    remove_own_files(path, HOST0)
    remove_empty_dirs(path)
    assert not path.exists()


def test_on_a_per_host_directory_another_hosts_downloaded_files_are_left_alone(tmp_path):
    # SageMaker: host 1's directory holds host 0's files as downloaded at the start. Deleting
    # them here could delete host 0's newer upload of the same name in S3.
    path = make_checkpoint(tmp_path, 10, [0, 1])
    remove_own_files(path, HOST1)
    remove_empty_dirs(path)
    left = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert left == [
        ".metadata",
        "COMPLETE.node-0-of-2",
        "__0_0.distcp",
        "__1_0.distcp",
        "rng/rank-00000.pt",
        "rng/rank-00001.pt",
        "train_state.json",
    ]


def checkpointer(directory, **cfg):
    from entrypoints.checkpoint import Checkpointer
    from launcher.contract.config import CheckpointConfig

    rank_hosts = RankHosts(rank=0, world_size=1, procs_per_node=1)
    return Checkpointer(directory, CheckpointConfig(**cfg), parts=[], optimizers=None, data=None, rank_hosts=rank_hosts)


def plan(directory, **cfg) -> list:
    """[refusal, candidates, complete steps]: what rank 0 decides before a resume."""
    return checkpointer(directory, **cfg)._resume_plan()


def test_auto_resume_takes_the_newest_checkpoint_every_host_completed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LAUNCHER_CHECKPOINT_LEASE", "0")
    make_checkpoint(tmp_path, 10, [0, 1])
    make_checkpoint(tmp_path, 20, [0])
    assert plan(tmp_path) == [None, [str(tmp_path / "step-00000010")], [10]]
    assert "warning: checkpoint step-00000020 is incomplete (host(s) 1 of 2 wrote no COMPLETE marker); skipped" in (
        capsys.readouterr().out
    )
    assert plan(tmp_path, resume="never") == [None, [], [10]]


def test_resume_from_an_incomplete_checkpoint_path_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_CHECKPOINT_LEASE", "0")
    path = make_checkpoint(tmp_path, 20, [1])
    refusal, candidates, _ = plan(tmp_path, resume=str(path))
    assert "is not a complete checkpoint (not every host's COMPLETE.node-* marker)" in refusal and candidates == []


def test_a_checkpoint_whose_files_differ_from_its_markers_is_skipped(tmp_path, capsys, monkeypatch):
    from entrypoints.checkpoint_files import checkpoint_fault, marker_content, own_file_sizes

    monkeypatch.setenv("LAUNCHER_CHECKPOINT_LEASE", "0")
    for step in (10, 20):
        path = make_checkpoint(tmp_path, step, [0, 1])
        for host in (HOST0, HOST1):
            (path / host.marker).write_bytes(marker_content(step, own_file_sizes(path, host)))
    newest = tmp_path / "step-00000020"
    assert checkpoint_fault(newest) is None
    (newest / "__3_0.distcp").write_bytes(b"sh")  # torn: host 1 recorded 5 bytes
    assert checkpoint_fault(newest) == "__3_0.distcp is 2 bytes, but COMPLETE.node-1-of-2 recorded 5"
    assert plan(tmp_path)[1] == [str(tmp_path / "step-00000010")]
    assert "warning: checkpoint step-00000020 is damaged (__3_0.distcp is 2 bytes" in capsys.readouterr().out
    (tmp_path / "step-00000010" / "train_state.json").unlink()
    refusal, candidates, _ = plan(tmp_path)
    assert candidates == [] and refusal.startswith("checkpoint: every complete checkpoint in ")


def test_the_lease_keeps_a_second_job_out_until_it_lapses(tmp_path):
    from entrypoints.checkpoint_files import LEASE_STALE_S, acquire_lease, read_lease, release_lease

    assert acquire_lease(tmp_path, "job-a", now=1000.0) is None
    refusal = acquire_lease(tmp_path, "job-b", now=1010.0)
    assert refusal.startswith(f"checkpoint.dir: {tmp_path} is in use by job job-a on ")
    assert "renewed 10 s ago" in refusal
    assert acquire_lease(tmp_path, "job-a", now=1020.0) is None  # the same job, restarted
    assert acquire_lease(tmp_path, "job-b", now=1020.0 + LEASE_STALE_S) is None  # job-a stopped renewing
    assert read_lease(tmp_path)["owner"] == "job-b"
    release_lease(tmp_path, "job-a")  # not its lease any more: nothing happens
    assert read_lease(tmp_path)["owner"] == "job-b"
    release_lease(tmp_path, "job-b")
    assert read_lease(tmp_path) is None


def test_a_same_size_change_is_found_by_its_digest_and_an_unreadable_marker_is_a_fault(tmp_path):
    from entrypoints.checkpoint_files import (
        checkpoint_fault,
        digest_fault,
        file_digest,
        marker_content,
        own_file_sizes,
        recorded_digests,
    )

    path = make_checkpoint(tmp_path, 10, [0, 1])
    for host in (HOST0, HOST1):
        sizes = own_file_sizes(path, host)
        (path / host.marker).write_bytes(marker_content(10, sizes, {name: file_digest(path / name) for name in sizes}))
    recorded, fault = recorded_digests(path)
    assert fault is None and recorded["__3_0.distcp"][0] == "COMPLETE.node-1-of-2"
    assert digest_fault(path, "__3_0.distcp", recorded, node=1) is None
    (path / "__3_0.distcp").write_bytes(b"shart")  # same size: the size check passes
    assert checkpoint_fault(path) is None
    assert digest_fault(path, "__3_0.distcp", recorded, node=1) == (
        "__3_0.distcp on host 1 differs from the sha256 that COMPLETE.node-1-of-2 recorded"
    )
    assert digest_fault(path, "__7_0.distcp", recorded, node=0) == (
        "__7_0.distcp has no sha256 in any COMPLETE marker (on host 0)"
    )
    # A marker of a launcher from before digests (the step only) verifies nothing; a garbled one is a fault.
    (path / HOST1.marker).write_text("10\n")
    (path / HOST0.marker).write_text("10\n")
    assert recorded_digests(path) == ({}, None) and digest_fault(path, "__3_0.distcp", {}, node=1) is None
    (path / HOST1.marker).write_bytes(b"\xff{\x00")
    assert checkpoint_fault(path) == "COMPLETE.node-1-of-2 is unreadable"
    (path / HOST1.marker).write_text('["files"]')
    assert checkpoint_fault(path) == "COMPLETE.node-1-of-2 is not a marker record"


def test_dcps_writer_records_each_files_digest_and_the_reader_refuses_a_changed_file(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from entrypoints.checkpoint import _damage
    from entrypoints.checkpoint_digests import DigestingWriter, VerifyingReader
    from entrypoints.checkpoint_files import file_digest

    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3)}
    writer = DigestingWriter(tmp_path)
    dcp.save(state, storage_writer=writer, no_dist=True)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [".metadata", "__0_0.distcp"] and sorted(writer.digests) == files
    assert all(writer.digests[name] == file_digest(tmp_path / name) for name in files)

    recorded = {name: ("COMPLETE.node-0-of-1", digest) for name, digest in writer.digests.items()}
    loaded = {"w": torch.zeros(4096), "b": torch.zeros(3)}
    dcp.load(loaded, storage_reader=VerifyingReader(tmp_path, HOST0_ALONE, recorded), no_dist=True)
    assert torch.equal(loaded["w"], state["w"])

    shard = tmp_path / "__0_0.distcp"
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2 : len(blob) // 2 + 1024] = b"\xff" * 1024
    shard.write_bytes(bytes(blob))
    with pytest.raises(BaseException) as caught:  # DCP's CheckpointException is a BaseException
        dcp.load(loaded, storage_reader=VerifyingReader(tmp_path, HOST0_ALONE, recorded), no_dist=True)
    assert _damage(caught.value) == "__0_0.distcp on host 0 differs from the sha256 that COMPLETE.node-0-of-1 recorded"


@pytest.mark.parametrize(
    "loss, grad_norm, resumed_from, reason",
    [
        (2.5, 1.0, 4, None),
        (
            float("nan"),
            float("nan"),
            4,
            "training: the loss is nan and the gradient norm is nan at step 5; 1 step(s) after resuming from "
            "checkpoint step-00000004, which may hold damaged values; resume from an older one "
            "(checkpoint.resume: <checkpoint.dir>/step-N); step 5 was not saved",
        ),
        (
            2.5,
            float("inf"),
            0,
            "training: the gradient norm is inf at step 5; lower training.optimizer.lr or training.grad_clip; "
            "step 5 was not saved",
        ),
    ],
)
def test_a_loss_or_gradient_norm_that_is_not_finite_stops_training_with_its_reason(
    loss, grad_norm, resumed_from, reason
):
    from entrypoints.train import divergence

    assert divergence(5, loss, grad_norm, resumed_from=resumed_from) == reason


def test_a_marker_whose_write_fails_on_a_full_disk_leaves_no_file_that_would_count(tmp_path):
    from entrypoints.checkpoint_files import marker_content, write_durable
    from tests.disks import fill_disk, small_disk

    with small_disk(tmp_path / "disk", "64k") as disk:
        step_dir = disk / "step-00000004"
        step_dir.mkdir()
        fill_disk(disk)
        marker = step_dir / marker_name(0, 1)
        with pytest.raises(OSError, match="No space left on device"):
            write_durable(marker, marker_content(4, {"__0_0.distcp": 1}))
        assert not marker.exists() and not is_complete(step_dir)


def test_a_save_starts_only_once_the_previous_copy_to_s3_is_done(tmp_path):
    """One checkpoint in flight to S3 per host: `save` waits for the mirror's previous push before
    it writes anything, and a failed one fails the job in one line naming that checkpoint."""
    from entrypoints.checkpoint import CheckpointWriteFailed
    from entrypoints.checkpoint_mirror import MirrorFailed

    waited = []

    class Mirror:
        def wait(self):
            waited.append(sorted(p.name for p in tmp_path.iterdir()))
            raise MirrorFailed("checkpoint: uploading s3://b/p/step-00000004/__0_0.distcp failed: SlowDown")

    saver = checkpointer(tmp_path)
    saver.mirror, saver.complete_steps = Mirror(), [4]
    with pytest.raises(CheckpointWriteFailed, match=r"SlowDown; checkpoint step-00000004 is complete in .* not in S3"):
        saver.save(8)
    assert waited == [[]] and not (tmp_path / "step-00000008").exists()
