"""A container engine for the tests: podman behind a `docker` command, and a local training image.

No registry is reachable here, so the image is made on the spot: an empty root filesystem
(`podman import`) whose PATH starts at a venv of this machine's Python (tests/engines/image.py:
the test environment's packages without torchao and the launcher, as in a PyTorch DLC), with the
DLC's entrypoint: bash as PID 1 running the command through `eval` (DLC_START_SCRIPT). The
engine's configuration (containers.conf) binds what that Python needs, read-only and at the same
paths: /usr, /lib, /lib64, /bin, the venvs and the base Python. So the launcher's exact
`docker run ...` argv runs unchanged; only `docker` on PATH is this wrapper.

The configuration is what works on these machines (../shared/KNOWLEDGE.md): runc rather than
crun, cgroupfs rather than systemd, no default ulimits (podman as root raises nofile and nproc
past what a process without CAP_SYS_RESOURCE may set), and logs in files, not the journal. The
image store is the machine's own: a private one (`--root` elsewhere, sharing podman's /run/libpod
with the default one) left the first container's exit unrecorded in every test run here, so
podman's `logs --follow` never ended. The fixture removes its image and that image's containers instead.

Needs root, podman and runc (CI installs them); elsewhere the tests skip and say why.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .image import build_image

RUNC_PATHS = ("/usr/sbin/runc", "/usr/bin/runc")
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/bin")


@dataclass(frozen=True)
class ContainerEngine:
    bin_dir: Path
    """Holds `docker`: podman with this configuration. Put it first on PATH."""
    config: Path
    image: str
    """The local training image: `--set cluster.image=<this>`."""
    podman: str

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        env = {**os.environ, "CONTAINERS_CONF": str(self.config)}
        return subprocess.run(
            [self.podman, *args], env=env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def remove_containers_of_the_image(self) -> None:
        ids = self.run("ps", "--all", "--quiet", "--filter", f"ancestor={self.image}", check=False).stdout.split()
        if ids:
            self.run("rm", "--force", "--time", "0", *ids, check=False)


def missing_engine_reason() -> str | None:
    """Why the container tests cannot run here, or None."""
    if os.geteuid() != 0:
        return f"the container engine tests need root (running as uid {os.geteuid()}), as CI runs"
    if shutil.which("podman") is None:
        return "podman is not installed (CI: apt-get install -y podman runc)"
    if runc() is None:
        return "runc is not installed (CI: apt-get install -y runc)"
    return None


def runc() -> str | None:
    return next((path for path in RUNC_PATHS if os.access(path, os.X_OK)), None) or shutil.which("runc")


def bound_paths(*extra: Path) -> list[str]:
    """Directories the image's Python needs, outermost only (a path inside another is already bound)."""
    candidates = [Path(p) for p in SYSTEM_DIRS if os.path.exists(p)]
    candidates += [Path(os.path.realpath(p)) for p in (sys.prefix, sys.base_prefix, *extra)]
    chosen: list[Path] = []
    for path in sorted(set(candidates), key=lambda p: len(p.parts)):
        if not any(path == outer or outer in path.parents for outer in chosen):
            chosen.append(path)
    return [str(path) for path in chosen]


def write_config(path: Path, volumes: list[str]) -> Path:
    """containers.conf: the engine settings above and the read-only binds of the image's Python."""
    binds = ", ".join(json.dumps(f"{volume}:{volume}:ro") for volume in volumes)
    path.write_text(
        "[containers]\n"
        "default_ulimits = []\n"
        'log_driver = "k8s-file"\n'
        f"volumes = [{binds}]\n"
        "[engine]\n"
        f'runtime = "{runc()}"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
    )
    return path


# The PyTorch DLC's start script, as it behaves for any command but SageMaker's `train`: it
# runs the command with `eval "$@"`, without exec, so bash stays PID 1 (aws/deep-learning-containers,
# scripts/pytorch/start_with_right_hostname.sh, whose other branches need a GPU or `train`).
# The image runs it as the DLC does, `ENTRYPOINT ["bash", "-m", "start_with_right_hostname.sh"]`
# (found on PATH, the Dockerfile copies it to /usr/local/bin; /usr here is the host's, so it
# lives in DLC_BIN). As PID 1 with no handler for SIGTERM, bash never sees docker stop's SIGTERM.
DLC_BIN = "/opt/dlc/bin"
DLC_START_SCRIPT = '#!/usr/bin/env bash\n# the DLC start script\'s last branch: no exec\neval "$@"\n'
DLC_ENTRYPOINT = '["bash", "-m", "start_with_right_hostname.sh"]'


def root_filesystem() -> bytes:
    """An almost empty root: /tmp for temporary files, root's passwd entry (getpass needs one),
    and the DLC's start script."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        directories = (("tmp", 0o1777), ("etc", 0o755), ("opt", 0o755), ("opt/dlc", 0o755), ("opt/dlc/bin", 0o755))
        for name, mode in (*directories, ("root", 0o700)):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        files = (
            ("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n", 0o644),
            ("etc/group", "root:x:0:\n", 0o644),
            (f"{DLC_BIN.lstrip('/')}/start_with_right_hostname.sh", DLC_START_SCRIPT, 0o755),
        )
        for name, text, mode in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(text), mode
            tar.addfile(info, io.BytesIO(text.encode()))
    return buffer.getvalue()


def start_engine(workdir: Path) -> ContainerEngine:
    """The configuration, the `docker` wrapper and the imported image, under `workdir`."""
    podman = shutil.which("podman")
    assert podman is not None
    venv = build_image(Path(sys.prefix), workdir / "image-venv")
    config = write_config(workdir / "containers.conf", bound_paths(venv))
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "docker"
    wrapper.write_text(f'#!/bin/sh\nCONTAINERS_CONF={config} exec {podman} "$@"\n')
    wrapper.chmod(0o755)
    image = f"localhost/launcher-test-python:{uuid.uuid4().hex[:8]}"  # unique in the shared store
    engine = ContainerEngine(bin_dir, config, image, podman)
    (workdir / "rootfs.tar").write_bytes(root_filesystem())
    path = f"{venv}/bin:{DLC_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    changes = [f"ENV PATH={path}", "ENV HOME=/root", f"ENTRYPOINT {DLC_ENTRYPOINT}", 'CMD ["/bin/bash"]']
    engine.run(
        "import", *[a for change in changes for a in ("--change", change)], str(workdir / "rootfs.tar"), engine.image
    )
    return engine


def container_engine(tmp_path_factory) -> Iterator[ContainerEngine]:
    """For a fixture: podman as `docker`, and a local image of this machine's Python; removed
    afterwards, with every container made from that image, whether the tests passed or not."""
    reason = missing_engine_reason()
    if reason is not None:
        pytest.skip(reason)
    engine = start_engine(tmp_path_factory.mktemp("container-engine"))
    try:
        yield engine
    finally:
        engine.remove_containers_of_the_image()
        engine.run("rmi", "--force", engine.image, check=False)
