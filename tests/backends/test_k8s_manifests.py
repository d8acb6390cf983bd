"""Every manifest the k8s backend renders is one an API server accepts.

- core objects (ConfigMap, PersistentVolume, PersistentVolumeClaim, and each pod template as a
  v1 PodTemplate) against the Kubernetes OpenAPI schemas of `kubernetes-validate`, strict (kubectl
  validates strictly by default: unknown fields are errors);
- the PyTorchJob against the openAPIV3Schema of the training operator's CRD (schemas/README.md),
  with unknown fields refused as well; a TrainJob (`k8s.api: trainjob`) against Kubeflow Trainer
  v2.3.0's CRD, and the pod it makes of its runtime (the vendored torch-distributed) as a PodTemplate;
- the rules that schemas miss and the API server or the scheduler enforce (core_rule_problems).

Each shipped recipe is rendered as it is (GPU recipes read s3:// data), and in variants: single-
and multi-node, cpu and cuda, EFA instance types, local-path data, a namespace, a storage class.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import re
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from launcher.backends import get_backend
from launcher.backends.k8s.manifest import ClaimSettings, build_manifest  # noqa: F401
from launcher.backends.k8s.settings import Toleration
from launcher.bundle import Bundle

from .helpers import load, spec_for

KUBERNETES = "1.37.0"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRD = SCHEMAS / "kubeflow.org_pytorchjobs.yaml"
TRAINJOB_CRD = SCHEMAS / "trainer.kubeflow.org_trainjobs.yaml"
TORCH_RUNTIME = SCHEMAS / "torch_distributed.yaml"
# Trainer v2.3.0 refuses a TrainJob whose trainer env sets these (pkg/constants TorchRunReservedEnvNames,
# checked in pkg/runtime/framework/plugins/torch/torch.go Validate): its torch plugin sets them.
TORCH_RESERVED_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
# A recipe's placement on tainted GPU pools, as the checks of every render see it.
CLUSTER_AS_SET_UP = {
    "node_selector": (("node.kubernetes.io/instance-type", "ml.p5.48xlarge"),),
    "tolerations": (
        Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),
        Toleration(key="sagemaker.amazonaws.com/node-health-status", value="Unschedulable", effect="NoExecute",
                   toleration_seconds=60),
    ),
}  # fmt: skip
RECIPE_DIR = Path(__file__).resolve().parents[2] / "recipes"
RECIPES = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
NAMESPACE = "team-a"
UID = "6f1c2b9e-0d4a-4f5e-9a53-2c1e7d9b8a10"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
EXTENDED = re.compile(r"^(hugepages-|[a-z0-9.-]+\.[a-z]+/)")
# The shipped multi-node recipes' layouts need all their nodes; single-node ones also run on two.
VARIANTS = {
    "as shipped": {},
    "local path data": {"data.source": "/fsx/tokens"},
}
TWO_NODES = {"cluster.instance_count": 2}
CPU_VARIANTS = {
    "tiny-cpu on any node, 2 x 2": {"cluster.instance_count": 2, "cluster.nproc_per_node": 2},
    "tiny-cpu on c5.2xlarge, 2 x 2": {
        "cluster.instance_type": "ml.c5.2xlarge",
        "cluster.instance_count": 2,
        "cluster.nproc_per_node": 2,
    },
    "tiny-cpu with s3 data": {
        "data.source": "s3://bucket/tokens/tiny",
        "cluster.instance_count": 2,
        "cluster.nproc_per_node": 2,
    },
}


# --- the validators --------------------------------------------------------------------------


def closed(schema):
    """The schema with unknown fields refused wherever it lists the known ones (kubectl's strict
    field validation; the API server would otherwise drop a misspelled field without a word)."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: closed(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            result["additionalProperties"] = False
    return result


@cache
def crd_validator(path: Path, version_name: str) -> jsonschema.Draft7Validator:
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == version_name]
    return jsonschema.Draft7Validator(closed(version["schema"]["openAPIV3Schema"]))


