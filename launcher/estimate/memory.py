"""Per-GPU peak memory of a training job: the public types, the verdict and the entry point.

`estimate_memory` dispatches to one of two accountings:
- `fsdp` (launcher/estimate/fsdp.py): what the bundled entrypoints really allocate, derived from
  their code and checked against a fake-tensor trace of it (tests/estimate/test_traced.py);
- `megatron` (launcher/estimate/megatron.py): the published accounting of Fujii et al. 2024, term
  by term, so its numbers can be reproduced.

Both return a `MemoryEstimate`: one `StageMemory` per pipeline rank, each with the components at
the moment that rank peaks. Everything here is plain arithmetic on integers so the planner can
call it thousands of times (scripts/bench_estimate.py measures it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from launcher.catalog import Accelerator, ModelArch, choices
from launcher.contract.layout import Layout
from launcher.errors import UsageError

Mode = Literal["fsdp", "megatron"]
MODES: tuple[str, ...] = ("fsdp", "megatron")
Verdict = Literal["fits", "risky", "oom"]
DEFAULT_THRESHOLD = 0.8

# Components in the order tables print them. Every breakdown has exactly these keys.
COMPONENTS: tuple[str, ...] = (
    "parameters",  # sharded weights (fp32 masters in fsdp mode)
    "gradients",  # sharded gradients (fp32)
    "optimizer_states",  # AdamW exp_avg and exp_avg_sq
    "optimizer_temp",  # temporaries of the optimizer step and gradient clipping
    "activations",  # tensors autograd saves for backward, over all in-flight micro-batches
    "fp8",  # float8 weight casts and scale state
    "fsdp_buffers",  # all-gathered unsharded blocks (with prefetch), unsharded grads, reduce-scatter input
    "cp_buffers",  # context parallel: K/V gathered from the whole sequence
    "tp_buffers",  # sequence parallel: the sequence gathered over the tensor group
    "working",  # one block's transient tensors in forward or backward (gradients of activations)
    "loss",  # logits and their gradients in the loss
    "cuda_context",  # CUDA context, cuBLAS workspace: allocated outside the caching allocator
    "nccl",  # NCCL communicator buffers: allocated outside the caching allocator
    "fragmentation",  # caching allocator: reserved but not allocated
)
# What torch.cuda.max_memory_allocated counts: everything but the last three.
ALLOCATED_COMPONENTS: tuple[str, ...] = COMPONENTS[:-3]


def format_bytes(n: float) -> str:
    """'52.5 GiB', or '37 MiB' below a GiB: how every memory number reaches the user."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What one estimate describes: a model, a layout and how each step runs."""

    arch: ModelArch
    layout: Layout
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int
    dtype: str = "bf16"
    fp8: bool = False
    fp8_recipe: str = "tensorwise"
    activation_checkpointing: str = "none"
    pipeline_schedule: str = "1f1b"


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    """One pipeline rank at the moment it peaks."""

    stage: int  # pipeline rank
    layers: int  # transformer blocks on this rank (all its virtual stages)
    phase: str  # "forward", "backward" or "optimizer": where this rank peaks
    breakdown: dict[str, int]

    @property
    def allocated_bytes(self) -> int:
        return sum(self.breakdown[name] for name in ALLOCATED_COMPONENTS)

    @property
    def peak_bytes(self) -> int:
        return sum(self.breakdown.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "layers": self.layers,
            "phase": self.phase,
            "peak_bytes": self.peak_bytes,
            "allocated_bytes": self.allocated_bytes,
            "breakdown": dict(self.breakdown),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    """Per-GPU peak memory of the heaviest pipeline rank, and whether it fits.

    `per_gpu_peak_bytes` is what the GPU must hold (allocations plus CUDA context, NCCL and
    fragmentation); `allocated_bytes` is the part `torch.cuda.max_memory_allocated` reports.
    """

    mode: str
    per_gpu_peak_bytes: int
    allocated_bytes: int
    gpu_memory_bytes: int
    threshold: float
    verdict: Verdict
    peak_stage: int
    peak_phase: str
    breakdown: dict[str, int]
    stages: tuple[StageMemory, ...]
    suggestion: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def utilization(self) -> float:
        """Peak as a fraction of the GPU's memory."""
        return self.per_gpu_peak_bytes / self.gpu_memory_bytes

    @property
    def fits(self) -> bool:
        return self.verdict == "fits"

    @property
    def largest_component(self) -> str:
        return max(self.breakdown, key=self.breakdown.__getitem__)

    def headline(self) -> str:
        """One line: verdict, peak against memory, and the largest component."""
        largest = self.largest_component
        return (
            f"{self.verdict}: {format_bytes(self.per_gpu_peak_bytes)} of {format_bytes(self.gpu_memory_bytes)} "
            f"per GPU ({self.utilization:.0%}, threshold {self.threshold:.0%}); largest: {largest} "
            f"{format_bytes(self.breakdown[largest])} on pipeline stage {self.peak_stage} ({self.peak_phase})"
        )

    def with_suggestion(self, suggestion: str | None) -> MemoryEstimate:
        return replace(self, suggestion=suggestion)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "per_gpu_peak_bytes": self.per_gpu_peak_bytes,
            "allocated_bytes": self.allocated_bytes,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "utilization": round(self.utilization, 4),
            "threshold": self.threshold,
            "verdict": self.verdict,
            "largest_component": self.largest_component,
            "peak_stage": self.peak_stage,
            "peak_phase": self.peak_phase,
            "breakdown": dict(self.breakdown),
            "stages": [stage.to_json() for stage in self.stages],
            "suggestion": self.suggestion,
            "notes": list(self.notes),
        }


