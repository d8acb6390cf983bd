"""The recipe schema: what a user may write in a YAML recipe, with a description per field.

Only the shape and the ranges of single fields live here. Rules that relate fields to each
other or to the catalogs (world size, head counts, instance types) live in `rules.py`, so the
planner can apply exactly the same rules to layouts it invents.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    NonNegativeInt,
    PositiveInt,
    Tag,
    WithJsonSchema,
    model_validator,
)

from launcher.catalog.engines import capabilities
from launcher.contract.config import (
    DEFAULT_MIN_STALL_S,
    DEFAULT_STALL_FACTOR,
    DEFAULT_STRAGGLER_EVERY,
    DEFAULT_STRAGGLER_MARGIN,
)
from launcher.contract.layout import MAX_SEQ_LEN
from launcher.contract.metrics import MAX_STEPS
from launcher.recipe.region import default_region

SAGEMAKER_MAX_RUN_S = capabilities("sagemaker").max_run_s  # 28 days (launcher/catalog/engines.yaml)

# Upper bounds of the numeric fields. Each is far above any real job, and each keeps the
# arithmetic the planner and estimator do on the values (divisors, products, forecasts) instant.
MAX_GPUS = 131072
"""The largest world size: 16,384 nodes of 8 GPUs."""
MAX_INSTANCES = 16384
MAX_PROCS_PER_NODE = 256
MAX_SEED = 2**32 - 1
"""numpy's seeds are 32-bit."""
MAX_GLOBAL_BATCH = 2**24
"""Sequences per step: 16M, i.e. 2^46 tokens at the longest sequence."""
MAX_CHECKPOINTS_KEPT = 10_000
MAX_DURATION_S = 365 * 86400
MAX_MODEL_SHAPE = {
    "hidden_size": 2**20,
    "num_layers": 10_000,
    "num_heads": 2**16,
    "num_kv_heads": 2**16,
    "ffn_hidden_size": 2**22,
    "vocab_size": 2**24,
    "max_context": 2**24,
}
"""The largest model shapes a recipe or a Hugging Face config may give (Llama 3.1 405B: 16,384
hidden, 126 layers, 128 heads, 53,248 FFN, 128,256 vocabulary)."""
MAX_ROPE_THETA = 1e12

# A duration is short text; the length cap comes before the regex, and the regex has no two
# adjacent `\s*` that could split the same run of spaces between them (which backtracked for
# 30 s on 200 spaces and an `x`).
_DURATION_MAX_CHARS = 32
_DURATION_RE = re.compile(r"\s*(?:(\d+)d\s*)?(?:(\d+)h\s*)?(?:(\d+)m\s*)?(?:(\d+)s\s*)?")


def parse_duration(value: Any) -> Any:
    """'5d', '12h', '1d12h', '90m' or whole seconds, as seconds. Other input passes to pydantic."""
    if isinstance(value, str):
        match = _DURATION_RE.fullmatch(value) if len(value) <= _DURATION_MAX_CHARS else None
        if not match or not any(match.groups()):
            shown = value if len(value) <= 40 else value[:37] + "..."
            raise ValueError(f"{shown!r} is not a duration; write e.g. 5d, 12h, 1d12h, 90m or seconds")
        days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
        return ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    return value


def at_most_a_year(seconds: int) -> int:
    if seconds > MAX_DURATION_S:
        raise ValueError(f"{seconds:,} seconds is over a year; use at most 365d")
    return seconds


Duration = Annotated[
    PositiveInt,
    BeforeValidator(parse_duration),
    AfterValidator(at_most_a_year),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": MAX_DURATION_S},
                {"type": "string", "pattern": r"^(\d+d)?(\d+h)?(\d+m)?(\d+s)?$"},
            ]
        }
    ),
]


# Patterns from the SageMaker API model (botocore sagemaker/2017-07-24/service-2.json), as JSON
# Schema writes them (anchored with ^ and $), so editors check them as they are typed. The recipe
# rules (`rules.sagemaker_problems`) match them whole with Python's `re` (`\Z`, not `$`: `$` also
# accepts a trailing newline, so `region: "us-west-2\n"` once passed validation and failed at
# submit), next to the cross-field rules, so every problem of a recipe is reported at once; a
# pydantic `pattern` would stop validation before those rules. Each is linear in its input.
ROLE_ARN_PATTERN = r"^arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+$"
S3_URI_PATTERN = r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(/.*)?$"
REGION_PATTERN = r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d+$"
SUBNET_PATTERN = r"^subnet-[0-9a-z]+$"
SECURITY_GROUP_PATTERN = r"^sg-[0-9a-z]+$"
KMS_KEY_PATTERN = r"^[a-zA-Z0-9:/_\-]+$"
IMAGE_PATTERN = r"^[\S]{1,255}$"