def pytorchjob_validator() -> jsonschema.Draft7Validator:
    return crd_validator(CRD, "v1")


def trainjob_pod(job: dict) -> dict:
    """The pod spec Trainer makes of the TrainJob: the runtime's `node` pod template, the trainer's
    image, command, args, env and resourcesPerNode on its `node` container, then the runtime patch
    (pod fields set, volumes and volumeMounts added)."""
    runtime = yaml.safe_load(TORCH_RUNTIME.read_text())
    (node,) = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == "node"]
    pod = copy.deepcopy(node["template"]["spec"]["template"]["spec"])
    (container,) = [c for c in pod["containers"] if c["name"] == "node"]
    trainer = job["spec"]["trainer"]
    container.update(image=trainer["image"], command=trainer["command"], args=trainer["args"])
    container["env"] = [*container.get("env", []), *trainer["env"]]
    container["resources"] = trainer["resourcesPerNode"]
    (patch,) = job["spec"]["runtimePatches"]
    for replicated in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
        assert replicated["name"] == "node", replicated["name"]
        patched = replicated["template"]["spec"]["template"]["spec"]
        for key, value in patched.items():
            if key == "containers":
                for change in value:
                    assert change["name"] == "node", change["name"]
                    container["volumeMounts"] = [*container.get("volumeMounts", []), *change.get("volumeMounts", [])]
                    container["env"] = [*container["env"], *change.get("env", [])]
            elif key == "volumes":
                pod["volumes"] = [*pod.get("volumes", []), *value]
            else:
                pod[key] = value
    return pod


def pod_template_problems(role: str, template: dict) -> list[str]:
    document = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
    return [f"{role} pod template: {p}" for p in schema_problems(document)]


@pytest.fixture(scope="module", autouse=True)
def _schemas_read_once():
    """kubernetes_validate reads and parses the kind's JSON schema and its definitions (2 MB) on
    every `validate`: 1,268 reads in this module. The files do not change; parsed once each."""
    from kubernetes_validate import utils

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(utils, "schema_contents", cache(utils.schema_contents))
        yield


