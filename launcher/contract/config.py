"""The resolved job config: the one file the entrypoints read.

`launcher` builds it (``Recipe.resolved()`` of a concrete recipe, see launcher/resolve.py) and
writes its ``to_dict()`` (``"format": 1``); the entrypoints parse it into the same frozen stdlib
dataclasses here (part of the contract both sides import, standard library only).
Every field the training code uses is listed below with its meaning; a missing field or a wrong
type is a `ConfigError` naming its key path, a layout the rules of `layout.py` refuse is one
naming the recipe key to change, and a file of another format is refused with the format it
expects.

    cfg = load_config("resolved.json")        # or JobConfig.from_dict(cfg.to_dict())
    cfg.model.head_dim, cfg.model.moe, cfg.parallel.fsdp_shard, cfg.training.seq_len
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from launcher.contract.layout import Layout, cp_attention_problems, layout_problems

FORMAT = 1
SYNTHETIC_DOCUMENT_SEPARATOR = 0
"""The token that ends documents in synthetic data with document masking (entrypoints/data.py)."""


class ConfigError(ValueError):
    """A resolved config the entrypoints cannot run: one line that says what and where."""


def _config(cls):
    return dataclass(frozen=True, kw_only=True, slots=True)(cls)


ROPE_SCALING_TYPES = ("llama3", "yarn")


@_config
class RopeScaling:
    type: str
    """"llama3" (Llama 3.1's frequency-dependent scaling) or "yarn" (YaRN, as Qwen3 documents
    for contexts past its 32K: arXiv 2309.00071; transformers' `_compute_yarn_parameters`)."""
    factor: float
    original_max_context: int
    """The context the base model was trained at (8192 for Llama 3.1, 32768 for Qwen3)."""
    low_freq_factor: float | None = None
    """llama3 only: wavelengths longer than original_max_context / low_freq_factor are slowed by `factor`."""
    high_freq_factor: float | None = None
    """llama3 only: wavelengths shorter than original_max_context / high_freq_factor are kept."""
    beta_fast: float | None = None
    """yarn only (None: 32): rotations per original context above which a dimension keeps its frequency."""
    beta_slow: float | None = None
    """yarn only (None: 1): rotations per original context below which a dimension is interpolated by `factor`."""

    def __post_init__(self):
        if self.type not in ROPE_SCALING_TYPES:
            raise ConfigError(
                f"model.rope_scaling.type: '{self.type}' is not supported; use {', '.join(ROPE_SCALING_TYPES)} or none"
            )
        if self.type == "llama3" and (self.low_freq_factor is None or self.high_freq_factor is None):
            raise ConfigError("model.rope_scaling: llama3 scaling needs low_freq_factor and high_freq_factor")


ROUTER_SCORES = ("softmax", "sigmoid")


@_config
class MoeConfig:
    """A mixture-of-experts MLP in every block (entrypoints/model/moe.py), in place of the dense SwiGLU."""

    num_experts: int
    """Routed experts per layer (config.json num_experts / num_local_experts)."""
    top_k: int
    """Experts each token is sent to (num_experts_per_tok)."""
    expert_ffn_hidden_size: int
    """Intermediate size of one expert's SwiGLU (moe_intermediate_size; Mixtral: intermediate_size)."""
    shared_experts: int = 0
    """Experts every token goes through besides the routed ones, as one dense SwiGLU of
    shared_experts x expert_ffn_hidden_size (DeepSeek-style, ungated)."""
    router_score: str = "softmax"
    """softmax over the experts' logits (Mixtral, Qwen3-MoE) or an independent sigmoid per expert (DeepSeek V3)."""
    normalize_top_k: bool = True
    """Rescale each token's top-k scores to sum to 1 (norm_topk_prob; Mixtral always does)."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss (router_aux_loss_coef), added to the training loss."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss, mean squared log-sum-exp of the router logits (ST-MoE, arXiv 2202.08906)."""
    dropless: bool = True
    """Every token reaches all of its top-k experts (no capacity limit). Only dropless routing is implemented."""

    def __post_init__(self):
        if self.num_experts < 1:
            raise ConfigError(f"model.moe.num_experts: {self.num_experts}; use a whole number of at least 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"model.moe.top_k: {self.top_k} experts per token, but the model has {self.num_experts}; "
                f"use 1 to {self.num_experts}"
            )
        if self.expert_ffn_hidden_size < 1:
            raise ConfigError(f"model.moe.expert_ffn_hidden_size: {self.expert_ffn_hidden_size}; use at least 1")
        if self.shared_experts < 0:
            raise ConfigError(f"model.moe.shared_experts: {self.shared_experts}; use 0 or more")
        if self.router_score not in ROUTER_SCORES:
            raise ConfigError(f"model.moe.router_score: '{self.router_score}' is not one of {', '.join(ROUTER_SCORES)}")
        if not self.dropless:
            raise ConfigError("model.moe.dropless: false (capacity-limited routing) is not implemented; use true")
        if self.aux_loss_coef < 0 or self.z_loss_coef < 0:
            raise ConfigError("model.moe: aux_loss_coef and z_loss_coef must be 0 or more")

    def active_ffn_width(self) -> float:
        return active_ffn_width(self)


def active_ffn_width(moe) -> float:
    """The width f of the dense SwiGLU (3 x hidden x f weights) holding as many weights as one
    token of an MoE layer passes through: its top-k and the shared experts, and the router
    (E x hidden, which is 3 x hidden x E/3). One rule for the MFU the entrypoints log
    (entrypoints/metrics.py) and the planner's (launcher/plan/throughput.py); `moe` is a
    MoeConfig or the catalog's MoeArch, which have the same fields."""
    return (moe.top_k + moe.shared_experts) * moe.expert_ffn_hidden_size + moe.num_experts / 3


@_config
class ModelConfig:
    name: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_context: int
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    head_dim: int | None = None
    """Dimensions per attention head; None: hidden_size / num_heads (Llama). Qwen3 sets it, and
    then num_heads x head_dim need not equal hidden_size. Filled in on construction."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    attention_bias: bool = False
    """Biases on the q, k, v and output projections (config.json attention_bias)."""
    moe: MoeConfig | None = None
    """Mixture-of-experts MLPs instead of the dense SwiGLU (None: dense)."""
    source: str | None = None
    """Where the architecture numbers come from (documentation only)."""
    init_from: str | None = None
    """A Hugging Face checkpoint directory (or s3:// prefix, read from SM_CHANNEL_MODEL) whose
    weights replace the random initialisation of a fresh run (entrypoints/hf_weights.py)."""

    def __post_init__(self):
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(f"model.num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 1:
            raise ConfigError(f"model.head_dim: {self.head_dim}; use a positive even number")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"model: head_dim {self.head_dim} is odd; rotary embeddings need an even head_dim")

    @property
    def q_dim(self) -> int:
        """Width of the query projection's output (and the output projection's input)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


@_config
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr: float = 0.0
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """AdamW's exp_avg and exp_avg_sq: fp32, or bf16 (entrypoints/optim.py, AdamWBf16Moments)."""


DEFAULT_STALL_FACTOR = 10.0
DEFAULT_MIN_STALL_S = 60.0
DEFAULT_STRAGGLER_EVERY = 50
DEFAULT_STRAGGLER_MARGIN = 1.0


@_config
class WatchdogConfig:
    """What entrypoints/watchdog.py watches on every rank (docs/monitoring.md)."""

    enabled: bool = True
    stall_factor: float = DEFAULT_STALL_FACTOR
    """A stall: no step completes within stall_factor x the running median step time (saves and
    evaluations excluded; before the first step, runtime.collective_timeout_s)..."""
    min_stall_s: float = DEFAULT_MIN_STALL_S
    """... or within this many seconds, whichever is longer."""
    straggler_every: int = DEFAULT_STRAGGLER_EVERY
    """Every this many steps the ranks gather their compute time (0: never)."""
    straggler_margin: float = DEFAULT_STRAGGLER_MARGIN
    """The slowest rank is named when its compute time is more than this share above the median."""

    def __post_init__(self):
        if not self.stall_factor >= 1:
            raise ConfigError(f"training.watchdog.stall_factor: {self.stall_factor}; use 1 or more")
        if not self.min_stall_s > 0:
            raise ConfigError(f"training.watchdog.min_stall_s: {self.min_stall_s}; use a positive number of seconds")
        if self.straggler_every < 0:
            raise ConfigError(f"training.watchdog.straggler_every: {self.straggler_every}; use 0 (off) or more")
        if not self.straggler_margin > 0:
            raise ConfigError(f"training.watchdog.straggler_margin: {self.straggler_margin}; use a positive share")


@_config
class TrainingConfig:
    seq_len: int
    global_batch_size: int
    micro_batch_size: int = 1
    steps: int
    seed: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    grad_clip: float | None = 1.0
    compile: bool = False
    log_every: int = 1
    gc_every_steps: int = 50
    """Python's cyclic garbage collector runs between steps, every this many (0: whenever Python
    decides, in the middle of a step too); entrypoints/garbage_collection.py."""
    moe_force_load_balance: bool = False
    """Round-robin routing over the experts (entrypoints/model/moe.py `route`): benchmarking only."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)

    def __post_init__(self):
        if isinstance(self.gc_every_steps, bool) or not isinstance(self.gc_every_steps, int) or self.gc_every_steps < 0:
            raise ConfigError(
                f"training.gc_every_steps: {self.gc_every_steps!r}; use 0 (Python's own timing) or a number of steps"
            )


@_config
class PrecisionConfig:
    dtype: Literal["bf16", "fp32"] = "bf16"
    fp8: bool = False
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    fp8_experts: bool = False
    """The experts' grouped GEMMs in FP8 too (launcher.contract.fp8 `fp8_experts`)."""


@_config
class ParallelConfig(Layout):
    """The layout's degrees (pp, dp_replicate, dp_shard, cp, tp; see `Layout`), how it schedules."""

    pipeline_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    cp_attention: Literal["allgather", "ulysses"] = "allgather"
    """How attention runs under context parallelism (the recipe's "auto" is resolved by
    `layout.cp_attention_for` before it gets here)."""
    world_size: int = field()
    """The product of the degrees, written out so that a config is never run on another world size."""
    grad_accum_steps: int
    grad_accumulation: Literal["sync_each", "sync_last", "sync_last_gathered"] = "sync_each"
    """Gradient sync across micro-batches (entrypoints/parallel/accumulate.py); never "auto"."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of FSDP's gradient reduce-scatter (MixedPrecisionPolicy.reduce_dtype)."""
    tp_saved_inputs: Literal["gathered", "shard"] = "gathered"
    """What sequence parallel saves of its all-gathered inputs (entrypoints/parallel/regather.py)."""

    def __post_init__(self):
        product = Layout.world_size.fget(self)
        if product != self.world_size:
            raise ConfigError(
                f"parallel: pipeline x data_replicate x data_shard x context x tensor = {product}, "
                f"but world_size is {self.world_size}"
            )


@_config
class ValidationConfig:
    """Held-out data the job evaluates forward-only, under the training layout (entrypoints/evaluate.py)."""

    source: str | None = None
    """'synthetic' (a seeded stream no training step reads) or a local directory or file of token shards."""
    fraction: float | None = None
    """Instead of a source: this share of data.source's documents, the last whole ones of the prepared
    dataset, is held out (training reads only the documents before them)."""
    every_steps: int = 0
    """Evaluate every this many steps (0: only after the last step); always after the last step."""
    batches: int = 1
    """Global batches (training.global_batch_size sequences each) per evaluation, the same ones every time."""

    def __post_init__(self):
        if (self.source is None) == (self.fraction is None):
            raise ConfigError("data.validation: give exactly one of source (held-out token files) or fraction")
        if self.fraction is not None and not 0 < self.fraction < 1:
            raise ConfigError(f"data.validation.fraction: {self.fraction} is not between 0 and 1 (exclusive)")
        if self.every_steps < 0:
            raise ConfigError(f"data.validation.every_steps: {self.every_steps} is negative; use 0 or more")
        if self.batches < 1:
            raise ConfigError(f"data.validation.batches: {self.batches} is not a positive number of batches")

    def due(self, step: int, last_step: int) -> bool:
        """Whether the job evaluates after `step`."""
        return step == last_step or (self.every_steps > 0 and step % self.every_steps == 0)


@_config
class DataConfig:
    source: str = "synthetic"
    """'synthetic', a local directory or file of token shards, or an s3:// URI (read from SM_CHANNEL_TRAIN)."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    document_masking: bool = False
    """Attention stays within each document of a packed sequence (entrypoints/model/documents.py)."""
    document_separator: int | None = None
    """The token id that ends a document (e.g. EOS); required when document_masking is on."""
    document_positions: Literal["restart", "global"] = "restart"
    """RoPE positions: restart at 0 in each document (as if it ran on its own), or count over the sequence."""
    validation: ValidationConfig | None = None
    """Held-out data evaluated during training; None: no validation."""

    def __post_init__(self):
        if self.document_masking and self.document_separator is None:
            raise ConfigError(
                "data.document_separator: document_masking needs the token id that ends each document "
                "(the tokenizer's EOS id)"
            )


OPTIMIZER_STATE_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes of each of AdamW's two moments per parameter, by training.optimizer.state_dtype."""


BF16_MOMENTS_CHUNK = 1 << 22
"""AdamWBf16Moments (entrypoints/optim.py) updates each parameter shard in chunks of this many
elements, each with two fp32 temporaries (exp_avg, and exp_avg_sq turned into the denominator):
32 MiB at most beside the states, whatever the largest shard."""


def checkpoint_bytes_per_param(state_dtype: str = "fp32") -> int:
    """What a checkpoint holds per parameter (entrypoints/checkpoint.py): the fp32 master weight and
    AdamW's exp_avg and exp_avg_sq in `state_dtype` (12 bytes with fp32 moments, 8 with bf16)."""
    return 4 + 2 * OPTIMIZER_STATE_BYTES[state_dtype]


@_config
class CheckpointConfig:
    dir: str | None = None
    every_steps: int = 0
    every_minutes: float = 0.0
    """Also save when this many minutes have passed since the last save began (0: off), by rank 0's clock."""
    keep: int = 3
    resume: str = "auto"
    """'auto' (newest complete checkpoint, if any), 'never', or the path of one checkpoint."""
    export_hf: str | None = None
    """After the last step, write a Hugging Face checkpoint here (relative: under the output directory)."""
    export_tokenizer: str | None = None
    """Tokenizer files (a directory or one file) copied into the export."""


@_config
class PeakFlops:
    bf16: float | None = None
    fp8: float | None = None


DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0
"""A collective's timeout where nothing predicts the step: torch's default for gloo, and what
the entrypoints used before the launcher predicted one."""


@_config
class RuntimeConfig:
    device: Literal["cpu", "cuda"] = "cuda"
    nnodes: int = 1
    nproc_per_node: int = 1
    accelerator: str | None = None
    peak_flops: PeakFlops = field(default_factory=PeakFlops)
    output_dir: str | None = None
    stop_budget_s: float = 100.0
    """Seconds after SIGTERM within which the final save must end: the engine's grace less what
    torchrun and the bootstrap keep to exit (launcher.catalog.engines.STOP_EXIT_S); torchrun's
    --shutdown-timeout is the same. 100: SageMaker's 120 s grace."""
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    """Seconds a rank waits in one collective before the group fails (init_process_group's
    timeout): the launcher's multiple of the predicted step plus a save, or the default."""


MLFLOW_ARN_RE = re.compile(
    r"arn:aws[a-z\-]*:sagemaker:[a-z0-9\-]+:[0-9]{12}:mlflow-tracking-server/[a-zA-Z0-9](-*[a-zA-Z0-9]){0,255}"
)
"""A SageMaker managed MLflow tracking server's ARN (botocore's TrackingServerArn pattern, with the
region and the name required: the endpoint and the signature are built from them)."""
MLFLOW_HTTP_RE = re.compile(r"https?://[^\s/?#]+(/[^\s?#]*)?")


@_config
class MlflowConfig:
    uri: str
    """An http(s):// tracking server, or a SageMaker managed MLflow tracking server's ARN."""
    experiment: str
    run_name: str
    """The run's name; a resumed lineage continues its run, found by the launcher.lineage tag."""

    def __post_init__(self):
        if not (MLFLOW_HTTP_RE.fullmatch(self.uri) or MLFLOW_ARN_RE.fullmatch(self.uri)):
            raise ConfigError(
                f"tracking.mlflow.uri: {self.uri!r} is neither an http(s):// URL nor a SageMaker MLflow tracking "
                "server ARN (arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME)"
            )


@_config
class TrackingConfig:
    """Dashboards fed from the metrics log (entrypoints/tracking.py); rank 0 writes them."""

    tensorboard: bool = False
    """Event files under <output_dir>/tensorboard."""
    mlflow: MlflowConfig | None = None
    job_name: str | None = None
    """The job, its backend and its lineage, as the MLflow run's tags (None outside a job spec)."""
    backend: str | None = None
    lineage: str | None = None


@_config
class JobConfig:
    name: str
    model: ModelConfig
    training: TrainingConfig
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self):
        t, p = self.training, self.parallel
        per_step = t.micro_batch_size * p.data_parallel * p.grad_accum_steps
        if per_step != t.global_batch_size:
            raise ConfigError(
                f"training.global_batch_size: {t.global_batch_size} != micro_batch_size {t.micro_batch_size} "
                f"x data-parallel {p.data_parallel} x grad_accum_steps {p.grad_accum_steps}"
            )
        problems = layout_problems(
            p,
            self.model,
            seq_len=t.seq_len,
            global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size,
            gpus_per_node=self.runtime.nproc_per_node,
            schedule=p.pipeline_schedule,
        )
        problems += cp_attention_problems(p.cp_attention, self.model, p)
        separator = self.data.document_separator
        if self.data.document_masking and not 0 <= separator < self.model.vocab_size:
            raise ConfigError(
                f"data.document_separator: {separator} is not a token id of the {self.model.vocab_size}-token vocabulary"
            )
        if problems:
            raise ConfigError(f"{problems[0].path}: {problems[0].message}")

    @staticmethod
    def from_dict(data: dict[str, Any]) -> JobConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"a resolved config is a JSON object, not {type(data).__name__}")
        fmt = data.get("format")
        if fmt != FORMAT:
            raise ConfigError(
                f"format: {fmt!r} is not a resolved config format these entrypoints read; expected {FORMAT} "
                "(write it with `launcher show --json` or Recipe.resolved() of the same launcher version)"
            )
        # "format" is checked above; "derived" is a human-readable summary the launcher adds.
        body = {k: v for k, v in data.items() if k not in ("format", "derived")}
        return _build(JobConfig, body, "")

    def to_dict(self) -> dict[str, Any]:
        """The config as the JSON object `from_dict` reads, `format` first and every key in field
        order: `JobConfig.from_dict(cfg.to_dict()) == cfg`."""
        return {"format": FORMAT, **_as_data(self)}


