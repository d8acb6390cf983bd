"""Renders for every backend, snapshot-tested, and each one parses as what it claims to be.

Snapshots live in tests/backends/snapshots/. After an intended change, rewrite them with
UPDATE_SNAPSHOTS=1 pytest tests/backends/test_render_snapshots.py and review the diff.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from launcher.backends import get_backend

from .helpers import spec_for

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
FSX = "/fsx/tokens/llama3-128k"

CASES = {
    "docker-tiny-cpu": ("tiny-cpu", "docker", {}),
    "docker-llama3-8b-8k": ("llama3-8b-8k", "docker", {"data.source": FSX}),
    "slurm-tiny-cpu": ("tiny-cpu", "slurm", {}),
    "slurm-llama70b-128k": ("llama70b-128k", "slurm", {"data.source": FSX}),
    "k8s-llama70b-128k": ("llama70b-128k", "k8s", {"data.source": FSX}),
    "accelerate-llama70b-128k": ("llama70b-128k", "accelerate", {"checkpoint.dir": "/fsx/checkpoints/llama70b"}),
    "accelerate-tiny-cpu": ("tiny-cpu", "accelerate", {}),
    "sagemaker-llama70b-128k": ("llama70b-128k", "sagemaker", {}),
    "local-tiny-cpu": ("tiny-cpu", "local", {}),
}


@pytest.fixture
def fixed_home(monkeypatch, fake_bundle):
    """A home path that is the same on every machine; rendering creates nothing there."""
    monkeypatch.setenv("LAUNCHER_HOME", "/home/user/.launcher")
    monkeypatch.setattr("sys.executable", "/usr/bin/python3")
    yield
    assert not Path("/home/user/.launcher").exists()


def render(case: str):
    recipe, backend, overrides = CASES[case]
    return get_backend(backend).render(spec_for(recipe, backend, **overrides))


def stable_text(rendering) -> str:
    """The rendering's text with the bundle's bytes, hash and size replaced (gzip output may vary
    between zlib builds, and test_bundle.py checks determinism on one machine), and with the
    SageMaker submission token, a digest of the request and so of the bundle's hash."""
    bundle = rendering.payload["bundle"]
    text = rendering.text.replace(base64.b64encode(bundle.data).decode(), "<bundle.tar.gz as base64>")
    text = re.sub(r'("Key": "launcher:submission",\s*"Value": )"[0-9a-f]{32}"', r'\1"<token>"', text)
    return text.replace(bundle.sha256, "<sha256>").replace(f'"bytes": {len(bundle.data)}', '"bytes": "<size>"')


def assert_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / name
    if os.environ.get("UPDATE_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no snapshot {path}; run with UPDATE_SNAPSHOTS=1 to create it"
    assert text == path.read_text(), f"{name} differs from its snapshot; if intended, UPDATE_SNAPSHOTS=1"


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_matches_its_snapshot(case, fixed_home):
    rendering = render(case)
    suffix = {"sagemaker": "json", "k8s": "yaml", "accelerate": "yaml", "slurm": "sbatch"}.get(CASES[case][1], "sh")
    assert_snapshot(f"{case}.{suffix}", stable_text(rendering))


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("docker")])
def test_the_docker_command_splits_back_into_its_argv(case, fixed_home):
    rendering = render(case)
    assert shlex.split(rendering.text) == rendering.data["command"]


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("slurm")])
def test_the_sbatch_script_is_valid_bash(case, fixed_home, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render(case).text)
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith(("k8s", "accelerate"))])
def test_manifests_and_configs_load_as_the_data_they_were_built_from(case, fixed_home):
    rendering = render(case)
    documents = list(yaml.safe_load_all(rendering.text))
    expected = rendering.data.get("manifest") or [rendering.data["config"]]
    assert documents == expected


def test_the_sagemaker_render_is_the_json_it_prints(fixed_home):
    rendering = render("sagemaker-llama70b-128k")
    assert json.loads(rendering.text) == rendering.data


def test_the_pytorchjob_asks_for_efa_devices_and_mounts_the_checkpoint_volume(fixed_home):
    (job,) = [d for d in render("k8s-llama70b-128k").data["manifest"] if d["kind"] == "PyTorchJob"]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    (container,) = pod["containers"]
    # No huge pages unless k8s.hugepages: nodes must pre-allocate them, and AWS's samples ask for none.
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["launcher"]["persistentVolumeClaim"]["claimName"] == "llama70b-128k-launcher"
    assert volumes["data-0"]["hostPath"]["path"] == FSX
    assert "--rdzv-endpoint=llama70b-128k-job-master-0:29500" in container["args"]


def test_the_accelerate_config_holds_the_machines_and_leaves_the_layout_to_resolved_json(fixed_home):
    rendering = render("accelerate-llama70b-128k")
    config = rendering.data["config"]
    assert (config["num_machines"], config["num_processes"], config["mixed_precision"]) == (4, 32, "no")
    assert not {"fsdp_config", "parallelism_config", "fp8_config"} & set(config)
    parallel = rendering.spec.resolved["parallel"]
    assert (parallel["data_shard"], parallel["context"], rendering.spec.resolved["precision"]["fp8"]) == (4, 8, True)


def test_accelerate_refuses_pipeline_parallel_recipes(fixed_home):
    from launcher.errors import UsageError

    spec = spec_for(
        "llama70b-128k",
        "accelerate",
        **{"parallel.pipeline": 2, "parallel.context": 8, "data.source": FSX, "cluster.backend": "slurm"},
    )
    with pytest.raises(UsageError, match="parallel.pipeline: the accelerate backend has no pipeline parallelism"):
        get_backend("accelerate").render(spec)


def test_bash_is_available_for_the_syntax_check():
    assert shutil.which("bash")