def verdict(peak_bytes: int, gpu_memory_bytes: int, threshold: float = DEFAULT_THRESHOLD) -> Verdict:
    """fits up to `threshold` of the GPU's memory, risky up to all of it, oom beyond.

    The 80% default is Fujii et al. 2024's finding: of 454 runs on A100/H100, none whose
    estimate stayed under 80% of GPU memory ran out of memory.
    """
    if peak_bytes <= threshold * gpu_memory_bytes:
        return "fits"
    return "risky" if peak_bytes <= gpu_memory_bytes else "oom"


def estimate_memory(
    arch: ModelArch,
    layout: Layout,
    *,
    seq_len: int,
    micro_batch_size: int,
    grad_accum_steps: int,
    dtype: str,
    fp8: bool,
    fp8_recipe: str,
    activation_checkpointing: str,
    pipeline_schedule: str,
    accelerator: Accelerator,
    mode: Mode = "fsdp",
    threshold: float = DEFAULT_THRESHOLD,
) -> MemoryEstimate:
    """Per-GPU peak memory for one layout; no suggestion (see `estimate_recipe`)."""
    workload = Workload(
        arch=arch,
        layout=layout,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        dtype=dtype,
        fp8=fp8,
        fp8_recipe=fp8_recipe,
        activation_checkpointing=activation_checkpointing,
        pipeline_schedule=pipeline_schedule,
    )
    return estimate_workload(workload, accelerator, mode=mode, threshold=threshold)


def estimate_workload(
    workload: Workload, accelerator: Accelerator, *, mode: Mode = "fsdp", threshold: float = DEFAULT_THRESHOLD
) -> MemoryEstimate:
    check_options(mode, threshold)
    if mode == "fsdp":
        from launcher.estimate import fsdp as accounting
    else:
        from launcher.estimate import megatron as accounting
    stages = accounting.stage_peaks(workload, device=_device_kind(accelerator))
    heaviest = max(stages, key=lambda s: s.peak_bytes)
    peak = heaviest.peak_bytes
    return MemoryEstimate(
        mode=mode,
        per_gpu_peak_bytes=peak,
        allocated_bytes=heaviest.allocated_bytes,
        gpu_memory_bytes=accelerator.memory_bytes,
        threshold=threshold,
        verdict=verdict(peak, accelerator.memory_bytes, threshold),
        peak_stage=heaviest.stage,
        peak_phase=heaviest.phase,
        breakdown=heaviest.breakdown,
        stages=tuple(stages),
        notes=tuple(accounting.notes(workload)),
    )


def check_options(mode: str, threshold: float) -> None:
    """Raise a UsageError (exit 2) for a mode or threshold the estimator does not know."""
    if mode not in MODES:
        raise UsageError(f"mode '{mode}' is not an accounting mode; use {choices(MODES)}")
    if not 0 < threshold <= 1:
        raise UsageError(f"threshold {threshold} is not a fraction of GPU memory; use a value in (0, 1], e.g. 0.8")


def _device_kind(accelerator: Accelerator) -> str:
    # The host CPU has no CUDA context, NCCL or caching allocator.
    return "cpu" if accelerator.peak_bf16_tflops is None and accelerator.hbm_gbps is None else "cuda"


def empty_breakdown() -> dict[str, int]:
    return dict.fromkeys(COMPONENTS, 0)
