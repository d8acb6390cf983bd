"""`launcher submit/status/logs/stop/list --backend k8s` through kubectl.

A stand-in kubectl (fake_kubectl.py) keeps the objects it is sent, so each test reads what a
cluster would hold afterwards. The failure tests also run this machine's real kubectl, which has
no cluster: its own words must reach the user once, in one line, with what to do.
"""

from __future__ import annotations

import base64
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from launcher.backends.k8s.kubectl import advice, first_message

from .fake_kubectl import positional
from .helpers import recipe_path

FAKE_KUBECTL = Path(__file__).resolve().parent / "fake_kubectl.py"
CLAIM = "tiny-cpu-launcher"
TWO_NODES = ["--set", "cluster.instance_count=2", "--set", "cluster.nproc_per_node=2"]


class Cluster:
    def __init__(self, state: Path):
        self.state = state

    @property
    def objects(self) -> dict[str, dict]:
        path = self.state / "objects.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def add(self, kind: str, namespace: str, name: str, spec: dict) -> None:
        objects = self.objects
        objects[f"{kind}/{namespace}/{name}"] = {
            "kind": kind,
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
            "spec": spec,
        }
        (self.state / "objects.json").write_text(json.dumps(objects))

    def calls(self) -> list[dict]:
        path = self.state / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def kinds(self) -> list[str]:
        return sorted(key.rsplit("/", 1)[0] for key in self.objects)


@pytest.fixture
def cluster(tmp_path, monkeypatch, home, fake_bundle) -> Cluster:
    state, bin_dir = tmp_path / "api", tmp_path / "bin"
    state.mkdir()
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_KUBECTL} "$@"\n')
    (bin_dir / "kubectl").chmod(0o755)
    monkeypatch.setenv("FAKE_KUBECTL_STATE", str(state))
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return Cluster(state)


def failure(result) -> list[str]:
    """The error of `submit --json` (JSON on stdout), which must be one line; stderr has nothing
    after announcing the job."""
    lines = result.err_lines
    assert lines[next(i for i, line in enumerate(lines) if line.startswith("job ")) + 1 :] == []
    return json.loads(result.out)["error"].splitlines()


def verbs(cluster) -> list[list[str]]:
    return [positional(c["argv"])[:2] for c in cluster.calls()]


def submit(cli, *options: str):
    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "k8s", "--json", *options)
    return result, (json.loads(result.out)["name"] if result.code == 0 else None)


def test_submit_creates_the_job_then_the_configmap_it_owns_in_the_current_namespace(cluster, cli, home):
    cluster.add("PersistentVolumeClaim", "default", CLAIM, {"accessModes": ["ReadWriteMany"]})
    result, name = submit(cli, *TWO_NODES)
    assert result.code == 0, result.err
    assert verbs(cluster) == [["config", "view"], ["get", "pvc"], ["create"], ["create"]]
    assert all(c["argv"][:2] == ["--namespace", "default"] for c in cluster.calls()[1:])
    objects = cluster.objects
    job, code = objects[f"PyTorchJob/default/{name}"], objects[f"ConfigMap/default/{name}-code"]
    assert code["metadata"]["ownerReferences"] == [
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": name, "uid": job["metadata"]["uid"]}
    ]
    assert json.loads((home / "jobs" / name / "job.json").read_text())["native_id"] == f"default/{name}"


def test_the_dry_run_shows_what_submit_creates(cluster, cli):
    cluster.add("PersistentVolumeClaim", "default", CLAIM, {"accessModes": ["ReadWriteMany"]})
    dry = cli("submit", recipe_path("tiny-cpu"), "--backend", "k8s", "--dry-run", *TWO_NODES)
    assert dry.code == 0 and cluster.calls() == []
    assert "# 1. checks that the claim tiny-cpu-launcher exists and is ReadWriteMany" in dry.out
    shown = [d for d in yaml.safe_load_all(dry.out[dry.out.index("---") :])]
    _, name = submit(cli, *TWO_NODES)
    created = {o["kind"]: o for o in cluster.objects.values() if o["kind"] != "PersistentVolumeClaim"}
    for document in shown:  # the same objects, with the namespace and owner uid filled in
        made = created[document["kind"]]
        assert (
            made["spec" if "spec" in document else "binaryData"].keys()
            == document.get("spec", document.get("binaryData")).keys()
        )


