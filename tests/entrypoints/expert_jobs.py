"""The expert-parallel jobs of test_expert_parallel.py, in the shared 1- and 4-rank launches.

A Qwen3-MoE-like tiny model (2 layers, QK-norm, head_dim 32 x 8 heads != hidden 128, 8 experts,
top-2, with a load-balancing and a z-loss) trains 2 steps under each expert-parallel layout, and once
in one process; the 6-expert model 3 steps, and its EP 2 checkpoint of step 2 resumes on 2 ranks. The launcher refuses MoE recipes until the estimator prices experts (issue 24
part 5), so each job is the dense job's resolved config (write_job) with the model's moe block
and parallel.expert written in, checked by the entrypoints' own parser.
"""

from __future__ import annotations

import json
from pathlib import Path

from .entrypoint_jobs import Job, Planned, write_job

MOE = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 64, "aux_loss_coef": 0.01, "z_loss_coef": 0.001}
# Two layers: one per pipeline stage under pp 2, and half the work of the dense jobs' four.
MOE_MODEL = {"num_layers": 2, "qk_norm": True, "head_dim": 32, "moe": MOE}
# The auxiliary losses pool every layer's routing, which pipeline stages cannot (the contract
# refuses them under pipeline > 1), so the pipelined job trains the model without them.
MOE_MODEL_NO_AUX = {**MOE_MODEL, "moe": {**MOE, "aux_loss_coef": 0.0, "z_loss_coef": 0.0}}
# Six experts: 3 a rank under EP 2 and 1.5 a rank without EP, on 4 ranks, which FSDP shards on
# their dim 1 instead (parallel/fsdp.py, expert_placement).
MOE_MODEL_6 = {**MOE_MODEL, "moe": {**MOE, "num_experts": 6}}
# Its jobs train 3 steps and checkpoint at step 2: the resumed job's step 3 is the uninterrupted one's.
SIX_EXPERTS = {"checkpoint.every_steps": 2, "training.steps": 3}
# A shared expert and a sigmoid router (DeepSeek-style): under TP both are replicated over the tp
# ranks, which run them on different tokens (parallel/tensor.py), and their gradients are summed.
MOE_MODEL_SHARED = {
    **MOE_MODEL,
    "moe": {**MOE, "shared_experts": 1, "router_score": "sigmoid", "aux_loss_coef": 1.0, "z_loss_coef": 0.1},
}
REFERENCES = {"moe": MOE_MODEL, "moe-no-aux": MOE_MODEL_NO_AUX, "moe6": MOE_MODEL_6, "moe-shared": MOE_MODEL_SHARED}
REFERENCE_STEPS = {"moe6": {"training.steps": 3}}
# name -> (overrides, parallel.expert, its reference), each on 4 ranks. "no_ep_dp_shard4" is
# ep2/ep4's layout without expert parallelism: EP must not move them from it by more than float
# rounding, whatever the data-parallel layout itself does to the order of sums.
LAYOUTS = {
    "ep2_dp_shard4": ({}, 2, "moe"),
    "ep4_dp_shard4": ({}, 4, "moe"),
    "ep2_cp2_dp_shard2": ({"parallel.context": 2}, 2, "moe"),
    # Under TP each tp rank routes its own tokens: EP 2 is the tp pair, EP 4 spans tp and dp_shard
    # (Megatron's expert_tensor_parallel_size 1), and without EP the experts are FSDP-sharded over
    # dp_shard x tp, whose ranks all compute them on different tokens.
    "ep2_tp2_dp_shard2": ({"parallel.tensor": 2}, 2, "moe"),
    "ep4_tp2_dp_shard2_shared": ({"parallel.tensor": 2}, 4, "moe-shared"),
    "no_ep_tp2_dp_shard2": ({"parallel.tensor": 2}, 1, "moe"),
    "ep2_pp2_dp_shard2": ({"parallel.pipeline": 2, "parallel.pipeline_schedule": "1f1b"}, 2, "moe-no-aux"),
    "no_ep_dp_shard4": ({}, 1, "moe"),
    "ep2_dp_shard4_6_experts": (SIX_EXPERTS, 2, "moe6"),
    "no_ep_dp_shard4_6_experts": (SIX_EXPERTS, 1, "moe6"),
    "ep2_tp2_dp_shard2_6_experts": ({**SIX_EXPERTS, "parallel.tensor": 2}, 2, "moe6"),
}
# name -> (the 4-rank layout whose step-2 checkpoint it resumes, parallel.expert) on 2 ranks: the
# experts saved as dim-1 shards (3 a rank over 2 shards) load as 3 whole experts a rank under EP 2,
# and as dim-0 shards of all 6 without EP.
RESUMED = {
    "ep2_6_experts_resumed_on_2_ep2": ("ep2_dp_shard4_6_experts", 2),
    "ep2_6_experts_resumed_on_2_no_ep": ("ep2_dp_shard4_6_experts", 1),
    # Saved where EP 2 is the tp pair (the experts on an expert mesh over dp_shard x tp), resumed
    # without TP: the experts' shards move to other ranks and meshes.
    "ep2_tp2_6_experts_resumed_on_2_ep2": ("ep2_tp2_dp_shard2_6_experts", 2),
}
# Two steps of 64 tokens (2 x cp 2 x 16, or tp 2 x 32) keep the jobs to seconds. A peak lr of
# 1e-4: AdamW moves every weight by about lr whatever the size of its gradient, so the order of
# float sums (which each layout changes) shows in the next step in proportion to lr.
TRAINING = {
    "training.seq_len": 64,
    "training.steps": 2,
    "training.optimizer.lr": 1e-4,
    "training.optimizer.min_lr": 1e-5,
}


def write_moe_job(
    root: Path, name: str, overrides: dict, *, procs: int, model: dict, expert: int = 1, resume: str | None = None
) -> Job:
    """The dense job's resolved config with `model`'s fields and parallel.expert written in."""
    from launcher.contract.config import JobConfig

    job = write_job(root, name, {**TRAINING, **overrides}, procs=procs, resume=resume)
    config = json.loads(job.config.read_text())
    config["model"] = {**config["model"], **model}
    config["parallel"]["expert"] = expert
    JobConfig.from_dict(config)
    job.config.write_text(json.dumps(config, indent=2))
    return job


def plan_experts(root: Path) -> Planned:
    """Every job of test_expert_parallel.py; {"references": ..., "layouts": ...} once run."""
    root.mkdir(parents=True)
    references = {
        name: write_moe_job(root, name, REFERENCE_STEPS.get(name, {}), procs=1, model=model)
        for name, model in REFERENCES.items()
    }
    layouts = {
        name: write_moe_job(root, name, changes, procs=4, model=REFERENCES[reference], expert=expert)
        for name, (changes, expert, reference) in LAYOUTS.items()
    }
    resumed = {
        name: write_moe_job(
            root,
            name,
            {"training.steps": 3},
            procs=2,
            model=MOE_MODEL_6,
            expert=expert,
            resume=str(layouts[source].checkpoint_dir / "step-00000002"),
        )
        for name, (source, expert) in RESUMED.items()
    }

    def train(job: Job) -> dict:
        return {"kind": "train", "config": str(job.config), "result": str(job.result)}

    def finish(stdout: dict[int, str]) -> dict:
        return {"references": references, "layouts": layouts, "resumed": resumed, "stdout": stdout[4]}

    jobs = {
        1: [train(j) for j in references.values()],
        4: [train(j) for j in layouts.values()],
        2: [train(j) for j in resumed.values()],
    }
    return Planned(jobs=jobs, finish=finish)