def whole(pattern: str) -> re.Pattern:
    """`pattern` compiled to match a whole value with `re.match`."""
    return re.compile(pattern.removesuffix("$") + r"\Z")


def _matching(pattern: str, **json_limits: int) -> Any:
    """A string whose JSON Schema carries `pattern` (the rules check it)."""
    return Annotated[str, WithJsonSchema({"type": "string", "pattern": pattern, **json_limits})]


RoleArn = _matching(ROLE_ARN_PATTERN)
S3Uri = _matching(S3_URI_PATTERN)
Region = _matching(REGION_PATTERN)
SubnetId = _matching(SUBNET_PATTERN)
SecurityGroupId = _matching(SECURITY_GROUP_PATTERN)
KmsKeyId = _matching(KMS_KEY_PATTERN)
ImageRef = _matching(IMAGE_PATTERN, maxLength=255)


class Section(BaseModel):
    # No field takes inf or nan: they would reach the estimator's arithmetic and the entrypoints.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)


# --- model -----------------------------------------------------------------------------


class ModelOverride(Section):
    """A catalog model with some of its shapes changed, e.g. fewer layers for a quick test."""

    base: str = Field(description="Catalog key of the model to start from, e.g. llama3.1-8b.")
    hidden_size: PositiveInt | None = Field(default=None, le=MAX_MODEL_SHAPE["hidden_size"])
    num_layers: PositiveInt | None = Field(default=None, le=MAX_MODEL_SHAPE["num_layers"])
    num_heads: PositiveInt | None = Field(default=None, le=MAX_MODEL_SHAPE["num_heads"])
    num_kv_heads: PositiveInt | None = Field(default=None, le=MAX_MODEL_SHAPE["num_kv_heads"])
    ffn_hidden_size: PositiveInt | None = Field(default=None, le=MAX_MODEL_SHAPE["ffn_hidden_size"])
    vocab_size: PositiveInt | None = Field(default=None, le=MAX_MODEL_SHAPE["vocab_size"])
    max_context: PositiveInt | None = Field(default=None, le=MAX_MODEL_SHAPE["max_context"])
    rope_theta: float | None = Field(default=None, gt=0, le=MAX_ROPE_THETA)
    tie_embeddings: bool | None = None
    init_from: str | None = Field(default=None, max_length=1024)
    """Start from the weights of a Hugging Face Llama/Mistral checkpoint: a directory (relative to
    the recipe) or an s3:// prefix holding config.json and safetensors. Its config.json must match
    the architecture; a resumed run continues from its own checkpoint instead."""


class HFConfigModel(Section):
    """A Hugging Face Llama or Mistral config.json, relative to the recipe file."""

    hf_config: str | None = Field(
        default=None,
        description="Path to a Hugging Face config.json (Llama or Mistral); default: the one in a local init_from.",
    )
    init_from: str | None = Field(default=None, max_length=1024)
    """Start from the weights of a Hugging Face Llama/Mistral checkpoint: a directory (relative to
    the recipe) or an s3:// prefix holding config.json and safetensors. Its config.json must match
    the architecture; a resumed run continues from its own checkpoint instead."""


def model_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "name"
    if isinstance(value, dict):
        # {init_from: DIR} alone: the checkpoint's own config.json is the architecture.
        return "hf_config" if "hf_config" in value or ("init_from" in value and "base" not in value) else "override"
    if isinstance(value, BaseModel):
        return "hf_config" if isinstance(value, HFConfigModel) else "override"
    return None


ModelRef = Annotated[
    Annotated[str, Tag("name")]
    | Annotated[ModelOverride, Tag("override")]
    | Annotated[HFConfigModel, Tag("hf_config")],
    Discriminator(
        model_kind,
        custom_error_type="model_ref",
        custom_error_message="expected a catalog name, {base: NAME, ...}, {hf_config: PATH} or {init_from: DIR}",
    ),
]
MODEL_REF_TAGS = ("name", "override", "hf_config")


# --- training --------------------------------------------------------------------------


