"""Catalogs of models, accelerators and instance types.

The numbers live in the YAML files beside this module, each with its source. This module
only gives them types and looks them up.
"""

from __future__ import annotations

import datetime
import difflib
import math
import os
from functools import cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_serializer, field_validator, model_validator

from launcher.catalog.packaged_yaml import load_packaged
from launcher.contract.config import active_ffn_width
from launcher.contract.text import choices  # noqa: F401  (catalog.choices: how messages list valid values)


def suggest(value: str, options) -> str:
    """' (did you mean X?)' when a close match exists."""
    close = difflib.get_close_matches(value, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


_FROZEN = ConfigDict(extra="forbid", frozen=True)


class RopeScaling(BaseModel):
    """RoPE frequency scaling for long context: Llama 3.1's "llama3", or YaRN (Qwen3)."""

    model_config = _FROZEN
    type: Literal["llama3", "yarn"] = "llama3"
    factor: float = Field(gt=0)
    original_max_context: PositiveInt
    low_freq_factor: float | None = Field(default=None, gt=0)
    high_freq_factor: float | None = Field(default=None, gt=0)
    beta_fast: float | None = Field(default=None, gt=0)
    """yarn only (default 32)."""
    beta_slow: float | None = Field(default=None, gt=0)
    """yarn only (default 1)."""


class MoeArch(BaseModel):
    """A mixture-of-experts MLP in every block; the fields are explained on
    launcher.contract.config.MoeConfig, which the entrypoints read."""

    model_config = _FROZEN
    num_experts: PositiveInt
    top_k: PositiveInt
    expert_ffn_hidden_size: PositiveInt
    shared_experts: int = Field(default=0, ge=0)
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    normalize_top_k: bool = True
    aux_loss_coef: float = Field(default=0.0, ge=0)
    z_loss_coef: float = Field(default=0.0, ge=0)
    dropless: Literal[True] = True
    """Only dropless routing is implemented."""

    def expert_params(self, hidden_size: int) -> int:
        """One expert's SwiGLU: gate, up and down projections."""
        return 3 * hidden_size * self.expert_ffn_hidden_size

    def active_ffn_width(self) -> float:
        return active_ffn_width(self)

    def layer_params(self, hidden_size: int) -> int:
        """Router, routed experts and shared experts of one layer."""
        router = self.num_experts * hidden_size
        return router + (self.num_experts + self.shared_experts) * self.expert_params(hidden_size)


class ModelArch(BaseModel):
    """The shapes of a decoder (Llama, Mistral, Qwen3, Mixtral): everything the estimator and
    trainer need. The families differ only by these fields, never by name in the model code."""

    # `head_dim` in the YAML and the resolved config is `declared_head_dim` here, so that the
    # `head_dim` property can fill in hidden_size / num_heads for models that do not set it.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, serialize_by_alias=True)
    family: Literal["llama", "mistral", "qwen3", "qwen3_moe", "mixtral"] = "llama"
    hidden_size: PositiveInt
    num_layers: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    ffn_hidden_size: PositiveInt
    vocab_size: PositiveInt
    max_context: PositiveInt
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    norm_eps: float = Field(default=1e-5, gt=0)
    declared_head_dim: PositiveInt | None = Field(default=None, alias="head_dim")
    qk_norm: bool = False
    attention_bias: bool = False
    moe: MoeArch | None = None
    source: str = ""

    @field_serializer("declared_head_dim")
    def _dump_head_dim(self, _declared: int | None) -> int:
        # The resolved config states the head_dim the model is built with.
        return self.head_dim

    @property
    def head_dim(self) -> int:
        return self.declared_head_dim or self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        """Width of the query projection (num_heads x head_dim; hidden_size for Llama)."""
        return self.head_dim * self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.num_kv_heads

    def attention_extra_params(self) -> int:
        """Attention parameters besides the four weight matrices: q/k RMSNorm weights (one head
        wide each) and projection biases. Zero for Llama and Mistral."""
        norms = 2 * self.head_dim if self.qk_norm else 0
        biases = self.q_dim + 2 * self.kv_dim + self.hidden_size if self.attention_bias else 0  # q, k, v, output
        return norms + biases

    def block_params(self) -> int:
        """Parameters of one transformer block: attention, MLP (SwiGLU or experts) and two RMSNorms."""
        h = self.hidden_size
        attention = h * self.q_dim * 2 + h * self.kv_dim * 2 + self.attention_extra_params()  # wq, wo, wk, wv
        mlp = self.moe.layer_params(h) if self.moe else 3 * h * self.ffn_hidden_size
        return attention + mlp + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        output = 0 if self.tie_embeddings else self.embedding_params()
        return self.embedding_params() + self.num_layers * self.block_params() + self.hidden_size + output

    def shape_problems(self) -> list[tuple[str, str]]:
        """(field, message) for shapes no model here can have."""
        problems = []
        if self.declared_head_dim is None and self.hidden_size % self.num_heads:
            problems.append(("hidden_size", f"{self.hidden_size} is not divisible by num_heads {self.num_heads}"))
        elif self.head_dim % 2:
            field = "head_dim" if self.declared_head_dim else "hidden_size"
            problems.append((field, f"head dimension {self.head_dim} must be even for RoPE"))
        if self.num_heads % self.num_kv_heads:
            problems.append(("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads {self.num_heads}"))
        if self.moe and self.moe.top_k > self.moe.num_experts:
            problems.append(
                (
                    "moe.top_k",
                    f"{self.moe.top_k} experts per token, but the model has {self.moe.num_experts}; "
                    f"use 1 to {self.moe.num_experts}",
                )
            )
        return problems


class Accelerator(BaseModel):
    model_config = _FROZEN
    name: str
    memory_bytes: int | None
    peak_bf16_tflops: float | None
    peak_fp8_tflops: float | None
    hbm_gbps: float | None
    nvlink_gbps: float | None
    source: str
    peak_bf16_tflops_bounds: tuple[float, float] | None = None
    """Where no datasheet gives the peak: the range the source allows. The peak itself is then
    fitted inside it to the calibration points that ran on the part (scripts/planner_calibration.py
    checks the catalog against that fit)."""

    @model_validator(mode="after")
    def _peak_inside_bounds(self) -> Accelerator:
        if self.peak_bf16_tflops_bounds is not None:
            low, high = self.peak_bf16_tflops_bounds
            if self.peak_bf16_tflops is None or not low <= self.peak_bf16_tflops <= high:
                raise ValueError(
                    f"{self.name}: peak_bf16_tflops {self.peak_bf16_tflops} lies outside its bounds [{low}, {high}]"
                )
        return self

    @property
    def has_fp8(self) -> bool:
        return self.peak_fp8_tflops is not None


class Interruptions(BaseModel):
    """How often one host ends a job, per day: what `checkpoint.every_minutes: auto` weighs."""

    model_config = _FROZEN
    failures_per_host_day: float = Field(gt=0)
    """Unexpected interruptions (hardware, network, software) per host and day."""
    failures_source: str
    spot_interruptions_per_host_day: float = Field(ge=0)
    """With managed spot, reclaims per host and day, on top of the failures."""
    spot_source: str

    def per_host_day(self, *, spot: bool) -> float:
        return self.failures_per_host_day + (self.spot_interruptions_per_host_day if spot else 0.0)


class InstanceType(BaseModel):
    model_config = _FROZEN
    accelerator: str | None
    gpus_per_node: int | None
    vcpus: int | None
    host_memory_gib: int | None
    efa_interfaces: int
    efa_gbps: float
    usd_per_hour: float
    price_date: datetime.date | None
    price_source: str
    local_nvme: bool = False
    """Instance-store NVMe, hardware-encrypted: SageMaker refuses a VolumeKmsKeyId for it."""
    checkpoint_write_gb_per_s: float | None = None
    """GB/s one host writes checkpoint files to its checkpoint directory (local NVMe)."""
    checkpoint_upload_gb_per_s: float | None = None
    """GB/s one host's checkpoint directory is uploaded to S3 (SageMaker's checkpoint sync)."""
    checkpoint_bandwidth_source: str = ""
    interruptions: Interruptions | None = None
    """Per-host interruption rates; None where none is published (CPU types, this machine)."""

    @property
    def has_efa(self) -> bool:
        return self.efa_interfaces > 0


HOST_CPU_WORK = (
    "per_step", "per_layer", "per_layer_micro_batch", "matmul_gflop", "attention_gflop", "fsdp_mb", "replicate_mb",
    "tp_layer_micro_batch", "tp_mb", "tp_replicated_layer_micro_batch", "cp_layer_micro_batch", "pp_step",
    "expert_layer_micro_batch", "ep_mb",
)  # fmt: skip
"""The kinds of work a CPU step is priced by (launcher.plan.host_cpu.cpu_work)."""


class HostCpuRates(BaseModel):
    """Seconds per unit of each kind of CPU step work, measured on one host (host_cpu.yaml)."""

    model_config = _FROZEN
    seconds_per_unit: dict[str, float]
    measured_on: str
    source: str

    @field_validator("seconds_per_unit")
    @classmethod
    def _every_kind(cls, rates: dict[str, float]) -> dict[str, float]:
        if set(rates) != set(HOST_CPU_WORK) or any(not 0 <= rate < math.inf for rate in rates.values()):
            raise ValueError(f"needs a rate >= 0 for each of {', '.join(HOST_CPU_WORK)}")
        return rates


def _load(filename: str) -> dict:
    return load_packaged(__package__, filename)


@cache
def models() -> dict[str, ModelArch]:
    return {key: ModelArch(**value) for key, value in _load("models.yaml").items()}


@cache
def accelerators() -> dict[str, Accelerator]:
    catalog = {key: Accelerator(**value) for key, value in _load("accelerators.yaml").items()}
    catalog["cpu"] = catalog["cpu"].model_copy(update={"memory_bytes": _host_memory_bytes()})
    return catalog


@cache
def instance_types() -> dict[str, InstanceType]:
    return {str(key): InstanceType(**value) for key, value in _load("instances.yaml").items()}


@cache
def host_cpu_rates() -> HostCpuRates:
    return HostCpuRates(**_load("host_cpu.yaml"))


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0))


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
