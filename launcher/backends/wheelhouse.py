"""Pinned wheels the training image lacks (torchao for FP8), fetched once and cached by content.

Every backend ships them (the wheel channel): SageMaker as the `wheels` channel, docker as a
read-only bind, Slurm in a directory on `slurm.shared_dir`, Kubernetes on the job's claim. The
pins live in backends/dlc_images.yaml with each wheel's file name, sha256 and the resolved-config
key that makes a job need it (`needed_when`), so a dry run names the job's wheelhouse without any
download, a new wheel is one entry there, and `pip download` output is checked against them. The
cache is `$LAUNCHER_HOME/wheelhouse/<sha256>/<file>`: one download per pinned wheel, reused by
every job. Inside the container, entrypoints/bootstrap.py installs them with
`pip install --no-index`, so this also works under network isolation.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from launcher.backends.images import image_catalog
from launcher.contract.wheels import ENV_REQUIREMENTS, ENV_WHEEL_SHA256, ENV_WHEELHOUSE
from launcher.errors import LauncherError
from launcher.registry import launcher_home


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    file: str
    sha256: str
    size: int
    platform: str
    python: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def pinned(name: str) -> Wheel:
    """The catalog's pin for `name`, for the default training image's platform and Python."""
    catalog = image_catalog()
    entry = catalog["wheels"][name]
    return Wheel(
        name=name,
        version=str(entry["version"]),
        file=entry["file"],
        sha256=entry["sha256"],
        size=int(entry["size"]),
        platform=catalog["wheel_platform"],
        python=str(catalog["python"]),
    )


def needed_by(resolved: dict, key: str) -> bool:
    """Whether the resolved config's dotted `key` (e.g. precision.fp8) is set to something true."""
    value: object = resolved
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return bool(value)


def job_wheels(resolved: dict) -> tuple[Wheel, ...]:
    """The wheels a job needs beyond the image, in the catalog's order: each pin whose
    `needed_when` key the resolved config sets (torchao for precision.fp8, tensorboard and the
    absl-py it imports for tracking.tensorboard)."""
    wheels = image_catalog()["wheels"]
    return tuple(pinned(name) for name, entry in wheels.items() if needed_by(resolved, entry["needed_when"]))


def wheelhouse_key(wheels: tuple[Wheel, ...]) -> str:
    """A content address for a set of wheels (the S3 prefix of the job's wheels channel)."""
    return hashlib.sha256("\n".join(sorted(f"{w.file} {w.sha256}" for w in wheels)).encode()).hexdigest()


CACHE_ENV = "LAUNCHER_WHEEL_CACHE"
PIP_TIMEOUT_S = 300  # a hung index must not hang submit


def cache_root() -> Path:
    """$LAUNCHER_WHEEL_CACHE (a cache shared by several homes, as in CI), else $LAUNCHER_HOME/wheelhouse."""
    shared = os.environ.get(CACHE_ENV)
    return Path(shared) if shared else launcher_home() / "wheelhouse"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _holds(path: Path, wheel: Wheel) -> bool:
    """Whether `path` is a file with exactly the pinned bytes (the size first: no hashing of a torn copy)."""
    return path.is_file() and path.stat().st_size == wheel.size and _sha256(path) == wheel.sha256


def ensure(wheel: Wheel) -> Path:
    """The cached wheel file, downloaded with pip on first use and checked against its sha256."""
    target = cache_root() / wheel.sha256 / wheel.file
    if _holds(target, wheel):
        return target
    with tempfile.TemporaryDirectory(prefix="launcher-wheel-") as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        command += ["--platform", wheel.platform, "--python-version", wheel.python, "--implementation", "cp"]
        command += ["--disable-pip-version-check", "--dest", scratch, wheel.requirement]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise LauncherError(
                f"cannot fetch {wheel.requirement} for the job's wheelhouse: pip gave no answer in {PIP_TIMEOUT_S} s; "
                f"check pip's access to the package index, or put {wheel.file} in {target.parent}"
            ) from None
        downloaded = Path(scratch) / wheel.file
        if result.returncode != 0 or not downloaded.is_file():
            last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
            got = ", ".join(p.name for p in Path(scratch).iterdir()) or "nothing"
            raise LauncherError(
                f"cannot fetch {wheel.requirement} ({wheel.file}) for the job's wheelhouse: {last} (got {got}); "
                f"FP8 jobs need it: check pip's access to the package index, or put the file in {target.parent}"
            )
        actual = _sha256(downloaded)
        if actual != wheel.sha256:
            raise LauncherError(
                f"{wheel.file} from pip has sha256 {actual}, not the pinned {wheel.sha256} "
                "(launcher/backends/dlc_images.yaml); refusing to ship it"
            )
        if downloaded.stat().st_size != wheel.size:  # the pin's bytes, the catalog's size mistyped
            raise LauncherError(
                f"{wheel.file} has {downloaded.stat().st_size} bytes, not the {wheel.size} that "
                "launcher/backends/dlc_images.yaml says; correct its size"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        shutil.copyfile(downloaded, partial)
        partial.replace(target)  # atomic: a concurrent submit never sees half a wheel
    return target


def build(wheels: tuple[Wheel, ...]) -> list[Path]:
    """Every wheel of the set, from the cache (fetched where missing)."""
    return [ensure(wheel) for wheel in wheels]


def requirements(wheels: tuple[Wheel, ...]) -> str:
    """LAUNCHER_REQUIREMENTS for entrypoints/bootstrap.py: the pins, space-separated."""
    return " ".join(wheel.requirement for wheel in wheels)


def bootstrap_environment(wheels: tuple[Wheel, ...], wheelhouse: str) -> dict[str, str]:
    """What entrypoints/bootstrap.py reads to install `wheels` from the container's directory
    `wheelhouse` (launcher.contract.wheels); empty when the job needs none."""
    if not wheels:
        return {}
    return {
        ENV_REQUIREMENTS: requirements(wheels),
        ENV_WHEELHOUSE: wheelhouse,
        ENV_WHEEL_SHA256: " ".join(wheel.sha256 for wheel in wheels),
    }


def fill(wheels: tuple[Wheel, ...], directory: Path) -> Path:
    """`directory` holding exactly these wheel files (from the cache), for a backend whose job
    reads its wheelhouse from a file system: the bootstrap's `pip --find-links` directory.
    Each file is checked against its pin and written whole before it gets its name."""
    directory.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        target = directory / wheel.file
        if _holds(target, wheel):
            continue
        partial = target.with_name(target.name + ".partial")
        shutil.copyfile(ensure(wheel), partial)
        partial.replace(target)
    return directory