def schema_problems(document: dict) -> list[str]:
    """What the schemas refuse in `document`, one line each (empty: accepted)."""
    kind = document["kind"]
    if kind == "PyTorchJob":
        errors = pytorchjob_validator().iter_errors(document)
        problems = [f"PyTorchJob {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
        for role, replica in document["spec"]["pytorchReplicaSpecs"].items():
            problems += pod_template_problems(role, replica["template"])
        return problems
    if kind == "TrainJob":
        errors = crd_validator(TRAINJOB_CRD, "v1alpha1").iter_errors(document)
        problems = [f"TrainJob {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
        return problems + pod_template_problems("node", {"spec": trainjob_pod(document)})
    try:
        kubernetes_validate.validate(document, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{kind} {'/'.join(map(str, error.path))}: {error.message}"]
    return []


def templates(job: dict) -> dict[str, tuple[int, dict]]:
    if job["kind"] == "TrainJob":
        return {"node": (job["spec"]["trainer"]["numNodes"], trainjob_pod(job))}
    return {role: (r["replicas"], r["template"]["spec"]) for role, r in job["spec"]["pytorchReplicaSpecs"].items()}


def pod_names(job: dict) -> list[str]:
    """The pods' hostnames (and Services): <job>-<role>-<i>, and JobSet's <job>-node-0-<i> for a TrainJob."""
    name = job["metadata"]["name"]
    if job["kind"] == "TrainJob":
        return [f"{name}-node-0-{i}" for i in range(job["spec"]["trainer"]["numNodes"])] + [name]
    return [f"{name}-{role.lower()}-{i}" for role, (count, _) in templates(job).items() for i in range(count)]


def toleration_problems(role: str, pod: dict) -> list[str]:
    """core/v1 ValidateTolerations, which the OpenAPI schema does not express."""
    problems = []
    for t in pod.get("tolerations", []):
        if t.get("operator") == "Exists" and t.get("value"):
            problems.append(f"{role}: toleration {t}: operator Exists takes no value")
        if not t.get("key") and t.get("operator") != "Exists":
            problems.append(f"{role}: toleration {t}: an empty key needs operator Exists")
        if "tolerationSeconds" in t and t.get("effect") != "NoExecute":
            problems.append(f"{role}: toleration {t}: tolerationSeconds needs effect NoExecute")
    return problems


def resource_problems(role: str, container: dict) -> list[str]:
    problems = []
    resources = container.get("resources", {})
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    for name in {**requests, **limits}:
        if name.startswith("hugepages-") and not ({"cpu", "memory"} & set(requests)):
            problems.append(
                f"{role}: {name} without a cpu or memory request (core validation: HugePages require cpu or memory)"
            )
        if EXTENDED.match(name) and requests.get(name) != limits.get(name):
            problems.append(f"{role}: {name} requests {requests.get(name)} != limits {limits.get(name)}")
    return problems


def claim_problems(manifest, pods: int, role: str, pod: dict) -> list[str]:
    problems = []
    claims = {d["metadata"]["name"]: d for d in manifest.documents() if d["kind"] == "PersistentVolumeClaim"}
    volumes = {d["metadata"]["name"]: d for d in manifest.documents() if d["kind"] == "PersistentVolume"}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    for volume in pod["volumes"]:
        if volume["name"] not in mounts:
            problems.append(f"{role}: volume {volume['name']} is never mounted")
        claim_ref = volume.get("persistentVolumeClaim")
        claim = claims.get(claim_ref["claimName"]) if claim_ref else None
        if claim is None:
            continue
        modes = claim["spec"]["accessModes"]
        read_only = claim_ref.get("readOnly") and mounts[volume["name"]].get("readOnly")
        if pods > 1 and "ReadWriteMany" not in modes and not ("ReadOnlyMany" in modes and read_only):
            problems.append(
                f"claim {claim['metadata']['name']} ({modes}) is mounted by {pods} pods: it must be ReadWriteMany"
            )
        if "volumeName" in claim["spec"]:
            bound = volumes[claim["spec"]["volumeName"]]["spec"]
            if bound["claimRef"] != {"namespace": claim["metadata"]["namespace"], "name": claim["metadata"]["name"]}:
                problems.append(f"volume {claim['spec']['volumeName']} is reserved for {bound['claimRef']}")
            if bound["storageClassName"] != "" or claim["spec"]["storageClassName"] != "":
                problems.append(f"claim {claim['metadata']['name']}: static binding needs storageClassName '' on both")
    return problems


def name_problems(manifest) -> list[str]:
    job = manifest.job
    problems = []
    for pod in pod_names(job):  # also its Service's name
        if len(pod) > 63 or not DNS_1035.match(pod):
            problems.append(f"pod and Service name {pod} is not a DNS-1035 label of at most 63 characters")
    for document in manifest.documents():
        name = document["metadata"]["name"]
        if len(name) > 63 or not DNS_SUBDOMAIN.match(name):
            problems.append(f"{document['kind']} name {name} is not a DNS label of at most 63 characters")
        for key, value in document["metadata"].get("labels", {}).items():
            if len(value) > 63 or not DNS_LABEL.match(value):
                problems.append(f"{document['kind']} label {key}={value} is not a valid label value")
    return problems


def core_rule_problems(manifest) -> list[str]:
    """What the API server or scheduler refuses although the schemas allow it."""
    problems = name_problems(manifest)
    replicas = templates(manifest.job)
    pods = sum(count for count, _ in replicas.values())
    for role, (_, pod) in replicas.items():
        (container,) = pod["containers"]
        problems += resource_problems(role, container)
        problems += claim_problems(manifest, pods, role, pod)
        problems += toleration_problems(role, pod)
        names = [e["name"] for e in container["env"]]
        if len(names) != len(set(names)):
            problems.append(f"{role}: an environment variable is set twice")
        if manifest.job["kind"] == "TrainJob" and TORCH_RESERVED_ENV & set(names):
            problems.append(
                f"TrainJob: the trainer env sets {sorted(TORCH_RESERVED_ENV & set(names))}, reserved by Trainer"
            )
    config_maps = [manifest.config_map, *manifest.wheel_config_maps]
    for config_map in config_maps:  # ValidateConfigMap: data plus binaryData, decoded, at most 1 MiB
        size = sum(len(base64.b64decode(value)) for value in config_map["binaryData"].values())
        if size > 1024 * 1024:
            problems.append(f"ConfigMap {config_map['metadata']['name']} holds {size} bytes, more than 1 MiB")
    names = {c["metadata"]["name"] for c in config_maps}
    for role, (_, pod) in replicas.items():  # a pod whose volume names a missing ConfigMap never starts
        for volume in pod["volumes"]:
            sources = [volume] if "configMap" in volume else volume.get("projected", {}).get("sources", [])
            absent = [s["configMap"]["name"] for s in sources if s["configMap"]["name"] not in names]
            problems += [
                f"{role}: volume {volume['name']} needs ConfigMap {name}, which is not created" for name in absent
            ]
    return problems


def wheel_bytes(spec) -> dict[str, bytes]:
    """The job's pinned wheels by file name, as submit reads them (the session's wheel cache)."""
    from launcher.backends.wheelhouse import build, job_wheels

    wheels = job_wheels(spec.resolved)
    return {wheel.file: path.read_bytes() for wheel, path in zip(wheels, build(wheels), strict=True)}


# --- the cases -------------------------------------------------------------------------------


def cases() -> list[tuple[str, str, dict]]:
    found = []
    for recipe in RECIPES:
        if recipe == "tiny-cpu":
            found += [(recipe, label, overrides) for label, overrides in CPU_VARIANTS.items()]
            continue
        multi_node = load(recipe).cluster.instance_count > 1
        variants = {**VARIANTS, **({} if multi_node else {"two nodes": TWO_NODES})}
        for label, overrides in variants.items():
            found.append((recipe, label, overrides))
    return found


@pytest.fixture(scope="module")
def bundle() -> Bundle:
    return Bundle.build('{"real": "entrypoints"}\n')


def settings(spec, **changes) -> ClaimSettings:
    from launcher.backends.k8s.backend import settings_of

    return dataclasses.replace(settings_of(spec), **changes)


@pytest.mark.parametrize(("recipe", "label", "overrides"), cases(), ids=[f"{r}-{v}" for r, v, _ in cases()])
def test_what_submit_creates_passes_schema_and_core_rules(recipe, label, overrides, bundle):
    spec = spec_for(recipe, "k8s", **overrides)
    for claim_settings in (
        settings(spec),
        settings(spec, namespace=NAMESPACE, storage_class="efs-sc", region="us-west-2"),
        settings(spec, namespace=NAMESPACE, auto_resume=True, retries=3, hugepages=True, **CLUSTER_AS_SET_UP),
    ):
        manifest = build_manifest(
            spec, bundle, claim_settings, namespace=NAMESPACE, uid=UID, wheel_data=wheel_bytes(spec)
        )
        problems = [p for d in manifest.documents() for p in schema_problems(d)] + core_rule_problems(manifest)
        assert problems == [], "\n".join(problems)
        assert {d["metadata"].get("namespace") for d in manifest.documents() if d["kind"] != "PersistentVolume"} == {
            NAMESPACE
        }


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_dry_run_of_every_shipped_recipe_renders_and_validates(recipe, fake_bundle):
    spec = spec_for(recipe, "k8s")
    rendering = get_backend("k8s").render(spec)
    documents = list(yaml.safe_load_all(rendering.text))
    assert documents == rendering.data["manifest"]
    problems = [p for d in documents for p in schema_problems(d)]
    assert problems == [], "\n".join(problems)


def test_the_validators_catch_what_they_are_for(bundle):
    """Each check refuses a manifest broken in its one way (else a pass would prove nothing)."""
    spec = spec_for("llama70b-128k", "k8s")
    chosen = settings(spec, storage_class="efs-sc", hugepages=True)
    good = build_manifest(spec, bundle, chosen, namespace=NAMESPACE, uid=UID, wheel_data=wheel_bytes(spec))
    assert core_rule_problems(good) == [] and all(schema_problems(d) == [] for d in good.documents())

    def broken(change) -> list[str]:
        manifest = copy.deepcopy(good)
        change(manifest)
        return [p for d in manifest.documents() for p in schema_problems(d)] + core_rule_problems(manifest)

    def container(m):
        return m.job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]

    assert any(
        "HugePages require" in p
        for p in broken(lambda m: [container(m)["resources"]["requests"].pop(k) for k in ("cpu", "memory")])
    )
    assert any(
        "requests" in p for p in broken(lambda m: container(m)["resources"]["limits"].update({"hugepages-2Mi": "1Gi"}))
    )
    assert any(
        "ReadWriteMany" in p for p in broken(lambda m: m.checkpoint_claim["spec"].update(accessModes=["ReadWriteOnce"]))
    )
    assert any("Additional properties" in p for p in broken(lambda m: m.job["spec"].update(nprocsPerNode="8")))
    assert any("PodTemplate" in p or "pod template" in p for p in broken(lambda m: container(m).update(gpus=8)))
    assert any(
        "ConfigMap" in p
        for p in broken(lambda m: m.config_map["binaryData"].update(x=base64.b64encode(bytes(1024 * 1024)).decode()))
    )
    assert any("DNS" in p for p in broken(lambda m: m.job["metadata"].update(name="9" + "x" * 60)))


def test_a_bundle_too_big_for_a_config_map_is_one_line(home, monkeypatch, tmp_path):
    import os

    import launcher.bundle
    from launcher import api
    from launcher.errors import UsageError

    from .helpers import recipe_path

    entrypoints = tmp_path / "entrypoints"
    entrypoints.mkdir()
    (entrypoints / "train.py").write_text("print('train')\n")
    # 2 MB of incompressible bytes in a Python file (an allowlisted name): a 2.7 MB ConfigMap before.
    (entrypoints / "blob.py").write_text(f"BLOB = {os.urandom(1 << 20).hex()!r}\n")
    monkeypatch.setattr(launcher.bundle, "find_entrypoints", lambda: entrypoints)
    with pytest.raises(
        UsageError, match=r"^the code bundle is 1\.\d\d MiB, more than the 1 MiB a Kubernetes ConfigMap holds; "
    ):
        api.submit(recipe_path("tiny-cpu"), backend="k8s", dry_run=True)


def test_pods_get_the_jobs_stop_grace_and_exec_torchrun_through_the_bootstrap(bundle):
    """Kubernetes' default terminationGracePeriodSeconds is 30 s; 70B's step and save need ~7 min."""
    spec = spec_for("llama70b-128k", "k8s")
    job = build_manifest(spec, bundle, settings(spec), namespace=NAMESPACE, uid=UID, wheel_data=wheel_bytes(spec)).job
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == spec.stop_grace_s > 300
        args = pod["containers"][0]["args"]
        assert args[:4] == ["python3", "entrypoints/bootstrap.py", "--exec", "torchrun"]
        assert f"--shutdown-timeout={spec.stop_grace_s - 20}" in args
    assert spec.resolved["runtime"]["stop_budget_s"] == spec.stop_grace_s - 20


# --- Kubernetes as clusters are set up (issue 27, build part 4) ---------------------------------


def job_pods(job: dict) -> list[dict]:
    return [pod for _, pod in templates(job).values()]


def test_hyperpod_auto_resume_annotates_the_job_and_restarts_its_pods_on_failure(bundle, fake_bundle):
    """HyperPod reads the two annotations (aws/sagemaker-hyperpod-cli command_constants.py) and
    needs restartPolicy OnFailure, which the operator counts against backoffLimit."""
    plain = spec_for("llama70b-128k", "k8s")
    job = build_manifest(plain, bundle, settings(plain)).job
    assert "annotations" not in job["metadata"] and job["spec"]["runPolicy"]["backoffLimit"] == 0
    assert all("affinity" not in pod for pod in job_pods(job))
    assert {r["restartPolicy"] for r in job["spec"]["pytorchReplicaSpecs"].values()} == {"Never"}
    for overrides, retries in (({}, 1), ({"k8s.retries": 4}, 4)):
        spec = spec_for("llama70b-128k", "k8s", **{"k8s.auto_resume": True, **overrides})
        job = build_manifest(spec, bundle, settings(spec)).job
        assert job["metadata"]["annotations"] == {
            "sagemaker.amazonaws.com/enable-job-auto-resume": "true",
            "sagemaker.amazonaws.com/job-max-retry-count": str(retries),
        }
        assert {r["restartPolicy"] for r in job["spec"]["pytorchReplicaSpecs"].values()} == {"OnFailure"}
        assert job["spec"]["runPolicy"]["backoffLimit"] == retries
        for pod in job_pods(job):  # only nodes HyperPod's health agents call Schedulable
            (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                "nodeSelectorTerms"
            ]
            assert term["matchExpressions"] == [
                {"key": "sagemaker.amazonaws.com/node-health-status", "operator": "In", "values": ["Schedulable"]}
            ]
        assert [p for p in schema_problems(job)] == []
    for namespace, warned in (("team-a", True), ("kubeflow", False), ("hyperpod-ns-team", False)):
        spec = spec_for("llama70b-128k", "k8s", **{"k8s.auto_resume": True, "k8s.namespace": namespace})
        warnings = get_backend("k8s").render(spec).data.get("warnings", [])
        assert (
            any(w.startswith("k8s.auto_resume: HyperPod resumes only jobs in the namespace kubeflow") for w in warnings)
            == warned
        )


def test_a_finished_job_deletes_its_running_pods():
    """cleanPodPolicy None kept the healthy pods (and their GPUs) after one pod failed."""
    spec = spec_for("llama70b-128k", "k8s")
    job = build_manifest(spec, Bundle.build("{}\n"), settings(spec)).job
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"


def test_node_selector_and_tolerations_reach_every_pod_and_huge_pages_are_asked_for_only_on_request(bundle):
    tolerations = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "value": "training", "effect": "NoExecute", "tolerationSeconds": 300},
    ]
    selector = {"node.kubernetes.io/instance-type": "ml.p5.48xlarge", "pool": "gpu"}
    for api in ("pytorchjob", "trainjob"):
        spec = spec_for(
            "llama70b-128k", "k8s", **{"k8s.node_selector": selector, "k8s.tolerations": tolerations, "k8s.api": api}
        )
        manifest = build_manifest(
            spec, bundle, settings(spec), namespace=NAMESPACE, uid=UID, wheel_data=wheel_bytes(spec)
        )
        pods = job_pods(manifest.job)
        assert len(pods) == (2 if api == "pytorchjob" else 1)
        for pod in pods:
            assert pod["nodeSelector"] == selector
            assert pod["tolerations"] == [
                {"operator": "Exists", **tolerations[0]},
                {"operator": "Equal", **tolerations[1]},
            ]
            (container,) = pod["containers"]
            assert "hugepages-2Mi" not in container["resources"]["limits"]
            assert container["resources"]["limits"]["vpc.amazonaws.com/efa"] == 32  # EFA stays
        problems = [p for d in manifest.documents() for p in schema_problems(d)] + core_rule_problems(manifest)
        assert problems == [], "\n".join(problems)
    spec = spec_for("llama70b-128k", "k8s", **{"k8s.hugepages": True})
    for pod in job_pods(build_manifest(spec, bundle, settings(spec)).job):
        assert pod["containers"][0]["resources"]["limits"]["hugepages-2Mi"] == "5120Mi"


