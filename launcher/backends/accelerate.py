"""The HF accelerate config: for users who start jobs with `accelerate launch`.

Render only: an accelerate config file whose header holds the launch script to run on every
node. The training layout comes from the recipe (resolved.json, which entrypoints/train.py
reads); the config's `parallelism_config` and `fsdp_config` mirror it (dp_replicate x dp_shard
x cp x tp, the same order and meaning as this launcher's mesh) so the file reads true, but
accelerate does not build the model. Accelerate has no pipeline parallelism, so recipes with
pipeline > 1 are refused. s3:// data is synced to each node by the script (`aws s3 sync`).
"""

from __future__ import annotations

import shlex

import yaml

from launcher.backends.base import Backend, Rendering
from launcher.bundle import Bundle
from launcher.spec import CONFIG_FILE, ENTRYPOINT, RDZV_PORT, JobSpec, Placement

CONFIG_NAME = "accelerate.yaml"
DATA_DIR = "data/train"  # relative to the unpacked bundle, where the script runs
LAYOUT_NOTE = (
    "The layout (tensor, context, FSDP degrees, precision, batch) comes from the recipe in resolved.json, "
    "which entrypoints/train.py reads; fsdp_config and parallelism_config below only mirror it."
)


def accelerate_config(spec: JobSpec) -> dict:
    r = spec.resources
    resolved = spec.resolved
    parallel, precision = resolved["parallel"], resolved["precision"]
    if precision["fp8"]:
        mixed = "fp8"
    else:
        mixed = {"bf16": "bf16", "fp32": "no"}[precision["dtype"]]
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": mixed,
        "use_cpu": r.device == "cpu",
        "num_machines": r.instance_count,
        "num_processes": r.world_size,
        "machine_rank": 0,
        "main_process_ip": None,
        "main_process_port": RDZV_PORT,
        "rdzv_backend": "c10d" if r.instance_count > 1 else "static",
        "same_network": True,
        "main_training_function": "main",
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_activation_checkpointing": parallel["activation_checkpointing"] != "none",
            "fsdp_cpu_ram_efficient_loading": False,
        },
        "parallelism_config": {
            "parallelism_config_dp_replicate_size": parallel["data_replicate"],
            "parallelism_config_dp_shard_size": parallel["data_shard"],
            "parallelism_config_tp_size": parallel["tensor"],
            "parallelism_config_cp_size": parallel["context"],
        },
    }
    if precision["fp8"]:
        config["fp8_config"] = {"backend": "AO"}
    return config


def launch_script(spec: JobSpec) -> str:
    """What to run on every node, from the unpacked bundle: data sync, environment, accelerate launch."""
    lines = ["#!/bin/bash", "set -euo pipefail"]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in spec.environment]
    command = ["accelerate", "launch", "--config_file", CONFIG_NAME]
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
