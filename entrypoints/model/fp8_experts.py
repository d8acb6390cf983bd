"""The experts' grouped GEMMs in FP8: torchao 0.18's rowwise-scaled grouped GEMM on CUDA, the
same casts emulated elsewhere.

    groups = pad_groups(rows, counts)                          # each expert's rows to a multiple of 16
    y = fp8_grouped_linear(groups.rows, weight, groups.offsets, emulate=False)
    out = groups.unpad(y)                                      # back to the unpadded rows

On CUDA the product is `torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm`
(torchao/prototype/moe_training/fp8_grouped_mm.py, `_Float8GroupedMM`), what torchtitan trains
MoE layers with under FP8 (torchtitan/components/quantization/float8.py):
- forward: the rows cast to float8 e4m3 with one scale per row, each expert's weight with one
  scale per output column, both scales rounded down to powers of 2; `torch._scaled_grouped_mm`
  with fast accumulation, output in bf16;
- backward: the incoming gradient cast per row and the weights per input column for the input's
  gradient; for the weights' gradient the gradient and the saved rows cast per column within
  each expert's group, so one expert's rows never set another's scale;
- saved for backward: the bf16 rows and the weight, as a bf16 grouped GEMM saves; the float8
  copies are made again in backward.

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
`Float8LinearConfig.emulate` does for the dense layers (entrypoints/fp8.py).
scripts/gpu_moe_check.py compares the two on an H100/H200.
"""

from __future__ import annotations

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


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, emulate: bool) -> torch.Tensor:
    """Padded rows x [P, K] times weight[e].T ([E, N, K]) per group, in FP8 (the module docstring)."""
    if emulate:
        return _EmulatedFloat8GroupedMM.apply(x, weight.transpose(-2, -1), offsets)
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    # weight [E, N, K] contiguous: its transpose [E, K, N] is column-major per group, as the
    # kernel's right operand must be. torch's _scaled_grouped_mm writes bf16; an fp32 job gets
    # its dtype back.
    out = _to_fp8_rowwise_then_scaled_grouped_mm(
        x, weight.transpose(-2, -1), offsets, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
    )
    return out.to(x.dtype)


def _cast(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t cast to float8 with one power-of-2 scale per slice along `dim`, then dequantised (fp32)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(
        t, FLOAT8, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim, round_scales_to_power_of_2=True
    )
    return to_fp8_saturated(t.float() * scale, FLOAT8).float() / scale


def _groups(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every non-empty group."""
    bounds = [0, *offsets.tolist()]
    return [(e, bounds[e], bounds[e + 1]) for e in range(len(bounds) - 1) if bounds[e + 1] > bounds[e]]


class _EmulatedFloat8GroupedMM(torch.autograd.Function):
    """torchao's `_Float8GroupedMM` with each FP8 product done on the dequantised operands in fp32."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b_t, offsets)
        a_q, b_q = _cast(a, -1), _cast(b_t, -2)  # per row of a; per (expert, output column) of b
        out = a.new_zeros(a.shape[0], b_t.shape[-1])
        for e, lo, hi in _groups(offsets):
            out[lo:hi] = (a_q[lo:hi] @ b_q[e]).to(a.dtype)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b_t, offsets = ctx.saved_tensors
        grad_q, b_rows = _cast(grad, -1), _cast(b_t, -1)  # per row of grad; per (expert, input row) of b
        grad_a = torch.zeros_like(a)
        grad_b_t = torch.zeros_like(b_t)
        for e, lo, hi in _groups(offsets):
            grad_a[lo:hi] = (grad_q[lo:hi] @ b_rows[e].T).to(a.dtype)
            # The weight's gradient: both operands scaled per column within this expert's rows.
            grad_b_t[e] = (_cast(a[lo:hi], 0).T @ _cast(grad[lo:hi], 0)).to(b_t.dtype)
        return grad_a, grad_b_t, None
