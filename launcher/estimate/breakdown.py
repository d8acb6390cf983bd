"""What both memory accountings return: one `StageMemory` per pipeline rank, by component.

`fsdp.py` and `megatron.py` build these records and `memory.py` picks the heaviest of them, so
the records live here, below all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    """One pipeline rank at the moment it peaks."""

    stage: int  # pipeline rank
    layers: int  # transformer blocks on this rank (all its virtual stages)
    # The moment this rank peaks: "loss backward", "backward of layer 3", "optimizer step",
    # "first backward (pipeline)", ... in fsdp mode; "backward" in megatron mode.
    phase: str
    breakdown: dict[str, int]

    @property
    def allocated_bytes(self) -> int:
        return sum(self.breakdown[name] for name in ALLOCATED_COMPONENTS)

    @property
    def peak_bytes(self) -> int:
        return sum(self.breakdown.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "layers": self.layers,
            "phase": self.phase,
            "peak_bytes": self.peak_bytes,
            "allocated_bytes": self.allocated_bytes,
            "breakdown": dict(self.breakdown),
        }


def empty_breakdown() -> dict[str, int]:
    return dict.fromkeys(COMPONENTS, 0)
