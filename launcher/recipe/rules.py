"""Rules that relate a recipe's fields to each other and to the hardware.

The layout rules themselves live in `launcher.contract.layout`, shared with the entrypoints;
`layout_problems` returns them as recipe Problems. It is what the planner calls for every layout
it considers, so a layout the planner proposes can never be one the recipe layer rejects. The
rest here are the hardware, SageMaker and training rules.
"""

from __future__ import annotations

import re

from launcher.catalog import ModelArch, accelerators
from launcher.catalog.engines import capabilities
from launcher.contract import layout as contract_layout
from launcher.contract.config import MLFLOW_ARN_RE, MLFLOW_HTTP_RE
from launcher.contract.dataset import manifest_problem
from launcher.contract.fp8 import fp8_experts_problem
from launcher.contract.hf_names import hf_layout_problem
from launcher.contract.layout import Layout, fill_data_shard
from launcher.contract.text import choices
from launcher.errors import Problem
from launcher.recipe import schema
from launcher.recipe.hardware import Hardware
from launcher.recipe.references import dataset_manifest
from launcher.recipe.schema import SAGEMAKER_MAX_RUN_S, RecipeSpec
from launcher.recipe.validation import validation_problems

# The SageMaker identifiers' patterns live in the schema (its JSON Schema shows them to editors);
# matched whole here, with the cross-field rules, so every problem of a recipe is reported at once.
ROLE_ARN_RE = schema.whole(schema.ROLE_ARN_PATTERN)
S3_URI_RE = schema.whole(schema.S3_URI_PATTERN)
REGION_RE = schema.whole(schema.REGION_PATTERN)
SUBNET_RE = schema.whole(schema.SUBNET_PATTERN)
SECURITY_GROUP_RE = schema.whole(schema.SECURITY_GROUP_PATTERN)
KMS_KEY_RE = schema.whole(schema.KMS_KEY_PATTERN)
IMAGE_RE = schema.whole(schema.IMAGE_PATTERN)


# The example account ids of AWS's documentation: 111122223333, 444455556666 and 777788889999 of
# the IAM User Guide's policies, 123456789012 of its ARN examples. A recipe that still names one
# was copied and not filled in: its role cannot be the user's, nor the bucket named for it theirs.
PLACEHOLDER_ACCOUNTS = frozenset({"111122223333", "444455556666", "777788889999", "123456789012"})


def placeholder_role(role_arn: str | None) -> str | None:
    """Why sagemaker.role_arn cannot be the user's role (it names a documentation account), if so."""
    parts = (role_arn or "").split(":")
    if len(parts) < 5 or parts[4] not in PLACEHOLDER_ACCOUNTS:
        return None
    return (
        f"sagemaker.role_arn: {parts[4]} is an example account of AWS's documentation, not yours; set your "
        "execution role, e.g. --set sagemaker.role_arn=arn:aws:iam::<your account>:role/<name>"
    )


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
    """Every rule a parallel layout must satisfy for this model and batch: the contract's rules,
    which the entrypoints check again on the resolved config, as recipe Problems."""
    found = contract_layout.layout_problems(
        layout,
        arch,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        gpus_per_node=gpus_per_node,
        schedule=schedule,
    )
    return [Problem(path, message) for path, message in found]


def architecture_problems(spec: RecipeSpec, arch: ModelArch) -> list[Problem]:
    """Hugging Face weights in or out of a model that has no Hugging Face checkpoint layout
    (a changed router, shared experts: launcher.contract.hf_names' `hf_layout_problem`)."""
    problem = hf_layout_problem(arch.model_dump(mode="json"))
    if problem is None:
        return []
    weights = [
        ("model.init_from", getattr(spec.model, "init_from", None)),
        ("checkpoint.export_hf", spec.checkpoint.export_hf),
    ]
    return [
        Problem(key, f"{problem}; train from the random initialisation and without export_hf")
        for key, value in weights
        if value
    ]