class Optimizer(Section):
    name: Literal["adamw"] = "adamw"
    """The optimizer. AdamW with decoupled weight decay."""
    lr: float = Field(default=3e-4, gt=0, le=10)
    """Peak learning rate, reached at the end of warmup."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    weight_decay: float = Field(default=0.1, ge=0, le=10)
    eps: float = Field(default=1e-8, gt=0, le=1)
    warmup_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    """Linear warmup from 0 to lr over this many optimizer steps."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup, from lr to min_lr at the last step."""
    min_lr: float = Field(default=0.0, ge=0, le=10)
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """AdamW's exp_avg and exp_avg_sq. bf16 halves them (4 bytes per parameter less, sharded as
    the parameters are; checkpoints 8 bytes per parameter, not 12), as NeMo's optim.dtype does for
    Apex's DistributedFusedAdam; the update still runs in fp32 on fp32 master weights. With
    betas[1] above 0.99 the second moment's per-step change falls below bf16's resolution."""


class Watchdog(Section):
    enabled: bool = True
    """Watch every rank for a stall, and the ranks' compute times for a straggler (docs/monitoring.md)."""
    stall_factor: float = Field(default=DEFAULT_STALL_FACTOR, ge=1, le=1e6)
    """A stall is no step completed within stall_factor x the running median step time (checkpoint
    saves and evaluations do not count; before the first step, cluster.collective_timeout), or
    min_stall_s if longer. Then every rank dumps its Python stacks to <output>/stacks/ and the job
    fails, naming the stuck ranks, so the engine's restart resumes from the newest checkpoint."""
    min_stall_s: float = Field(default=DEFAULT_MIN_STALL_S, gt=0, le=MAX_DURATION_S)
    """The shortest stall, in seconds, that fails the job."""
    straggler_every: int = Field(default=DEFAULT_STRAGGLER_EVERY, ge=0, le=MAX_STEPS)
    """Every this many steps the ranks gather their compute time and rank 0 names the slowest
    rank and host when it is above the median by more than straggler_margin (0: never)."""
    straggler_margin: float = Field(default=DEFAULT_STRAGGLER_MARGIN, gt=0, le=1e6)
    """The share above the median compute time that makes a rank a straggler (1.0: twice the median;
    on a loaded 2-core machine healthy ranks measured up to 54% above it)."""


class Training(Section):
    seq_len: PositiveInt = Field(le=MAX_SEQ_LEN)
    """Tokens per sequence (1 to 4194304, i.e. 4M). Above the model's trained context is a warning."""
    global_batch_size: PositiveInt = Field(le=MAX_GLOBAL_BATCH)
    """Sequences per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: PositiveInt = Field(default=1, le=MAX_GLOBAL_BATCH)
    """Sequences per forward/backward pass on one data-parallel rank."""
    steps: PositiveInt = Field(le=MAX_STEPS)
    """Optimizer steps to run."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seeds initialisation and synthetic data; the same seed gives the same model on any layout."""
    optimizer: Optimizer = Optimizer()
    grad_clip: float | None = Field(default=1.0, gt=0, le=1e6)
    """Clip the global gradient norm to this value; null disables clipping."""
    compile: bool = False
    """torch.compile each transformer block."""
    log_every: PositiveInt = Field(default=1, le=MAX_STEPS)
    """Log metrics every this many steps."""
    gc_every_steps: int = Field(default=50, ge=0, le=MAX_STEPS)
    """Python's garbage collector runs between steps, every this many (torchtitan's gc_freq, 50), so
    no rank pauses for it in the middle of a step and holds up the others; 0 leaves it to Python."""
    moe_force_load_balance: bool = False
    """Benchmarking a mixture of experts: route token copies round-robin over the experts, so each
    gets the same rows whatever the router scores (torchtitan's debug.moe_force_load_balance;
    Megatron-Core's moe_router_force_load_balancing). The router still trains on the scores of
    the experts it is given, but does not choose them: for speed and memory, not for a model."""
    watchdog: Watchdog = Watchdog()


class Precision(Section):
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Parameter and compute dtype (fp32 for CPU numerics tests)."""
    fp8: bool = False
    """Run the linear layers' matrix products in FP8 (torchao float8 training). H100/H200, or CPU tests."""
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao float8 scaling: one scale per tensor, or one per row (more accurate, a little slower)."""
    fp8_experts: bool = False
    """Under fp8, also run a mixture-of-experts model's experts as torchao's rowwise FP8 grouped
    GEMMs (whatever fp8_recipe says), on rows padded to 16 per expert; Hopper and Blackwell only,
    the experts stay in the compute dtype elsewhere. An opt-in, as in torchtitan (its grouped_mm
    converter is apart from the linear one): with many small experts per GPU the weights' casts
    can cost more than the faster GEMMs save, which submit's predicted time shows."""


