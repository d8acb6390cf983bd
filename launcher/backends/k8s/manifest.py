"""The Kubernetes objects of one job, built as data: a Kubeflow PyTorchJob and what it mounts.

- the PyTorchJob (kubeflow.org/v1, training-operator 1.9): a Master and `instance_count - 1`
  Workers, each pod one container named `pytorch` that unpacks the code bundle and execs the
  spec's argv (entrypoints/bootstrap.py --exec, which checks the image and execs torchrun), with
  the job's stop grace as terminationGracePeriodSeconds, the recipe's node selector and
  tolerations, and with `k8s.auto_resume` HyperPod's annotations, OnFailure and node-health affinity;
- or with `k8s.api: trainjob` a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) on
  the ClusterTrainingRuntime `k8s.runtime`: the same container in its `trainer`, the same pod
  fields, volumes and mounts in a runtime patch;
- a ConfigMap holding the code bundle, owned by the job so it is deleted with it;
- for a job that needs wheels its image lacks (torchao for FP8), those wheels in ConfigMap parts
  of at most 1 MiB (wheels.py), owned by the job, projected into one read-only directory;
- the checkpoint claim (ReadWriteMany, mounted at /launcher by every pod), rendered only when
  `k8s.storage_class` lets submit create it; otherwise it must already exist;
- for s3:// data: a Mountpoint-for-S3 CSI PersistentVolume (static provisioning, read-only) and
  the claim bound to it, mounted where the training processes read SM_CHANNEL_TRAIN.

Three values exist only at submit time: the job's uid (owner of the ConfigMaps and data
claims), when `k8s.namespace` is unset kubectl's current namespace (a data volume's claimRef
names it), and the bytes of the job's wheels (a dry run downloads nothing). A render without
them shows placeholders; submit builds the manifest again with the real values, so what it
creates is exactly what a dry-run printed, filled in.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.backends.k8s.settings import Toleration
from launcher.backends.k8s.wheels import MAX_CONFIG_MAP_BYTES, WHEELS_DIR, WheelPart, wheel_parts, wheel_volume
from launcher.backends.wheelhouse import bootstrap_environment, job_wheels
from launcher.bundle import ARCHIVE_NAME, ENV_BUNDLE_SHA256, Bundle, unpack_entrypoint
from launcher.catalog import instance_types
from launcher.errors import UsageError
from launcher.spec import RDZV_PORT, JobSpec, Resources

VOLUME_ROOT = "/launcher"
BUNDLE_DIR = "/opt/launcher/bundle"
CODE_DIR = "/opt/launcher/code"
DATA_DIR = "/opt/launcher/data"
MANAGED_BY = {"app.kubernetes.io/managed-by": "launcher"}
# Pod names are `<job>-worker-<index>` and must be DNS labels of at most 63 characters.
MAX_NAME = 52
# Services (the operator makes one per pod) and PyTorchJobs need DNS-1035 labels: a letter first.
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
EFA_HUGEPAGES = "5120Mi"  # libfabric's EFA provider registers its buffers in 2 MiB huge pages
# The kubelet, system daemons and per-node agents (device plugins, CSI, CNI) keep part of each
# node; requesting 90% of the catalog's vCPUs and memory still fits one pod per node.
ALLOCATABLE_SHARE = 0.9
# 'local' has no catalog size: what one gloo/CUDA process of a small job needs.
CPU_PER_PROCESS, MEMORY_GI_PER_PROCESS = 1, 4
# The operator reads MASTER_PORT from the container port of this name (default 23456); naming
# the rendezvous port makes MASTER_ADDR:MASTER_PORT the same endpoint torchrun uses.
OPERATOR_PORT_NAME = "pytorchjob-port"
# Mountpoint ignores a static volume's size, but Kubernetes requires one (and claim <= volume).
S3_VOLUME_SIZE = "1Ti"
S3_DRIVER = "s3.csi.aws.com"
PYTORCHJOB = ("kubeflow.org/v1", "PyTorchJob")
TRAINJOB = ("trainer.kubeflow.org/v1alpha1", "TrainJob")
# Kubeflow Trainer v2.3.0: the torch runtime's replicated job and container are both named `node`
# (manifests/base/runtimes/torch_distributed.yaml), and its torch plugin points PET_MASTER_ADDR at
# <trainjob>-node-0-0.<trainjob>, port 29500 (pkg/runtime/framework/plugins/torch/torch.go).
TRAINJOB_NODE = "node"
# SageMaker HyperPod's job auto-resume, read from the PyTorchJob's annotations (aws/sagemaker-hyperpod-cli
# src/sagemaker/hyperpod/cli/constants/command_constants.py; docs.aws.amazon.com/sagemaker/latest/dg/
# sagemaker-hyperpod-eks-run-jobs-kubectl.html); the CLI refuses auto-resume without restartPolicy
# OnFailure (validators/job_validator.py).
AUTO_RESUME_ANNOTATION = "sagemaker.amazonaws.com/enable-job-auto-resume"
MAX_RETRY_ANNOTATION = "sagemaker.amazonaws.com/job-max-retry-count"
OWNER_UID_AT_SUBMIT = "<uid of the job, set by submit>"
NAMESPACE_AT_SUBMIT = "<kubectl's current namespace, set by submit>"


@dataclass(frozen=True, kw_only=True)
class ClaimSettings:
    """What the manifest needs of the recipe's k8s: section."""

    namespace: str | None
    checkpoint_claim: str
    storage_class: str | None
    storage_size: str
    region: str | None = None
    """AWS region of s3:// data, for Mountpoint's `region` option (None: Mountpoint finds it)."""


