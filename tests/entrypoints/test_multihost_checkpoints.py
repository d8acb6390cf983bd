"""Checkpoints across hosts, on one machine: two torchrun "hosts" (--nnodes 2, static rendezvous on
127.0.0.1), one process each.

Launch 1 gives each host its OWN checkpoint directory, as SageMaker does (/opt/ml/checkpoints is
local to each host and synced to one S3 prefix). It runs an uninterrupted reference, a job that
stops after step 4 saving every step (keep 2), and a job saved by time only (every_minutes).
The test then merges the two host directories the way SageMaker's download at job start does.
Launch 2 runs both hosts on the merged directory (a shared directory, as on Slurm): a job
resumes from it, another resumes from a copy whose newest checkpoint lacks host 1's marker, and
a third from a copy whose newest checkpoint has 1 KiB of host 1's shard changed at the same size.

The learning rate is constant, so a 4-step job and the first 4 steps of a 6-step job match.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.contract.checkpoint_dirs import complete_checkpoints, is_complete
from tests.checkpoint_items import whole_items

REPO = Path(__file__).resolve().parents[2]
# The interpreter, read at import: these launches run in a background thread while the serial
# tests run, and a test may monkeypatch sys.executable meanwhile (test_render_snapshots.py does).
PYTHON = sys.executable
TORCHRUN = Path(PYTHON).parent / "torchrun"
MULTIRUN = REPO / "tests" / "entrypoints" / "multirun.py"
HOSTS = 2

pytestmark = pytest.mark.torchrun

BASE = {
    "model": "llama3.1-tiny",
    "cluster.nproc_per_node": HOSTS,  # the world: 2 ranks, one per "host"
    "parallel.tensor": 1,
    "training.seq_len": 64,
    "training.global_batch_size": 4,
    "training.micro_batch_size": 2,
    "training.optimizer.warmup_steps": 0,
    "training.optimizer.schedule": "constant",
    "checkpoint.every_steps": 0,
    "checkpoint.keep": 2,
}


def write_config(root: Path, name: str, host: int, checkpoint_dir: Path, **overrides) -> dict:
    from launcher.recipe import Recipe
    from launcher.resolve import resolve

    recipe = resolve(Recipe.load(REPO / "recipes" / "tiny-cpu.yaml", {**BASE, **overrides})).concrete
    resolved = recipe.resolved(checkpoint_dir=str(checkpoint_dir), output_dir=str(root / name / "output"))
    path = root / name / f"resolved-host{host}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(resolved.to_dict(), indent=2))
    return {"kind": "train", "config": str(path), "result": str(root / name / "result.json")}


def launch_hosts(root: Path, plans: list[list[dict]], name: str, popen, env: dict[str, str] | None = None) -> str:
    """torchrun once per host (node rank 0 and 1), each with its own plan (and `env` added to the
    environment), started by `popen` (`Background.popen`, or `foreground_popen`); returns host 0's stdout."""
    port = _free_port()
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    procs = []
    for host, plan in enumerate(plans):
        plan_path = root / f"plan-{name}-host{host}.json"
        plan_path.write_text(json.dumps({"jobs": plan}))
        cmd = [
            str(TORCHRUN),
            f"--nnodes={HOSTS}",
            "--nproc_per_node=1",
            f"--node_rank={host}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(MULTIRUN),
            str(plan_path),
        ]
        log = (root / f"log-{name}-host{host}.txt").open("w")
        procs.append((popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=600))
        finally:
            proc.kill()
            log.close()
    logs = [(root / f"log-{name}-host{h}.txt").read_text() for h in range(HOSTS)]
    if any(codes):
        pytest.fail(f"{name}: exit codes {codes}\n" + "\n".join(text[-4000:] for text in logs))
    return logs[0]