class Parallel(Section):
    tensor: PositiveInt = Field(default=1, le=MAX_GPUS)
    """Tensor (and sequence) parallel degree; stays within a node."""
    context: PositiveInt = Field(default=1, le=MAX_GPUS)
    """Context parallel degree: the sequence is split over this many GPUs (zigzag load balancing)."""
    pipeline: PositiveInt = Field(default=1, le=MAX_GPUS)
    """Pipeline parallel degree: layers are split into this many stages."""
    virtual_stages: PositiveInt = Field(default=1, le=MAX_MODEL_SHAPE["num_layers"])
    """Pipeline stages per rank (interleaved 1F1B uses 2 or more)."""
    pipeline_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    pipeline_layers: list[Annotated[NonNegativeInt, Field(le=MAX_MODEL_SHAPE["num_layers"])]] | None = Field(
        default=None, max_length=MAX_MODEL_SHAPE["num_layers"]
    )
    """Transformer layers per pipeline stage, pipeline x virtual_stages numbers summing to the
    model's layers, e.g. [15, 16, 16, 16, 16, 16, 16, 15]; the first and last stages may hold 0
    (only the embedding, only the output layer and loss). Default: balanced, with one layer
    fewer on the first and last stages where they carry the embedding and the output layer."""
    data_replicate: PositiveInt = Field(default=1, le=MAX_GPUS)
    """Replicas of the FSDP-sharded model (HSDP); gradients are all-reduced between them."""
    data_shard: Annotated[PositiveInt, Field(le=MAX_GPUS)] | Literal["auto"] = "auto"
    """FSDP shard degree; 'auto' fills the GPUs the other degrees leave."""
    expert: PositiveInt = Field(default=1, le=MAX_GPUS)
    """Expert-parallel degree of a mixture-of-experts model: each MoE layer's experts are split
    over this many of the data_shard x context x tensor ranks (it adds no GPUs; under tensor
    parallelism each tensor rank routes its own slice of the sequence), tokens reach them by
    all-to-all. It must divide the expert count and data_shard x context x tensor."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: none, selective (every other block of each pipeline
    rank), or full (every block)."""
    cp_attention: Literal["auto", "allgather", "ulysses"] = "auto"
    """Attention under context parallelism: allgather (K/V gathered from the whole sequence), ulysses
    (all-to-all over heads; needs num_heads and num_kv_heads divisible by tensor x context), or auto:
    ulysses where the heads allow it and it moves no more bytes: the all-gather path runs three K/V
    collectives per layer (two under document masking), Ulysses one set of all-to-alls per pass
    (two passes, three in a checkpointed layer); launcher/contract/layout.py cp_attention_for."""
    grad_accumulation: Literal["auto", "sync_each", "sync_last", "sync_last_gathered"] = "auto"
    """How FSDP treats the micro-batches of one step: sync_each all-gathers parameters and
    reduce-scatters gradients for every micro-batch; sync_last keeps gradients unsharded until
    the last micro-batch and reduce-scatters once; sync_last_gathered also keeps parameters
    gathered between micro-batches; auto picks the fastest mode whose memory estimate fits.
    Under pipeline parallelism blocks stay gathered between micro-batches in every mode: sync_each
    reduce-scatters each micro-batch's gradients into their shards (no unsharded gradients held
    across micro-batches, as the Llama 3 paper's FSDP), sync_last runs as sync_last_gathered."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of FSDP's gradient reduce-scatter (and of unsharded gradients under sync_last)."""
    tp_saved_inputs: Literal["gathered", "shard"] = "gathered"
    """What sequence parallel keeps for backward of the attention's and MLP's all-gathered
    inputs: gathered (the whole sequence, torchtitan's) or shard (this rank's 1/tensor of it,
    all-gathered again in backward: one more all-gather per input, as Megatron-Core does).
    Checkpointed blocks recompute their inputs either way."""