@dataclass(frozen=True, kw_only=True)
class JobSettings(ClaimSettings):
    """What the manifest needs of the recipe's k8s: section beyond the claims: the API and the pods' placement."""

    api: str = "pytorchjob"
    runtime: str = "torch-distributed"
    auto_resume: bool = False
    retries: int = 0
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    hugepages: bool = False

    @property
    def kind(self) -> tuple[str, str]:
        """(apiVersion, kind) of the job object."""
        return TRAINJOB if self.api == "trainjob" else PYTORCHJOB


@dataclass(frozen=True)
class Manifest:
    config_map: dict
    job: dict
    checkpoint_claim: dict | None
    """Created by submit when missing (with k8s.storage_class); None: it must exist."""
    data_volumes: tuple[dict, ...]
    """PersistentVolume, PersistentVolumeClaim pairs for s3:// data."""
    wheel_config_maps: tuple[dict, ...] = ()
    """The parts of the job's wheels, one ConfigMap each (wheels.py)."""

    def documents(self) -> list[dict]:
        claim = [self.checkpoint_claim] if self.checkpoint_claim else []
        return [self.config_map, *self.wheel_config_maps, self.job, *claim, *self.data_volumes]

    def owned(self) -> list[dict]:
        """The objects created after the PyTorchJob, with it as their owner."""
        claims = (d for d in self.data_volumes if d["kind"] == "PersistentVolumeClaim")
        return [self.config_map, *self.wheel_config_maps, *claims]


def dns_label(text: str) -> str:
    return re.sub(r"[^a-z0-9-]", "-", text.lower()).strip("-")[:63].rstrip("-") or "launcher"


def claim_name(recipe_name: str) -> str:
    return dns_label(f"{recipe_name}-launcher")


def name_problem(name: str) -> str | None:
    if len(name) > MAX_NAME or not DNS_1035.match(name):
        return (
            f"job name {name}: the k8s backend needs a lowercase name that starts with a letter and has at most "
            f"{MAX_NAME} characters (pods are <job>-worker-<n>, Services are DNS-1035 labels); rename the recipe"
        )
    return None


