"""The experts' grouped GEMMs in FP8: torchao 0.18's rowwise-scaled grouped GEMM on CUDA, the
same casts emulated elsewhere.

    groups = pad_groups(rows, counts)                          # each expert's rows to a multiple of 16
    gate, up = fp8_expert_linears(groups.rows, (w1, w3), groups.offsets, emulate=False)
    out = groups.unpad(fp8_grouped_linear(hidden, w2, groups.offsets, emulate=False))

On CUDA the products and casts are those of
`torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm` (torchao/prototype/
moe_training/fp8_grouped_mm.py, `_Float8GroupedMM`), what torchtitan trains MoE layers with under
FP8 (torchtitan/components/quantization/float8.py), called kernel by kernel here:
- forward: the rows cast to float8 e4m3 with one scale per row, each expert's weight with one
  scale per output column, both scales rounded down to powers of 2; `torch._scaled_grouped_mm`
  with fast accumulation, output in bf16;
- backward: the incoming gradient cast per row and the weights per input column for the input's
  gradient; for the weights' gradient the gradient and the rows cast per column within each
  expert's group, so one expert's rows never set another's scale.
Two things differ from calling `_Float8GroupedMM` once per weight, neither the numbers: w1 and w3
share one cast of their common input, and what backward keeps of the input is its per-group
column-wise float8 copy, made in forward (1 byte per element with fp32 scales per group and
column), where torchao keeps the bf16 rows and casts them in backward (`_Float8GroupedLinears`).
Per layer that is P x (h + f) bytes less for backward (Qwen3-30B-A3B: 190 MB per 8K-token
micro-batch).

torch's FP8 grouped GEMM needs every group's rows to be a multiple of 16 (torchao asserts it;
torchtitan's FP8_GROUP_ALIGNMENT_SIZE in torchtitan/components/quantization/__init__.py), and
dropless routing sends any number of rows to an expert, so `pad_groups` copies each expert's
rows into a zeroed buffer at 16-row boundaries. An expert no row reached still gets 16 zero
rows, as torchtitan pads empty experts (torchtitan/models/moe/kernels.py
`generate_permute_indices`: clamp_min to the alignment): no group is empty, so the weight
gradient's grouped GEMM never has a group of zero length whose output it might leave unwritten.
The buffer's size depends only on the rows and the expert count (R rounded up to 16, plus 16 x E:
no device synchronisation), and its rows past the last group go to the last expert: zero rows,
whose products are zero, so every row of the buffer belongs to a group.

The emulation (CPU, and any device without the kernel) makes the same float8 casts with torchao's
own reference functions (`tensor_to_scale`, `to_fp8_saturated`) and multiplies the dequantised
operands in fp32, per expert: the numerics of the kernel up to its accumulation order, as
`Float8LinearConfig.emulate` does for the dense layers (entrypoints/fp8.py). Both run the same
autograd function with their own `Float8Kernels`. scripts/gpu_moe_check.py compares the kernels'
path with the emulation and with torchao's own `_Float8GroupedMM` on an H100/H200.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from launcher.contract.fp8 import FP8_GROUP_ALIGNMENT, padded_group_rows

FLOAT8 = torch.float8_e4m3fn


class PaddedGroups(NamedTuple):
    rows: torch.Tensor
    """[P, K]: each expert's rows from a multiple of 16, zero rows between and after them."""
    offsets: torch.Tensor
    """[E] int32: where each expert's group ends; multiples of 16, the last one P."""
    destination: torch.Tensor
    """[R] int64: the padded row of each unpadded row."""

    def unpad(self, padded_out: torch.Tensor) -> torch.Tensor:
        """[R, N]: the rows of a grouped GEMM's padded output [P, N] that hold real rows."""
        return padded_out[self.destination]

    def pad(self, per_row: torch.Tensor) -> torch.Tensor:
        """[P]: a value per unpadded row [R] at its padded row, zero on the padding rows."""
        return _ScatterRows.apply(per_row.unsqueeze(-1), self.destination, self.rows.shape[0]).squeeze(-1)


def pad_groups(x: torch.Tensor, counts: torch.Tensor) -> PaddedGroups:
    """x [R, K], sorted by expert with counts [E] rows each, into groups of 16-row multiples."""
    alignment = FP8_GROUP_ALIGNMENT
    experts, rows = counts.numel(), x.shape[0]
    capacity = padded_group_rows(rows, experts)
    padded_counts = ((counts + alignment - 1) // alignment * alignment).clamp_min(alignment)
    padded_ends = torch.cumsum(padded_counts, 0)
    padded_starts = padded_ends - padded_counts
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=rows)
    destination = padded_starts[expert] + torch.arange(rows, device=x.device) - starts[expert]
    # The rows past the last group join it: capacity and every end are multiples of 16.
    offsets = padded_ends.to(torch.int32)
    offsets[-1] = capacity
    return PaddedGroups(_ScatterRows.apply(x, destination, capacity), offsets, destination)