class Cluster(Section):
    backend: Literal["sagemaker", "local", "docker", "slurm", "k8s", "accelerate"] = "local"
    """Where the job runs (accelerate: render an `accelerate launch` config only)."""
    instance_type: str = "local"
    """An instance type from the catalog (ml.p5.48xlarge, ...) or 'local' for this machine."""
    instance_count: PositiveInt = Field(default=1, le=MAX_INSTANCES)
    nproc_per_node: PositiveInt | None = Field(default=None, le=MAX_PROCS_PER_NODE)
    """Processes per node. 'local' defaults to 1; other instance types use their GPU count."""
    device: Literal["cpu", "cuda"] = "cuda"
    """cpu (gloo) or cuda (nccl)."""
    accelerator: str | None = None
    """The GPU of a 'local' cuda machine, e.g. h100-80gb. Derived for catalog instance types."""
    usd_per_hour: float | None = Field(default=None, ge=0, le=1e6)
    """Your price per instance-hour, if it differs from the catalog's."""
    image: ImageRef | None = Field(default=None, max_length=255)
    """Container image for sagemaker, docker and k8s; default: the region's PyTorch training image
    (its CPU variant for device: cpu). Slurm runs containers only with slurm.container_image."""
    max_run: Duration = 86400
    """Time limit, e.g. 5d or 12h: SageMaker's MaxRuntime (at most 28 days), Slurm's --time, a
    PyTorchJob's activeDeadlineSeconds."""
    max_restarts: int | None = Field(default=None, ge=0, le=100)
    """Times torchrun restarts the workers after one fails; they resume from the newest complete
    checkpoint. Default: 1 on local, docker and Slurm (which requeues a job after node failure or
    preemption, never after it failed: sbatch(1) --requeue); on SageMaker (which retries a job
    only after an InternalServerError) 1 on one host or with sagemaker.checkpoint_copy per_host,
    else 0, since CheckpointConfig copies the other hosts' files only at the job's start; 0 on
    Kubernetes (the PyTorchJob's backoff reruns it)."""
    stop_grace: Duration | None = None
    """Seconds from the engine's SIGTERM to its SIGKILL, on engines where the job sets them:
    docker's --stop-timeout, a pod's terminationGracePeriodSeconds, the least Slurm --signal lead.
    torchrun's --shutdown-timeout and the trainer's budget for its final save are 20 s less.
    Default: the predicted step plus one save, a quarter more, at least 120 s (settled at submit).
    SageMaker's grace is its own 120 s."""
    collective_timeout: Duration | None = None
    """How long a rank waits in one collective before the job fails (init_process_group's
    timeout), e.g. 20m. Default: four times the predicted step plus one save, at least 10 min
    (settled at submit); 30 min where nothing predicts the step."""


class SageMaker(Section):
    region: Region = Field(default_factory=default_region)
    """AWS region of the job and of the default image; default: AWS_REGION, AWS_DEFAULT_REGION, the
    AWS profile's region, else us-west-2 (the AWS CLI's order)."""
    role_arn: RoleArn | None = None
    """IAM role the training job runs as, e.g. arn:aws:iam::123456789012:role/SageMakerTraining."""
    output_uri: S3Uri | None = None
    """s3:// prefix for the job's output; default: the session's default bucket."""
    checkpoint_uri: S3Uri | None = None
    """s3:// prefix that SageMaker syncs with /opt/ml/checkpoints."""
    checkpoint_copy: Literal["by_size", "checkpoint_config", "per_host"] = "by_size"
    """How checkpoints reach S3 and come back: checkpoint_config (SageMaker copies every kept
    checkpoint to every host at each start), per_host (each host copies its own files and reads
    back only those), or by_size: per_host once CheckpointConfig's copy to each host would pass
    per_host_checkpoints_above_gb (launcher/catalog/engines.yaml, 500 GB)."""
    spot: bool = False
    """Managed spot training."""
    max_wait: Duration | None = None
    """With spot: how long to wait for capacity plus run time; at least max_run."""
    volume_size_gb: PositiveInt = Field(default=500, le=16384)
    subnets: list[SubnetId] = []
    security_group_ids: list[SecurityGroupId] = []
    kms_key_id: KmsKeyId | None = None
    network_isolation: bool = False
    encrypt_inter_container_traffic: bool = False
    tags: dict[str, str] = {}
    retries: int = Field(default=0, ge=0, le=30)
    """Times SageMaker retries the job after an internal server error (0 to 30)."""
    # Pattern and length: ResourceConfig.TrainingPlanArn in botocore's sagemaker service model.
    training_plan_arn: str | None = Field(
        default=None, pattern=r"^arn:aws[a-z\-]*:sagemaker:[a-z0-9\-]*:[0-9]{12}:training-plan/.+$", max_length=2048
    )
    """Run on a SageMaker training plan's reserved capacity (the usual way to get ml.p5e), e.g.
    arn:aws:sagemaker:us-west-2:123456789012:training-plan/my-plan; default: on-demand or spot."""
    infra_check: bool | None = None
    """SageMaker's infrastructure health check of the instances' hardware and the network between
    them before training (InfraCheckConfig). Default: on for GPU jobs of more than one EFA
    instance, where one bad GPU or link would otherwise fail or stall the whole job hours in;
    off otherwise."""


