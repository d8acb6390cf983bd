"""When FP8 training gathers float8 weights: one condition for the entrypoints and the estimators.

With tensorwise scaling (one scale per tensor) FSDP all-gathers the weights in float8, half the
bytes of bf16, and tensor parallelism uses torchao's Float8 Colwise/Rowwise styles, so its
all-gathers move float8 activations too. That needs float8 collectives, which nccl has and gloo
does not; rowwise scaling never gathers in float8 (torchao's recipe).

With `fp8_experts`, a mixture-of-experts block's experts run torchao's FP8 grouped GEMM,
rowwise-scaled whatever `fp8_recipe` says (torchao 0.18's only FP8 grouped recipe,
Float8TrainingRecipe.FP8_ROWWISE in torchao/prototype/moe_training/config.py).
"""

from __future__ import annotations

FP8_GROUP_ALIGNMENT = 16
"""Rows of each expert's group in an FP8 grouped GEMM come in multiples of this (torch's
`_scaled_grouped_mm`; torchtitan's FP8_GROUP_ALIGNMENT_SIZE, torchtitan/components/quantization/__init__.py).
The entrypoints pad each group to it (entrypoints/model/fp8_experts.py); the estimators price the padding."""


def padded_group_rows(rows: int, experts: int) -> int:
    """Rows of the FP8 experts' padded buffer: enough for any split of `rows` over `experts`
    groups of 16-row multiples, none empty (a group of c > 0 rows takes at most c + 15, an
    empty one 16): `rows` rounded up to 16, plus 16 per expert."""
    alignment = FP8_GROUP_ALIGNMENT
    return -(-rows // alignment) * alignment + experts * alignment


def collective_backend(device: str) -> str:
    """The torch.distributed backend the entrypoints use on a device: nccl on CUDA, gloo on the CPU."""
    return "nccl" if device == "cuda" else "gloo"


def float8_all_gather(*, fp8: bool, fp8_recipe: str, backend: str) -> bool:
    """Whether FSDP gathers float8 weights (and TP uses float8 styles) for this precision."""
    return fp8 and fp8_recipe == "tensorwise" and backend == "nccl"


def fp8_experts_problem(*, hidden_size: int, expert_ffn_hidden_size: int) -> str | None:
    """Why a model's experts cannot run FP8 grouped GEMMs, or None: torchao's kernel takes
    dimensions that are multiples of 16 (its _Float8GroupedMM asserts it)."""
    if hidden_size % 16 == 0 and expert_ffn_hidden_size % 16 == 0:
        return None
    return (
        f"FP8 grouped GEMMs need the hidden size and the experts' FFN width to be multiples of 16 "
        f"(this model: {hidden_size} and {expert_ffn_hidden_size})"
    )


def fp8_experts(*, fp8: bool, fp8_experts: bool, hidden_size: int, expert_ffn_hidden_size: int) -> bool:
    """Whether the experts' grouped GEMMs run in FP8 (precision.fp8 and precision.fp8_experts)."""
    if not (fp8 and fp8_experts):
        return False
    return fp8_experts_problem(hidden_size=hidden_size, expert_ffn_hidden_size=expert_ffn_hidden_size) is None
