"""The Slurm backend against a real Slurm cluster: two slurmd "nodes" on this machine.

`launcher submit --backend slurm` calls the real sbatch; tiny-cpu trains in FP8 on 2 nodes x 1
process (gloo, torchrun's c10d rendezvous on the first node). The job's own Python comes from
`slurm.venv`, as it would on a cluster without containers: this test's environment without
torchao (tests/engines/image.py), so each node's bootstrap installs it from the wheelhouse that
submit put on the shared directory.
The cluster (tests/engines/slurm_cluster.py) needs root and Debian's slurm-wlm and munge.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.contract.checkpoint_dirs import complete_checkpoints
from tests import REPO
from tests.progress import communicate_while_growing, wait_while_growing

from .image import build_image
from .slurm_cluster import SlurmCluster

RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
STEPS = 20  # enough that USR1 lands well before the end, even on a fast machine
SPARSE_SAVES = 20  # the stalled-rank job saves at 20 and 40: 19 compute-only steps after the first
JOB_TIMEOUT_S = 240.0  # the longest a job's log may stay silent (start-up on a loaded machine)

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def venv_without_torchao(tmp_path_factory, torchao_wheel) -> Path:
    """slurm.venv: this machine's packages without torchao, read by both nodes (shared, as on a
    cluster); its own, so what the jobs install could not reach the other tests' image."""
    return build_image(Path(sys.prefix), tmp_path_factory.mktemp("slurm-venv") / "venv")


def job_settings(*extra: str) -> list[str]:
    """tiny-cpu on 2 nodes x 1 process, small enough for 2 shared cores, a checkpoint every 2 steps.
    One process per node: torchrun (one srun task per node) maps the ranks within a node, and each
    rank more costs every run ~10 s of CPU to start (torch's imports and first dispatches)."""
    sets = [
        "cluster.instance_count=2",
        "cluster.nproc_per_node=1",
        "parallel.tensor=1",
        f"training.steps={STEPS}",
        "training.seq_len=32",
        "training.global_batch_size=4",
        "checkpoint.every_steps=2",
        "precision.fp8=true",
        *extra,
    ]
    return [arg for item in sets for arg in ("--set", item)]


@pytest.fixture
def submit(slurm, home, cli, venv_without_torchao):
    """`launcher submit tiny-cpu --backend slurm ...`; returns (job name, Slurm job id, its log).

    `home` (a private $LAUNCHER_HOME) is also the cluster's shared directory: both nodes are this host."""

    def run(*extra: str) -> tuple[str, str, Path]:
        venv = ["--set", f"slurm.venv={venv_without_torchao}"]
        result = cli("submit", RECIPE, "--backend", "slurm", "--json", *job_settings(*extra), *venv)
        assert result.code == 0, f"launcher submit failed:\n{result.err}"
        name = json.loads(result.out)["name"]
        job_id = json.loads((home / "jobs" / name / "job.json").read_text())["native_id"]
        assert job_id and job_id.isdigit(), job_id
        return name, job_id, home / "jobs" / name / f"slurm-{job_id}.out"

    return run


def wait_for_log(log: Path, pattern: str, *, timeout: float = JOB_TIMEOUT_S, cluster: SlurmCluster, job_id: str) -> str:
    """The log's text once `pattern` appears in it; fails with the log and job state if the job
    ends without it, or if its log stays silent for `timeout` s (on progress, not in total: a
    busy machine slows every step but stops none)."""
    deadline, seen = time.monotonic() + timeout, -1
    while True:
        text = log.read_text(errors="replace") if log.exists() else ""
        if re.search(pattern, text, re.MULTILINE):
            return text
        if len(text) != seen:
            deadline, seen = time.monotonic() + timeout, len(text)
        state = cluster.job_field(job_id, "JobState")
        if time.monotonic() > deadline or state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            pytest.fail(f"no /{pattern}/ in {log} (Slurm job {job_id} is {state}):\n{text[-3000:]}")
        time.sleep(0.2)