def test_k8s_namespace_reaches_every_object_and_every_call(cluster, cli):
    cluster.add("PersistentVolumeClaim", "team-a", CLAIM, {"accessModes": ["ReadWriteMany"]})
    result, name = submit(cli, "--set", "k8s.namespace=team-a", *TWO_NODES)
    assert result.code == 0, result.err
    assert all(c["argv"][:2] == ["--namespace", "team-a"] for c in cluster.calls())
    assert {o["metadata"]["namespace"] for o in cluster.objects.values()} == {"team-a"}


def test_a_missing_claim_is_one_line_that_says_what_to_create(cluster, cli):
    result, _ = submit(cli, *TWO_NODES)
    assert result.code == 2
    (line,) = failure(result)
    assert line.startswith("k8s.checkpoint_claim: no PersistentVolumeClaim tiny-cpu-launcher in namespace default;")
    assert "ReadWriteMany" in line and "k8s.storage_class" in line
    assert cluster.kinds() == []


def test_a_read_write_once_claim_is_refused_for_several_pods(cluster, cli):
    cluster.add("PersistentVolumeClaim", "default", CLAIM, {"accessModes": ["ReadWriteOnce"]})
    result, _ = submit(cli, *TWO_NODES)
    assert result.code == 2
    assert failure(result) == [
        "k8s.checkpoint_claim: tiny-cpu-launcher in namespace default is ReadWriteOnce, but the 2 pods of this job "
        "all mount it; use a ReadWriteMany claim"
    ]
    assert cluster.kinds() == ["PersistentVolumeClaim/default"]


def test_a_storage_class_creates_the_claim_once(cluster, cli):
    options = ("--set", "k8s.storage_class=efs-sc", "--set", "k8s.storage_size=200Gi", *TWO_NODES)
    assert submit(cli, *options)[0].code == 0
    claim = cluster.objects[f"PersistentVolumeClaim/default/{CLAIM}"]
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "storageClassName": "efs-sc",
        "resources": {"requests": {"storage": "200Gi"}},
    }
    assert "ownerReferences" not in claim["metadata"]  # checkpoints outlive the job
    assert submit(cli, *options)[0].code == 0  # the second job finds the claim and reuses it


def test_s3_data_is_a_read_only_mountpoint_volume_owned_by_the_job(cluster, cli):
    cluster.add("PersistentVolumeClaim", "default", CLAIM, {"accessModes": ["ReadWriteMany"]})
    result, name = submit(cli, "--set", "data.source=s3://bucket/tokens/tiny", "--set", "sagemaker.region=eu-west-1",
                          *TWO_NODES)  # fmt: skip
    assert result.code == 0, result.err
    objects = cluster.objects
    volume, claim = objects[f"PersistentVolume//{name}-data-0"], objects[f"PersistentVolumeClaim/default/{name}-data-0"]
    assert volume["spec"]["csi"] == {
        "driver": "s3.csi.aws.com",
        "volumeHandle": f"{name}-data-0",
        "volumeAttributes": {"bucketName": "bucket"},
    }
    assert volume["spec"]["mountOptions"] == ["read-only", "prefix tokens/tiny/", "region eu-west-1"]
    assert volume["spec"]["claimRef"] == {"namespace": "default", "name": f"{name}-data-0"}
    assert claim["spec"]["volumeName"] == f"{name}-data-0" and claim["spec"]["storageClassName"] == ""
    assert claim["metadata"]["ownerReferences"][0]["uid"] == objects[f"PyTorchJob/default/{name}"]["metadata"]["uid"]
    container = objects[f"PyTorchJob/default/{name}"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in container["containers"][0]["env"]}
    mounts = {m["mountPath"]: m for m in container["containers"][0]["volumeMounts"]}
    assert env["SM_CHANNEL_TRAIN"] == "/opt/launcher/data/train" and mounts["/opt/launcher/data/train"]["readOnly"]


