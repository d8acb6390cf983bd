"""The PyTorchJob `launcher submit --backend k8s` creates, run as the training operator runs it.

`launcher submit` talks to a stand-in kubectl (tests/backends/fake_kubectl.py) that keeps what
it is sent; the ConfigMap and PyTorchJob it received then run on two simulated pods
(k8s_sim.py): `<job>-master-0` and `<job>-worker-0`, each with its own network, hostname, root
and the operator's environment for nprocPerNode 2, sharing the checkpoint claim. tiny-cpu
(2 pods x 2 gloo processes) must train to its last step and write its final checkpoint there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests import REPO

from .k8s_sim import PyTorchJobSim, operator_environment

FAKE_KUBECTL = REPO / "tests" / "backends" / "fake_kubectl.py"
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
CLAIM = "tiny-cpu-launcher"
STEPS = 2
RUN_TIMEOUT_S = 120.0

pytestmark = [pytest.mark.torchrun, pytest.mark.engines]


def settings() -> list[str]:
    """tiny-cpu as a CPU user runs it on Kubernetes: any node ('local' size), 2 pods x 2 processes."""
    items = [
        "cluster.instance_count=2",
        "cluster.nproc_per_node=2",
        "cluster.image=sim.local/launcher-cpu:test",
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


def test_tiny_cpu_trains_to_the_end_on_two_pods(cli, cluster, image, tmp_path):
    name, documents = submitted(cli, cluster)
    claim = tmp_path / "claim"
    sim = PyTorchJobSim(image=image, workdir=tmp_path / "k8s", claims={CLAIM: claim})
    with sim.start(documents) as run:
        outcome = run.wait(timeout_s=RUN_TIMEOUT_S)
    assert outcome.status == "Succeeded", outcome.report()
    assert outcome.exit_codes == {f"{name}-master-0": 0, f"{name}-worker-0": 0}
    metrics = [json.loads(line) for line in (claim / "jobs" / name / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("step", 0) for m in metrics) == STEPS, metrics[-3:]
    checkpoints = sorted(p.name for p in (claim / "checkpoints" / name).iterdir())
    assert f"step-{STEPS:08d}" in checkpoints, checkpoints