def foreground_popen(argv: list[str], *, cwd: Path, env: dict[str, str], **options) -> subprocess.Popen:
    """`subprocess.Popen` with this process's environment plus `env`, for a test's own launch."""
    return subprocess.Popen(argv, cwd=cwd, env={**os.environ, **env}, **options)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(root: Path, name: str) -> list[tuple[int, float]]:
    lines = (root / name / "output" / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def files(directory: Path) -> dict[str, list[str]]:
    """{step directory: sorted relative file paths} under one checkpoint directory."""
    return {
        step_dir.name: sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file())
        for step_dir in sorted(directory.iterdir())
    }


def merge(sources: list[Path], target: Path) -> None:
    """What SageMaker's download does: every host's uploads land in one directory."""
    for source in sources:
        shutil.copytree(source, target, dirs_exist_ok=True)


def overwrite_1kib_inside(file: Path) -> None:
    """Same size, different bytes: only the host 1 shard's digest can tell."""
    blob = bytearray(file.read_bytes())
    blob[len(blob) // 2 : len(blob) // 2 + 1024] = bytes(255 - b for b in blob[len(blob) // 2 : len(blob) // 2 + 1024])
    file.write_bytes(bytes(blob))


HOST_RUNS = "the multi-host checkpoint launches"


def wants_host_runs(item) -> bool:
    return "host_runs" in item.fixturenames


def host_runs_work(items, tmp_path_factory, background) -> dict:
    """Both launches, if a selected test needs them: every config written now, in the foreground;
    the launches and the merges between them run beside the serial tests (tests/background.py)."""
    if not any(wants_host_runs(item) for item in items):
        return {}
    root = tmp_path_factory.mktemp("multihost")
    merged, torn, damaged = root / "merged", root / "torn", root / "damaged"
    per_host = [
        [
            write_config(root, "reference", h, root / f"reference-host{h}", **{"training.steps": 6}),
            write_config(
                root, "split", h, root / f"split-host{h}", **{"training.steps": 4, "checkpoint.every_steps": 1}
            ),
            write_config(
                root,
                "timed",
                h,
                root / f"timed-host{h}",
                **{"training.steps": 3, "checkpoint.every_minutes": 0.0001, "checkpoint.keep": 10},
            ),
        ]
        for h in range(HOSTS)
    ]
    shared = [
        [
            write_config(root, "resumed", h, merged, **{"training.steps": 6}),
            write_config(root, "torn-resumed", h, torn, **{"training.steps": 6}),
            write_config(root, "damaged-resumed", h, damaged, **{"training.steps": 6}),
        ]
        for h in range(HOSTS)
    ]

    def run() -> Path:
        (root / "stdout-hosts.txt").write_text(launch_hosts(root, per_host, "own-dirs", background.popen))
        merge([root / f"split-host{h}" for h in range(HOSTS)], merged)
        shutil.copytree(merged, torn)
        (torn / "step-00000004" / "COMPLETE.node-1-of-2").unlink()
        shutil.copytree(merged, damaged)
        overwrite_1kib_inside(damaged / "step-00000004" / "__1_0.distcp")
        (root / "stdout-shared.txt").write_text(launch_hosts(root, shared, "shared-dir", background.popen))
        return root

    return {HOST_RUNS: run}


@pytest.fixture(scope="module")
def host_runs(_background) -> Path:
    return _background.result(HOST_RUNS)


def test_each_host_directory_holds_only_its_own_files_of_the_newest_two_checkpoints(host_runs):
    host0, host1 = files(host_runs / "split-host0"), files(host_runs / "split-host1")
    assert list(host0) == list(host1) == ["step-00000003", "step-00000004"]
    for step in host0:
        assert host0[step] == [
            ".metadata",
            "COMPLETE.node-0-of-2",
            "__0_0.distcp",
            "rng/rank-00000.pt",
            "train_state.json",
        ]
        assert host1[step] == ["COMPLETE.node-1-of-2", "__1_0.distcp", "rng/rank-00001.pt"]
    # Neither host's directory is a complete checkpoint alone; merged (as S3 holds them) they are.
    assert complete_checkpoints(host_runs / "split-host0") == complete_checkpoints(host_runs / "split-host1") == []


def test_merged_host_directories_resume_with_the_losses_of_an_uninterrupted_run(host_runs):
    reference = dict(losses(host_runs, "reference"))
    resumed = losses(host_runs, "resumed")
    assert [step for step, _ in resumed] == [5, 6]
    for step, loss in resumed:
        assert loss == pytest.approx(reference[step], abs=1e-5), step
    split = dict(losses(host_runs, "split"))
    assert [split[s] for s in range(1, 5)] == pytest.approx([reference[s] for s in range(1, 5)], abs=1e-6)
    assert "resumed_from_step=4" in (host_runs / "stdout-shared.txt").read_text()
    assert [s for s, _ in complete_checkpoints(host_runs / "merged")] == [4, 6]


def test_a_checkpoint_missing_one_hosts_marker_is_ignored_and_then_removed(host_runs):
    reference = dict(losses(host_runs, "reference"))
    resumed = losses(host_runs, "torn-resumed")
    assert [step for step, _ in resumed] == [4, 5, 6]  # from step 3, the newest complete one
    for step, loss in resumed:
        assert loss == pytest.approx(reference[step], abs=1e-5), step
    assert "resumed_from_step=3" in (host_runs / "stdout-shared.txt").read_text()
    # Keep 2: steps 3 and 6 remain; both hosts removed their files of the torn step 4.
    assert sorted(p.name for p in (host_runs / "torn").iterdir()) == ["step-00000003", "step-00000006"]
    assert all(is_complete(p) for p in (host_runs / "torn").iterdir())


def test_each_hosts_marker_records_the_sha256_of_the_files_that_host_wrote(host_runs):
    for host in range(HOSTS):
        for step_dir in (host_runs / f"split-host{host}").iterdir():
            recorded = json.loads((step_dir / f"COMPLETE.node-{host}-of-2").read_text())
            assert (
                sorted(recorded["sha256"])
                == sorted(recorded["files"])
                == [
                    p.relative_to(step_dir).as_posix()
                    for p in sorted(step_dir.rglob("*"))
                    if p.is_file() and not p.name.startswith("COMPLETE.")
                ]
            )
            for relative, digest in recorded["sha256"].items():
                assert hashlib.sha256((step_dir / relative).read_bytes()).hexdigest() == digest, relative


def test_a_shard_changed_on_one_host_makes_both_hosts_resume_from_the_previous_checkpoint(host_runs):
    reference = dict(losses(host_runs, "reference"))
    resumed = losses(host_runs, "damaged-resumed")
    assert [step for step, _ in resumed] == [4, 5, 6]  # from step 3: both hosts skipped step 4
    for step, loss in resumed:
        assert loss == pytest.approx(reference[step], abs=1e-5), step
    stdout = (host_runs / "stdout-shared.txt").read_text()
    assert re.search(
        r"warning: checkpoint step-00000004 is damaged \(__1_0\.distcp on host [01] differs from the sha256 that "
        r"COMPLETE\.node-1-of-2 recorded\); skipped",
        stdout,
    ), stdout[-3000:]


def test_every_minutes_saves_without_every_steps(host_runs):
    for host in range(HOSTS):
        assert sorted(p.name for p in (host_runs / f"timed-host{host}").iterdir()) == [
            "step-00000001",
            "step-00000002",
            "step-00000003",
        ]
    stdout = (host_runs / "stdout-hosts.txt").read_text()
    for step in (1, 2, 3):
        assert f"checkpoint step={step} written_s=" in stdout


# --- each host's own files in S3 (entrypoints/checkpoint_mirror.py), not CheckpointConfig -------

MIRROR_BUCKET = "mirror-ckpt"
MIRROR_URI = f"s3://{MIRROR_BUCKET}/tiny-cpu/lineage-1"


@pytest.fixture(scope="module")
def mirror_runs(host_runs, moto_server) -> dict:
    """Launch 1: each host with its own empty directory, saving every step of 4 (keep 3) through
    LAUNCHER_CHECKPOINT_S3 at moto. The test then tears step 4 in S3 (host 1's marker gone, as
    when host 1 dies mid-upload) and changes 1 KiB of host 1's shard of step 3 there at the same
    size (only its digest can tell). Launch 2: new hosts, empty directories, resume to step 6:
    from step 3, found damaged as it loads, then from step 2, restored from S3 after it; then a
    job on other empty directories resumes from the step-2 checkpoint it names. Before both, a job
    that names the torn step 4 is refused."""
    import boto3

    root = host_runs / "mirror"
    env = {
        "AWS_ENDPOINT_URL": moto_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "LAUNCHER_CHECKPOINT_S3": MIRROR_URI,
    }
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")  # fmt: skip
    s3.create_bucket(Bucket=MIRROR_BUCKET)
    split = {"training.steps": 4, "checkpoint.every_steps": 1, "checkpoint.keep": 3}
    plans = [[write_config(root, "split", h, root / f"split-host{h}", **split)] for h in range(HOSTS)]
    launch_hosts(root, plans, "mirror-split", foreground_popen, env=env)
    pushed = s3_listing(s3)
    s3.delete_object(Bucket=MIRROR_BUCKET, Key="tiny-cpu/lineage-1/step-00000004/COMPLETE.node-1-of-2")
    shard = root / "split-host1" / "step-00000003" / "__1_0.distcp"
    overwrite_1kib_inside(shard)
    s3.upload_file(str(shard), MIRROR_BUCKET, "tiny-cpu/lineage-1/step-00000003/__1_0.distcp")
    # Then, in the same launch, a job on new empty directories that names its checkpoint,
    # as the NaN-loss error advises (checkpoint.resume: <checkpoint.dir>/step-N): step 2, in S3 only.
    # First of all (S3 as the test left it), a job that names step 4, torn there: refused.
    plans = [
        [
            {**write_config(root, "torn", h, root / f"torn-host{h}", **{"training.steps": 6},
                            **{"checkpoint.resume": str(root / f"torn-host{h}" / "step-00000004")}),
             "kind": "train_refused"},
            write_config(root, "resumed", h, root / f"new-host{h}", **{"training.steps": 6}),
            write_config(root, "named", h, root / f"named-host{h}", **{"training.steps": 4},
                         **{"checkpoint.resume": str(root / f"named-host{h}" / "step-00000002")}),
        ]
        for h in range(HOSTS)
    ]  # fmt: skip
    stdout = launch_hosts(root, plans, "mirror-resumed", foreground_popen, env=env)
    return {"root": root, "pushed": pushed, "stdout": stdout, "after": s3_listing(s3)}


def s3_listing(s3) -> dict[str, dict[str, int]]:
    """{step directory: {file: size}} under MIRROR_URI."""
    found: dict[str, dict[str, int]] = {}
    for item in s3.list_objects_v2(Bucket=MIRROR_BUCKET, Prefix="tiny-cpu/lineage-1/").get("Contents", []):
        step, _, relative = item["Key"].removeprefix("tiny-cpu/lineage-1/").partition("/")
        found.setdefault(step, {})[relative] = item["Size"]
    return found


def test_each_host_copies_its_own_files_to_s3_and_keep_is_honoured_there(mirror_runs):
    pushed = mirror_runs["pushed"]
    assert list(pushed) == ["step-00000002", "step-00000003", "step-00000004"]  # keep 3: step 1 deleted in S3
    assert sorted(pushed["step-00000004"]) == [
        ".metadata", "COMPLETE.node-0-of-2", "COMPLETE.node-1-of-2", "__0_0.distcp", "__1_0.distcp",
        "rng/rank-00000.pt", "rng/rank-00001.pt", "train_state.json",
    ]  # fmt: skip


def test_a_resume_from_s3_reads_each_hosts_own_files_of_the_newest_complete_checkpoint(mirror_runs):
    """Step 4 is torn in S3: skipped. Step 3 is restored, found damaged as it loads, and dropped;
    step 2 is restored after it. Each restore downloads a host's own files and the shared ones."""
    logs = [(mirror_runs["root"] / f"log-mirror-resumed-host{h}.txt").read_text() for h in range(HOSTS)]
    assert "resumed_from_step=2" in mirror_runs["stdout"]
    assert re.search(
        r"warning: checkpoint step-00000003 is damaged \(__1_0\.distcp on host 1 differs from the sha256 that "
        rf"COMPLETE\.node-1-of-2 recorded\); skipped; looking for an older one in {MIRROR_URI}\n",
        logs[0],
    ), logs[0][-3000:]
    read = dict(re.findall(r"host(\d)=(\d+)", re.search(r"read from S3 to resume \(bytes\): (.*)", logs[0]).group(1)))
    for host in range(HOSTS):
        restored = 0
        for step in ("step-00000003", "step-00000002"):
            files = mirror_runs["pushed"][step]
            shared = sum(
                size for name, size in files.items() if name in (".metadata", "train_state.json") or "COMPLETE" in name
            )
            own = sum(
                size
                for name, size in files.items()
                if re.match(rf"(__{host}_0\.distcp|rng/rank-0000{host}\.pt)$", name)
            )
            got = int(re.search(rf"restored {step} from \S+: (\d+) bytes to host {host} ", logs[host]).group(1))
            assert got == own + shared, (host, step)
            restored += got
        # Beyond its own files, a host reads only the byte ranges of the items every rank holds
        # whole (the optimizer's param groups and step counts), which DCP stores once, maybe in
        # the other host's file: in each of the two loads.
        replicated, _ = whole_items(mirror_runs["root"] / "new-host0" / "step-00000002", f"__{1 - host}_0.distcp")
        assert restored <= int(read[str(host)]) <= restored + 2 * replicated, (host, read, restored, replicated)
        # The damaged copy was dropped on both hosts: no later save of step 3 finds its markers.
        assert not (mirror_runs["root"] / f"new-host{host}" / "step-00000003").exists()


def test_resuming_from_s3_gives_the_losses_of_an_uninterrupted_run(mirror_runs, host_runs):
    reference = dict(losses(host_runs, "reference"))
    resumed = losses(mirror_runs["root"], "resumed")
    assert [s for s, _ in resumed] == [3, 4, 5, 6]
    for s, loss in resumed:
        assert loss == pytest.approx(reference[s], abs=1e-5), s


def test_a_checkpoint_named_by_checkpoint_resume_is_restored_from_s3_onto_empty_hosts(mirror_runs, host_runs):
    """Before, new hosts found nothing at the named path: 'is not a complete checkpoint'."""
    reference = dict(losses(host_runs, "reference"))
    named = losses(mirror_runs["root"], "named")
    assert [s for s, _ in named] == [3, 4]
    for s, loss in named:
        assert loss == pytest.approx(reference[s], abs=1e-5), s
    log = (mirror_runs["root"] / "log-mirror-resumed-host1.txt").read_text()
    restores = re.findall(
        rf"^checkpoint: restored (step-\d+) from {MIRROR_URI}: \d+ bytes to host 1 ", log, re.MULTILINE
    )
    assert restores == ["step-00000003", "step-00000002", "step-00000002"]  # the last: the named job's


def test_a_named_checkpoint_that_is_not_complete_in_s3_is_refused_naming_the_complete_steps(mirror_runs):
    root = mirror_runs["root"]
    refused = json.loads((root / "torn" / "result.json").read_text())["refused"]
    assert refused == (
        f"checkpoint.resume: {root}/torn-host0/step-00000004: step 4 is not a complete checkpoint in {MIRROR_URI} "
        "(the complete steps there: 2, 3); nothing was resumed"
    )
    assert not list((root / "torn-host0").glob("step-*")) and not list((root / "torn-host1").glob("step-*"))
