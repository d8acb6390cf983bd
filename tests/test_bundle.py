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
from tests.backends.helpers import REPO

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
        "launcher.contract.checkpoint_dirs",
        "launcher.contract.config",
        "launcher.contract.dataset",
        "launcher.contract.fp8",
        "launcher.contract.hf_checkpoint",
        "launcher.contract.hf_names",
        "launcher.contract.layout",
        "launcher.contract.loss",
        "launcher.contract.failure",
        "launcher.contract.metrics",
        "launcher.contract.regular_files",
        "launcher.contract.text",
        "launcher.contract.wheels",
    }
    outside = {name: path for name, path in loaded.items() if not path or not path.startswith(str(root))}
    assert outside == {}, f"imported from outside the bundle: {outside}"


# --- secrets by content ---------------------------------------------------------------------------
# The values are assembled at run time, so this file holds no literal secret for a scanner to find.
AWS_KEY_ID = "AKIA" + "Q7ZK2M4N6P8R3T5V"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCYEXAMPLEKEY"  # AWS's documented example, 40 characters
GITHUB_TOKEN = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
HF_TOKEN = "hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZaBcDeFgH"
SLACK_TOKEN = "xoxb-" + "1234567890-0987654321-AbCdEfGhIjKlMnOp"
PRIVATE_KEY = "-----BEGIN OPENSSH " + "PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"
PASSWORD = "q8Zr3xLw9TfV2mNp"

SECRET_FILES = [
    # (file under entrypoints/, content, line, kind): the three names first
    (".env.py", f'import os\nos.environ["AWS_ACCESS_KEY_ID"] = "{AWS_KEY_ID}"\n', 2, "an AWS access key id"),
    ("local_settings.py", f'DEBUG = True\n\naws_secret_access_key = "{AWS_SECRET}"\n', 3, "an AWS secret access key"),
    ("secrets.py", f'KEY = """\n{PRIVATE_KEY}"""\n', 2, "a private key"),
    ("hub.py", f'from x import login\nlogin(token="{HF_TOKEN}")\n', 2, "a Hugging Face token"),
    ("model/ci.py", f"GITHUB = '{GITHUB_TOKEN}'\n", 1, "a GitHub token"),
    ("notify.py", f'import os\n\n\nhook = {{"token": "{SLACK_TOKEN}"}}\n', 4, "a Slack token"),
    ("db.py", f'HOST = "db"\nDB_PASSWORD = "{PASSWORD}"\n', 2, "a password, secret or token assigned"),
]


@pytest.mark.parametrize(("name", "content", "line", "kind"), SECRET_FILES, ids=[f[0] for f in SECRET_FILES])
def test_a_python_file_holding_a_secret_is_refused_with_file_line_and_kind(source, name, content, line, kind):
    (source / name).write_text(content)
    with pytest.raises(LauncherError) as raised:
        Bundle.build(RESOLVED, source)
    message = str(raised.value)
    assert message.startswith(f"bundle: entrypoints/{name}:{line} ({kind}) looks like a secret; nothing is uploaded")
    assert "bundle.allow_secrets_in" in message and "\n" not in message
    for value in (AWS_KEY_ID, AWS_SECRET, GITHUB_TOKEN, HF_TOKEN, SLACK_TOKEN, PASSWORD, "b3BlbnNzaC1rZXkt"):
        assert value not in message  # the secret itself is never printed


def test_an_included_data_file_is_scanned_too_and_every_finding_is_named(source):
    (source / "assets").mkdir()
    (source / "assets" / "hub.json").write_text(f'{{\n  "repo": "x",\n  "hf_token": "{HF_TOKEN}"\n}}\n')
    (source / "keys.py").write_text(f"ID = '{AWS_KEY_ID}'\nSECRET_KEY = '{AWS_SECRET}'\n")
    with pytest.raises(LauncherError) as raised:
        Bundle.build(RESOLVED, source, include=("assets/*.json",))
    assert str(raised.value).startswith(
        "bundle: entrypoints/assets/hub.json:3 (a Hugging Face token), entrypoints/keys.py:1 (an AWS access key id), "
        "entrypoints/keys.py:2 (a password, secret or token assigned) looks like a secret"
    )


