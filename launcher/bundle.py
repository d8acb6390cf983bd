"""The code bundle: `entrypoints/`, the contract they import and `resolved.json`, as one deterministic tar.gz.

The entrypoints import nothing of the launcher but `launcher.contract` (standard library only),
so the bundle carries `launcher/__init__.py` (lazy: it imports nothing) and
`launcher/contract/*.py` beside `entrypoints/`; the training processes need only torch.

The same inputs give the same bytes on every run (sorted members, fixed mtimes, owners and
modes, no gzip timestamp), so the content hash can name the object in S3 and an unchanged
bundle is uploaded once.

What goes in is an allowlist: Python sources under entrypoints/, the contract and the resolved
recipe. Any other file needs an explicit `include` pattern, and a name that looks like a secret
(credentials, keys, tokens, tool configs that hold them) is refused even then: a stray
`.git-credentials` or kubeconfig beside the entrypoints never leaves this machine.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import LauncherError
from launcher.spec import CONFIG_FILE, ENTRYPOINT

BUNDLE_ROOT = "entrypoints"
CONTRACT_PACKAGE = "launcher/contract"
ARCHIVE_NAME = "code.tar.gz"
# 1980-01-01: the oldest time a zip-derived tool accepts; any fixed value makes the bytes stable.
FIXED_MTIME = 315532800
MAX_BUNDLE_BYTES = 64 * 1024 * 1024

ALLOWED_FILES = ("*.py",)
EXCLUDED_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
# Directories and names that hold credentials for common tools; matched case-insensitively.
SECRET_DIRS = {".aws", ".ssh", ".kube", ".docker", ".gnupg", ".azure", ".config"}
SECRET_FILES = (
    ".env",
    ".env.*",
    "*.env",
    ".envrc",
    ".netrc",
    ".git-credentials",
    ".gitconfig",
    ".npmrc",
    ".pypirc",
    ".pgpass",
    ".vault-token",
    ".boto",
    "credentials",
    "credentials.*",
    "*secret*",
    "*token*",
    "*password*",
    "*service-account*",
    "*kubeconfig*",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "*.jks",
    "*.keystore",
    "id_rsa*",
    "id_dsa*",
    "id_ed25519*",
    "id_ecdsa*",
)

# The bootstrap that SageMaker and Kubernetes containers run before torchrun: unpack the bundle
# named by $LAUNCHER_BUNDLE into $LAUNCHER_CODE and exec the argv that follows. Paths arrive as
# environment variables, so this text never contains anything from a recipe.
UNPACK_SCRIPT = (
    'set -e; mkdir -p "$LAUNCHER_CODE"; tar -xzf "$LAUNCHER_BUNDLE" -C "$LAUNCHER_CODE"; cd "$LAUNCHER_CODE"; exec "$@"'
)


def unpack_entrypoint(*, image_entrypoint: str | None = None) -> list[str]:
    """Container entrypoint argv; the job's argv follows it as arguments.

    `image_entrypoint`: the image's own ENTRYPOINT, which the container entrypoint replaces; when
    that file exists in the container, the job's argv runs through it (it must end in exec "$@")."""
    script = UNPACK_SCRIPT
    if image_entrypoint:
        script = script.replace(
            'exec "$@"', f'if [ -x {image_entrypoint} ]; then set -- {image_entrypoint} "$@"; fi; exec "$@"'
        )
    return ["/bin/bash", "-c", script, "launcher-bootstrap"]


def find_entrypoints() -> Path:
    """`entrypoints/` of a source checkout, or the copy installed inside the wheel."""
    package = Path(__file__).resolve().parent
    for candidate in (package.parent / BUNDLE_ROOT, package / "_entrypoints"):
        if (candidate / "train.py").is_file():
            return candidate
    raise LauncherError(
        f"cannot find {ENTRYPOINT}: looked in {package.parent / BUNDLE_ROOT} and {package / '_entrypoints'}; "
        "reinstall the launcher (pip install launcher) or run from a source checkout"
    )