_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Kubernetes label keys and values (apimachinery validation.IsQualifiedName, IsValidLabelValue):
# an optional DNS-subdomain prefix and a slash, then a name of at most 63 characters.
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY_RE = re.compile(rf"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}")
_LABEL_VALUE_RE = re.compile(rf"({_LABEL_NAME})?")


def _label_key(value: str) -> str:
    if len(value) > 317 or not _LABEL_KEY_RE.fullmatch(value) or len(value.rpartition("/")[0]) > 253:
        raise ValueError(
            f"{value[:80]!r} is not a Kubernetes label key: an optional DNS-subdomain prefix and '/', then up to "
            "63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
        )
    return value


def _label_value(value: str) -> str:
    if len(value) > 63 or not _LABEL_VALUE_RE.fullmatch(value):
        raise ValueError(
            f"{value[:80]!r} is not a Kubernetes label value: empty, or up to 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    return value


LabelKey = Annotated[str, AfterValidator(_label_key)]
LabelValue = Annotated[str, AfterValidator(_label_value)]


class Toleration(Section):
    """A Kubernetes Toleration (core/v1), with its field names."""

    key: LabelKey | None = None
    """The taint key; empty with operator Exists: every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    value: LabelValue | None = None
    """With Equal: the taint's value; none with Exists."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """The taint effect matched; empty: every effect."""
    tolerationSeconds: int | None = Field(default=None, ge=0, le=MAX_DURATION_S)  # noqa: N815 (Kubernetes' name)
    """With effect NoExecute: how long the pod stays bound after the taint appears."""

    @model_validator(mode="after")
    def _as_the_api_server_validates(self) -> Toleration:
        # core/v1 validation (ValidateTolerations): Exists takes no value, an empty key needs
        # Exists, and tolerationSeconds only applies to NoExecute.
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists takes no value; use operator Equal or drop value")
        if not self.key and self.operator != "Exists":
            raise ValueError("a toleration without a key must have operator Exists (it then tolerates every taint)")
        if self.tolerationSeconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds needs effect NoExecute")
        return self


class Slurm(Section):
    """How the job runs on a Slurm cluster."""

    partition: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)
    account: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)
    shared_dir: str | None = Field(default=None, max_length=1024)
    """An absolute directory that every node mounts at the same path (a shared home, Lustre, FSx
    or NFS): the job's code, logs, checkpoints and staged s3:// data go there. Default: $LAUNCHER_HOME."""
    container_image: str | None = Field(default=None, max_length=255)
    """Run torchrun inside this image on every node through pyxis/enroot (srun --container-image);
    default: the nodes' own Python environment."""
    venv: str | None = Field(default=None, max_length=1024)
    """A Python environment on the shared file system (holding torch and torchao) to activate on
    every node before torchrun; default: whatever python the nodes' PATH gives."""
    signal_before_end: Duration = 600
    """Slurm sends USR1 this long before the time limit; the job then checkpoints and, with
    requeue, goes back in the queue to resume."""
    requeue: bool = True
    """Requeue the job when it is preempted, its node fails or its time runs out; it resumes from
    its newest checkpoint."""
    gpu_request: Literal["gpus-per-node", "gres", "none"] = "gpus-per-node"
    """How a GPU job asks for each node's GPUs besides --exclusive: --gpus-per-node=N, --gres=gpu:N,
    or none (--exclusive alone, for clusters whose GPUs are not GRES, such as HyperPod's default
    Slurm, which answers 'Invalid generic resource (gres) specification')."""