def metadata(name: str, labels: dict, namespace: str | None, **extra) -> dict:
    return {"name": name, **({"namespace": namespace} if namespace else {}), "labels": labels, **extra}


def owner_reference(job_name: str, settings: ClaimSettings, uid: str | None) -> dict:
    # No blockOwnerDeletion: it needs update rights on pytorchjobs/finalizers, which users often lack.
    api_version, kind = settings.kind if isinstance(settings, JobSettings) else PYTORCHJOB
    return {"apiVersion": api_version, "kind": kind, "name": job_name, "uid": uid or OWNER_UID_AT_SUBMIT}


def config_map(
    spec: JobSpec, bundle: Bundle, settings: ClaimSettings, labels: dict, namespace: str | None, uid: str | None
) -> dict:
    if len(bundle.data) > MAX_CONFIG_MAP_BYTES:
        raise UsageError(
            f"the code bundle is {len(bundle.data) / 2**20:.2f} MiB, more than the 1 MiB a Kubernetes ConfigMap holds; "
            "keep entrypoints/ small (data belongs in data.source)"
        )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(
            f"{spec.name}-code", labels, namespace, ownerReferences=[owner_reference(spec.name, settings, uid)]
        ),
        "binaryData": {ARCHIVE_NAME: base64.b64encode(bundle.data).decode()},
    }


def wheel_config_map(part: WheelPart, labels: dict, owner: dict, namespace: str | None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(part.config_map, labels, namespace, ownerReferences=[owner]),
        "immutable": True,
        "binaryData": {part.key: part.value},
    }


def container_resources(r: Resources, hugepages: bool = False) -> dict:
    """Requests sized from the instance catalog; devices and huge pages with requests == limits."""
    limits: dict[str, str | int] = {}
    if r.device == "cuda":
        limits["nvidia.com/gpu"] = r.procs_per_node
    if r.has_efa:
        limits["vpc.amazonaws.com/efa"] = r.efa_interfaces
        # Only on request: a pod asking for huge pages never schedules on nodes that did not
        # pre-allocate them, and AWS's EKS samples request none (the EFA provider falls back).
        if hugepages:
            limits["hugepages-2Mi"] = EFA_HUGEPAGES
    instance = instance_types().get(r.instance_type)
    if instance is not None and instance.vcpus and instance.host_memory_gib:
        cpu = math.floor(instance.vcpus * ALLOCATABLE_SHARE)
        memory_gi = math.floor(instance.host_memory_gib * ALLOCATABLE_SHARE)
    else:
        cpu, memory_gi = CPU_PER_PROCESS * r.procs_per_node, MEMORY_GI_PER_PROCESS * r.procs_per_node
    # Huge pages are refused without a cpu or memory request; the scheduler places pods by requests.
    requests = {"cpu": str(cpu), "memory": f"{memory_gi}Gi", **limits}
    return {"requests": requests, "limits": limits} if limits else {"requests": requests}


def s3_location(uri: str) -> tuple[str, str]:
    """(bucket, prefix ending in / or empty) of an s3:// URI, read as a directory."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    key = key.strip("/")
    return bucket, f"{key}/" if key else ""


def s3_volume(spec: JobSpec, index: int, source: str, settings: ClaimSettings, namespace: str | None, uid: str | None):
    """(PersistentVolume, PersistentVolumeClaim) of Mountpoint for S3's static provisioning."""
    name = f"{spec.name}-data-{index}"
    labels = job_labels(spec)
    bucket, prefix = s3_location(source)
    options = [
        "read-only",
        *([f"prefix {prefix}"] if prefix else []),
        *([f"region {settings.region}"] if settings.region else []),
    ]
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": metadata(name, labels, None),  # cluster-scoped; the job name makes it unique
        "spec": {
            "capacity": {"storage": S3_VOLUME_SIZE},
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",  # static provisioning: no class, no provisioner
            # Reserved for this job's claim, so no other claim can bind it first.
            "claimRef": {"namespace": namespace or NAMESPACE_AT_SUBMIT, "name": name},
            "mountOptions": options,
            "csi": {"driver": S3_DRIVER, "volumeHandle": name, "volumeAttributes": {"bucketName": bucket}},
        },
    }
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(name, labels, namespace, ownerReferences=[owner_reference(spec.name, settings, uid)]),
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "resources": {"requests": {"storage": S3_VOLUME_SIZE}},
            "volumeName": name,
        },
    }
    return volume, claim


