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

Names are not enough (`local_settings.py` is a Python source), so the content of every file
headed for the bundle is scanned too (`secret_findings`): an AWS key, a private key, a GitHub,
Hugging Face or Slack token, or a long random value assigned to a password/secret/token name
stops the build with `file:line` and the kind of secret, never the secret itself. The recipe's
`bundle.allow_secrets_in` lets one named file through (a test fixture, a public example key).

The container trusts the bundle only by its content: its entrypoint (`unpack_entrypoint`, part of
the job's request, not of the bundle) compares the file's sha256 with LAUNCHER_BUNDLE_SHA256 from
the same request before it unpacks or runs anything.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import math
import re
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.errors import LauncherError, UsageError
from launcher.spec import CONFIG_FILE, ENTRYPOINT

if TYPE_CHECKING:
    from launcher.spec import JobSpec

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

# What a secret looks like inside a file, by kind. Each pattern is specific (a vendor's prefix
# and length, a PEM header) except the last, whose value must also look random (`_random`), so
# `eos_token = "<|end_of_text|>"` or `token = os.environ["HF_TOKEN"]` is no finding.
SECRET_PATTERNS = (
    ("an AWS access key id", re.compile(rb"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    (
        "an AWS secret access key",
        re.compile(rb"(?i)aws_?secret_?access_?key[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])"),
    ),
    ("a private key", re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")),
    ("a GitHub token", re.compile(rb"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})\b")),
    ("a Hugging Face token", re.compile(rb"\bhf_[A-Za-z0-9]{30,}\b")),
    ("a Slack token", re.compile(rb"\bxox[abposr]-[A-Za-z0-9-]{10,}")),
)
ASSIGNED_SECRET = re.compile(
    rb"(?i)\b[a-z0-9_.-]*(?:password|passwd|secret|secret_?key|token|api_?key|access_?key|private_?key)[\"']?\s*[:=]\s*"
    rb"[\"']([^\s\"'<>{}|$%]{16,})[\"']"
)
MIN_SECRET_ENTROPY = 3.0  # bits per character; random base64 or hex values are above, words below


@dataclass(frozen=True)
class SecretFinding:
    path: str
    line: int
    kind: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.kind})"


def _random(value: bytes) -> bool:
    """Letters and digits mixed, with the spread of characters of a generated value."""
    if not (re.search(rb"[A-Za-z]", value) and re.search(rb"[0-9]", value)):
        return False
    counts = Counter(value)
    entropy = -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())
    return entropy >= MIN_SECRET_ENTROPY


def secret_findings(path: str, content: bytes) -> list[SecretFinding]:
    """Where `content` holds something that looks like a secret: one finding per line and kind."""
    found: dict[tuple[int, str], None] = {}
    for kind, pattern in SECRET_PATTERNS:
        for match in pattern.finditer(content):
            found[(content.count(b"\n", 0, match.start()) + 1, kind)] = None
    specific = {line for line, _ in found}
    for match in ASSIGNED_SECRET.finditer(content):
        line = content.count(b"\n", 0, match.start()) + 1
        if line not in specific and _random(match[1]):
            found[(line, "a password, secret or token assigned")] = None
    return [SecretFinding(path, line, kind) for line, kind in sorted(found)]


def refuse_secrets(members: dict[str, bytes | None], allowed: tuple[str, ...]) -> None:
    """Stop the build when a member holds what looks like a secret, unless the recipe allows that file."""
    unknown = sorted(set(allowed) - set(members))
    if unknown:
        raise UsageError(
            f"bundle.allow_secrets_in: {', '.join(unknown)} is not a file of the code bundle; "
            "name files by their path in it, e.g. entrypoints/data.py"
        )
    findings = [
        finding
        for name, content in sorted(members.items())
        if content is not None and name not in allowed
        for finding in secret_findings(name, content)
    ]
    if findings:
        shown = ", ".join(map(str, findings[:5])) + (f" and {len(findings) - 5} more" if len(findings) > 5 else "")
        raise UsageError(
            f"bundle: {shown} looks like a secret; nothing is uploaded: move it out of the file (read it "
            "from the environment or a secret store at run time), or, if it is no secret, list the file "
            "in the recipe's bundle.allow_secrets_in"
        )


