"""How a job is handed the pinned wheels its image lacks, and how the container reads them back.

The launcher writes (launcher/backends/wheelhouse.py, and the k8s manifest for a wheel in
parts); entrypoints/bootstrap.py reads, installs offline and trusts a file only by its sha256.

- LAUNCHER_REQUIREMENTS: the `name==version` pins, space-separated;
- LAUNCHER_WHEELHOUSE: the directory holding them (a channel, a bind, a shared directory, a
  projected ConfigMap volume);
- LAUNCHER_WHEEL_SHA256: the sha256 of every wheel file the job pins, space-separated.

A wheel may come in parts, `<file>.part000`, `<file>.part001`, ...: a Kubernetes ConfigMap holds
at most 1 MiB (ValidateConfigMap in kubernetes/kubernetes pkg/apis/core/validation/validation.go),
and torchao's wheel is 3.4 MB. The bootstrap joins the parts in order before the check.
"""

from __future__ import annotations

import re

ENV_REQUIREMENTS = "LAUNCHER_REQUIREMENTS"
ENV_WHEELHOUSE = "LAUNCHER_WHEELHOUSE"
ENV_WHEEL_SHA256 = "LAUNCHER_WHEEL_SHA256"

# A ConfigMap key: [-._a-zA-Z0-9]+ (IsConfigMapKey), which wheel file names are.
PART = re.compile(r"^(?P<file>[-._a-zA-Z0-9]+\.whl)\.part(?P<index>\d{3})$")
MAX_PARTS = 1000


def part_name(file: str, index: int) -> str:
    """The name of part `index` (from 0) of wheel `file`."""
    if not 0 <= index < MAX_PARTS:
        raise ValueError(f"part {index} of {file}: a wheel has at most {MAX_PARTS} parts")
    return f"{file}.part{index:03d}"