def test_the_mountpoint_volume_is_told_the_recipes_region(bundle):
    """Mountpoint takes the bucket's region as the mount option `region REGION`
    (awslabs/mountpoint-s3-csi-driver examples/kubernetes/static_provisioning/static_provisioning.yaml)."""
    spec = spec_for("tiny-cpu", "k8s", **{"data.source": "s3://bucket/tokens", "sagemaker.region": "eu-central-1"})
    (volume,) = [d for d in build_manifest(spec, bundle, settings(spec)).documents() if d["kind"] == "PersistentVolume"]
    assert volume["spec"]["mountOptions"] == ["read-only", "prefix tokens/", "region eu-central-1"]


TRAINJOB_CASES = [
    ("tiny-cpu", {"cluster.instance_count": 2, "cluster.nproc_per_node": 2, "data.source": "s3://bucket/tokens/tiny"}),
    ("llama70b-128k", {}),
    ("llama3-8b-8k", {"data.source": "/fsx/tokens"}),
]


@pytest.mark.parametrize(("recipe", "overrides"), TRAINJOB_CASES, ids=[r for r, _ in TRAINJOB_CASES])
def test_a_trainjob_passes_the_trainer_crd_its_runtime_and_the_core_rules(recipe, overrides, bundle):
    spec = spec_for(recipe, "k8s", **{"k8s.api": "trainjob", **overrides})
    for claim_settings in (settings(spec), settings(spec, storage_class="efs-sc", **CLUSTER_AS_SET_UP)):
        manifest = build_manifest(
            spec, bundle, claim_settings, namespace=NAMESPACE, uid=UID, wheel_data=wheel_bytes(spec)
        )
        job = manifest.job
        assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
        assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
        assert job["spec"]["trainer"]["numNodes"] == spec.resources.instance_count
        owned = [d for d in manifest.owned()]
        assert {r["kind"] for d in owned for r in d["metadata"]["ownerReferences"]} == {"TrainJob"}
        problems = [p for d in manifest.documents() for p in schema_problems(d)] + core_rule_problems(manifest)
        assert problems == [], "\n".join(problems)
    # torchrun's endpoint is the node-0 address Trainer's torch plugin gives as PET_MASTER_ADDR.
    endpoints = [a for a in job["spec"]["trainer"]["args"] if a.startswith("--rdzv-endpoint=")]
    if spec.resources.instance_count > 1:
        assert endpoints == [f"--rdzv-endpoint={spec.name}-node-0-0.{spec.name}:29500"]