def data_volumes(spec: JobSpec, settings: ClaimSettings, namespace: str | None, uid: str | None):
    """(mounts, pod volumes, documents to create) for the job's data inputs."""
    mounts, volumes, documents = [], [], []
    for index, data in enumerate(spec.inputs):
        name = f"data-{index}"
        mounts.append({"name": name, "mountPath": data.container_path, "readOnly": True})
        if data.source.startswith("s3://"):
            volume, claim = s3_volume(spec, index, data.source, settings, namespace, uid)
            documents += [volume, claim]
            volumes.append(
                {"name": name, "persistentVolumeClaim": {"claimName": claim["metadata"]["name"], "readOnly": True}}
            )
        else:
            # A path that every node has (a host mount of FSx, NFS or local disks).
            volumes.append({"name": name, "hostPath": {"path": data.source}})
    return mounts, volumes, documents


def job_labels(spec: JobSpec) -> dict:
    return {**MANAGED_BY, "launcher/recipe": dns_label(spec.recipe_name), "launcher/job": spec.name}


def container_environment(spec: JobSpec, bundle_sha256: str) -> list[dict]:
    wheels = bootstrap_environment(job_wheels(spec.resolved), WHEELS_DIR)  # read by entrypoints/bootstrap.py
    env = [{"name": k, "value": v} for k, v in [*spec.environment, *wheels.items()]]
    return env + [
        {"name": "LAUNCHER_BUNDLE", "value": f"{BUNDLE_DIR}/{ARCHIVE_NAME}"},
        {"name": "LAUNCHER_CODE", "value": CODE_DIR},
        # The pod runs nothing from a ConfigMap whose bundle has other bytes (launcher.bundle).
        {"name": ENV_BUNDLE_SHA256, "value": bundle_sha256},
    ]


def pod_storage(spec: JobSpec, settings: ClaimSettings, data_mounts: list, data_pod_volumes: list):
    """(the container's volumeMounts, the pod's volumes): the bundle, the claim, /dev/shm and the data."""
    mounts = [
        {"name": "bundle", "mountPath": BUNDLE_DIR, "readOnly": True},
        {"name": "launcher", "mountPath": VOLUME_ROOT},
        {"name": "dshm", "mountPath": "/dev/shm"},
        *data_mounts,
    ]
    volumes = [
        {"name": "bundle", "configMap": {"name": f"{spec.name}-code"}},
        {"name": "launcher", "persistentVolumeClaim": {"claimName": settings.checkpoint_claim}},
        # NCCL and data-loader workers share tensors through /dev/shm; the default is 64 MiB.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        *data_pod_volumes,
    ]
    return mounts, volumes


# HyperPod's node-health labels, as the HyperPod CLI's jobs use them (aws/sagemaker-hyperpod-cli
# src/sagemaker/hyperpod/cli/constants/command_constants.py NODE_AFFINITY_DICT): only nodes that
# HyperPod's health agents call Schedulable, preferring those whose deep health check passed.
HYPERPOD_NODE_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {
                    "matchExpressions": [
                        {
                            "key": "sagemaker.amazonaws.com/node-health-status",
                            "operator": "In",
                            "values": ["Schedulable"],
                        }
                    ]
                }
            ]
        },
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": 100,
                "preference": {
                    "matchExpressions": [
                        {
                            "key": "sagemaker.amazonaws.com/deep-health-check-status",
                            "operator": "In",
                            "values": ["Passed"],
                        }
                    ]
                },
            }
        ],
    }
}