def load_config(path: str | Path) -> JobConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the resolved config ({err.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    return JobConfig.from_dict(data)


def _as_data(value: Any) -> Any:
    """A config dataclass as JSON data: objects in field order, tuples as lists. The layout's
    degrees are written as `Layout.as_dict` writes them (pipeline_layers only when set)."""
    if isinstance(value, Layout):
        rest = [f for f in dataclasses.fields(value) if f.name not in _LAYOUT_FIELDS]
        return {**value.as_dict(), **{f.name: _as_data(getattr(value, f.name)) for f in rest}}
    if dataclasses.is_dataclass(value):
        return {f.name: _as_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_as_data(item) for item in value]
    return value


_LAYOUT_FIELDS = frozenset(f.name for f in dataclasses.fields(Layout))


def _build(cls: type, data: Any, where: str) -> Any:
    """A dataclass from a JSON object, checking each field's presence and type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected an object, got {json.dumps(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        # A newer launcher may add keys; running on is safer than refusing a job over one.
        print(f"config: ignoring unknown keys {', '.join(_join(where, k) for k in unknown)}", file=sys.stderr)
    values = {}
    for name, f in fields.items():
        key = _join(where, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{key}: missing from the resolved config")
            continue
        values[name] = _coerce(hints[name], data[name], key)
    return cls(**values)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{key}: must not be null")
        (inner,) = [o for o in options if o is not type(None)]
        return _coerce(inner, value, key)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    if origin is Literal:
        if value not in typing.get_args(hint):
            valid = ", ".join(str(v) for v in typing.get_args(hint))
            raise ConfigError(f"{key}: '{value}' is not one of {valid}")
        return value
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            if not isinstance(value, list | tuple):
                raise ConfigError(f"{key}: expected a list, got {json.dumps(value)}")
            return tuple(_coerce(args[0], v, f"{key}.{i}") for i, v in enumerate(value))
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} numbers, got {json.dumps(value)}")
        return tuple(_coerce(a, v, f"{key}.{i}") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {json.dumps(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {json.dumps(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{key}: expected a number, got {json.dumps(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {json.dumps(value)}")
        return value
    raise TypeError(f"{key}: no parser for {hint}")


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name