def test_the_trainjob_checks_catch_what_they_are_for(bundle):
    spec = spec_for("llama70b-128k", "k8s", **{"k8s.api": "trainjob"})
    good = build_manifest(
        spec, bundle, settings(spec, **CLUSTER_AS_SET_UP), namespace=NAMESPACE, uid=UID, wheel_data=wheel_bytes(spec)
    )
    assert core_rule_problems(good) == [] and all(schema_problems(d) == [] for d in good.documents())

    def broken(change) -> list[str]:
        manifest = copy.deepcopy(good)
        change(manifest)
        return [p for d in manifest.documents() for p in schema_problems(d)] + core_rule_problems(manifest)

    def patch(m):
        return m.job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]

    assert any("Additional properties" in p for p in broken(lambda m: m.job["spec"]["trainer"].update(nodes=2)))
    assert any("runtimeRef" in p for p in broken(lambda m: m.job["spec"].pop("runtimeRef")))
    assert any(
        "node pod template" in p
        for p in broken(lambda m: patch(m)["template"]["spec"]["template"]["spec"].update(nodeSelector=["x"]))
    )
    assert any(
        "reserved by Trainer" in p
        for p in broken(lambda m: m.job["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "4"}))
    )
    assert any(
        "operator Exists takes no value" in p
        for p in broken(
            lambda m: patch(m)["template"]["spec"]["template"]["spec"]["tolerations"].append(
                {"key": "a", "operator": "Exists", "value": "b"}
            )
        )
    )
    assert any("pod and Service name" in p for p in broken(lambda m: m.job["metadata"].update(name="t" + "x" * 55)))


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ('k8s.api="jobset"', "k8s.api: expected 'pytorchjob' or 'trainjob', got 'jobset'"),
        (
            'k8s.tolerations=[{"key": "a", "operator": "Exists", "value": "b"}]',
            "k8s.tolerations.0: a toleration with operator Exists takes no value; use operator Equal or drop value",
        ),
        ('k8s.tolerations=[{"key": "a", "tolerationSeconds": 5}]', "k8s.tolerations.0: tolerationSeconds needs effect NoExecute"),
        ('k8s.tolerations=[{"value": "a"}]', "k8s.tolerations.0: a toleration without a key must have operator Exists"),
        ('k8s.tolerations=[{"key": "a", "operator": "Lt"}]', "k8s.tolerations.0.operator: expected 'Exists' or 'Equal', got 'Lt'"),
        ('k8s.node_selector={"bad key": "x"}', "k8s.node_selector.bad key: 'bad key' is not a Kubernetes label key: "),
        ('k8s.node_selector={"pool": "-gpu"}', "k8s.node_selector.pool: '-gpu' is not a Kubernetes label value: "),
        ("k8s.retries=101", "k8s.retries: expected at most 100, got 101"),
    ],
)  # fmt: skip
def test_a_bad_k8s_value_is_one_line_naming_the_key_and_what_is_valid(option, message, cli):
    from .helpers import recipe_path

    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "k8s", "--dry-run", "--set", option)
    assert result.code == 2 and len(result.err_lines) == 1, result.err
    assert result.err_lines[0].startswith("--set/--backend " + message), result.err_lines[0]