class _ScatterRows(torch.autograd.Function):
    """Rows x [R, K] into a zeroed [capacity, K] buffer at `destination`; backward gathers them
    back. Saves only the row map: `index_copy`'s derivative would keep x itself (its formula
    reads the source's shape through the tensor), R x K bytes per layer for nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, destination: torch.Tensor, capacity: int) -> torch.Tensor:
        ctx.save_for_backward(destination)
        padded = x.new_zeros(capacity, x.shape[1])
        padded[destination] = x
        return padded

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (destination,) = ctx.saved_tensors
        return grad[destination], None, None


class Float8Kernels(NamedTuple):
    """The casts and the product an FP8 grouped GEMM is made of, with torchao 0.18's shapes,
    layouts and scales (torchao/prototype/moe_training/kernels/, scales = 448 / amax rounded down
    to a power of 2, so dividing by one is exact): its Triton kernels and `torch._scaled_grouped_mm`
    on CUDA (`torchao_kernels`), the same casts with products in fp32 elsewhere (`EMULATED`)."""

    rows: Callable
    """[M, K] -> (float8 [M, K] row-major, [M, 1] scales): one scale per row."""
    weight_columns: Callable
    """B_t [E, K, N] -> (float8 [E, K, N] column-major, [E, 1, N]): one per expert and output column."""
    weight_rows: Callable
    """B_t [E, K, N] -> (float8 B [E, N, K] column-major, [E, K]): one per expert and input column."""
    group_columns: Callable
    """([M, K], group ends [E]) -> (float8 [M, K] column-major, [E x K]): one per group and column."""
    grouped_mm: Callable
    """(a, b, 1 / a's scales, 1 / b's scales, group ends, out_dtype): per group, a [M, K] times
    b [E, K, N] -> [M, N]; or a [N, M] times b [M, K], the groups along M -> [E, N, K]."""


def torchao_kernels() -> Float8Kernels:
    """torchao 0.18's Triton casts, as `_Float8GroupedMM` calls them, and torch's FP8 grouped GEMM."""
    from torchao.prototype.moe_training.kernels import (
        triton_fp8_colwise_3d_scale_and_cast,
        triton_fp8_per_group_colwise_scales_dual,
        triton_fp8_rowwise_2d_scale_and_cast,
        triton_fp8_rowwise_3d_transpose_rhs,
    )

    options = {"output_dtype": FLOAT8, "round_scales_to_power_of_2": True}

    def group_columns(t: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The dual kernel, as `_Float8GroupedMM`'s backward calls it, with a copy of t's first 16
        # columns as its second tensor (discarded). torchao's single-tensor kernel sizes its
        # one-pass tile from the mean group (ceil(rows / groups) rounded up to a power of 2,
        # jagged_float8_scales.py `triton_fp8_per_group_colwise_scales`), so a group above it
        # loses its last rows: on one H100, uneven routing gave weight gradients 16% off
        # torchao's and a NaN gradient norm at a Qwen3-30B-A3B run's first step.
        data, scales, _, _ = triton_fp8_per_group_colwise_scales_dual(t, t[:, :16].contiguous(), ends, **options)
        return data, scales

    return Float8Kernels(
        rows=lambda t: triton_fp8_rowwise_2d_scale_and_cast(t, **options),
        weight_columns=lambda t: triton_fp8_colwise_3d_scale_and_cast(t, **options),
        weight_rows=lambda t: triton_fp8_rowwise_3d_transpose_rhs(t, **options),
        group_columns=group_columns,
        grouped_mm=lambda a, b, a_inv, b_inv, ends, out_dtype: torch._scaled_grouped_mm(
            a, b, a_inv, b_inv, ends, out_dtype=out_dtype, use_fast_accum=True
        ),
    )


def _scaled(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 t, its fp32 scales along `dim`): torchao's reference cast (torchao/float8/)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(
        t, FLOAT8, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim, round_scales_to_power_of_2=True
    )
    return to_fp8_saturated(t.float() * scale, FLOAT8), scale


def _emulated_weight_rows(b_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    data, scale = _scaled(b_t, -1)
    return data.transpose(-2, -1), scale.squeeze(-1)


def _emulated_group_columns(t: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Pieces joined, not written into a float8 buffer: Inductor cannot lower that write on the CPU.
    pieces, scales, start = [], [], 0
    for end in ends.tolist():
        if end > start:
            data, scale = _scaled(t[start:end], 0)
            pieces.append(data)
            scales.append(scale)
        else:
            scales.append(torch.ones(1, t.shape[1], device=t.device))
        start = end
    return torch.cat(pieces), torch.cat(scales).flatten()


def _emulated_grouped_mm(a, b, a_inv, b_inv, ends, out_dtype) -> torch.Tensor:
    """torch._scaled_grouped_mm's product on the dequantised operands in fp32, group by group."""
    groups = _groups(ends)
    if b.dim() == 3:  # [M, K] x [E, K, N]: the groups split a's rows
        out = a.new_zeros((a.shape[0], b.shape[-1]), dtype=out_dtype)
        for e, lo, hi in groups:
            out[lo:hi] = ((a[lo:hi].float() * a_inv[lo:hi, None]) @ (b[e].float() * b_inv[e])).to(out_dtype)
        return out
    n, k = a.shape[0], b.shape[1]  # [N, M] x [M, K]: the groups split the shared M
    out = a.new_zeros((ends.numel(), n, k), dtype=out_dtype)
    for e, lo, hi in groups:
        left = a[:, lo:hi].float() * a_inv[e * n : (e + 1) * n, None]
        out[e] = (left @ (b[lo:hi].float() * b_inv[e * k : (e + 1) * k])).to(out_dtype)
    return out


