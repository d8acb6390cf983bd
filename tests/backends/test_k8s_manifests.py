"""Every manifest the k8s backend renders is one an API server accepts.

- core objects (ConfigMap, PersistentVolume, PersistentVolumeClaim, and each pod template as a
  v1 PodTemplate) against the Kubernetes OpenAPI schemas of `kubernetes-validate`, strict (kubectl
  validates strictly by default: unknown fields are errors);
- the PyTorchJob against the openAPIV3Schema of the training operator's CRD (schemas/README.md),
  with unknown fields refused as well;
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
from launcher.bundle import Bundle

from .helpers import load, spec_for

KUBERNETES = "1.37.0"
CRD = Path(__file__).resolve().parent / "schemas" / "kubeflow.org_pytorchjobs.yaml"
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
def pytorchjob_validator() -> jsonschema.Draft7Validator:
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(closed(version["schema"]["openAPIV3Schema"]))


def schema_problems(document: dict) -> list[str]:
    """What the schemas refuse in `document`, one line each (empty: accepted)."""
    kind = document["kind"]
    if kind == "PyTorchJob":
        errors = pytorchjob_validator().iter_errors(document)
        problems = [f"PyTorchJob {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
        for role, replica in document["spec"]["pytorchReplicaSpecs"].items():
            template = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": replica["template"],
            }
            problems += [f"{role} pod template: {p}" for p in schema_problems(template)]
        return problems
    try:
        kubernetes_validate.validate(document, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{kind} {'/'.join(map(str, error.path))}: {error.message}"]
    return []


def templates(job: dict) -> dict[str, tuple[int, dict]]:
    return {role: (r["replicas"], r["template"]["spec"]) for role, r in job["spec"]["pytorchReplicaSpecs"].items()}


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
    for role, (replicas, _) in templates(job).items():
        for index in range(replicas):
            pod = f"{job['metadata']['name']}-{role.lower()}-{index}"  # also its Service's name
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
        names = [e["name"] for e in container["env"]]
        if len(names) != len(set(names)):
            problems.append(f"{role}: an environment variable is set twice")
    data = manifest.config_map["binaryData"]
    size = sum(len(base64.b64decode(value)) for value in data.values())
    if size > 1024 * 1024:
        problems.append(f"ConfigMap holds {size} bytes, more than 1 MiB")
    return problems


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
    ):
        manifest = build_manifest(spec, bundle, claim_settings, namespace=NAMESPACE, uid=UID)
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
    good = build_manifest(spec, bundle, settings(spec, storage_class="efs-sc"), namespace=NAMESPACE, uid=UID)
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
    job = build_manifest(spec, bundle, settings(spec), namespace=NAMESPACE, uid=UID).job
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == spec.stop_grace_s > 300
        args = pod["containers"][0]["args"]
        assert args[:4] == ["python3", "entrypoints/bootstrap.py", "--exec", "torchrun"]
        assert f"--shutdown-timeout={spec.stop_grace_s - 20}" in args
    assert spec.resolved["runtime"]["stop_budget_s"] == spec.stop_grace_s - 20