BENIGN = '''"""Tokenizer settings; the credentials come from the environment at run time."""
import getpass
import os

pad_token = "<|finetune_right_pad_id|>"
eos_token = "</s>"
bos_token_id = 128000
max_tokens = 4096
token = os.environ["HF_TOKEN"]
password = getpass.getpass()
api_key = "YOUR_API_KEY_HERE"
secret_name = "prod/training/db"
tokenizer_path = "meta-llama/Llama-3.1-8B-Instruct"
checksum = "3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b8557"
header = "-----BEGIN PUBLIC KEY-----"
prefix = "AKIA"
secret_template = "{secret_token_value_from_vault}"
auth_token = f"Bearer {token}"
'''


def test_ordinary_code_that_names_tokens_and_passwords_is_packed(source):
    (source / "tokenizer_settings.py").write_text(BENIGN)
    packed = {i.name for i in members(Bundle.build(RESOLVED, source))}
    assert "entrypoints/tokenizer_settings.py" in packed


def test_the_launchers_own_entrypoints_and_contract_pass_the_scan():
    packed = {i.name for i in members(Bundle.build(RESOLVED))}
    assert {"entrypoints/train.py", "entrypoints/bootstrap.py", "launcher/contract/config.py"} <= packed


def test_the_recipe_lets_one_named_file_through_and_no_other(source):
    (source / "fixture_key.py").write_text(f'EXAMPLE = "{AWS_SECRET}"\naws_secret_access_key = EXAMPLE\n{PRIVATE_KEY}')
    allowed = ("entrypoints/fixture_key.py",)
    packed = {i.name for i in members(Bundle.build(RESOLVED, source, allow_secrets_in=allowed))}
    assert "entrypoints/fixture_key.py" in packed
    (source / "other.py").write_text(f"key = '{AWS_KEY_ID}'\n")
    with pytest.raises(LauncherError, match=r"^bundle: entrypoints/other\.py:1 \(an AWS access key id\) looks like"):
        Bundle.build(RESOLVED, source, allow_secrets_in=allowed)


def test_an_allowance_for_a_file_the_bundle_lacks_is_refused(source):
    with pytest.raises(
        LauncherError,
        match=r"^bundle\.allow_secrets_in: entrypoints/fixture_key\.pyy is not a file of the code bundle; ",
    ):
        Bundle.build(RESOLVED, source, allow_secrets_in=("entrypoints/fixture_key.pyy",))


def test_bundle_allow_secrets_in_reaches_the_bundle_from_the_recipe(monkeypatch, source):
    import launcher.bundle
    from tests.backends.helpers import spec_for

    (source / "fixture_key.py").write_text(PRIVATE_KEY)
    monkeypatch.setattr(launcher.bundle, "find_entrypoints", lambda: source)
    with pytest.raises(LauncherError, match=r"^bundle: entrypoints/fixture_key\.py:1 \(a private key\)"):
        Bundle.of(spec_for("tiny-cpu", "local"))
    spec = spec_for("tiny-cpu", "local", **{"bundle.allow_secrets_in": ["entrypoints/fixture_key.py"]})
    assert spec.bundle_allow_secrets == ("entrypoints/fixture_key.py",)
    assert "entrypoints/fixture_key.py" in Bundle.of(spec).describe()["files"]


def test_submit_of_a_job_whose_bundle_holds_a_secret_stops_with_one_line_and_creates_nothing(
    monkeypatch, source, home, cli
):
    import launcher.bundle
    from tests.backends.helpers import recipe_path

    (source / "local_settings.py").write_text(f'aws_secret_access_key = "{AWS_SECRET}"\n')
    monkeypatch.setattr(launcher.bundle, "find_entrypoints", lambda: source)
    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "local")
    assert result.code == 2
    assert result.err.splitlines()[-1].startswith(
        "bundle: entrypoints/local_settings.py:1 (an AWS secret access key) looks like a secret; nothing is uploaded"
    )
    assert "Traceback" not in result.err and AWS_SECRET not in result.out + result.err
    assert not (home / "jobs").exists() or not list((home / "jobs").iterdir())