def test_a_failure_after_the_job_was_created_deletes_it_again(cluster, cli, monkeypatch):
    cluster.add("PersistentVolumeClaim", "default", CLAIM, {"accessModes": ["ReadWriteMany"]})
    monkeypatch.setenv("FAKE_KUBECTL_FAIL", "kind: ConfigMap")
    result, _ = submit(cli, *TWO_NODES)
    assert result.code != 0 and len(failure(result)) == 1, result.err
    assert cluster.kinds() == ["PersistentVolumeClaim/default"]
    assert verbs(cluster)[-1] == ["delete", "pytorchjob"]


def test_status_logs_and_stop_use_the_jobs_namespace(cluster, cli):
    cluster.add("PersistentVolumeClaim", "team-a", CLAIM, {"accessModes": ["ReadWriteMany"]})
    _, name = submit(cli, "--set", "k8s.namespace=team-a", "--set", "data.source=s3://bucket/tokens", *TWO_NODES)
    status = json.loads(cli("status", name, "--json").out)
    assert (status["state"], status["details"]["namespace"]) == ("InProgress", "team-a")
    assert cli("logs", name).out.splitlines() == [f"logs of {name}-master-0"]
    assert cli("stop", name).code == 0
    assert cluster.kinds() == ["PersistentVolumeClaim/team-a"]  # the job, its ConfigMap and data volume are gone
    reads = [c["argv"] for c in cluster.calls() if "persistentvolume" not in c["argv"]][-4:]
    assert all(argv[:2] == ["--namespace", "team-a"] for argv in reads)


def test_a_trainjob_is_created_read_and_stopped_as_a_trainjob(cluster, cli, home):
    cluster.add("PersistentVolumeClaim", "team-a", CLAIM, {"accessModes": ["ReadWriteMany"]})
    result, name = submit(cli, "--set", "k8s.api=trainjob", "--set", "k8s.namespace=team-a", *TWO_NODES)
    assert result.code == 0, result.err
    job, code = cluster.objects[f"TrainJob/team-a/{name}"], cluster.objects[f"ConfigMap/team-a/{name}-code"]
    assert code["metadata"]["ownerReferences"] == [
        {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "name": name, "uid": job["metadata"]["uid"]}
    ]
    assert json.loads((home / "jobs" / name / "job.json").read_text())["native_id"] == f"trainjob/team-a/{name}"
    objects = cluster.objects  # the controller's status when it ends: Complete (trainer v2.3.0 trainjob_types.go)
    objects[f"TrainJob/team-a/{name}"]["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    (cluster.state / "objects.json").write_text(json.dumps(objects))
    assert json.loads(cli("status", name, "--json").out)["state"] == "Completed"
    assert cli("logs", name).out.splitlines() == [
        f"logs of jobset.sigs.k8s.io/jobset-name={name},batch.kubernetes.io/job-completion-index=0"
    ]
    assert cli("stop", name).code == 0
    assert cluster.kinds() == ["PersistentVolumeClaim/team-a"]
    assert [positional(c["argv"])[:2] for c in cluster.calls()][-2] == ["delete", "trainjobs.trainer.kubeflow.org"]


def test_an_unknown_job_is_one_line(cluster, cli):
    result = cli("status", "nobody-here", "--backend", "k8s")
    assert result.code == 2
    assert result.err_lines == [
        "no PyTorchJob named nobody-here in kubectl's current namespace; `launcher list --backend k8s` lists the jobs there"
    ]


@pytest.fixture
def no_cluster(tmp_path, monkeypatch, home):
    """This machine's real kubectl, with no kubeconfig: what a user without a cluster sees."""
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is not installed here; the failure texts below are the real tool's")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)


@pytest.mark.parametrize(
    "command",
    [
        ("status", "tiny-cpu-x", "--backend", "k8s"),
        ("logs", "tiny-cpu-x", "--backend", "k8s"),
        ("stop", "tiny-cpu-x", "--backend", "k8s"),
        ("list", "--backend", "k8s"),
    ],
)
def test_without_a_cluster_every_command_says_so_in_one_line(no_cluster, cli, command):
    result = cli(*command)
    assert result.code != 0
    (line,) = result.err_lines
    assert "kubectl failed: The connection to the server localhost:8080 was refused" in line
    assert line.count("refused") == 1 and "E11" not in line and "memcache" not in line
    assert line.endswith(
        "set KUBECONFIG to your cluster's kubeconfig or pick a context (kubectl config use-context NAME)"
    )


def test_submit_without_a_cluster_is_one_line(no_cluster, cli, fake_bundle):
    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "k8s", "--json")
    (line,) = failure(result)
    assert line.startswith("finding the namespace: kubectl failed: error: current-context must exist")


