"""The wheel channel on Kubernetes: the job's pinned wheels (torchao for FP8) as ConfigMap parts.

A pod reads nothing from the launcher's machine, and a private cluster may reach no package
index, so the wheels travel in the API server as the code bundle does. One ConfigMap holds at
most 1 MiB of data (ValidateConfigMap, kubernetes/kubernetes pkg/apis/core/validation/validation.go)
and torchao's wheel is 3.4 MB: each wheel is cut into parts of at most 1 MiB, one part per
ConfigMap (`<job>-wheel-<n>`, key `<file>.part<NNN>`, launcher.contract.wheels), and one
projected volume shows every part in one read-only directory (kubernetes.io/docs/concepts/
storage/projected-volumes). entrypoints/bootstrap.py joins the parts in order and installs the
wheel only if its sha256 is the pinned one.

The ConfigMaps are immutable (the kubelet then stops watching them: kubernetes.io/docs/concepts/
configuration/configmap/#configmap-immutable) and owned by the job, so they go with it. A dry
run counts the parts from the catalog's sizes and shows placeholders for their bytes.

Each part also fits the store behind the API server: etcd refuses a request over 1.5 MiB by
default (etcd.io/docs/latest/dev-guide/limit, --max-request-bytes), and the API server keeps a
ConfigMap's binaryData as raw bytes in its protobuf encoding, so a 1 MiB part and its metadata
stay under it. The cost is the wheels' size in etcd (3.4 MB for torchao) while the job exists.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.backends.wheelhouse import Wheel
from launcher.contract.wheels import part_name

WHEELS_DIR = "/opt/launcher/wheels"
VOLUME = "wheels"
# The API server refuses a ConfigMap whose data adds up to more than 1 MiB (binaryData decoded):
# `totalSize > core.MaxSecretSize`, so a part of exactly 1 MiB is accepted.
MAX_CONFIG_MAP_BYTES = 1024 * 1024


@dataclass(frozen=True)
class WheelPart:
    config_map: str
    key: str
    value: str
    """base64 of the part's bytes; in a dry run, a placeholder that says which bytes."""


def wheel_parts(job_name: str, wheels: tuple[Wheel, ...], data: Mapping[str, bytes] | None) -> list[WheelPart]:
    """Every part of every wheel, one ConfigMap each, in order. `data`: each wheel file's bytes
    (submit), or None (a dry run, which downloads nothing)."""
    parts = []
    for wheel in wheels:
        content = data[wheel.file] if data is not None else None
        if content is not None and len(content) != wheel.size:
            raise ValueError(f"{wheel.file}: {len(content)} bytes, not the catalog's {wheel.size}")
        for index in range(max(1, math.ceil(wheel.size / MAX_CONFIG_MAP_BYTES))):
            start = index * MAX_CONFIG_MAP_BYTES
            end = min(wheel.size, start + MAX_CONFIG_MAP_BYTES)
            if content is None:
                value = f"<bytes {start} to {end - 1} of {wheel.file}, read by submit>"
            else:
                value = base64.b64encode(content[start:end]).decode()
            parts.append(WheelPart(f"{job_name}-wheel-{len(parts)}", part_name(wheel.file, index), value))
    return parts


def wheel_volume(parts: list[WheelPart]) -> tuple[list[dict], list[dict]]:
    """(the container's volumeMounts, the pod's volumes) that show the parts in WHEELS_DIR."""
    if not parts:
        return [], []
    mount = {"name": VOLUME, "mountPath": WHEELS_DIR, "readOnly": True}
    volume = {"name": VOLUME, "projected": {"sources": [{"configMap": {"name": p.config_map}} for p in parts]}}
    return [mount], [volume]
