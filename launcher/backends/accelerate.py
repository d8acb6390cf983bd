"""The HF accelerate config: for users who start jobs with `accelerate launch`.

Render only: an accelerate config file whose header holds the launch script to run on every
node. `accelerate launch` is used as a torchrun launcher and nothing more: entrypoints/train.py
never builds an `Accelerator`, so the layout (FSDP, tensor, context degrees, precision, FP8)
comes from the recipe in resolved.json, and the config carries no fsdp, parallelism or fp8
section that would only pretend to set it. Accelerate has no pipeline parallelism, so recipes
with pipeline > 1 are refused. s3:// data is synced to each node by the script (`aws s3 sync`).

The multi-node rendezvous is torchrun's static one, on the main node's address: `accelerate
launch` fills an argument from the config file only where the command line left it None
(`_validate_launch_command` in accelerate/commands/launch.py), and `--rdzv_backend` defaults to
"static" and `--same_network` to False, so those keys of a config file never apply. Without
`--same_network` accelerate gives torchrun `--rdzv_endpoint <main_process_ip>:<port>` and
`--node_rank` (`prepare_multi_gpu_env` in accelerate/utils/launch.py); a c10d backend with
`--same_network` would give it only the master address, which c10d does not read
(`get_rdzv_endpoint` in torch/distributed/run.py), so each node would wait alone. The launch
script therefore says `--rdzv_backend static` itself. The `MULTI_GPU` launcher is torchrun's
on a CPU too (the recipe's device decides where train.py runs); accelerate's CPU launcher would
run one process per machine without torchrun.
"""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath

import yaml

from launcher.backends.base import Backend, Rendering
from launcher.bundle import Bundle
from launcher.spec import CONFIG_FILE, ENTRYPOINT, RDZV_PORT, JobSpec, Placement

CONFIG_NAME = "accelerate.yaml"
DATA_DIR = "data/train"  # relative to the unpacked bundle, where the script runs
LAYOUT_NOTE = (
    "accelerate launch only starts torchrun here: the layout (FSDP, tensor, context degrees, precision, FP8) "
    "comes from the recipe in resolved.json, which entrypoints/train.py reads."
)


def accelerate_config(spec: JobSpec) -> dict:
    r = spec.resources
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU",
        "mixed_precision": "no",  # train.py casts as the recipe says, with no Accelerator
        "use_cpu": False,
        "num_machines": r.instance_count,
        "num_processes": r.world_size,
        "machine_rank": 0,
        "main_process_ip": None,
        "main_process_port": RDZV_PORT,
        "main_training_function": "main",
    }


def launch_script(spec: JobSpec) -> str:
    """What to run on every node, from the unpacked bundle: data sync, environment, accelerate launch."""
    lines = ["#!/bin/bash", "set -euo pipefail"]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in spec.environment]
    command = ["accelerate", "launch", "--config_file", CONFIG_NAME, "--rdzv_backend", "static"]
    if spec.resources.instance_count > 1:
        # Each node needs its own rank; Slurm's is taken when present, so the script runs under srun as is.
        lines += [
            'machine_rank="${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK to the index of this node: 0 on the main node}}"',
            'main_ip="${MAIN_PROCESS_IP:?set MAIN_PROCESS_IP to the address of the main node}"',
        ]
        command += ["--machine_rank", '"$machine_rank"', "--main_process_ip", '"$main_ip"']
    for data in spec.inputs:
        if data.source.startswith("s3://"):
            lines.append(
                f"aws s3 sync --only-show-errors {shlex.quote(data.source)} {shlex.quote(data.container_path)}"
            )
    command += [ENTRYPOINT, "--config", CONFIG_FILE]
    lines.append(" ".join(command))
    return "\n".join(lines) + "\n"


class AccelerateBackend(Backend):
    name = "accelerate"

    def placement(self, recipe, name: str, lineage: str | None = None) -> Placement:
        return Placement(
            checkpoint_dir=recipe.checkpoint.dir or "checkpoints", output_dir="output", s3_data_dir=DATA_DIR
        )

    def problems(self, spec: JobSpec) -> list[str]:
        problems = super().problems(spec)
        nodes = spec.resources.instance_count
        if nodes > 1 and not PurePosixPath(spec.checkpoint_dir).is_absolute():
            problems.append(
                f"checkpoint.dir: {spec.checkpoint_dir!r} is relative, on each node's own disk, where the other "
                f"nodes' parts of a checkpoint never arrive and none is ever complete; {nodes} nodes need a "
                "directory they all share, e.g. --set checkpoint.dir=/fsx/checkpoints/" + spec.recipe_name
            )
        return problems

    def _render(self, spec: JobSpec) -> Rendering:
        bundle = Bundle.of(spec)
        config = accelerate_config(spec)
        script = launch_script(spec)
        header = [
            f"# {CONFIG_NAME} for `accelerate launch`. {LAYOUT_NOTE}",
            "# Run on every node, from the unpacked code bundle:",
        ]
        header += [f"#   {line}" for line in script.splitlines()[1:]]
        text = "\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False)
        data = {"config": config, "launch_script": script, "layout": LAYOUT_NOTE, "bundle": bundle.describe()}
        return Rendering(spec=spec, data=data, text=text, payload={"bundle": bundle})