class Kubernetes(Section):
    """How the job runs as a Kubeflow PyTorchJob."""

    namespace: str | None = Field(default=None, pattern=_DNS_LABEL, max_length=63)
    """Namespace of the job; default: kubectl's current namespace."""
    checkpoint_claim: str | None = Field(default=None, pattern=_DNS_LABEL, max_length=63)
    """A ReadWriteMany PersistentVolumeClaim for checkpoints and outputs; default <recipe>-launcher."""
    storage_class: str | None = Field(default=None, pattern=r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$", max_length=253)
    """A storage class that provides ReadWriteMany volumes (EFS, FSx for Lustre): submit creates the
    checkpoint claim with it when missing. Without it the claim must already exist."""
    storage_size: str = Field(default="1Ti", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
    """Requested size of a created checkpoint claim."""
    api: Literal["pytorchjob", "trainjob"] = "pytorchjob"
    """pytorchjob: a Kubeflow PyTorchJob (training operator v1.7 to v1.9, what HyperPod installs);
    trainjob: a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) that references k8s.runtime."""
    runtime: str = Field(default="torch-distributed", pattern=_DNS_SUBDOMAIN, max_length=253)
    """With api: trainjob, the ClusterTrainingRuntime the TrainJob runs on (Trainer's own torch-distributed by default)."""
    auto_resume: bool = False
    """SageMaker HyperPod EKS: annotate the PyTorchJob for HyperPod's job auto-resume (restartPolicy
    OnFailure): after a node fault HyperPod replaces the node and restarts the job, which resumes
    from its newest checkpoint. Needs training operator 1.7 to 1.8.1 and the namespace kubeflow or hyperpod-*."""
    retries: int | None = Field(default=None, ge=0, le=100)
    """Times the job is restarted after a failure: the PyTorchJob's backoffLimit and, with auto_resume,
    HyperPod's job-max-retry-count. Default: 1 with auto_resume (the HyperPod CLI's --max-retry), else 0."""
    node_selector: dict[LabelKey, LabelValue] = Field(default={}, max_length=64)
    """Node labels every pod must match, e.g. {node.kubernetes.io/instance-type: ml.p5.48xlarge}."""
    tolerations: list[Toleration] = Field(default=[], max_length=64)
    """Taints of the GPU nodes that the pods tolerate, as Kubernetes Toleration objects, e.g.
    [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]."""
    hugepages: bool = False
    """Request 5 GiB of 2 MiB huge pages per pod on EFA instance types (the nodes must pre-allocate
    them, or no pod schedules); off: libfabric's EFA provider uses regular pages, as AWS's samples do."""


class CodeBundle(Section):
    """What goes into the code bundle that every backend ships to the job."""

    allow_secrets_in: tuple[Annotated[str, Field(pattern=r"^[^/\x00-\x1f][^\x00-\x1f]*$", max_length=512)], ...] = (
        Field(default=(), max_length=100)
    )
    """Files of the bundle, by their path in it (entrypoints/tests/fixture_key.py), that are packed
    although their content looks like a secret (an AWS or private key, a token, a random password):
    a test fixture or a documented example key. Every other such file stops the build, with
    file:line and the kind of secret. Name each file exactly; no globs."""


MAX_VALIDATION_BATCHES = 100_000


class Validation(Section):
    """Held-out data the job evaluates forward-only (validation loss and perplexity in its metrics)."""

    source: str | None = Field(default=None, max_length=1024)
    """A directory (or file) of token shards, as data.source, that no training step reads; 'synthetic'
    for a seeded synthetic stream (tests). Give this or fraction."""
    fraction: Annotated[float, Field(gt=0, lt=1)] | None = None
    """Hold out this share of data.source's documents (a prepared dataset), the last whole ones:
    the same split on every run and layout; training reads only the documents before it."""
    every_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    """Evaluate every this many steps (0: only after the last step); always after the last step."""
    batches: PositiveInt = Field(default=1, le=MAX_VALIDATION_BATCHES)
    """Global batches (training.global_batch_size sequences) per evaluation, the same ones each time."""


class Data(Section):
    source: str = "synthetic"
    """'synthetic'; token shards: a local directory (e.g. `launcher data prepare`'s output) or file, or an
    s3:// URI; or, with data.tokenizer, raw text: a file, directory, glob or s3:// prefix."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Integer type of the token files (uint16 holds vocabularies up to 65536); read from a prepared
    dataset's manifest.json when not given."""
    document_masking: bool = False
    """Attention stays within each document of a packed sequence (block-diagonal causal mask)."""
    document_separator: int | None = Field(default=None, ge=0, le=2**32 - 1)
    """The token id that ends each document (the tokenizer's EOS id); required with document_masking
    on token files, unless data.source is a prepared dataset (its manifest's eos_id). Synthetic data
    ends documents with token 0 at seeded random lengths."""
    document_positions: Literal["restart", "global"] = "restart"
    """With document_masking: RoPE positions restart at 0 in each document, or count over the whole sequence."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer.json or a directory holding one: data.source is then raw text, which
    submit tokenizes first (cached by content hash under $LAUNCHER_HOME/datasets)."""
    format: Literal["auto", "text", "jsonl", "parquet", "arrow"] = "auto"
    """How to read raw data.source files: auto (by file name), text (one document per file, or split
    at data.delimiter), jsonl, parquet, or arrow (a `datasets` dataset saved to disk)."""
    field: str = "text"
    """The JSONL field, or Parquet/arrow column, that holds each document's text."""
    delimiter: str | None = None
    """Text files only: split each file into documents at this string (e.g. a blank line, "\n\n")."""
    eos_token: str | None = None
    """The token appended after every document; default: the tokenizer's end-of-text token."""
    validation: Validation | None = None
    """Validation on held-out data: {source: DIR} or {fraction: 0.01}, with every_steps and batches."""


DATA_PREPARE_KEYS = ("tokenizer", "format", "field", "delimiter", "eos_token")
"""The data keys that say how submit prepares raw text; the training job never sees them."""


class Checkpoint(Section):
    dir: str | None = None
    """Where checkpoints go; default /opt/ml/checkpoints on SageMaker, the job directory elsewhere."""
    every_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    """Save every this many steps (0: only at the end and on SIGTERM)."""
    every_minutes: Annotated[float, Field(ge=0, le=MAX_DURATION_S / 60)] | Literal["auto"] = 0.0
    """Also save when this many minutes have passed since the last save began (0: off). Bounds the
    work an interruption can lose whatever the step time; e.g. 30 on spot capacity. auto: the
    Young/Daly interval from the predicted save time and the cluster's interruption rate
    (launcher/estimate/checkpoint.py), settled before the job is built."""
    keep: PositiveInt = Field(default=3, le=MAX_CHECKPOINTS_KEPT)
    """Keep the newest this many complete checkpoints."""
    resume: str = "auto"
    """'auto' (newest complete checkpoint, if any), 'never', or a checkpoint path."""
    export_hf: bool | str = False
    """After the last step, write a Hugging Face checkpoint (config.json, safetensors, tokenizer
    files) that transformers loads: true for <output dir>/hf, or a directory (relative: under the
    job's output directory; on SageMaker under /opt/ml/model, the job's model artifact)."""
    export_tokenizer: str | None = Field(default=None, max_length=1024)
    """Tokenizer files to copy into the export: a directory or one file on the machines that run
    the job. Default: those beside a model.init_from checkpoint, if any."""


MLFLOW_URI_PATTERN = (
    r"^(https?://[^\s/?#]+(/[^\s?#]*)?"
    r"|arn:aws[a-z\-]*:sagemaker:[a-z0-9\-]+:[0-9]{12}:mlflow-tracking-server/[a-zA-Z0-9](-*[a-zA-Z0-9]){0,255})$"
)


class MlflowTracking(Section):
    uri: Annotated[str, Field(max_length=2048), WithJsonSchema({"type": "string", "pattern": MLFLOW_URI_PATTERN})]
    """The tracking server: http(s)://host:port, or a SageMaker managed MLflow tracking server's ARN
    (arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME), which the job reaches with SigV4
    as the sagemaker-mlflow plugin does (docs/monitoring.md)."""
    experiment: str | None = Field(default=None, min_length=1, max_length=256)
    """The experiment, created when missing; default: the recipe's name."""
    run_name: str | None = Field(default=None, min_length=1, max_length=256)
    """The run's name; default: the job's name. A `submit --resume` continues its lineage's run."""


class Tracking(Section):
    """Dashboards that rank 0 feeds from the metrics log, never blocking a step."""

    tensorboard: bool = False
    """Write TensorBoard event files under the job's output (tensorboard/); on SageMaker also
    TensorBoardOutputConfig, so they reach S3 while the job runs."""
    mlflow: MlflowTracking | None = None
    """Log params, per-step metrics, tags and the resolved config to an MLflow tracking server."""


class RecipeSpec(Section):
    """A training job: model, data, layout and cluster."""

    name: str = Field(pattern=r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$", max_length=40)
    """Job name prefix: letters, digits and hyphens, at most 40 characters."""
    extends: str | None = None
    """Another recipe file this one overrides, relative to this file."""
    model: ModelRef
    """A catalog key (llama3.1-8b), {base: KEY, num_layers: 2, ...}, {hf_config: config.json}, or
    {init_from: DIR} (a Hugging Face checkpoint: its config.json gives the architecture)."""
    training: Training
    precision: Precision = Precision()
    parallel: Parallel = Parallel()
    cluster: Cluster = Cluster()
    sagemaker: SageMaker = Field(default_factory=SageMaker)
    slurm: Slurm = Slurm()
    k8s: Kubernetes = Kubernetes()
    bundle: CodeBundle = CodeBundle()
    data: Data = Data()
    checkpoint: Checkpoint = Checkpoint()
    tracking: Tracking = Tracking()