# The request's sha256 of the bundle; the container refuses any other bytes (VERIFY_SCRIPT).
ENV_BUNDLE_SHA256 = "LAUNCHER_BUNDLE_SHA256"

# The first stage of the container's entrypoint: nothing of the bundle has run yet, and this text
# is part of the job's request, so a bundle changed in S3 (or in a ConfigMap) cannot skip it; the
# bootstrap.py inside the bundle could. Its first argument is the refusal, a printf format (each
# entrypoint string is at most 256 characters in SageMaker's API); the rest is the next stage.
# `sha256sum -c` fails on a missing file, other bytes and an empty or absent sha256 alike.
VERIFY_SCRIPT = (
    'm=$1;shift;echo "$LAUNCHER_BUNDLE_SHA256  $LAUNCHER_BUNDLE"|sha256sum -c --status&&exec "$@";'
    'printf "$m\\n" "$LAUNCHER_BUNDLE"|tee "${LAUNCHER_FAILURE_FILE:-/opt/ml/output/failure}">&2 2>/dev/null;exit 2'
)
BUNDLE_REFUSAL = (
    "bundle check: refused the code bundle %s: its sha256 is not the LAUNCHER_BUNDLE_SHA256 of the job's "
    "request (it was changed or damaged after upload); nothing from it ran"
)
# The second stage: unpack the verified bundle named by $LAUNCHER_BUNDLE into $LAUNCHER_CODE and
# exec the argv that follows. Paths arrive as environment variables, so this text never contains
# anything from a recipe.
UNPACK_SCRIPT = (
    'set -e; mkdir -p "$LAUNCHER_CODE"; tar -xzf "$LAUNCHER_BUNDLE" -C "$LAUNCHER_CODE"; cd "$LAUNCHER_CODE"; exec "$@"'
)


def unpack_entrypoint(*, image_entrypoint: str | None = None) -> list[str]:
    """Container entrypoint argv (verify, then unpack); the job's argv follows it as arguments.

    The container's environment must name the bundle (LAUNCHER_BUNDLE), where to unpack it
    (LAUNCHER_CODE) and its sha256 (LAUNCHER_BUNDLE_SHA256). `image_entrypoint`: the image's own
    ENTRYPOINT, which the container entrypoint replaces; when that file exists in the container,
    the job's argv runs through it (it must end in exec "$@")."""
    script = UNPACK_SCRIPT
    if image_entrypoint:
        script = script.replace(
            'exec "$@"', f'if [ -x {image_entrypoint} ]; then set -- {image_entrypoint} "$@"; fi; exec "$@"'
        )
    verify = ["/bin/bash", "-c", VERIFY_SCRIPT, "launcher-verify", BUNDLE_REFUSAL]
    return [*verify, "/bin/bash", "-c", script, "launcher-unpack"]


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
    def of(cls, spec: JobSpec) -> Bundle:
        """The bundle of a job: its resolved recipe, and the files its recipe lets past the secret scan."""
        return cls.build(spec.resolved_json, allow_secrets_in=spec.bundle_allow_secrets)

    @classmethod
    def build(
        cls,
        resolved_json: str,
        entrypoints: Path | None = None,
        *,
        include: tuple[str, ...] = (),
        allow_secrets_in: tuple[str, ...] = (),
    ) -> Bundle:
        """Pack `entrypoints/`, the contract and the resolved recipe (as resolved.json at the bundle root).

        `include`: glob patterns (relative to entrypoints/) of non-Python files to pack as well.
        `allow_secrets_in`: bundle paths (entrypoints/x.py) whose content the secret scan skips."""
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
        refuse_secrets(members, allow_secrets_in)

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
