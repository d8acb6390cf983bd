"""Rules that relate a recipe's fields to each other and to the hardware.

`layout_problems` is what the planner calls for every layout it considers, so a layout the
planner proposes can never be one the recipe layer rejects.
"""

from __future__ import annotations

import re

from launcher.catalog import ModelArch, choices
from launcher.errors import Problem
from launcher.layout import Layout, fill_data_shard
from launcher.recipe.resolve import Hardware
from launcher.recipe.schema import SAGEMAKER_MAX_RUN_S, RecipeSpec

# Patterns from the SageMaker API model (botocore sagemaker/2017-07-24/service-2.json).
ROLE_ARN_RE = re.compile(r"^arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+$")
S3_URI_RE = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(/.*)?$")
REGION_RE = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d+$")
SUBNET_RE = re.compile(r"^subnet-[0-9a-z]+$")
SECURITY_GROUP_RE = re.compile(r"^sg-[0-9a-z]+$")
KMS_KEY_RE = re.compile(r"^[a-zA-Z0-9:/_\-]+$")
IMAGE_RE = re.compile(r"^[\S]{1,255}$")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_choices(arch: ModelArch, gpus_per_node: int) -> list[int]:
    """TP degrees that split both query and KV heads evenly and stay inside one node."""
    return [t for t in divisors(arch.num_kv_heads) if arch.num_heads % t == 0 and t <= gpus_per_node]


