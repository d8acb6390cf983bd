"""The accelerate render: validated as accelerate, and a launch script that gives each node its rank.

tests/engines/test_accelerate_hosts.py runs the script with the real `accelerate launch` on two
simulated hosts."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
import yaml

from launcher import api
from launcher.errors import UsageError

from .helpers import REPO

SHARED = "checkpoint.dir=/fsx/checkpoints/llama70b"  # what every node of a multi-node job must share


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
    local = render("llama70b-128k", "data.source=/fsx/tokens", SHARED)
    assert local.spec.inputs[0].container_path == "/fsx/tokens"
    s3 = render("llama70b-128k", SHARED)
    assert (
        "aws s3 sync --only-show-errors s3://my-training-bucket/tokens/llama3-128k/ data/train"
        in s3.data["launch_script"]
    )
    assert s3.spec.env["SM_CHANNEL_TRAIN"] == "data/train"


def test_every_node_gets_its_own_machine_rank(home, tmp_path):
    rendering = render("llama70b-128k", SHARED)
    script = rendering.data["launch_script"]
    second = run_script(script, tmp_path, NODE_RANK="1", MAIN_PROCESS_IP="10.0.0.5")
    assert second.returncode == 0, second.stderr
    launch = second.stdout.splitlines()[-1].split()
    assert launch[:6] == ["accelerate", "launch", "--config_file", "accelerate.yaml", "--rdzv_backend", "static"]
    assert launch[launch.index("--machine_rank") + 1] == "1"
    assert launch[launch.index("--main_process_ip") + 1] == "10.0.0.5"
    under_slurm = run_script(script, tmp_path, SLURM_NODEID="3", MAIN_PROCESS_IP="10.0.0.5")
    assert "--machine_rank 3 " in under_slurm.stdout

    missing = run_script(script, tmp_path, MAIN_PROCESS_IP="10.0.0.5")
    assert missing.returncode != 0 and "set NODE_RANK to the index of this node: 0 on the main node" in missing.stderr
    assert "accelerate launch" not in missing.stdout


def test_the_config_says_where_the_layout_comes_from_and_still_loads_as_yaml(home):
    rendering = render("tiny-cpu")
    assert rendering.text.startswith(
        "# accelerate.yaml for `accelerate launch`. accelerate launch only starts torchrun here: the layout"
    )
    config = yaml.safe_load(rendering.text)
    assert config == rendering.data["config"]
    # No section that would pretend to set what train.py takes from resolved.json.
    assert not {"fsdp_config", "parallelism_config", "fp8_config"} & set(config)
    assert (config["distributed_type"], config["mixed_precision"], config["use_cpu"]) == ("MULTI_GPU", "no", False)
    assert "--machine_rank" not in rendering.data["launch_script"]  # one node: accelerate's default rank 0


def test_several_nodes_need_a_checkpoint_directory_they_share(home):
    with pytest.raises(UsageError) as error:
        render("llama70b-128k")
    assert (
        "checkpoint.dir: 'checkpoints' is relative, on each node's own disk, where the other nodes' parts of a "
        "checkpoint never arrive and none is ever complete; 4 nodes need a directory they all share, e.g. "
        "--set checkpoint.dir=/fsx/checkpoints/llama70b-128k"
    ) in str(error.value)
