"""The code bundle: deterministic bytes, no caches or secrets, resolved.json at the root."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from launcher.bundle import FIXED_MTIME, Bundle, find_entrypoints

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


def test_same_inputs_give_the_same_bytes_whatever_the_file_times(source):
    first = Bundle.build(RESOLVED, source)
    for path in source.rglob("*"):
        os.utime(path, (1_900_000_000, 1_900_000_000))
    second = Bundle.build(RESOLVED, source)
    assert first.data == second.data and first.sha256 == second.sha256


def test_a_changed_recipe_changes_the_hash(source):
    assert Bundle.build(RESOLVED, source).sha256 != Bundle.build('{"format": 1, "x": 2}\n', source).sha256


def test_members_are_sorted_with_fixed_owner_time_and_mode(source):
    infos = members(Bundle.build(RESOLVED, source))
    names = [i.name for i in infos]
    assert names == [
        "entrypoints",
        "entrypoints/model",
        "entrypoints/model/llama.py",
        "entrypoints/run.sh",
        "entrypoints/train.py",
        "resolved.json",
    ]
    assert {(i.uid, i.gid, i.uname, i.gname, i.mtime) for i in infos} == {(0, 0, "", "", FIXED_MTIME)}
    modes = {i.name: i.mode for i in infos}
    assert modes["entrypoints/run.sh"] == 0o755 and modes["entrypoints/train.py"] == 0o644


@pytest.mark.parametrize(
    "unwanted",
    [
        "__pycache__/train.cpython-311.pyc",
        "model/__pycache__/llama.cpython-311.pyc",
        "stale.pyc",
        ".git/config",
        ".env",
        ".env.local",
        "credentials",
        ".aws/credentials",
        "deploy.pem",
        "id_rsa",
        ".netrc",
    ],
)
def test_caches_vcs_data_and_secrets_stay_out(source, unwanted):
    path = source / unwanted
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("secret")
    bundle = Bundle.build(RESOLVED, source)
    assert not any(unwanted.split("/")[-1] in i.name for i in members(bundle))
    assert bundle.data == Bundle.build(RESOLVED, source).data


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