@pytest.mark.parametrize(
    "output, message, fix",
    [
        ('error: the server doesn\'t have a resource type "pytorchjob"', None, "install the Kubeflow training operator"),
        ("error: You must be logged in to the server (Unauthorized)", None, "refresh your cluster credentials"),
        ('Error from server (Forbidden): pytorchjobs.kubeflow.org is forbidden: User "u" cannot list', None, "ask your"),
        ('E1130 07:57:04.88 24727 memcache.go:265] "Unhandled Error" err="dial tcp: lookup eks.example: no such host"',
         "dial tcp: lookup eks.example: no such host", "set KUBECONFIG"),
    ],
)  # fmt: skip
def test_kubectl_messages_get_the_fix_that_applies(output, message, fix):
    assert first_message(output) == (message or output)
    assert advice(first_message(output)).startswith(fix)


def test_an_fp8_job_gets_its_wheel_in_config_map_parts_that_join_to_the_pinned_bytes(cluster, cli, torchao_wheel):
    from launcher.backends.wheelhouse import pinned

    cluster.add("PersistentVolumeClaim", "default", CLAIM, {"accessModes": ["ReadWriteMany"]})
    result, name = submit(cli, "--set", "precision.fp8=true", *TWO_NODES)
    assert result.code == 0, result.err
    objects = cluster.objects
    uid = objects[f"PyTorchJob/default/{name}"]["metadata"]["uid"]
    parts = [objects[f"ConfigMap/default/{name}-wheel-{i}"] for i in range(4)]  # 3,372,585 bytes in 1 MiB parts
    assert f"ConfigMap/default/{name}-wheel-4" not in objects
    assert all(p["immutable"] and p["metadata"]["ownerReferences"][0]["uid"] == uid for p in parts)
    ((key, value),) = parts[0]["binaryData"].items()
    assert key == f"{torchao_wheel.name}.part000"
    joined = b"".join(base64.b64decode(v) for p in parts for v in p["binaryData"].values())
    assert joined == torchao_wheel.read_bytes()
    pod = objects[f"PyTorchJob/default/{name}"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "wheels"]
    assert [s["configMap"]["name"] for s in volume["projected"]["sources"]] == [f"{name}-wheel-{i}" for i in range(4)]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["LAUNCHER_WHEEL_SHA256"] == pinned("torchao").sha256 and env["LAUNCHER_WHEELHOUSE"] in {
        m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == "wheels" and m["readOnly"]
    }
    assert cli("stop", name).code == 0
    assert cluster.kinds() == ["PersistentVolumeClaim/default"]  # the parts went with the job


def test_a_part_the_api_server_refuses_is_one_line_and_leaves_no_job(cluster, cli, torchao_wheel, monkeypatch):
    import launcher.backends.k8s.wheels

    # Parts of 2 MiB: the API server refuses each ConfigMap over 1 MiB (ValidateConfigMap).
    monkeypatch.setattr(launcher.backends.k8s.wheels, "MAX_CONFIG_MAP_BYTES", 2 * 1024 * 1024)
    cluster.add("PersistentVolumeClaim", "default", CLAIM, {"accessModes": ["ReadWriteMany"]})
    result, _ = submit(cli, "--set", "precision.fp8=true", *TWO_NODES)
    assert result.code != 0
    (line,) = failure(result)
    assert "is invalid: []: Too long: must have at most 1048576 bytes" in line, line
    assert cluster.kinds() == ["PersistentVolumeClaim/default"]  # the job and what it owned, deleted again
