"""The HF accelerate config: for users who start jobs with `accelerate launch`.

Render only. It maps the recipe's layout onto accelerate's ND-parallel `parallelism_config`
(dp_replicate x dp_shard x cp x tp, the same order and meaning as this launcher's mesh) with
FSDP2. Accelerate has no pipeline parallelism, so recipes with pipeline > 1 are refused.
"""

from __future__ import annotations

import yaml

from launcher.backends.base import Backend, Capabilities, Rendering
from launcher.bundle import Bundle
from launcher.spec import CONFIG_FILE, ENTRYPOINT, RDZV_PORT, JobSpec, Placement

CONFIG_NAME = "accelerate.yaml"


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


class AccelerateBackend(Backend):
    name = "accelerate"
    capabilities = Capabilities(multi_node=True, efa=True, pipeline_parallel=False, submits=False)

    def placement(self, recipe, name: str, lineage: str | None = None) -> Placement:
        return Placement(checkpoint_dir=recipe.checkpoint.dir or "checkpoints", output_dir="output")

    def _render(self, spec: JobSpec) -> Rendering:
        bundle = Bundle.build(spec.resolved_json)
        config = accelerate_config(spec)
        command = ["accelerate", "launch", "--config_file", CONFIG_NAME, ENTRYPOINT, "--config", CONFIG_FILE]
        if spec.resources.instance_count > 1:
            command[2:2] = ["--machine_rank", "<rank of this node>", "--main_process_ip", "<first node's address>"]
        text = yaml.safe_dump(config, sort_keys=False)
        data = {"config": config, "command": command, "bundle": bundle.describe()}
        return Rendering(spec=spec, data=data, text=text, payload={"bundle": bundle})
