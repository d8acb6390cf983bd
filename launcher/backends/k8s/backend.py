"""The Kubernetes backend: a Kubeflow PyTorchJob (training-operator v1.9), or with `k8s.api:
trainjob` a Kubeflow Trainer v2 TrainJob, and what it mounts.

The objects are built in manifest.py and dumped with PyYAML, so recipe strings stay string
values. Submit creates them in an order that leaves nothing behind when a step fails:
1. the checkpoint claim: created when missing with `k8s.storage_class`; otherwise it must exist
   and, for a multi-node job, be ReadWriteMany (one line says what to create);
2. the PyTorchJob (or TrainJob); its uid is read back from the create;
3. with that uid as owner: the code ConfigMap and the claims of s3:// data (plus their
   cluster-scoped volumes), so deleting the job deletes them. Pods that start before step 3
   wait: the kubelet retries a missing ConfigMap volume and the scheduler a missing claim.
   If step 3 fails the PyTorchJob is deleted again.
Every kubectl call names the namespace: k8s.namespace, else kubectl's current one, which the
job's record keeps (native_id `namespace/name`, `trainjob/namespace/name` for a TrainJob) for
status, logs and stop.
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
    TRAINJOB_NODE,
    VOLUME_ROOT,
    ClaimSettings,
    JobSettings,
    Manifest,
    build_manifest,
    claim_name,
    name_problem,
)
from launcher.backends.k8s.settings import KubernetesSettings
from launcher.backends.tools import stream_tool
from launcher.backends.wheelhouse import build, job_wheels, requirements
from launcher.bundle import Bundle
from launcher.errors import UsageError
from launcher.spec import JobSpec, Placement


class _Dumper(yaml.SafeDumper):
    """No &anchors/*aliases for shared dicts: every document reads on its own."""

    def ignore_aliases(self, data) -> bool:
        return True


def dump(documents: list[dict]) -> str:
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=120)


# How kubectl names the job kinds, and the prefix a TrainJob's native_id carries.
RESOURCES = {"pytorchjob": "pytorchjob", "trainjob": "trainjobs.trainer.kubeflow.org"}
TRAINJOB_ID = "trainjob/"


def settings_of(spec: JobSpec) -> JobSettings:
    """The recipe's k8s: section as the manifest reads it (the claim named after the recipe by default)."""
    # A spec of another engine has no k8s part: the section's defaults, as for a recipe without one.
    k8s = spec.engine if isinstance(spec.engine, KubernetesSettings) else KubernetesSettings()
    return JobSettings(
        namespace=k8s.namespace,
        checkpoint_claim=k8s.checkpoint_claim or claim_name(spec.recipe_name),
        storage_class=k8s.storage_class,
        storage_size=k8s.storage_size,
        region=k8s.region,
        api=k8s.api,
        runtime=k8s.runtime,
        auto_resume=k8s.auto_resume,
        retries=k8s.retries,
        node_selector=k8s.node_selector,
        tolerations=k8s.tolerations,
        hugepages=k8s.hugepages,
    )


def hyperpod_namespace(namespace: str) -> bool:
    """Where HyperPod's job auto-resume acts: the kubeflow namespace or one prefixed hyperpod
    (docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-eks-run-jobs-hyperpod-cli.html)."""
    return namespace == "kubeflow" or namespace.startswith("hyperpod")


def settings_problems(spec: JobSpec) -> list[str]:
    """What the k8s: section asks that the chosen API cannot do, one line each."""
    k8s = settings_of(spec)
    problems = []
    if k8s.api == "trainjob" and k8s.auto_resume:
        problems.append(
            "k8s.auto_resume: HyperPod's job auto-resume reads PyTorchJob annotations (training operator 1.7 to "
            "1.8.1); use k8s.api: pytorchjob with it, or auto_resume: false with trainjob"
        )
    elif k8s.api == "trainjob" and k8s.retries:
        problems.append(
            f"k8s.retries: {k8s.retries} cannot be set on a TrainJob (its restarts are the runtime's JobSet "
            f"failurePolicy.maxRestarts); set them in the ClusterTrainingRuntime {k8s.runtime}, or use k8s.api: pytorchjob"
        )
    return problems


def submit_steps(spec: JobSpec, settings: ClaimSettings, manifest: Manifest) -> str:
    """The comment above a rendered manifest: what submit does with these documents, in order."""
    claim = settings.checkpoint_claim
    first = (
        f"creates the claim {claim} (storage class {settings.storage_class}) unless it exists"
        if settings.storage_class
        else f"checks that the claim {claim} exists"
        + (" and is ReadWriteMany" if spec.resources.instance_count > 1 else "")
    )
    parts = [d["metadata"]["name"] for d in manifest.wheel_config_maps]
    owned = ", ".join(
        f"{d['kind']} {d['metadata']['name']}" for d in manifest.owned() if d["metadata"]["name"] not in parts
    )
    if parts:
        names = f"s {parts[0]} to {parts[-1]}" if len(parts) > 1 else f" {parts[0]}"
        owned += f", ConfigMap{names} ({requirements(job_wheels(spec.resolved))} in parts of 1 MiB)"
    where = settings.namespace or "kubectl's current namespace"
    lines = [
        f"launcher submit, in namespace {where}:",
        f"1. {first}",
        f"2. creates the {settings.kind[1]} {spec.name}",
        f"3. creates {owned} owned by it (deleted with the job)",
    ]
    if manifest.data_volumes:
        lines.append(
            "   and the s3:// data volumes (cluster-scoped: kubectl delete pv -l launcher/job=NAME after the job)"
        )
    return "".join(f"# {line}\n" for line in lines)


def job_location(ref: JobRef) -> tuple[str | None, str]:
    """(namespace or None for kubectl's current one, name) of a job."""
    namespace, _, name = (ref.native_id or "").removeprefix(TRAINJOB_ID).rpartition("/")
    return namespace or None, name or ref.name


def job_resource(ref: JobRef) -> str:
    """kubectl's name for the kind of the job: pytorchjob, or the TrainJob's resource."""
    return RESOURCES["trainjob" if (ref.native_id or "").startswith(TRAINJOB_ID) else "pytorchjob"]


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


def create_job(
    spec: JobSpec, bundle: Bundle, settings: ClaimSettings, namespace: str, wheel_data: dict[str, bytes]
) -> None:
    """Steps 2 and 3 of submit: the PyTorchJob (or TrainJob), then what it owns (undone if that fails)."""
    manifest = build_manifest(spec, bundle, settings, namespace=namespace)
    kind = manifest.job["kind"]
    created = kubectl(["create", "--filename", "-", "--output", "json"], action=f"creating the {kind} {spec.name}",
                      namespace=namespace, input=dump([manifest.job]))  # fmt: skip
    uid = json.loads(created)["metadata"]["uid"]
    owned = build_manifest(spec, bundle, settings, namespace=namespace, uid=uid, wheel_data=wheel_data)
    documents = [*owned.data_volumes, owned.config_map, *owned.wheel_config_maps]
    try:
        kubectl(["create", "--filename", "-"], action=f"creating the code, wheels and data of {spec.name}",
                namespace=namespace, input=dump(documents))  # fmt: skip
    except Exception:
        # What it owns goes with it; the data volumes are cluster-scoped and go by their label.
        kubectl(["delete", RESOURCES[settings.api], spec.name, "--ignore-not-found"],
                action=f"removing {spec.name} again", namespace=namespace)  # fmt: skip
        if owned.data_volumes:
            kubectl(["delete", "persistentvolume", "--selector", f"launcher/job={spec.name}", "--ignore-not-found"],
                    action=f"removing the data volumes of {spec.name} again")  # fmt: skip
        raise


class KubernetesBackend(Backend):
    name = "k8s"
    max_name_length = MAX_NAME
    settings_type = KubernetesSettings
    checkpoint_setting = "k8s.checkpoint_claim"

    def placement(self, recipe, name: str, lineage: str | None = None) -> Placement:
        # The operator gives each replica a headless Service named after its pod; Trainer v2's
        # JobSet gives node 0 the hostname <job>-node-0-0 under a headless Service named <job>.
        trainjob = recipe.k8s.api == "trainjob"
        return Placement(
            checkpoint_dir=f"{VOLUME_ROOT}/checkpoints/{lineage or name}",
            output_dir=f"{VOLUME_ROOT}/jobs/{name}",
            rendezvous_host=f"{name}-{TRAINJOB_NODE}-0-0.{name}" if trainjob else f"{name}-master-0",
            s3_data_dir=f"{DATA_DIR}/train",  # the Mountpoint for S3 volume of the train data
            image=training_image(recipe),
            bootstrap="exec",  # checks the image, then torchrun is PID 1 and keeps the operator's rendezvous
        )

    def checkpoint_location(self, spec: JobSpec) -> str:
        """The directory on the checkpoint volume, named by its claim and namespace."""
        settings = settings_of(spec)
        namespace = settings.namespace or "the current context's namespace"
        return f"{spec.checkpoint_dir} on PersistentVolumeClaim {settings.checkpoint_claim} in {namespace}"

    def problems(self, spec: JobSpec) -> list[str]:
        problem = name_problem(spec.name)
        return [*super().problems(spec), *([problem] if problem else []), *settings_problems(spec)]

    def _render(self, spec: JobSpec) -> Rendering:
        bundle = Bundle.of(spec)
        settings = settings_of(spec)
        manifest = build_manifest(spec, bundle, settings)
        documents = manifest.documents()
        text = submit_steps(spec, settings, manifest) + dump(documents)
        data = {"manifest": documents, "bundle": bundle.describe()}
        warnings = []
        if settings.auto_resume and settings.namespace and not hyperpod_namespace(settings.namespace):
            warnings.append(
                f"k8s.auto_resume: HyperPod resumes only jobs in the namespace kubeflow or one starting with hyperpod, "
                f"not {settings.namespace}; set k8s.namespace to such a namespace, or the job is not resumed"
            )
        if warnings:
            data["warnings"] = warnings
        return Rendering(spec=spec, data=data, text=text, payload={"bundle": bundle})

    def _submit(self, rendering: Rendering) -> JobRef:
        spec, settings = rendering.spec, settings_of(rendering.spec)
        namespace = settings.namespace or current_namespace()
        bundle = rendering.payload["bundle"]
        # First, so a wheel pip cannot fetch leaves nothing created: from the cache, checked by its pin.
        wheels = job_wheels(spec.resolved)
        wheel_data = {wheel.file: path.read_bytes() for wheel, path in zip(wheels, build(wheels), strict=True)}
        ensure_checkpoint_claim(spec, settings, build_manifest(spec, bundle, settings, namespace=namespace), namespace)
        create_job(spec, bundle, settings, namespace, wheel_data)
        native_id = f"{TRAINJOB_ID if settings.api == 'trainjob' else ''}{namespace}/{spec.name}"
        return JobRef(name=spec.name, backend=self.name, native_id=native_id, created=utc_now())

    def _get(self, ref: JobRef) -> dict:
        namespace, name = job_location(ref)
        resource = job_resource(ref)
        try:
            out = kubectl(["get", resource, name, "--output", "json"], action=f"reading {name}", namespace=namespace)
        except KubectlFailed as failure:
            if failure.not_found:
                raise missing("TrainJob" if resource != "pytorchjob" else "PyTorchJob", name, namespace) from None
            raise
        return json.loads(out)

    def _status(self, ref: JobRef) -> JobStatus:
        return status_from_pytorchjob(self._get(ref))

    def _logs(self, ref: JobRef, *, follow: bool, poll_s: float) -> Iterator[str]:
        self._get(ref)  # an unknown job or an unreachable cluster: one line, before any streaming
        namespace, name = job_location(ref)
        # `kubectl logs --follow` returns when the first node's container exits. A TrainJob's pods
        # have generated names: JobSet's labels select node 0 (jobset.sigs.k8s.io, batch/v1 Indexed Job).
        if job_resource(ref) == "pytorchjob":
            pod = [f"{name}-master-0", "--container", "pytorch"]
        else:
            selector = f"jobset.sigs.k8s.io/jobset-name={name},batch.kubernetes.io/job-completion-index=0"
            pod = ["--selector", selector, "--container", TRAINJOB_NODE]
        argv = ["kubectl", *(["--namespace", namespace] if namespace else []), "logs",
                *(["--follow"] if follow else []), *pod]  # fmt: skip
        return stream_tool(argv, action=f"reading the logs of {name}")

    def _stop(self, ref: JobRef, *, grace_s: float) -> JobStatus:
        status = self._status(ref)
        namespace, name = job_location(ref)
        # The ConfigMap and data claims are owned by the job and go with it; the data volumes
        # are cluster-scoped and cannot be owned by it.
        kubectl(["delete", job_resource(ref), name, f"--grace-period={int(grace_s)}"], action=f"deleting {name}",
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
    # A PyTorchJob ends Succeeded or Failed; a TrainJob Complete or Failed (trainer v2.3.0 trainjob_types.go).
    state = {"Succeeded": "Completed", "Complete": "Completed", "Failed": "Failed"}.get(last, "InProgress")
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