EMULATED = Float8Kernels(
    rows=lambda t: _scaled(t, -1),
    weight_columns=lambda t: _scaled(t, -2),
    weight_rows=_emulated_weight_rows,
    group_columns=_emulated_group_columns,
    grouped_mm=_emulated_grouped_mm,
)


def kernels_for(emulate: bool) -> Float8Kernels:
    return EMULATED if emulate else torchao_kernels()


def fp8_expert_linears(x: torch.Tensor, weights: tuple, offsets: torch.Tensor, *, emulate: bool) -> tuple:
    """Padded rows x [P, K] times each weight[e].T ([E, N, K]) per group, in FP8: one output per
    weight, the rows cast once for all (the module docstring)."""
    out_dtype = x.dtype if emulate else torch.bfloat16  # torch's kernel writes bf16
    return _Float8GroupedLinears.apply(emulate, out_dtype, x, offsets, *weights)


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, emulate: bool) -> torch.Tensor:
    """Padded rows x [P, K] times weight[e].T ([E, N, K]) per group, in FP8 (the module docstring)."""
    (out,) = fp8_expert_linears(x, (weight,), offsets, emulate=emulate)
    return out


def _groups(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every non-empty group."""
    bounds = [0, *offsets.tolist()]
    return [(e, bounds[e], bounds[e + 1]) for e in range(len(bounds) - 1) if bounds[e + 1] > bounds[e]]


class _Float8GroupedLinears(torch.autograd.Function):
    """torchao 0.18's `_Float8GroupedMM` (torchao/prototype/moe_training/fp8_grouped_mm.py), for
    one or more weights sharing their input, keeping the input's float8 copy for backward in place
    of the rows themselves. The weights' gradient multiplies the rows scaled per column within each
    group; that copy depends on the rows alone, so it is made in forward and saved (P x K bytes
    with E x K fp32 scales, where torchao keeps the bf16 rows, 2 P x K) and backward reads the same
    values torchao would make from the rows. Transformer Engine keeps its FP8 linears' inputs the
    same way, as the column-wise float8 copy. Every product and cast is torchao's, in its order,
    so outputs and gradients are those of one `_Float8GroupedMM` per weight."""

    @staticmethod
    def forward(ctx, emulate: bool, out_dtype, x: torch.Tensor, offsets: torch.Tensor, *weights):
        # The kernels are looked up, not passed: a flag is all torch.compile needs to see.
        kernels = kernels_for(emulate)
        rows, row_scales = kernels.rows(x)
        inverse = row_scales.squeeze(-1).reciprocal()
        outputs = []
        for weight in weights:
            data, scales = kernels.weight_columns(weight.transpose(-2, -1))
            product = kernels.grouped_mm(rows, data, inverse, scales.squeeze(1).reciprocal(), offsets, out_dtype)
            outputs.append(product.to(x.dtype))
            del data, scales, product
        del rows, row_scales, inverse
        columns, column_scales = kernels.group_columns(x, offsets)
        ctx.save_for_backward(columns, column_scales, offsets, *weights)
        ctx.emulate, ctx.out_dtype, ctx.input_dtype = emulate, out_dtype, x.dtype
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        columns, column_scales, offsets, *weights = ctx.saved_tensors
        kernels, out_dtype = kernels_for(ctx.emulate), ctx.out_dtype
        grad_x, grad_weights = None, [None] * len(weights)
        # The last weight first, as autograd runs separate products (the last made first).
        for i in reversed(range(len(weights))):
            grad, weight = grads[i], weights[i]
            rows, row_scales = kernels.rows(grad)
            data, scales = kernels.weight_rows(weight.transpose(-2, -1))
            part = kernels.grouped_mm(
                rows, data, row_scales.squeeze(-1).reciprocal(), scales.squeeze(1).reciprocal(), offsets, out_dtype
            ).to(ctx.input_dtype)
            del rows, row_scales, data, scales
            grad_x = part if grad_x is None else grad_x.add_(part)
            del part
            grad_columns, grad_scales = kernels.group_columns(grad, offsets)
            grad_weight = kernels.grouped_mm(
                grad_columns.t(), columns, grad_scales.reciprocal(), column_scales.reciprocal(), offsets, out_dtype
            )
            grad_weights[i] = grad_weight.to(weight.dtype)
            del grad_columns, grad_scales, grad_weight
        return None, None, grad_x, None, *grad_weights
