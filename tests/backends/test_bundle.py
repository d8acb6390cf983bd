"""The code bundle: deterministic bytes, no caches or secrets, resolved.json at the root, and the
contract the entrypoints import (nothing else of the launcher) beside them."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from launcher.bundle import FIXED_MTIME, Bundle, find_entrypoints
from launcher.errors import LauncherError

from .helpers import REPO

RESOLVED = '{"format": 1}\n'


@pytest.fixture
def source(tmp_path) -> Path:
    root = tmp_path / "entrypoints"
    (root / "model").mkdir(parents=True)
    (root / "train.py").write_text("print('train')\n")
    (root / "model" / "llama.py").write_text("x = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    return root


def members(bundle: Bundle) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(bundle.data), mode="r:gz") as tar:
        return tar.getmembers()


def build(source: Path) -> Bundle:
    return Bundle.build(RESOLVED, source, include=("*.sh",))


def test_same_inputs_give_the_same_bytes_whatever_the_file_times(source):
    first = Bundle.build(RESOLVED, source)
    for path in source.rglob("*"):
        os.utime(path, (1_900_000_000, 1_900_000_000))
    second = Bundle.build(RESOLVED, source)
    assert first.data == second.data and first.sha256 == second.sha256


def test_a_changed_recipe_changes_the_hash(source):
    assert Bundle.build(RESOLVED, source).sha256 != Bundle.build('{"format": 1, "x": 2}\n', source).sha256


def test_members_are_sorted_with_fixed_owner_time_and_mode(source):
    infos = members(build(source))
    names = [i.name for i in infos]
    contract = sorted(f"launcher/contract/{p.name}" for p in (REPO / "launcher" / "contract").glob("*.py"))
    assert names == [
        "entrypoints",
        "entrypoints/model",
        "entrypoints/model/llama.py",
        "entrypoints/run.sh",
        "entrypoints/train.py",
        "launcher",
        "launcher/__init__.py",
        "launcher/contract",
        *contract,
        "resolved.json",
    ]
    assert "launcher/contract/config.py" in contract and "launcher/contract/layout.py" in contract
    assert {(i.uid, i.gid, i.uname, i.gname, i.mtime) for i in infos} == {(0, 0, "", "", FIXED_MTIME)}
    modes = {i.name: i.mode for i in infos}
    assert modes["entrypoints/run.sh"] == 0o755 and modes["entrypoints/train.py"] == 0o644


SECRETS = [
    ".env",
    ".env.local",
    ".envrc",
    "credentials",
    ".aws/credentials",
    ".git-credentials",
    ".kube/config",
    ".docker/config.json",
    ".npmrc",
    ".pgpass",
    ".vault-token",
    ".boto",
    "deploy.pem",
    "id_rsa",
    "id_dsa",
    ".netrc",
    "secrets.yaml",
    "service-account.json",
    "token.txt",
]


@pytest.mark.parametrize(
    "unwanted",
    [
        "__pycache__/train.cpython-311.pyc",
        "model/__pycache__/llama.cpython-311.pyc",
        "stale.pyc",
        ".git/config",
        *SECRETS,
    ],
)
def test_caches_vcs_data_and_secrets_stay_out(source, unwanted):
    path = source / unwanted
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("secret")
    bundle = Bundle.build(RESOLVED, source)
    packed = [i.name for i in members(bundle) if i.name.startswith("entrypoints/")]
    assert packed == ["entrypoints/model", "entrypoints/model/llama.py", "entrypoints/train.py"]
    assert bundle.data == Bundle.build(RESOLVED, source).data


def test_only_python_sources_go_in_unless_included(source):
    (source / "notes.txt").write_text("x")
    (source / "assets").mkdir()
    (source / "assets" / "vocab.json").write_text("{}")
    (source / "tokenizer.py").write_text("x = 1\n")  # code, whatever its name
    packed = {i.name for i in members(Bundle.build(RESOLVED, source))}
    assert "entrypoints/tokenizer.py" in packed
    assert not {"entrypoints/notes.txt", "entrypoints/run.sh", "entrypoints/assets"} & packed
    included = {i.name for i in members(Bundle.build(RESOLVED, source, include=("assets/*.json",)))}
    assert {"entrypoints/assets", "entrypoints/assets/vocab.json"} <= included


@pytest.mark.parametrize("secret", ["secrets.yaml", ".kube/config", "token.txt"])
def test_an_included_secret_is_refused_with_one_line(source, secret):
    path = source / secret
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("secret")
    with pytest.raises(
        LauncherError, match=r"^bundle: .* looks like a secret \(credentials, a key or a token\); it is never packed"
    ):
        Bundle.build(RESOLVED, source, include=(secret, "*"))


def test_resolved_json_sits_beside_entrypoints_and_extracts(source, tmp_path):
    out = Bundle.build(RESOLVED, source).extract(tmp_path / "code")
    assert (out / "resolved.json").read_text() == RESOLVED
    assert (out / "entrypoints" / "train.py").read_text() == "print('train')\n"


def test_describe_lists_files_hash_and_size(source):
    bundle = Bundle.build(RESOLVED, source)
    described = bundle.describe("s3://b/code.tar.gz")
    assert described["uri"] == "s3://b/code.tar.gz"
    assert described["sha256"] == bundle.sha256 and described["bytes"] == len(bundle.data)
    assert "resolved.json" in described["files"]


def test_finds_the_entrypoints_of_a_source_checkout():
    assert find_entrypoints() == REPO / "entrypoints"


def test_finds_the_entrypoints_shipped_inside_an_installed_wheel(tmp_path):
    """A wheel carries entrypoints/ as launcher/_entrypoints (a symlink in the source tree)."""
    import shutil
    import subprocess
    import sys

    site = tmp_path / "site-packages"
    shutil.copytree(REPO / "launcher", site / "launcher", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    (site / "launcher" / "_entrypoints").unlink()
    (site / "launcher" / "_entrypoints").mkdir()
    (site / "launcher" / "_entrypoints" / "train.py").write_text("")
    code = "from launcher.bundle import find_entrypoints; print(find_entrypoints())"
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.stdout.strip() == str(site / "launcher" / "_entrypoints"), out.stderr


# Run in a fresh interpreter: keep only the bundle and the directories that hold torch on the
# path, drop the editable-install finder that maps `launcher` to this checkout, import every
# entrypoints module, and report where each launcher/entrypoints module came from.
_IMPORT_ALL = """
import importlib, importlib.machinery, json, pathlib, sys
bundle = pathlib.Path(sys.argv[1])
sys.meta_path[:] = [f for f in sys.meta_path if f in (importlib.machinery.BuiltinImporter,
                    importlib.machinery.FrozenImporter, importlib.machinery.PathFinder)]