def placement(settings: JobSettings) -> dict:
    """The pod spec's nodeSelector and tolerations (tainted GPU pools), when the recipe sets them,
    and with HyperPod auto-resume its node-health affinity."""
    found: dict = {}
    if settings.auto_resume:
        found["affinity"] = HYPERPOD_NODE_AFFINITY
    if settings.node_selector:
        found["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        found["tolerations"] = [t.to_kubernetes() for t in settings.tolerations]
    return found


def pod_template(
    spec: JobSpec, settings: JobSettings, data_mounts: list, data_pod_volumes: list, bundle_sha256: str
) -> dict:
    mounts, volumes = pod_storage(spec, settings, data_mounts, data_pod_volumes)
    container = {
        "name": "pytorch",  # the training operator finds the container by this name
        "image": spec.image,
        "command": unpack_entrypoint(),
        "args": list(spec.command),
        "env": container_environment(spec, bundle_sha256),
        "ports": [{"name": OPERATOR_PORT_NAME, "containerPort": RDZV_PORT, "protocol": "TCP"}],
        "resources": container_resources(spec.resources, settings.hugepages),
        "volumeMounts": mounts,
    }
    # The kubelet's SIGTERM to PID 1 (torchrun, exec'd by the bootstrap) is followed by SIGKILL
    # after this long; Kubernetes' default is 30 s (PodSpec.terminationGracePeriodSeconds), too
    # short for the step in progress and a final save. `kubectl delete --grace-period` on the
    # PyTorchJob does not reach the pods: the garbage collector deletes them with their own.
    pod = {
        "terminationGracePeriodSeconds": spec.stop_grace_s,
        **placement(settings),
        "containers": [container],
        "volumes": volumes,
    }
    return {"metadata": {"labels": job_labels(spec)}, "spec": pod}


def job_metadata(spec: JobSpec, settings: JobSettings, namespace: str | None, annotations: dict) -> dict:
    if spec.tags:
        annotations = {**annotations, "launcher/tags": json.dumps(dict(spec.tags), sort_keys=True)}
    return metadata(spec.name, job_labels(spec), namespace, **({"annotations": annotations} if annotations else {}))


def pytorch_job(spec: JobSpec, settings: JobSettings, template: dict, namespace: str | None) -> dict:
    r = spec.resources
    # HyperPod restarts an auto-resumed job's pods in place: restartPolicy OnFailure, which the
    # operator counts against backoffLimit (training-operator v1.9 pkg/core/job.go PastBackoffLimit;
    # with Never it counts nothing, and backoffLimit 0 fails the job at its first restart).
    restart = "OnFailure" if settings.auto_resume else "Never"
    replicas = {"Master": {"replicas": 1, "restartPolicy": restart, "template": template}}
    if r.instance_count > 1:
        replicas["Worker"] = {"replicas": r.instance_count - 1, "restartPolicy": restart, "template": template}
    annotations = {}
    if settings.auto_resume:
        annotations = {AUTO_RESUME_ANNOTATION: "true", MAX_RETRY_ANNOTATION: str(settings.retries)}
    return {
        "apiVersion": PYTORCHJOB[0],
        "kind": PYTORCHJOB[1],
        "metadata": job_metadata(spec, settings, namespace, annotations),
        "spec": {
            "runPolicy": {
                # Once the job has finished (one pod failed, or activeDeadlineSeconds passed), the
                # operator deletes its still Running and Pending pods and leaves the finished ones
                # for their logs; None would keep the healthy pods' GPUs (training-operator v1.9
                # pkg/controller.v1/common/job.go DeletePodsAndServices).
                "cleanPodPolicy": "Running",
                "backoffLimit": settings.retries,
                "activeDeadlineSeconds": spec.max_run_s,
            },
            "nprocPerNode": str(r.procs_per_node),
            "pytorchReplicaSpecs": replicas,
        },
    }


def train_job(spec: JobSpec, settings: JobSettings, template: dict, namespace: str | None) -> dict:
    """A Kubeflow Trainer v2 TrainJob on `settings.runtime`, its pods patched to the same spec as a PyTorchJob's."""
    r = spec.resources
    (container,) = template["spec"]["containers"]
    pod = {k: v for k, v in template["spec"].items() if k != "containers"}
    # The runtime owns the container; a patch may add only env, volumeMounts and securityContext to it.
    pod["containers"] = [{"name": TRAINJOB_NODE, "volumeMounts": container["volumeMounts"]}]
    patch = {
        "manager": "launcher",
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": TRAINJOB_NODE,
                            "template": {"spec": {"template": {"metadata": template["metadata"], "spec": pod}}},
                        }
                    ]
                }
            }
        },
    }
    return {
        "apiVersion": TRAINJOB[0],
        "kind": TRAINJOB[1],
        "metadata": job_metadata(spec, settings, namespace, {}),
        "spec": {
            "runtimeRef": {
                "apiGroup": "trainer.kubeflow.org",
                "kind": "ClusterTrainingRuntime",
                "name": settings.runtime,
            },
            "activeDeadlineSeconds": spec.max_run_s,
            "trainer": {
                "image": spec.image,
                "command": container["command"],
                "args": container["args"],
                "env": container["env"],
                "numNodes": r.instance_count,
                "numProcPerNode": r.procs_per_node,
                "resourcesPerNode": container["resources"],
            },
            "runtimePatches": [patch],
        },
    }


