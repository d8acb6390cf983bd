"""The PyTorchJob `launcher submit --backend k8s` creates, run as the training operator runs it.

`launcher submit` talks to a stand-in kubectl (tests/backends/fake_kubectl.py) that keeps what
it is sent; the ConfigMap and PyTorchJob it received then run on two simulated pods
(k8s_sim.py): `<job>-master-0` and `<job>-worker-0`, each with its own network, hostname, root
and the operator's environment for nprocPerNode 2, sharing the checkpoint claim. tiny-cpu
(2 pods x 2 gloo processes) trains there in FP8 until the pods are deleted as the kubelet deletes
them (SIGTERM to each container's PID 1, SIGKILL after the pod's terminationGracePeriodSeconds):
the final checkpoint must land on the claim, complete. The image has no torchao (image.py): each
pod's bootstrap joins the wheel's ConfigMap parts from the projected volume, checks its sha256
and installs it offline.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from launcher.contract.checkpoint_dirs import complete_checkpoints
from tests import REPO

from .k8s_sim import PyTorchJobSim, operator_environment

FAKE_KUBECTL = REPO / "tests" / "backends" / "fake_kubectl.py"
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
CLAIM = "tiny-cpu-launcher"
STEPS = 200  # more than it trains before the stop
RUN_TIMEOUT_S = 120.0

pytestmark = [pytest.mark.torchrun, pytest.mark.engines]


def settings() -> list[str]:
    """tiny-cpu as a CPU user runs it on Kubernetes: any node ('local' size), 2 pods x 2 processes, FP8."""
    items = [
        "cluster.instance_count=2",
        "cluster.nproc_per_node=2",
        "cluster.image=sim.local/launcher-cpu:test",
        "precision.fp8=true",  # torchao from the job's ConfigMap parts: the image has none
        f"training.steps={STEPS}",
        "training.seq_len=64",
        "training.global_batch_size=4",
        "checkpoint.every_steps=2",
    ]
    return [arg for item in items for arg in ("--set", item)]


@pytest.fixture
def cluster(tmp_path, monkeypatch) -> Path:
    """kubectl on PATH answering from a state directory that holds the ReadWriteMany claim."""
    state, bin_dir = tmp_path / "api", tmp_path / "bin"
    state.mkdir()
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_KUBECTL} "$@"\n')
    (bin_dir / "kubectl").chmod(0o755)
    claim = {"kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM, "namespace": "default", "uid": "c1"},
             "spec": {"accessModes": ["ReadWriteMany"]}}  # fmt: skip
    (state / "objects.json").write_text(json.dumps({f"PersistentVolumeClaim/default/{CLAIM}": claim}))
    monkeypatch.setenv("FAKE_KUBECTL_STATE", str(state))
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin")
    monkeypatch.setenv("LAUNCHER_HOME", str(tmp_path / "launcher-home"))
    return state


def submitted(cli, state: Path) -> tuple[str, list[dict]]:
    result = cli("submit", RECIPE, "--backend", "k8s", "--json", *settings())
    assert result.code == 0, f"launcher submit failed:\n{result.err}"
    name = json.loads(result.out)["name"]
    objects = json.loads((state / "objects.json").read_text()).values()
    return name, [o for o in objects if o["kind"] in ("ConfigMap", "PyTorchJob")]


def test_the_operator_environment_is_node_level_rank_and_process_level_world_size(cli, cluster):
    name, documents = submitted(cli, cluster)
    (job,) = [d for d in documents if d["kind"] == "PyTorchJob"]
    worker = dict(operator_environment(job, "worker", 0))
    assert worker == {
        "PYTHONUNBUFFERED": "1",
        "MASTER_ADDR": f"{name}-master-0",
        "PET_MASTER_ADDR": f"{name}-master-0",
        "MASTER_PORT": "29500",  # the container port named pytorchjob-port: the rendezvous port
        "PET_MASTER_PORT": "29500",
        "WORLD_SIZE": "4",
        "RANK": "1",
        "PET_NODE_RANK": "1",
        "PET_NPROC_PER_NODE": "2",
        "PET_NNODES": "2",
    }
    args = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"]
    assert f"--rdzv-endpoint={worker['MASTER_ADDR']}:{worker['MASTER_PORT']}" in args


def logged_steps(path: Path) -> list[int]:
    """The steps in metrics.jsonl so far: whole lines only (rank 0 may be writing the next one)."""
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line)["step"] for line in lines if '"step"' in line]


def torn_down_by_torch(code: int, log: str) -> bool:
    """torchrun's own crash after its SignalException, in the interpreter's teardown: seen once
    here (2026-12-02, on a loaded 2-core machine) as "terminate called without an active exception",
    then SIGABRT's and SIGSEGV's fatal errors with no Python frame on the stack, exit 139. The
    workers had saved by then; the stop is the same to the launcher (a Failed pod, no restart)."""
    after_stop = log.rpartition("SignalException: Process 1 got signal: 15")[2]
    return code in (128 + 6, 128 + 11) and "terminate called without an active exception" in after_stop


def test_tiny_cpu_trains_on_two_pods_and_deleting_them_lands_a_final_checkpoint(cli, cluster, image, tmp_path):
    name, documents = submitted(cli, cluster)
    (job,) = [d for d in documents if d["kind"] == "PyTorchJob"]
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    # Not Kubernetes' 30 s default: the job's grace (SageMaker's 120 s with no predicted step here).
    assert pod["terminationGracePeriodSeconds"] == 120
    claim = tmp_path / "claim"
    metrics = claim / "jobs" / name / "metrics.jsonl"
    sim = PyTorchJobSim(image=image, workdir=tmp_path / "k8s", claims={CLAIM: claim})
    with sim.start(documents) as run:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not logged_steps(metrics) and run.running() and time.monotonic() < deadline:
            time.sleep(0.2)  # until it trains, so the stop interrupts real work
        assert logged_steps(metrics), run.wait(timeout_s=0).report()
        outcome = run.stop(timeout_s=RUN_TIMEOUT_S)
    # torchrun, PID 1 by the bootstrap's exec, passed SIGTERM to the workers, which saved and exited
    # 143; torchrun itself then ends with its SignalException, exit 1 (torch/distributed/elastic/
    # multiprocessing/api.py, _terminate_process_handler), before the grace's SIGKILL (137).
    for pod, code in outcome.exit_codes.items():
        assert code == 1 or torn_down_by_torch(code, outcome.logs[pod]), outcome.report()
    assert "SignalException: Process 1 got signal: 15" in outcome.logs[f"{name}-master-0"]
    last = logged_steps(metrics)[-1]
    assert f"interrupted by SIGTERM after step {last}; checkpoint saved" in outcome.logs[f"{name}-master-0"]
    for log in outcome.logs.values():  # each pod joined the parts, checked them, and installed offline
        assert "bootstrap: installed torchao==0.18.0 offline into /tmp/launcher-wheels-" in log, outcome.report()
    assert " fp8=tensorwise " in outcome.logs[f"{name}-master-0"], outcome.report()
    lineage = claim / "checkpoints" / name
    assert complete_checkpoints(lineage)[-1] == (last, lineage / f"step-{last:08d}"), sorted(lineage.iterdir())