sys.path[:] = [str(bundle)] + [p for p in sys.path if p and not pathlib.Path(p, "launcher").exists()
                               and not pathlib.Path(p, "entrypoints").exists()]
sys.path_importer_cache.clear()
names = sorted(".".join(p.relative_to(bundle).with_suffix("").parts).removesuffix(".__init__")
               for p in (bundle / "entrypoints").rglob("*.py"))
for name in names:
    importlib.import_module(name)
print(json.dumps({name: getattr(module, "__file__", None) for name, module in sys.modules.items()
                  if name.split(".")[0] in ("launcher", "entrypoints", "pydantic", "yaml", "boto3")}))
"""


def test_the_entrypoints_import_from_an_unpacked_bundle_with_nothing_else_of_the_launcher(tmp_path):
    import json
    import subprocess
    import sys

    root = Bundle.build(RESOLVED).extract(tmp_path / "code")
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, str(root)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "entrypoints.train" in loaded and "entrypoints.parallel.pipeline" in loaded
    assert {name for name in loaded if name.startswith("launcher")} == {
        "launcher",
        "launcher.contract",
        "launcher.contract.config",
        "launcher.contract.dataset",
        "launcher.contract.fp8",
        "launcher.contract.hf_checkpoint",
        "launcher.contract.layout",
        "launcher.contract.failure",
        "launcher.contract.metrics",
        "launcher.contract.text",
    }
    outside = {name: path for name, path in loaded.items() if not path or not path.startswith(str(root))}
    assert outside == {}, f"imported from outside the bundle: {outside}"
