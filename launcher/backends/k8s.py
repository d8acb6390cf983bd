"""The Kubernetes backend: a Kubeflow PyTorchJob (training-operator v1) and its code ConfigMap.

The manifest is built as data and dumped with PyYAML, so recipe strings stay string values.
The bundle travels in a ConfigMap; the container unpacks it and execs the spec's torchrun argv.
Checkpoints and outputs live on a PersistentVolumeClaim named after the recipe, so a new job
of the same recipe resumes from the last one's checkpoints.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from collections.abc import Iterator

import yaml

from launcher.backends.base import Backend, Capabilities, JobRef, JobStatus, Rendering, Transition, utc_now
from launcher.backends.images import training_image
from launcher.backends.tools import ToolFailed, run_tool, stream_tool
from launcher.bundle import ARCHIVE_NAME, Bundle, unpack_entrypoint
from launcher.errors import UsageError
from launcher.spec import JobSpec, Placement

VOLUME_ROOT = "/launcher"
BUNDLE_DIR = "/opt/launcher/bundle"
CODE_DIR = "/opt/launcher/code"
MANAGED_BY = {"app.kubernetes.io/managed-by": "launcher"}
# Pod names are `<job>-worker-<index>` and need DNS labels of at most 63 characters.
MAX_NAME = 52
EFA_HUGEPAGES = "5120Mi"  # libfabric's EFA provider registers its buffers in 2 MiB huge pages


def dns_label(text: str) -> str:
    return re.sub(r"[^a-z0-9-]", "-", text.lower()).strip("-")[:63] or "launcher"


def claim_name(recipe_name: str) -> str:
    return dns_label(f"{recipe_name}-launcher")


def pytorchjob_manifest(spec: JobSpec, bundle: Bundle) -> list[dict]:
    """[ConfigMap with the bundle, PyTorchJob]: the documents `kubectl apply` gets."""
    r = spec.resources
    labels = {**MANAGED_BY, "launcher/recipe": dns_label(spec.recipe_name), "launcher/job": spec.name}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{spec.name}-code", "labels": labels},
        "binaryData": {ARCHIVE_NAME: base64.b64encode(bundle.data).decode()},
    }
    limits: dict[str, str | int] = {}
    if r.device == "cuda":
        limits["nvidia.com/gpu"] = r.procs_per_node
    if r.has_efa:
        limits["vpc.amazonaws.com/efa"] = r.efa_interfaces
        limits["hugepages-2Mi"] = EFA_HUGEPAGES
    env = [{"name": k, "value": v} for k, v in spec.environment]
    env += [
        {"name": "LAUNCHER_BUNDLE", "value": f"{BUNDLE_DIR}/{ARCHIVE_NAME}"},
        {"name": "LAUNCHER_CODE", "value": CODE_DIR},
        {"name": "LAUNCHER_JOB_NAME", "value": spec.name},
    ]
    mounts = [
        {"name": "bundle", "mountPath": BUNDLE_DIR, "readOnly": True},
        {"name": "launcher", "mountPath": VOLUME_ROOT},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes = [
        {"name": "bundle", "configMap": {"name": f"{spec.name}-code"}},
        {"name": "launcher", "persistentVolumeClaim": {"claimName": claim_name(spec.recipe_name)}},
        # NCCL and data-loader workers share tensors through /dev/shm; the default is 64 MiB.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    for i, data in enumerate(spec.inputs):
        mounts.append({"name": f"data-{i}", "mountPath": data.container_path, "readOnly": True})
        volumes.append({"name": f"data-{i}", "hostPath": {"path": data.source}})
    container = {
        "name": "pytorch",  # the training operator finds the container by this name
        "image": spec.image,
        "command": unpack_entrypoint(),
        "args": list(spec.command),
        "env": env,
        "volumeMounts": mounts,
    }
    if limits:
        container["resources"] = {"limits": limits, "requests": dict(limits)}
    pod = {"metadata": {"labels": labels}, "spec": {"containers": [container], "volumes": volumes}}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": pod}}
    if r.instance_count > 1:
        replicas["Worker"] = {"replicas": r.instance_count - 1, "restartPolicy": "Never", "template": pod}
    annotations = {"launcher/tags": json.dumps(dict(spec.tags), sort_keys=True)} if spec.tags else {}
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": spec.name, "labels": labels, **({"annotations": annotations} if annotations else {})},
        "spec": {
            "runPolicy": {
                "cleanPodPolicy": "None",
                "backoffLimit": spec.retries,
                "activeDeadlineSeconds": spec.max_run_s,
            },
            "nprocPerNode": str(r.procs_per_node),
            "pytorchReplicaSpecs": replicas,
        },
    }
    return [config_map, job]


class _Dumper(yaml.SafeDumper):
    """No &anchors/*aliases for shared dicts: every document reads on its own."""

    def ignore_aliases(self, data) -> bool:
        return True


def dump(documents: list[dict]) -> str:
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=120)


class KubernetesBackend(Backend):
    name = "k8s"
    capabilities = Capabilities(multi_node=True, efa=True, time_limit=True)
    max_name_length = MAX_NAME

    def placement(self, recipe, name: str, lineage: str | None = None) -> Placement:
        return Placement(
            checkpoint_dir=f"{VOLUME_ROOT}/checkpoints/{lineage or name}",
            output_dir=f"{VOLUME_ROOT}/jobs/{name}",
            # The operator gives each replica a headless Service named after its pod.
            rendezvous_host=f"{name}-master-0",
            image=training_image(recipe),
        )

    def _render(self, spec: JobSpec) -> Rendering:
        bundle = Bundle.build(spec.resolved_json)
        documents = pytorchjob_manifest(spec, bundle)
        text = dump(documents)
        data = {"manifest": documents, "bundle": bundle.describe()}
        return Rendering(spec=spec, data=data, text=text, payload={"bundle": bundle})

    def _submit(self, rendering: Rendering) -> JobRef:
        spec = rendering.spec
        run_tool(["kubectl", "apply", "-f", "-"], input=rendering.text, action=f"creating PyTorchJob {spec.name}")
        return JobRef(name=spec.name, backend=self.name, native_id=spec.name, created=utc_now())

    def _get(self, ref: JobRef) -> dict:
        try:
            out = run_tool(["kubectl", "get", "pytorchjob", ref.name, "-o", "json"], action=f"reading {ref.name}")
        except ToolFailed as failure:
            if "NotFound" in failure.output:
                raise UsageError(f"no PyTorchJob named {ref.name} in the current namespace") from None
            raise
        return json.loads(out)

    def _status(self, ref: JobRef) -> JobStatus:
        return status_from_pytorchjob(self._get(ref))

    def _logs(self, ref: JobRef, *, follow: bool, poll_s: float) -> Iterator[str]:
        # `kubectl logs --follow` returns when the master container exits.
        argv = ["kubectl", "logs", *(["--follow"] if follow else []), f"{ref.name}-master-0", "-c", "pytorch"]
        return stream_tool(argv, action=f"reading the logs of {ref.name}")

    def _stop(self, ref: JobRef, *, grace_s: float) -> JobStatus:
        status = self._status(ref)
        run_tool(
            ["kubectl", "delete", "pytorchjob", ref.name, f"--grace-period={int(grace_s)}"],
            action=f"deleting {ref.name}",
        )
        run_tool(["kubectl", "delete", "configmap", f"{ref.name}-code", "--ignore-not-found"], action="cleaning up")
        return dataclasses.replace(status, state="Stopped", secondary="Deleted")

    def _list(self, *, region: str | None, limit: int) -> list[JobStatus]:
        selector = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
        out = run_tool(["kubectl", "get", "pytorchjobs", "-l", selector, "-o", "json"], action="listing PyTorchJobs")
        return [status_from_pytorchjob(item) for item in json.loads(out).get("items", [])][:limit]


def status_from_pytorchjob(job: dict) -> JobStatus:
    conditions = job.get("status", {}).get("conditions", [])
    current = [c for c in conditions if c.get("status") == "True"]
    last = current[-1]["type"] if current else "Created"
    state = {"Succeeded": "Completed", "Failed": "Failed"}.get(last, "InProgress")
    failure = current[-1].get("message") if state == "Failed" else None
    return JobStatus(
        name=job["metadata"]["name"],
        backend="k8s",
        state=state,
        secondary=last,
        transitions=tuple(
            Transition(status=c["type"], start=c.get("lastTransitionTime"), message=c.get("message", ""))
            for c in conditions
        ),
        failure_reason=failure,
        exit_code={"Completed": 0, "Failed": 1}.get(state),
        created=job["metadata"].get("creationTimestamp"),
        ended=job.get("status", {}).get("completionTime"),
    )