def layout_problems(
    layout: Layout,
    arch: ModelArch,
    *,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    gpus_per_node: int,
    schedule: str,
) -> list[Problem]:
    """Every rule a parallel layout must satisfy for this model and batch."""
    problems = []
    t, c, p, v = layout.tensor, layout.context, layout.pipeline, layout.virtual_stages

    if arch.num_heads % t or arch.num_kv_heads % t:
        heads = arch.num_heads if arch.num_heads % t else arch.num_kv_heads
        kind = "attention heads" if arch.num_heads % t else "KV heads"
        problems.append(
            Problem(
                "parallel.tensor",
                f"{t} does not divide {heads} {kind}; use {choices(tensor_choices(arch, gpus_per_node))}",
            )
        )
    elif t > gpus_per_node:
        problems.append(
            Problem(
                "parallel.tensor",
                f"{t} exceeds the {gpus_per_node} GPUs of one node; tensor parallelism needs NVLink, use {choices(tensor_choices(arch, gpus_per_node))}",
            )
        )

    stages = p * v
    if arch.num_layers % stages:
        valid_p = [d // v for d in divisors(arch.num_layers) if d % v == 0]
        where = "parallel.pipeline" if v == 1 else "parallel.virtual_stages"
        fix = f"use pipeline {choices(valid_p)}" if valid_p else f"use virtual_stages dividing {arch.num_layers}"
        problems.append(
            Problem(
                where,
                f"pipeline {p} x virtual_stages {v} = {stages} stages do not divide {arch.num_layers} layers; {fix}",
            )
        )
    if v > 1 and schedule != "interleaved_1f1b":
        problems.append(
            Problem(
                "parallel.virtual_stages",
                f"{v} stages per rank need pipeline_schedule: interleaved_1f1b, not {schedule}",
            )
        )
    if schedule == "interleaved_1f1b" and v < 2:
        problems.append(
            Problem(
                "parallel.pipeline_schedule",
                "interleaved_1f1b needs virtual_stages of 2 or more; set virtual_stages or use 1f1b",
            )
        )
    if v > 1 and p == 1:
        problems.append(
            Problem("parallel.virtual_stages", f"{v} needs pipeline > 1; virtual stages interleave pipeline ranks")
        )
    if arch.tie_embeddings and p > 1:
        # The first stage owns the embedding and the last the output layer; tying them would
        # need a cross-stage gradient all-reduce the entrypoints do not do.
        problems.append(
            Problem("parallel.pipeline", f"{p} splits a model with tied embeddings over stages; use pipeline: 1")
        )

    # Zigzag CP cuts the sequence into 2c chunks; sequence parallel then splits each rank's
    # tokens over the tensor group.
    divisor = 2 * c * t if c > 1 else t
    if seq_len % divisor:
        why = f"2 x context {c} x tensor {t}" if c > 1 else f"tensor {t} (sequence parallel)"
        lower = seq_len - seq_len % divisor
        hint = f"{lower} or {lower + divisor}" if lower else f"{divisor}"
        problems.append(
            Problem("training.seq_len", f"{seq_len} is not divisible by {why} = {divisor}; use e.g. {hint}")
        )

    dp = layout.data_parallel
    per_step = micro_batch_size * dp
    if global_batch_size % per_step:
        problems.append(
            Problem(
                "training.global_batch_size",
                f"{global_batch_size} is not a multiple of micro_batch_size {micro_batch_size} x data-parallel size {dp} = {per_step}; use a multiple of {per_step}",
            )
        )
    elif p > 1:
        microbatches = global_batch_size // per_step
        if microbatches < p:
            problems.append(
                Problem(
                    "training.global_batch_size",
                    f"{global_batch_size} gives {microbatches} micro-batches per step, fewer than the {p} pipeline stages; use at least {p * per_step}",
                )
            )
        elif schedule == "interleaved_1f1b" and microbatches % p:
            problems.append(
                Problem(
                    "training.global_batch_size",
                    f"interleaved 1F1B needs micro-batches per step ({microbatches}) divisible by pipeline {p}; use a multiple of {p * per_step}",
                )
            )
    return problems


def resolve_layout(spec: RecipeSpec, world_size: int, hardware_text: str) -> tuple[Layout | None, list[Problem]]:
    par = spec.parallel
    shard = par.data_shard
    if shard == "auto":
        shard = fill_data_shard(
            world_size=world_size,
            tensor=par.tensor,
            context=par.context,
            pipeline=par.pipeline,
            data_replicate=par.data_replicate,
        )
        if shard is None:
            others = par.tensor * par.context * par.pipeline * par.data_replicate
            return None, [
                Problem(
                    "parallel",
                    f"tensor {par.tensor} x context {par.context} x pipeline {par.pipeline} x data_replicate {par.data_replicate} = {others} does not divide the {world_size} GPUs of {hardware_text}",
                )
            ]
    layout = Layout(
        tensor=par.tensor,
        context=par.context,
        pipeline=par.pipeline,
        data_replicate=par.data_replicate,
        data_shard=shard,
        virtual_stages=par.virtual_stages,
    )
    if layout.world_size != world_size:
        others = layout.world_size // shard
        fix = f"data_shard {world_size // others} or auto" if world_size % others == 0 else "other degrees"
        return None, [
            Problem(
                "parallel.data_shard",
                f"tensor x context x pipeline x data_replicate x data_shard = {layout.world_size} GPUs, but {hardware_text} has {world_size}; use {fix}",
            )
        ]
    return layout, []


def hardware_problems(spec: RecipeSpec, arch: ModelArch, hardware: Hardware) -> list[Problem]:
    problems = []
    if spec.precision.fp8 and not hardware.accelerator.has_fp8 and spec.cluster.device != "cpu":
        problems.append(
            Problem(
                "precision.fp8",
                f"{hardware.accelerator_key} has no FP8 tensor cores; FP8 needs h100-80gb or h200-141gb (or device: cpu for tests)",
            )
        )
    if spec.data.source != "synthetic" and spec.data.dtype == "uint16" and arch.vocab_size > 65536:
        problems.append(
            Problem("data.dtype", f"uint16 cannot hold token ids of a {arch.vocab_size}-token vocabulary; use uint32")
        )
    source = spec.data.source
    if spec.cluster.backend == "sagemaker" and source != "synthetic" and not source.startswith("s3://"):
        problems.append(
            Problem(
                "data.source", f"a local path ({source}) cannot reach a SageMaker job; upload it and use an s3:// URI"
            )
        )
    return problems


def sagemaker_problems(spec: RecipeSpec) -> list[Problem]:
    sm = spec.sagemaker
    problems = []

    def check(path: str, value, pattern: re.Pattern, valid: str):
        if value is not None and not pattern.match(value):
            problems.append(Problem(path, f"'{value}' is not {valid}"))

    check("sagemaker.region", sm.region, REGION_RE, "an AWS region; use e.g. us-east-1 or us-west-2")
    check(
        "sagemaker.role_arn",
        sm.role_arn,
        ROLE_ARN_RE,
        "an IAM role ARN; use arn:aws:iam::<12-digit account>:role/<name>",
    )
    check("sagemaker.output_uri", sm.output_uri, S3_URI_RE, "an S3 URI; use s3://<bucket>/<prefix>")
    check("sagemaker.checkpoint_uri", sm.checkpoint_uri, S3_URI_RE, "an S3 URI; use s3://<bucket>/<prefix>")
    check(
        "sagemaker.image_uri",
        sm.image_uri,
        IMAGE_RE,
        "an image URI; use <account>.dkr.ecr.<region>.amazonaws.com/<repo>:<tag>",
    )
    check("sagemaker.kms_key_id", sm.kms_key_id, KMS_KEY_RE, "a KMS key ID, ARN or alias")
    if spec.data.source.startswith("s3://"):
        check("data.source", spec.data.source, S3_URI_RE, "an S3 URI; use s3://<bucket>/<prefix>")
    for i, subnet in enumerate(sm.subnets):
        check(f"sagemaker.subnets.{i}", subnet, SUBNET_RE, "a subnet ID; use subnet-<hex>")
    for i, group in enumerate(sm.security_group_ids):
        check(f"sagemaker.security_group_ids.{i}", group, SECURITY_GROUP_RE, "a security group ID; use sg-<hex>")
    if bool(sm.subnets) != bool(sm.security_group_ids):
        missing = "security_group_ids" if sm.subnets else "subnets"
        problems.append(
            Problem(f"sagemaker.{missing}", "a VPC needs both subnets and security_group_ids; add the missing list")
        )
    if len(sm.subnets) > 16:
        problems.append(Problem("sagemaker.subnets", f"{len(sm.subnets)} subnets; SageMaker takes at most 16"))
    if len(sm.security_group_ids) > 5:
        problems.append(
            Problem("sagemaker.security_group_ids", f"{len(sm.security_group_ids)} groups; SageMaker takes at most 5")
        )
    if sm.max_run > SAGEMAKER_MAX_RUN_S:
        problems.append(
            Problem("sagemaker.max_run", f"{_days(sm.max_run)} exceeds SageMaker's limit of 28 days; use 28d or less")
        )
    if sm.max_wait is not None:
        if not sm.spot:
            problems.append(
                Problem("sagemaker.max_wait", "applies only to managed spot; set spot: true or remove max_wait")
            )
        elif sm.max_wait < sm.max_run:
            problems.append(
                Problem(
                    "sagemaker.max_wait",
                    f"{_days(sm.max_wait)} is shorter than max_run {_days(sm.max_run)}; the wait includes the run, use at least max_run",
                )
            )
        elif sm.max_wait > SAGEMAKER_MAX_RUN_S:
            problems.append(
                Problem(
                    "sagemaker.max_wait", f"{_days(sm.max_wait)} exceeds SageMaker's limit of 28 days; use 28d or less"
                )
            )
    if len(sm.tags) > 50:
        problems.append(Problem("sagemaker.tags", f"{len(sm.tags)} tags; SageMaker takes at most 50"))
    for key, value in sm.tags.items():
        if not 1 <= len(key) <= 128 or key.startswith("aws:"):
            problems.append(
                Problem(f"sagemaker.tags.{key}", "tag keys are 1 to 128 characters and may not start with aws:")
            )
        elif len(value) > 256:
            problems.append(Problem(f"sagemaker.tags.{key}", f"tag value of {len(value)} characters; at most 256"))
    return problems


def training_problems(spec: RecipeSpec) -> list[Problem]:
    opt = spec.training.optimizer
    problems = []
    if opt.min_lr > opt.lr:
        problems.append(Problem("training.optimizer.min_lr", f"{opt.min_lr} is above lr {opt.lr}; use at most lr"))
    if not all(0 <= beta < 1 for beta in opt.betas):
        problems.append(
            Problem("training.optimizer.betas", f"{list(opt.betas)} must each be in [0, 1); use e.g. [0.9, 0.95]")
        )
    return problems


def _days(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    hours = rest // 3600
    return f"{days}d{hours}h" if hours else f"{days}d"