def attention_problems(spec: RecipeSpec, arch: ModelArch, layout: Layout) -> list[Problem]:
    """The context-parallel attention path and document masking against the model and the data."""
    problems = [
        Problem(path, message)
        for path, message in contract_layout.cp_attention_problems(spec.parallel.cp_attention, arch, layout)
    ]
    data = spec.data
    if not data.document_masking:
        return problems
    separator = data.document_separator
    if separator is None and data.source != "synthetic":
        problems.append(
            Problem(
                "data.document_separator",
                "document_masking needs the token id that ends each document; set it to the tokenizer's EOS id",
            )
        )
    elif separator is not None and separator >= arch.vocab_size:
        problems.append(
            Problem(
                "data.document_separator",
                f"{separator} is not a token id of the {arch.vocab_size}-token vocabulary; use 0 to {arch.vocab_size - 1}",
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
        expert=par.expert,
        virtual_stages=par.virtual_stages,
        pipeline_layers=None if par.pipeline_layers is None else tuple(par.pipeline_layers),
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


def fp8_accelerators() -> list[str]:
    """The catalog's accelerators with FP8 tensor cores."""
    return [key for key, accelerator in accelerators().items() if accelerator.has_fp8]


def fp8_experts_problems(spec: RecipeSpec, arch: ModelArch) -> list[Problem]:
    """precision.fp8_experts needs fp8, a mixture of experts, and experts the kernel can take."""
    if not spec.precision.fp8_experts:
        return []
    if not spec.precision.fp8:
        why = "it adds the experts to FP8 training; set precision.fp8: true too, or drop it"
    elif arch.moe is None:
        why = "this model has no experts (no moe: block in its architecture); drop it"
    else:
        why = fp8_experts_problem(hidden_size=arch.hidden_size, expert_ffn_hidden_size=arch.moe.expert_ffn_hidden_size)
        if why is None:
            return []
        why += "; drop it"
    return [Problem("precision.fp8_experts", why)]


def hardware_problems(spec: RecipeSpec, arch: ModelArch, hardware: Hardware) -> list[Problem]:
    problems = fp8_experts_problems(spec, arch)
    if spec.training.moe_force_load_balance and arch.moe is None:
        why = "this model has no experts (no moe: block in its architecture) to balance; drop it"
        problems.append(Problem("training.moe_force_load_balance", why))
    if spec.precision.fp8 and not hardware.accelerator.has_fp8 and spec.cluster.device != "cpu":
        problems.append(
            Problem(
                "precision.fp8",
                f"{hardware.accelerator_key} has no FP8 tensor cores; FP8 needs {choices(fp8_accelerators())} "
                "(or device: cpu for tests)",
            )
        )
    if spec.data.source != "synthetic" and spec.data.dtype == "uint16" and arch.vocab_size > 65536:
        problems.append(
            Problem("data.dtype", f"uint16 cannot hold token ids of a {arch.vocab_size}-token vocabulary; use uint32")
        )
    source, engine = spec.data.source, capabilities(spec.cluster.backend)
    if not engine.reads_local_paths and source != "synthetic" and not source.startswith("s3://"):
        problems.append(
            Problem(
                "data.source",
                f"a local path ({source}) cannot reach a {engine.title} job; upload it and use an s3:// URI",
            )
        )
    return problems + data_problems(spec, arch) + validation_problems(spec, arch)


def data_problems(spec: RecipeSpec, arch: ModelArch) -> list[Problem]:
    """A prepared dataset must fit the model; raw text needs somewhere the job can read it."""
    data = spec.data
    if data.tokenizer is None:
        manifest, problem = dataset_manifest(data.source)
        if problem is not None or manifest is None:
            return [problem] if problem else []
        line = manifest_problem(manifest, dtype=data.dtype, vocab_size=arch.vocab_size)
        key, _, message = (line or "").partition(": ")
        return [Problem(key, message)] if line else []
    if data.source == "synthetic":
        return [
            Problem(
                "data.tokenizer",
                "tokenizes raw text, but data.source is synthetic; set data.source to text files, e.g. corpus/*.jsonl",
            )
        ]
    engine = capabilities(spec.cluster.backend)
    if not engine.reads_local_paths:
        return [
            Problem(
                "data.tokenizer",
                f"submit prepares raw text on this machine, which a {engine.title} job cannot read; run "
                "`launcher data prepare SOURCE --tokenizer T --out s3://...` and set data.source to that prefix",
            )
        ]
    return []


def sagemaker_problems(spec: RecipeSpec) -> list[Problem]:
    sm = spec.sagemaker
    problems = []

    def check(path: str, value, pattern: re.Pattern, valid: str):
        if value is not None and not pattern.match(value):
            shown = value if len(value) <= 60 else value[:57] + "..."
            problems.append(Problem(path, f"{shown!r} is not {valid}"))

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
        "cluster.image",
        spec.cluster.image,
        IMAGE_RE,
        "an image reference; use e.g. <account>.dkr.ecr.<region>.amazonaws.com/<repo>:<tag>",
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
    max_run, engine = spec.cluster.max_run, capabilities(spec.cluster.backend)
    if engine.max_run_s is not None and max_run > engine.max_run_s:
        limit = engine.max_run_s
        problems.append(
            Problem(
                "cluster.max_run",
                f"{_days(max_run)} exceeds {engine.title}'s limit of {limit // 86400} days; use {_days(limit)} or less",
            )
        )
    problems += _capacity_problems(sm, max_run)
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


def _capacity_problems(sm: schema.SageMaker, max_run: int) -> list[Problem]:
    """Spot against a training plan, and spot's wait against the run."""
    problems = []
    if sm.spot and sm.training_plan_arn:
        # A plan's capacity is reserved and paid for; managed spot is capacity SageMaker may take back.
        problems.append(
            Problem(
                "sagemaker.training_plan_arn",
                "runs on the plan's reserved capacity, which is not spot: remove sagemaker.spot: true "
                "(or the training plan)",
            )
        )
    if sm.max_wait is not None:
        if not sm.spot:
            problems.append(
                Problem("sagemaker.max_wait", "applies only to managed spot; set spot: true or remove max_wait")
            )
        elif sm.max_wait < max_run:
            problems.append(
                Problem(
                    "sagemaker.max_wait",
                    f"{_days(sm.max_wait)} is shorter than cluster.max_run {_days(max_run)}; the wait includes the run, use at least max_run",
                )
            )
        elif sm.max_wait > SAGEMAKER_MAX_RUN_S:
            problems.append(
                Problem(
                    "sagemaker.max_wait", f"{_days(sm.max_wait)} exceeds SageMaker's limit of 28 days; use 28d or less"
                )
            )
    return problems


def slurm_problems(spec: RecipeSpec) -> list[Problem]:
    """Paths the Slurm nodes must find at the same place: absolute, or they would resolve per node."""
    problems = []
    for key in ("shared_dir", "venv"):
        value = getattr(spec.slurm, key)
        if value is not None and not value.startswith("/"):
            problems.append(Problem(f"slurm.{key}", f"'{value}' is not an absolute path; use e.g. /fsx/launcher"))
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


def tracking_problems(spec: RecipeSpec) -> list[Problem]:
    mlflow = spec.tracking.mlflow
    if mlflow is None or MLFLOW_HTTP_RE.fullmatch(mlflow.uri) or MLFLOW_ARN_RE.fullmatch(mlflow.uri):
        return []
    shown = mlflow.uri if len(mlflow.uri) <= 60 else mlflow.uri[:57] + "..."
    return [
        Problem(
            "tracking.mlflow.uri",
            f"{shown!r} is not an MLflow tracking server; use http(s)://host:port or a SageMaker MLflow tracking "
            "server ARN, arn:aws:sagemaker:<region>:<account>:mlflow-tracking-server/<name>",
        )
    ]


def _days(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    hours = rest // 3600
    return f"{days}d{hours}h" if hours else f"{days}d"