def follow_logs(name: str) -> subprocess.Popen:
    """`launcher logs NAME --follow` as a user runs it, in its own process."""
    return subprocess.Popen(
        [sys.executable, "-m", "launcher", "logs", name, "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )


def resumed_from(log_text: str) -> list[int]:
    return [int(step) for step in re.findall(r"^start job=.* resumed_from_step=(\d+)", log_text, re.MULTILINE)]


@pytest.mark.timeout(1800)  # a last resort: every wait below is on progress
def test_a_two_node_job_checkpoints_on_usr1_requeues_resumes_and_trains_to_the_end(slurm, submit, cli, home):
    name, job_id, log = submit()
    follower = follow_logs(name)
    try:
        # The first periodic checkpoint is written: now Slurm's time-limit warning arrives.
        wait_for_log(log, r"^checkpoint step=2 ", cluster=slurm, job_id=job_id)
        slurm.run("scancel", "--signal=USR1", "--batch", job_id)
        out, err = communicate_while_growing(follower, log, quiet_limit_s=JOB_TIMEOUT_S)
    finally:
        follower.kill()
    assert follower.returncode == 0, err

    # logs --follow printed the whole log, both runs, and ended when the job did.
    assert out == log.read_text(), "logs --follow did not print exactly the job's log"
    assert "launcher: USR1 from Slurm" in out and "interrupted by SIGTERM after step" in out, out[-3000:]
    assert f"launcher: requeueing Slurm job {job_id}" in out, out[-3000:]
    (saved_at,) = [int(s) for s in re.findall(r"^interrupted by SIGTERM after step (\d+); checkpoint saved", out, re.M)]
    starts = resumed_from(out)
    assert starts == [0, saved_at], f"resumed_from_step per run: {starts}, saved at {saved_at}\n{out[-3000:]}"
    assert "world_size=2" in out and "(run 2)" in out
    # Each node of each run installed torchao from the shared wheelhouse into a directory of its own.
    assert out.count("bootstrap: installed torchao==0.18.0 offline into ") == 4, out[-3000:]
    assert len(re.findall(r"^start job=.* fp8=tensorwise ", out, re.MULTILINE)) == 2
    second_run = out[out.index("(run 2)") :]
    steps = [int(s) for s in re.findall(r"^metrics step=(\d+) ", second_run, re.MULTILINE)]
    assert steps == list(range(starts[1] + 1, STEPS + 1)), f"the second run's steps: {steps}"

    status = json.loads(cli("status", name, "--json").out)
    assert (status["state"], status["exit_code"], status["secondary"]) == ("Completed", 0, "COMPLETED"), status
    assert status["details"]["restarts"] == 1 and status["details"]["nodes"] == "node[1-2]", status["details"]
    assert status["metrics"]["step"] == STEPS
    assert (home / "checkpoints" / "tiny-cpu" / name / f"step-{STEPS:08d}").is_dir()
    assert (home / "jobs" / name / "exit_code").read_text().strip() == "0"

    listed = cli("list", "--backend", "slurm")
    assert listed.code == 0 and re.search(rf"^{name}\s+slurm\s+Completed\s+COMPLETED", listed.out, re.MULTILINE), (
        listed.out
    )


def job_workers(job_id: str) -> dict[int, int]:
    """{rank: pid} of Slurm job `job_id`'s training processes (both nodes are this host), each
    checked to be that job's before it is signalled: Slurm's SLURM_JOB_ID, and torchrun's RANK and
    TORCHELASTIC_RUN_ID (which its agent does not have) in its environment, train.py in its argv."""
    workers = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            raw = (entry / "environ").read_bytes().decode(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
        if b"entrypoints/train.py" not in argv:
            continue
        environment = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
        if environment.get("SLURM_JOB_ID") == job_id and "TORCHELASTIC_RUN_ID" in environment and "RANK" in environment:
            workers[int(environment["RANK"])] = int(entry.name)
    return workers


@pytest.mark.timeout(1200)  # a last resort: every wait below is on progress
def test_a_stalled_rank_is_named_and_torchrun_restarts_it_inside_the_allocation(slurm, submit, cli, home):
    """Rank 1 of a one-node, 2-process job is stopped for good (SIGSTOP). Rank 0's watchdog fires:
    its stacks are on disk, the failure names rank 1 and its host, it exits with 5, and torchrun
    (--max-restarts=1 on Slurm, which reruns a job only after node failure, preemption or an
    explicit requeue, never after its script failed: sbatch(1) --requeue) restarts the workers,
    which resume from the newest checkpoint and train to the end. The job COMPLETED, never requeued.

    The stop lands in a step's compute, the path this test is for: saves at steps 20 and 40 only,
    and the stop once step 20's save is written. Rank 0 prints that line when every rank has
    written its files (entrypoints/checkpoint.py `finish_pending`), just before the step's own save
    is due: with a save every 2 steps the stop came right before the next save's collectives,
    which then held rank 0 to the collective timeout (CI, 2026-12-04). Rank 0 now names a peer
    stopped during a save at the step's limit (tests/entrypoints/test_watchdog.py)."""
    steps = 2 * SPARSE_SAVES
    watchdog = ["training.watchdog.min_stall_s=10", "training.watchdog.stall_factor=5"]  # defaults: 60 s and 10
    saves = [f"training.steps={steps}", f"checkpoint.every_steps={SPARSE_SAVES}"]
    name, job_id, log = submit(
        "cluster.instance_count=1", "cluster.nproc_per_node=2", "precision.fp8=false", *watchdog, *saves
    )
    follower = follow_logs(name)
    try:
        wait_for_log(log, rf"^checkpoint step={SPARSE_SAVES} ", cluster=slurm, job_id=job_id)
        workers = job_workers(job_id)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGSTOP)
        stacks = home / "jobs" / name / "stacks" / "rank-0.txt"
        wait_while_growing(
            lambda: stacks.exists() and not Path(f"/proc/{workers[0]}").exists(), log, "rank 0's stacks and exit"
        )
        os.kill(workers[1], signal.SIGKILL)  # what torchrun does itself to a worker that ignores its SIGTERM
        out, err = communicate_while_growing(follower, log, quiet_limit_s=JOB_TIMEOUT_S)
    finally:
        follower.kill()
    assert follower.returncode == 0, err

    stuck = f"stuck: rank 1 on {socket.gethostname()}"
    assert "error: watchdog: no step completed for " in out and stuck in out, out[-3000:]
    assert "failed (exitcode: 5)" in out, out[-3000:]
    assert stuck in stacks.read_text() and "Thread 0x" in stacks.read_text()
    starts = resumed_from(out)
    assert starts == [0, SPARSE_SAVES], f"resumed_from_step per start: {starts}"
    restarted = out[out.rindex("resumed_from_step=") :]
    ran = [int(s) for s in re.findall(r"^metrics step=(\d+) ", restarted, re.MULTILINE)]
    assert ran == list(range(SPARSE_SAVES + 1, steps + 1)), f"the restarted workers' steps: {ran}"
    assert "requeueing" not in out
    status = json.loads(cli("status", name, "--json").out)
    assert (status["state"], status["exit_code"], status["secondary"]) == ("Completed", 0, "COMPLETED"), status
    assert "restarts" not in status["details"], status["details"]


@pytest.mark.timeout(1200)  # a last resort: every wait below is on progress
def test_stop_cancels_the_job_after_it_saves_a_checkpoint(slurm, submit, cli, home):
    """`launcher stop` sends SIGTERM to the training step only, waits for the final save, and the
    job ends CANCELLED by its own script: the batch shell is never signalled while training runs."""
    # One node is enough to show the SIGTERM reaching the workers, and starts faster.
    name, job_id, log = submit(f"training.steps={STEPS * 10}", "cluster.instance_count=1")
    wait_for_log(log, r"^metrics step=1 ", cluster=slurm, job_id=job_id)
    stopped = cli("stop", name)
    assert stopped.code == 0, stopped.err
    assert stopped.out.startswith(f"{name}  [slurm]  Stopped (CANCELLED)"), stopped.out
    text = log.read_text(errors="replace")  # the job is over: its log is whole
    (saved_at,) = [
        int(s) for s in re.findall(r"^interrupted by SIGTERM after step (\d+); checkpoint saved", text, re.M)
    ]
    assert f"launcher: training stopped by launcher stop; cancelling Slurm job {job_id}" in text, text[-3000:]
    assert "launcher: SIGTERM from Slurm" not in text and "requeueing" not in text, text[-3000:]
    lineage = home / "checkpoints" / "tiny-cpu" / name
    assert complete_checkpoints(lineage)[-1] == (saved_at, lineage / f"step-{saved_at:08d}"), sorted(lineage.iterdir())
    status = json.loads(cli("status", name, "--json").out)
    assert (status["state"], status["secondary"], status["failure_reason"]) == ("Stopped", "CANCELLED", None), status
    assert "restarts" not in status["details"], status["details"]
    assert slurm.job_field(job_id, "JobState") == "CANCELLED"


# tiny-cpu's model as a GPU job on one 8-GPU node (rendered and handed to sbatch; it never runs).
GRES_REFUSED = "sbatch: error: Invalid generic resource (gres) specification"
GPU_JOB = [
    "cluster.device=cuda",
    "cluster.instance_type=ml.p5.48xlarge",
    "cluster.nproc_per_node=8",
    "precision.dtype=bf16",
]


def test_sbatch_refusing_the_job_is_one_line_with_slurms_reason(slurm, home, cli, tmp_path):
    result = cli("submit", RECIPE, "--backend", "slurm", *job_settings("slurm.partition=nosuch"))
    assert result.code == 3  # the engine refused it
    assert result.err_lines[-1].startswith("submitting tiny-cpu-"), result.err
    assert "sbatch failed: sbatch: error: invalid partition specified: nosuch" in result.err_lines[-1]
    # A GPU job's script (gpu_request: none) against this cluster, which has no GRES, as HyperPod's
    # default Slurm: sbatch --test-only checks a job against the cluster and submits nothing.
    # --exclusive --mem=0 alone is a job it takes; the directive gpus-per-node or gres adds
    # (tests/backends/test_slurm_backend.py) gets HyperPod's answer.
    gpu = [arg for item in GPU_JOB for arg in ("--set", item)]
    dry = cli("submit", RECIPE, "--backend", "slurm", "--dry-run", "--json", *gpu, "--set", "slurm.gpu_request=none")
    script = tmp_path / "job.sbatch"
    script.write_text(json.loads(dry.out)["script"])
    assert "#SBATCH --exclusive\n#SBATCH --mem=0\n#SBATCH --time=" in script.read_text()
    for added, answer in [
        ((), " to start at "),
        (("--gpus-per-node=8",), GRES_REFUSED),
        (("--gres=gpu:8",), GRES_REFUSED),
    ]:
        tried = slurm.run("sbatch", "--test-only", "--output=/dev/null", *added, str(script), check=False)
        assert (tried.returncode == 0, answer in tried.stderr) == (not added, True), (added, tried.stderr)


def test_status_of_a_job_id_slurm_does_not_know_is_one_line(slurm, home, cli):
    result = cli("status", "999999", "--backend", "slurm")
    assert result.code == 2
    assert result.err_lines == [
        "Slurm does not know job 999999 (it never existed, or it ended over MinJobAge ago); check the id with squeue or sacct"
    ]


def test_status_of_a_job_not_submitted_from_here_is_found_by_its_id(slurm, home, cli):
    job_id = slurm.run("sbatch", "--parsable", "--output=/dev/null", "--wrap", "exit 3").stdout.strip()
    deadline = time.monotonic() + 60
    while slurm.job_field(job_id, "JobState") != "FAILED" and time.monotonic() < deadline:
        time.sleep(0.2)
    status = json.loads(cli("status", job_id, "--backend", "slurm", "--json").out)
    assert (status["state"], status["exit_code"], status["secondary"]) == ("Failed", 3, "FAILED"), status
    assert status["failure_reason"].startswith(f"Slurm job {job_id} ended FAILED (exit code 3:0, NonZeroExitCode)")