def contract_members() -> dict[str, bytes | None]:
    """`launcher/__init__.py` and `launcher/contract/*.py` of this launcher, by archive path."""
    package = Path(__file__).resolve().parent
    paths = [package / "__init__.py", *sorted((package / "contract").glob("*.py"))]
    members: dict[str, bytes | None] = {"launcher": None, CONTRACT_PACKAGE: None}
    members.update({f"launcher/{path.relative_to(package).as_posix()}": path.read_bytes() for path in paths})
    return members


def looks_secret(relative: Path) -> bool:
    """A credential's usual name or place. Python sources are code (tokenizer.py is no token)."""
    if any(part.lower() in SECRET_DIRS for part in relative.parts[:-1]):
        return True
    if relative.suffix == ".py":
        return False
    return any(fnmatch.fnmatch(relative.name.lower(), pattern) for pattern in SECRET_FILES)


def selected(relative: Path, include: tuple[str, ...]) -> bool:
    """Whether a file under entrypoints/ goes in: allowlisted or included, never a cache or secret."""
    if any(part in EXCLUDED_DIRS for part in relative.parts[:-1]) or relative.suffix in (".pyc", ".pyo"):
        return False
    explicit = any(fnmatch.fnmatch(relative.as_posix(), pattern) for pattern in include)
    if explicit and looks_secret(relative):
        raise LauncherError(
            f"bundle: {relative} looks like a secret (credentials, a key or a token); it is never packed, "
            "even when included: move it out of entrypoints/"
        )
    allowed = any(fnmatch.fnmatch(relative.name, pattern) for pattern in ALLOWED_FILES)
    return explicit or (allowed and not looks_secret(relative))


@dataclass(frozen=True)
class BundleFile:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Bundle:
    data: bytes
    files: tuple[BundleFile, ...]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @classmethod
    def build(cls, resolved_json: str, entrypoints: Path | None = None, *, include: tuple[str, ...] = ()) -> Bundle:
        """Pack `entrypoints/`, the contract and the resolved recipe (as resolved.json at the bundle root).

        `include`: glob patterns (relative to entrypoints/) of non-Python files to pack as well."""
        source = entrypoints or find_entrypoints()
        members: dict[str, bytes | None] = {}  # archive path -> content (None: directory)
        for path in sorted(source.rglob("*")):
            relative = path.relative_to(source)
            if path.is_symlink() or not path.is_file() or not selected(relative, include):
                continue
            for parent in reversed(relative.parents[:-1]):  # the directories that hold it
                members[f"{BUNDLE_ROOT}/{parent.as_posix()}"] = None
            members[f"{BUNDLE_ROOT}/{relative.as_posix()}"] = path.read_bytes()
        members.update(contract_members())
        members[CONFIG_FILE] = resolved_json.encode()

        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(_info(BUNDLE_ROOT, None))
            for name in sorted(members):
                content = members[name]
                tar.addfile(_info(name, content), io.BytesIO(content) if content is not None else None)
        compressed = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=compressed, mtime=0, compresslevel=9) as gz:
            gz.write(raw.getvalue())
        data = compressed.getvalue()
        if len(data) > MAX_BUNDLE_BYTES:
            raise LauncherError(
                f"the code bundle from {source} is {len(data) / 2**20:.0f} MiB; keep data out of entrypoints/ "
                f"(at most {MAX_BUNDLE_BYTES // 2**20} MiB), use data.source for datasets"
            )
        files = tuple(
            BundleFile(name, len(content), hashlib.sha256(content).hexdigest())
            for name, content in sorted(members.items())
            if content is not None
        )
        return cls(data, files)

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.data)
        return path

    def extract(self, destination: Path) -> Path:
        destination.mkdir(parents=True, exist_ok=True)
        try:
            with tarfile.open(fileobj=io.BytesIO(self.data), mode="r:gz") as tar:
                tar.extractall(destination, filter="data")
        except OSError as error:
            error.filename = error.filename or str(destination)  # tarfile's write errors name no path
            raise
        return destination

    def describe(self, uri: str | None = None) -> dict:
        """What `--dry-run` shows about the bundle."""
        info = {"sha256": self.sha256, "bytes": len(self.data), "files": [f.path for f in self.files]}
        return {"uri": uri, **info} if uri else info


def _info(name: str, content: bytes | None) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime = FIXED_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if content is None:
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
    else:
        info.size = len(content)
        info.mode = 0o755 if content.startswith(b"#!") else 0o644
    return info
