"""The Kubernetes backend: a Kubeflow PyTorchJob (training-operator v1.9) and what it mounts.

The objects are built in k8s_manifest.py and dumped with PyYAML, so recipe strings stay string
values. Submit creates them in an order that leaves nothing behind when a step fails:
1. the checkpoint claim: created when missing with `k8s.storage_class`; otherwise it must exist
   and, for a multi-node job, be ReadWriteMany (one line says what to create);
2. the PyTorchJob; its uid is read back from the create;
3. with that uid as owner: the code ConfigMap and the claims of s3:// data (plus their
   cluster-scoped volumes), so deleting the job deletes them. Pods that start before step 3
   wait: the kubelet retries a missing ConfigMap volume and the scheduler a missing claim.
   If step 3 fails the PyTorchJob is deleted again.
Every kubectl call names the namespace: k8s.namespace, else kubectl's current one, which the
job's record keeps (native_id `namespace/name`) for status, logs and stop.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import yaml

from launcher.backends.base import Backend, JobRef, JobStatus, Rendering, Transition, utc_now
from launcher.backends.images import training_image
from launcher.backends.k8s.kubectl import KubectlFailed, current_namespace, kubectl, missing
from launcher.backends.k8s.manifest import (
    DATA_DIR,
    MANAGED_BY,
    MAX_NAME,
    VOLUME_ROOT,
    ClaimSettings,
    Manifest,
    build_manifest,
    claim_name,
    name_problem,
)
from launcher.backends.k8s.settings import KubernetesSettings
from launcher.backends.tools import stream_tool
from launcher.backends.wheelhouse import job_wheels, requirements
from launcher.bundle import Bundle
from launcher.errors import UsageError
from launcher.spec import JobSpec, Placement


class _Dumper(yaml.SafeDumper):
    """No &anchors/*aliases for shared dicts: every document reads on its own."""

    def ignore_aliases(self, data) -> bool:
        return True


def dump(documents: list[dict]) -> str:
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=120)


def settings_of(spec: JobSpec) -> ClaimSettings:
    """The recipe's k8s: section as the manifest reads it (the claim named after the recipe by default)."""
    # A spec of another engine has no k8s part: the section's defaults, as for a recipe without one.
    k8s = spec.engine if isinstance(spec.engine, KubernetesSettings) else KubernetesSettings()
    return ClaimSettings(
        namespace=k8s.namespace,
        checkpoint_claim=k8s.checkpoint_claim or claim_name(spec.recipe_name),
        storage_class=k8s.storage_class,
        storage_size=k8s.storage_size,
    )


def submit_steps(spec: JobSpec, settings: ClaimSettings, manifest: Manifest) -> str:
    """The comment above a rendered manifest: what submit does with these documents, in order."""
    claim = settings.checkpoint_claim
    first = (
        f"creates the claim {claim} (storage class {settings.storage_class}) unless it exists"
        if settings.storage_class
        else f"checks that the claim {claim} exists"
        + (" and is ReadWriteMany" if spec.resources.instance_count > 1 else "")
    )
    owned = ", ".join(f"{d['kind']} {d['metadata']['name']}" for d in manifest.owned())
    where = settings.namespace or "kubectl's current namespace"
    lines = [
        f"launcher submit, in namespace {where}:",
        f"1. {first}",
        f"2. creates the PyTorchJob {spec.name}",
        f"3. creates {owned} owned by it (deleted with the job)",
    ]
    if manifest.data_volumes:
        lines.append(
            "   and the s3:// data volumes (cluster-scoped: kubectl delete pv -l launcher/job=NAME after the job)"
        )
    return "".join(f"# {line}\n" for line in lines)


def job_location(ref: JobRef) -> tuple[str | None, str]:
    """(namespace or None for kubectl's current one, name) of a job."""
    namespace, _, name = (ref.native_id or "").rpartition("/")
    return namespace or None, name or ref.name


def ensure_checkpoint_claim(spec: JobSpec, settings: ClaimSettings, manifest: Manifest, namespace: str) -> None:
    """Step 1 of submit: the claim exists (created with a storage class) and every pod can mount it."""
    name = settings.checkpoint_claim
    try:
        claim = json.loads(
            kubectl(["get", "pvc", name, "--output", "json"], action=f"reading the claim {name}", namespace=namespace)
        )
    except KubectlFailed as failure:
        if not failure.not_found:
            raise
        if manifest.checkpoint_claim is None:
            raise UsageError(
                f"k8s.checkpoint_claim: no PersistentVolumeClaim {name} in namespace {namespace}; create a ReadWriteMany "
                f"claim of that name (docs/kubernetes.md), or set k8s.storage_class to a class with ReadWriteMany "
                f"volumes (EFS, FSx for Lustre) and submit creates it"
            ) from None
        kubectl(["create", "--filename", "-"], action=f"creating the claim {name}", namespace=namespace,
                input=dump([manifest.checkpoint_claim]))  # fmt: skip
        return
    modes = claim.get("spec", {}).get("accessModes", [])
    if spec.resources.instance_count > 1 and "ReadWriteMany" not in modes:
        raise UsageError(
            f"k8s.checkpoint_claim: {name} in namespace {namespace} is {', '.join(modes) or 'without access modes'}, "
            f"but the {spec.resources.instance_count} pods of this job all mount it; use a ReadWriteMany claim"
        )


def create_job(spec: JobSpec, bundle: Bundle, settings: ClaimSettings, namespace: str) -> None:
    """Steps 2 and 3 of submit: the PyTorchJob, then what it owns (undone if that fails)."""
    manifest = build_manifest(spec, bundle, settings, namespace=namespace)
    created = kubectl(["create", "--filename", "-", "--output", "json"], action=f"creating the PyTorchJob {spec.name}",
                      namespace=namespace, input=dump([manifest.job]))  # fmt: skip
    uid = json.loads(created)["metadata"]["uid"]
    owned = build_manifest(spec, bundle, settings, namespace=namespace, uid=uid)
    try:
        kubectl(["create", "--filename", "-"], action=f"creating the code and data of {spec.name}",
                namespace=namespace, input=dump([*owned.data_volumes, owned.config_map]))  # fmt: skip
    except Exception:
        kubectl(["delete", "pytorchjob", spec.name, "--ignore-not-found"], action=f"removing {spec.name} again",
                namespace=namespace)  # fmt: skip
        raise


class KubernetesBackend(Backend):
    name = "k8s"
    max_name_length = MAX_NAME
    settings_type = KubernetesSettings

    def placement(self, recipe, name: str, lineage: str | None = None) -> Placement:
        return Placement(
            checkpoint_dir=f"{VOLUME_ROOT}/checkpoints/{lineage or name}",
            output_dir=f"{VOLUME_ROOT}/jobs/{name}",
            # The operator gives each replica a headless Service named after its pod.
            rendezvous_host=f"{name}-master-0",
            s3_data_dir=f"{DATA_DIR}/train",  # the Mountpoint for S3 volume of the train data
            image=training_image(recipe),
            bootstrap="exec",  # checks the image, then torchrun is PID 1 and keeps the operator's rendezvous
        )

    def problems(self, spec: JobSpec) -> list[str]:
        problem = name_problem(spec.name)
        return [*super().problems(spec), *([problem] if problem else [])]

    def _render(self, spec: JobSpec) -> Rendering:
        bundle = Bundle.of(spec)
        settings = settings_of(spec)
        manifest = build_manifest(spec, bundle, settings)
        documents = manifest.documents()
        text = submit_steps(spec, settings, manifest) + dump(documents)
        data = {"manifest": documents, "bundle": bundle.describe()}
        wheels = job_wheels(spec.resolved)
        if wheels:
            data["warnings"] = [
                f"the k8s backend does not ship the job's wheels yet: the image must have {requirements(wheels)} "
                "(set cluster.image to such an image), or the job stops at start"
            ]
        return Rendering(spec=spec, data=data, text=text, payload={"bundle": bundle})

    def _submit(self, rendering: Rendering) -> JobRef:
        spec, settings = rendering.spec, settings_of(rendering.spec)
        namespace = settings.namespace or current_namespace()
        bundle = rendering.payload["bundle"]
        ensure_checkpoint_claim(spec, settings, build_manifest(spec, bundle, settings, namespace=namespace), namespace)
        create_job(spec, bundle, settings, namespace)
        return JobRef(name=spec.name, backend=self.name, native_id=f"{namespace}/{spec.name}", created=utc_now())

    def _get(self, ref: JobRef) -> dict:
        namespace, name = job_location(ref)
        try:
            out = kubectl(
                ["get", "pytorchjob", name, "--output", "json"], action=f"reading {name}", namespace=namespace
            )
        except KubectlFailed as failure:
            if failure.not_found:
                raise missing("PyTorchJob", name, namespace) from None
            raise
        return json.loads(out)

    def _status(self, ref: JobRef) -> JobStatus:
        return status_from_pytorchjob(self._get(ref))

    def _logs(self, ref: JobRef, *, follow: bool, poll_s: float) -> Iterator[str]:
        self._get(ref)  # an unknown job or an unreachable cluster: one line, before any streaming
        namespace, name = job_location(ref)
        # `kubectl logs --follow` returns when the master container exits.
        argv = ["kubectl", *(["--namespace", namespace] if namespace else []), "logs",
                *(["--follow"] if follow else []), f"{name}-master-0", "--container", "pytorch"]  # fmt: skip
        return stream_tool(argv, action=f"reading the logs of {name}")

    def _stop(self, ref: JobRef, *, grace_s: float) -> JobStatus:
        status = self._status(ref)
        namespace, name = job_location(ref)
        # The ConfigMap and data claims are owned by the job and go with it; the data volumes
        # are cluster-scoped and cannot be owned by it.
        kubectl(["delete", "pytorchjob", name, f"--grace-period={int(grace_s)}"], action=f"deleting {name}",
                namespace=namespace)  # fmt: skip
        kubectl(["delete", "persistentvolume", "--selector", f"launcher/job={name}", "--ignore-not-found"],
                action=f"deleting the data volumes of {name}")  # fmt: skip
        return dataclasses.replace(status, state="Stopped", secondary="Deleted")

    def _list(self, *, region: str | None, limit: int) -> list[JobStatus]:
        selector = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
        out = kubectl(["get", "pytorchjobs", "--selector", selector, "--output", "json"], action="listing PyTorchJobs")
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
        details={"namespace": job["metadata"].get("namespace")},
    )
