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
from pathlib import Path
from typing import Any, Literal

from launcher.catalog import Accelerator, choices
from launcher.display import html, svg
from launcher.errors import UsageError
from launcher.estimate import fsdp, megatron
from launcher.estimate.breakdown import StageMemory
from launcher.estimate.workload import Workload
from launcher.recipe.hardware import Hardware

Mode = Literal["fsdp", "megatron"]
MODES: tuple[str, ...] = ("fsdp", "megatron")
Verdict = Literal["fits", "risky", "oom"]
DEFAULT_THRESHOLD = 0.8
ACCOUNTINGS = {"fsdp": fsdp, "megatron": megatron}


def format_bytes(n: float) -> str:
    """'52.5 GiB', or '37 MiB' below a GiB: how every memory number reaches the user."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


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
    device: str = "GPU"
    """What one process runs on, as the units name it: "GPU", or "CPU rank" on the host CPU."""

    @property
    def per_device(self) -> str:
        return f"per {self.device}"

    @property
    def memory_name(self) -> str:
        """'GPU memory', or 'host memory' on the host CPU."""
        return "GPU memory" if self.device == "GPU" else "host memory"

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
            f"{self.verdict}: {format_bytes(self.per_gpu_peak_bytes)} {self._of_capacity()} "
            f"({self.utilization:.0%}, threshold {self.threshold:.0%}); largest: {largest} "
            f"{format_bytes(self.breakdown[largest])} on pipeline stage {self.peak_stage} ({self.peak_phase})"
        )

    def _of_capacity(self) -> str:
        # Every CPU rank draws on the one host's memory, which is what the estimate compares with.
        if self.device == "GPU":
            return f"of {format_bytes(self.gpu_memory_bytes)} per GPU"
        return f"{self.per_device}, of {format_bytes(self.gpu_memory_bytes)} of host memory"

    def stage_bars(self) -> list[tuple[str, dict[str, int]]]:
        """(label, breakdown) per pipeline stage: what the pictures draw."""
        return [(f"stage {s.stage}" if len(self.stages) > 1 else "GPU", dict(s.breakdown)) for s in self.stages]

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """The memory per stage as stacked bars with the capacity and threshold lines, a PNG (the `plot` extra)."""
        from launcher.display.plots import plot_memory

        title = (
            title or f"{self.verdict}: peak {format_bytes(self.per_gpu_peak_bytes)} per GPU ({self.utilization:.0%})"
        )
        return plot_memory(
            path, self.stage_bars(), capacity_bytes=self.gpu_memory_bytes, threshold=self.threshold, title=title
        )

    def _repr_html_(self) -> str:
        largest = self.largest_component
        rows = [
            ("verdict", self.verdict),
            (
                "peak per GPU",
                f"{format_bytes(self.per_gpu_peak_bytes)} of {format_bytes(self.gpu_memory_bytes)} ({self.utilization:.0%})",
            ),
            ("threshold", f"{self.threshold:.0%} ({format_bytes(self.threshold * self.gpu_memory_bytes)})"),
            ("allocated", format_bytes(self.allocated_bytes)),
            ("largest", f"{largest} {format_bytes(self.breakdown[largest])}"),
            ("peaks at", f"pipeline stage {self.peak_stage}, {self.peak_phase}"),
            ("accounting", self.mode),
        ]
        rows += [("suggestion", self.suggestion)] if self.suggestion else []
        rows += [("note", note) for note in self.notes]
        picture = svg.memory_bars(
            self.stage_bars(), capacity_bytes=self.gpu_memory_bytes, threshold=self.threshold, size=format_bytes
        )
        return html.block(html.table(rows, title=f"Memory estimate: {self.verdict}"), picture)

    def with_suggestion(self, suggestion: str | None) -> MemoryEstimate:
        return replace(self, suggestion=suggestion)

    def to_dict(self) -> dict[str, Any]:
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
            "stages": [stage.to_dict() for stage in self.stages],
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
    workload: Workload, hardware: Hardware, *, mode: Mode = "fsdp", threshold: float = DEFAULT_THRESHOLD
) -> MemoryEstimate:
    """Per-GPU peak memory of `workload` on `hardware`; no suggestion (see `launcher.api.estimate`).

    A recipe's workload comes settled (launcher/resolve.py); the planner's candidate layouts may
    still say grad_accumulation auto, which each is estimated with (`choose_grad_accumulation`)."""
    check_options(mode, threshold)
    if mode == "megatron" and workload.arch.moe is not None:
        raise UsageError(
            f"mode 'megatron' is Fujii et al. 2024's accounting of dense decoders, and {workload.arch.family} "
            "is a mixture of experts, which it does not cover; use mode fsdp"
        )
    if workload.grad_accumulation == "auto":
        choice, chosen = _choose_with_estimate(workload, hardware, threshold)
        if mode == "fsdp":
            return chosen  # the chosen mode's estimate, already made while choosing
        workload = replace(workload, grad_accumulation=choice)
    return _estimate(workload, hardware, mode, threshold)


def estimate_if_fits(
    workload: Workload, hardware: Hardware, *, mode: Mode = "fsdp", threshold: float = DEFAULT_THRESHOLD
) -> MemoryEstimate | None:
    """`estimate_memory`'s estimate where its verdict is fits, else None: the planner's question
    about each candidate. The same numbers, found sooner: in `fsdp` mode a workload stops at the
    first pipeline rank above `threshold` (`fsdp.stage_peaks`), and under `auto` accumulation the
    modes go in the order `_choose_with_estimate` weighs them, so the first that fits is the one
    it would choose (where none of the faster ones fits, sync_each fitting makes it the least)."""
    check_options(mode, threshold)
    if mode != "fsdp":
        found = estimate_memory(workload, hardware, mode=mode, threshold=threshold)
        return found if found.fits else None
    if workload.grad_accumulation != "auto":
        return _estimate_below(workload, hardware, threshold)
    if not fsdp.accumulation_changes_memory(workload):
        choices_in_order: tuple[str, ...] = ("sync_each",)
    else:
        faster = ACCUMULATION_SPEED_ORDER[:1] if workload.layout.pipeline > 1 else ACCUMULATION_SPEED_ORDER[:-1]
        choices_in_order = (*faster, "sync_each")
    for choice in choices_in_order:
        found = _estimate_below(replace(workload, grad_accumulation=choice), hardware, threshold)
        if found is not None:
            return found
    return None


def _estimate_below(workload: Workload, hardware: Hardware, threshold: float) -> MemoryEstimate | None:
    limit = threshold * hardware.accelerator.memory_bytes
    stages = fsdp.stage_peaks(workload, device=_device_kind(hardware.accelerator), limit_bytes=limit)
    return None if stages is None else _from_stages(workload, hardware, "fsdp", threshold, stages)


def _estimate(workload: Workload, hardware: Hardware, mode: Mode, threshold: float) -> MemoryEstimate:
    stages = ACCOUNTINGS[mode].stage_peaks(workload, device=_device_kind(hardware.accelerator))
    return _from_stages(workload, hardware, mode, threshold, stages)


def _from_stages(
    workload: Workload, hardware: Hardware, mode: Mode, threshold: float, stages: list[StageMemory]
) -> MemoryEstimate:
    accounting = ACCOUNTINGS[mode]
    accelerator = hardware.accelerator
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
        device="CPU rank" if _device_kind(accelerator) == "cpu" else "GPU",
    )


# Fastest first: sync_last_gathered sends nothing between micro-batches, sync_last re-gathers
# parameters but reduce-scatters once, sync_each does both for every micro-batch.
ACCUMULATION_SPEED_ORDER = ("sync_last_gathered", "sync_last", "sync_each")


def choose_grad_accumulation(workload: Workload, hardware: Hardware, threshold: float = DEFAULT_THRESHOLD) -> str:
    """What `parallel.grad_accumulation: auto` runs (launcher/resolve.py settles it with this): the
    fastest mode whose `fsdp` estimate fits under `threshold`, else the mode of the least memory."""
    return _choose_with_estimate(workload, hardware, threshold)[0]


def _choose_with_estimate(workload: Workload, hardware: Hardware, threshold: float) -> tuple[str, MemoryEstimate]:
    """`choose_grad_accumulation`, with the `fsdp` estimate of the choice where it was made on the way.

    Where the mode moves no byte (`fsdp.accumulation_changes_memory`), one estimate answers for
    every mode: the fastest fits exactly when sync_each does. Under pipelining sync_last runs as
    sync_last_gathered (Recipe.grad_accumulation), so only that and sync_each are weighed."""
    if not fsdp.accumulation_changes_memory(workload):
        found = _estimate(replace(workload, grad_accumulation="sync_each"), hardware, "fsdp", threshold)
        return ("sync_last_gathered" if found.fits else "sync_each"), found
    faster = ACCUMULATION_SPEED_ORDER[:1] if workload.layout.pipeline > 1 else ACCUMULATION_SPEED_ORDER[:-1]
    tried = []
    for choice in faster:
        found = _estimate(replace(workload, grad_accumulation=choice), hardware, "fsdp", threshold)
        if found.fits:
            return choice, found
        tried.append((choice, found))
    # None fits: the least memory, the faster mode on a tie. Under pipelining sync_each's fp32
    # gradient shards hold as much as unsharded bf16 ones over a shard of 2, and more over 1.
    tried.append(
        ("sync_each", _estimate(replace(workload, grad_accumulation="sync_each"), hardware, "fsdp", threshold))
    )
    return min(tried, key=lambda pair: pair[1].per_gpu_peak_bytes)


def check_options(mode: str, threshold: float) -> None:
    """Raise a UsageError (exit 2) for a mode or threshold the estimator does not know."""
    if mode not in MODES:
        raise UsageError(f"mode '{mode}' is not an accounting mode; use {choices(MODES)}")
    if not 0 < threshold <= 1:
        raise UsageError(
            f"threshold {threshold} is not a fraction of GPU memory; use a value in (0, 1], e.g. {DEFAULT_THRESHOLD}"
        )


def _device_kind(accelerator: Accelerator) -> str:
    # The host CPU has no CUDA context, NCCL or caching allocator.
    return "cpu" if accelerator.peak_bf16_tflops is None and accelerator.hbm_gbps is None else "cuda"
