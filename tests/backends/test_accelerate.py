"""The accelerate render: validated as accelerate, and a launch script that gives each node its rank."""

from __future__ import annotations

import os
import stat
import subprocess

import yaml

from launcher import api

from .helpers import REPO


def render(recipe: str, *sets: str):
    return api.submit(
        REPO / "recipes" / f"{recipe}.yaml", backend="accelerate", set_options=sets, dry_run=True
    ).rendering


def run_script(script: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    """Run the rendered script with fake `accelerate` and `aws` commands that print their argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("accelerate", "aws"):
        fake = bin_dir / tool
        fake.write_text(f'#!/bin/sh\necho {tool} "$@"\n')
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    clean = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "SLURM_NODEID", "MAIN_PROCESS_IP")}
    environment = {**clean, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
    return subprocess.run(["bash", "-c", script], env=environment, capture_output=True, text=True, cwd=tmp_path)


def test_accelerate_takes_the_recipes_own_data_paths_and_s3_uris(home):
    # A SageMaker recipe rendered for accelerate is validated as accelerate: a local path is allowed.
    local = render("llama70b-128k", "data.source=/fsx/tokens")
    assert local.spec.inputs[0].container_path == "/fsx/tokens"
    s3 = render("llama70b-128k")
    assert (
        "aws s3 sync --only-show-errors s3://my-training-bucket/tokens/llama3-128k/ data/train"
        in s3.data["launch_script"]
    )
    assert s3.spec.env["SM_CHANNEL_TRAIN"] == "data/train"


def test_every_node_gets_its_own_machine_rank(home, tmp_path):
    rendering = render("llama70b-128k")
    script = rendering.data["launch_script"]
    second = run_script(script, tmp_path, NODE_RANK="1", MAIN_PROCESS_IP="10.0.0.5")
    assert second.returncode == 0, second.stderr
    launch = second.stdout.splitlines()[-1].split()
    assert launch[:4] == ["accelerate", "launch", "--config_file", "accelerate.yaml"]
    assert launch[launch.index("--machine_rank") + 1] == "1"
    assert launch[launch.index("--main_process_ip") + 1] == "10.0.0.5"
    under_slurm = run_script(script, tmp_path, SLURM_NODEID="3", MAIN_PROCESS_IP="10.0.0.5")
    assert "--machine_rank 3 " in under_slurm.stdout

    missing = run_script(script, tmp_path, MAIN_PROCESS_IP="10.0.0.5")
    assert missing.returncode != 0 and "set NODE_RANK to the index of this node: 0 on the main node" in missing.stderr
    assert "accelerate launch" not in missing.stdout


def test_the_config_says_where_the_layout_comes_from_and_still_loads_as_yaml(home):
    rendering = render("tiny-cpu")
    assert rendering.text.startswith("# accelerate.yaml for `accelerate launch`. The layout (tensor, context")
    assert yaml.safe_load(rendering.text) == rendering.data["config"]
    assert "--machine_rank" not in rendering.data["launch_script"]  # one node: accelerate's default rank 0
