"""When FP8 training gathers float8 weights: one condition for the entrypoints and the estimators.

With tensorwise scaling (one scale per tensor) FSDP all-gathers the weights in float8, half the
bytes of bf16, and tensor parallelism uses torchao's Float8 Colwise/Rowwise styles, so its
all-gathers move float8 activations too. That needs float8 collectives, which nccl has and gloo
does not; rowwise scaling never gathers in float8 (torchao's recipe).
"""

from __future__ import annotations


def collective_backend(device: str) -> str:
    """The torch.distributed backend the entrypoints use on a device: nccl on CUDA, gloo on the CPU."""
    return "nccl" if device == "cuda" else "gloo"


def float8_all_gather(*, fp8: bool, fp8_recipe: str, backend: str) -> bool:
    """Whether FSDP gathers float8 weights (and TP uses float8 styles) for this precision."""
    return fp8 and fp8_recipe == "tensorwise" and backend == "nccl"
