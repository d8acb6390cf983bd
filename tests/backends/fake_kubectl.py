#!/usr/bin/env python3
"""A stand-in `kubectl` over a tiny in-file API server: what the k8s backend's calls need.

State lives in $FAKE_KUBECTL_STATE/objects.json; every call is appended to calls.jsonl. It
answers as kubectl does: `create -f -` (refusing a name that exists and a ConfigMap over 1 MiB,
giving each object a uid, `-o json` printing it; kubectl sends a stream's objects one by one,
and here those before a refused one stay created), `get KIND [NAME] -o json` (NotFound as
kubectl words it), `delete`
(owned objects go with their owner, as the garbage collector does), `config view --minify`.
$FAKE_KUBECTL_NAMESPACE is the context's namespace; $FAKE_KUBECTL_FAIL=<text in the argv or stdin>
makes matching calls fail with kubectl's text for an unreachable server.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import uuid
from pathlib import Path

import yaml

KINDS = {
    "pytorchjob": "PyTorchJob", "pytorchjobs": "PyTorchJob",
    "pvc": "PersistentVolumeClaim", "persistentvolumeclaim": "PersistentVolumeClaim",
    "pv": "PersistentVolume", "persistentvolume": "PersistentVolume",
    "configmap": "ConfigMap", "configmaps": "ConfigMap",
    "trainjobs.trainer.kubeflow.org": "TrainJob", "trainjob": "TrainJob",
}  # fmt: skip
PLURAL = {"PyTorchJob": "pytorchjobs.kubeflow.org", "PersistentVolumeClaim": "persistentvolumeclaims",
          "PersistentVolume": "persistentvolumes", "ConfigMap": "configmaps",
          "TrainJob": "trainjobs.trainer.kubeflow.org"}  # fmt: skip
CLUSTER_SCOPED = {"PersistentVolume"}
UNREACHABLE = (
    'E1130 07:57:04.883126   24727 memcache.go:265] "Unhandled Error" err="couldn\'t get current server API group list: '
    'Get \\"http://localhost:8080/api?timeout=32s\\": dial tcp 127.0.0.1:8080: connect: connection refused"\n'
) * 5 + "The connection to the server localhost:8080 was refused - did you specify the right host or port?\n"


def option(args: list[str], *names: str) -> str | None:
    for i, arg in enumerate(args):
        if arg in names and i + 1 < len(args):
            return args[i + 1]
        for name in names:
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def positional(args: list[str]) -> list[str]:
    takes_value = {"--namespace", "-n", "--output", "-o", "--filename", "-f", "--selector", "-l", "--container", "-c"}
    found, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif not arg.startswith("-"):
            found.append(arg)
    return found


def key(kind: str, namespace: str, name: str) -> str:
    return f"{kind}/{'' if kind in CLUSTER_SCOPED else namespace}/{name}"


def main(args: list[str]) -> int:
    state = Path(os.environ["FAKE_KUBECTL_STATE"])
    path = state / "objects.json"
    objects = json.loads(path.read_text()) if path.exists() else {}
    namespace = option(args, "--namespace", "-n") or os.environ.get("FAKE_KUBECTL_NAMESPACE", "default")
    verb, *rest = positional(args)
    stdin = sys.stdin.read() if verb == "create" else ""  # only create reads a manifest
    with open(state / "calls.jsonl", "a") as calls:
        calls.write(json.dumps({"argv": args, "stdin": stdin}) + "\n")
    fail = os.environ.get("FAKE_KUBECTL_FAIL")
    if fail and (fail in " ".join(args) or fail in stdin):
        sys.stderr.write(UNREACHABLE)
        return 1
    code = VERBS[verb](objects, rest, args, namespace, stdin)
    path.write_text(json.dumps(objects))
    return code


def config_map_too_long(document: dict) -> bool:
    """The API server's ValidateConfigMap (kubernetes/kubernetes pkg/apis/core/validation/validation.go):
    data plus binaryData (decoded) over core.MaxSecretSize, 1 MiB, is refused."""
    if document["kind"] != "ConfigMap":
        return False
    size = sum(len(v.encode()) for v in document.get("data", {}).values())
    size += sum(len(base64.b64decode(v)) for v in document.get("binaryData", {}).values())
    return size > 1024 * 1024


def create(objects, rest, args, namespace, stdin) -> int:
    created = []
    for document in yaml.safe_load_all(stdin):
        meta = document["metadata"]
        ns = meta.setdefault("namespace", namespace) if document["kind"] not in CLUSTER_SCOPED else ""
        if ns != namespace and document["kind"] not in CLUSTER_SCOPED:
            sys.stderr.write("error: the namespace from the provided object does not match the namespace given\n")
            return 1
        name = key(document["kind"], ns, meta["name"])
        if config_map_too_long(document):
            sys.stderr.write(
                f'The ConfigMap "{meta["name"]}" is invalid: []: Too long: must have at most 1048576 bytes\n'
            )
            return 1
        if name in objects:
            sys.stderr.write(
                f'Error from server (AlreadyExists): {PLURAL[document["kind"]]} "{meta["name"]}" already exists\n'
            )
            return 1
        meta["uid"] = str(uuid.uuid4())
        objects[name] = document
        created.append(document)
    if option(args, "--output", "-o") == "json":
        print(json.dumps(created[0] if len(created) == 1 else {"kind": "List", "items": created}))
    return 0


def get(objects, rest, args, namespace, stdin) -> int:
    kind = KINDS[rest[0]]
    if len(rest) > 1:
        found = objects.get(key(kind, namespace, rest[1]))
        if found is None:
            sys.stderr.write(f'Error from server (NotFound): {PLURAL[kind]} "{rest[1]}" not found\n')
            return 1
        print(json.dumps(found))
        return 0
    selector = dict(p.split("=", 1) for p in (option(args, "--selector", "-l") or "").split(",") if p)
    items = [o for k, o in objects.items() if k.startswith(key(kind, namespace, ""))
             and selector.items() <= o["metadata"].get("labels", {}).items()]  # fmt: skip
    print(json.dumps({"kind": "List", "items": items}))
    return 0


def delete(objects, rest, args, namespace, stdin) -> int:
    kind = KINDS[rest[0]]
    selector = dict(p.split("=", 1) for p in (option(args, "--selector", "-l") or "").split(",") if p)
    names = [key(kind, namespace, rest[1])] if len(rest) > 1 else [
        k for k, o in objects.items() if k.startswith(key(kind, namespace, "")) and selector.items() <= o["metadata"].get("labels", {}).items()
    ]  # fmt: skip
    for name in names:
        if name not in objects:
            if "--ignore-not-found" in args:
                continue
            sys.stderr.write(f'Error from server (NotFound): {PLURAL[kind]} "{name.rsplit("/", 1)[1]}" not found\n')
            return 1
        uid = objects.pop(name)["metadata"]["uid"]
        for owned in [
            k for k, o in objects.items() if any(r["uid"] == uid for r in o["metadata"].get("ownerReferences", []))
        ]:
            objects.pop(owned)
        print(f'{PLURAL[kind]} "{name.rsplit("/", 1)[1]}" deleted')
    return 0


def config(objects, rest, args, namespace, stdin) -> int:
    print(os.environ.get("FAKE_KUBECTL_NAMESPACE", ""), end="")
    return 0


def logs(objects, rest, args, namespace, stdin) -> int:
    print(os.environ.get("FAKE_KUBECTL_LOGS") or f"logs of {rest[0] if rest else option(args, '--selector', '-l')}")
    return 0


VERBS = {"create": create, "get": get, "delete": delete, "config": config, "logs": logs}

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