def checkpoint_claim(spec: JobSpec, settings: ClaimSettings, namespace: str | None) -> dict | None:
    """The claim submit creates when missing: only with a storage class that provisions it."""
    if settings.storage_class is None:
        return None
    labels = {**MANAGED_BY, "launcher/recipe": dns_label(spec.recipe_name)}
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        # No owner: checkpoints outlive the job, so the next job of the lineage resumes from them.
        "metadata": metadata(settings.checkpoint_claim, labels, namespace),
        "spec": {
            "accessModes": ["ReadWriteMany"],  # every pod of the job writes its shards
            "storageClassName": settings.storage_class,
            "resources": {"requests": {"storage": settings.storage_size}},
        },
    }


def build_manifest(
    spec: JobSpec,
    bundle: Bundle,
    settings: ClaimSettings,
    *,
    namespace: str | None = None,
    uid: str | None = None,
    wheel_data: Mapping[str, bytes] | None = None,
) -> Manifest:
    """Every object of the job; `namespace`, `uid` and the bytes of the job's wheels (by file
    name) as far as they are known (see the module doc)."""
    namespace = namespace or settings.namespace
    settings = settings if isinstance(settings, JobSettings) else JobSettings(**vars(settings))
    mounts, pod_volumes, volume_documents = data_volumes(spec, settings, namespace, uid)
    parts = wheel_parts(spec.name, job_wheels(spec.resolved), wheel_data)
    wheel_mounts, wheel_pod_volumes = wheel_volume(parts)
    template = pod_template(spec, settings, mounts + wheel_mounts, pod_volumes + wheel_pod_volumes, bundle.sha256)
    render = train_job if settings.api == "trainjob" else pytorch_job
    owner = owner_reference(spec.name, settings, uid)
    return Manifest(
        config_map=config_map(spec, bundle, settings, job_labels(spec), namespace, uid),
        job=render(spec, settings, template, namespace),
        checkpoint_claim=checkpoint_claim(spec, settings, namespace),
        data_volumes=tuple(volume_documents),
        wheel_config_maps=tuple(wheel_config_map(p, job_labels(spec), owner, namespace) for p in parts),
    )