def test_what_a_trainjob_cannot_do_is_one_line_before_anything_is_rendered(cli):
    from .helpers import recipe_path

    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "k8s", "--dry-run", "--set", 'k8s.api="trainjob"',
                 "--set", "k8s.auto_resume=true")  # fmt: skip
    assert result.code == 2 and result.err_lines[-1] == (
        "k8s.auto_resume: HyperPod's job auto-resume reads PyTorchJob annotations (training operator 1.7 to 1.8.1); "
        "use k8s.api: pytorchjob with it, or auto_resume: false with trainjob"
    ), result.err


def test_the_k8s_settings_read_back_from_a_saved_spec_and_a_damaged_toleration_is_one_line(home):
    from launcher.errors import LauncherError
    from launcher.registry import job_dir, write_json

    overrides = {
        "k8s.auto_resume": True,
        "k8s.retries": 2,
        "k8s.node_selector": {"pool": "gpu"},
        "k8s.tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "k8s.hugepages": True,
        "sagemaker.region": "eu-west-1",
    }
    spec = spec_for("llama70b-128k", "k8s", **overrides)
    assert spec.engine.tolerations == (Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),)
    path = job_dir(spec.name) / "spec.json"
    write_json(path, spec.to_dict())
    backend = get_backend("k8s")
    assert backend.saved_spec(spec.name) == spec
    data = spec.to_dict()
    data["engine"]["tolerations"] = [{"key": "a", "sudo": True}]
    write_json(path, data)
    with pytest.raises(LauncherError) as raised:
        backend.saved_spec(spec.name)
    assert str(raised.value).startswith(f"{path}: ") and "engine.tolerations: expected Toleration mappings" in str(
        raised.value
    )
    assert "\n" not in str(raised.value)
