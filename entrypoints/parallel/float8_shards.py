"""Float8 linears under tensor parallelism that cast and multiply this rank's shards only.

    use_shard_scales(model)     # after convert_to_float8_training, before apply_tensor_parallel

torchao's Float8Linear run on DTensors scales each tensor by the amax of the whole tensor, so
every cast of a sharded tensor is an all-reduce over the TP group: per linear and micro-batch,
four (colwise: the weight twice, grad_output twice; rowwise: the input twice, the weight twice).
Each is a one-number collective that every TP rank waits on, and every op of the cast runs
through two tensor subclasses (DTensor around Float8TrainingTensor). On a loaded CPU that is
where an FP8 step's time goes (docs/sagemaker.md, "FP8 on the CPU").

A ShardScaledFloat8Linear runs torchao's same matmul (`matmul_with_hp_or_float8_args`, forward
and backward) on the local shards instead, so each shard gets its own scale and no cast needs a
collective. The product is still exact per shard: a colwise weight's shard owns whole output
columns; a rowwise linear's partial products are summed (reduce-scattered) after their own
dequantisation, as before. A shard's amax is at most the tensor's, so its scale is the same or
finer. Layouts it does not know (no TP, inputs already in float8 under torchao's float8 TP
styles, a bias) run torchao's own forward unchanged.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

COLWISE, ROWWISE = (Shard(0),), (Shard(1),)


class ShardScaledFloat8Linear(Float8Linear):
    """Float8Linear whose casts and matmuls see this rank's TP shards (one scale per shard)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        layout = _shard_layout(input, weight) if self.bias is None else None
        if layout is None:
            return super().forward(input)
        if layout == "colwise":
            # Replicated input, weight split by output rows: each rank computes its output
            # columns; the input's gradient is a partial sum (the TP plan reduce-scatters it).
            local_in = input.to_local(grad_placements=[Partial()])
            out_placements, out_grad = [Shard(input.ndim - 1)], None
        else:
            # Input and weight split along the inner dim: partial outputs, summed by the TP
            # plan's reduce-scatter; every rank's output gradient is the whole one.
            local_in = input.to_local()
            out_placements, out_grad = [Partial()], [Replicate()]
        local_out = matmul_with_hp_or_float8_args.apply(
            local_in, weight.to_local().t(), self.linear_mm_config, self.config
        )
        return DTensor.from_local(
            local_out, weight.device_mesh, out_placements, run_check=False, grad_placements=out_grad
        )


def _shard_layout(input: torch.Tensor, weight: torch.Tensor) -> str | None:
    """'colwise' or 'rowwise' for the two Megatron TP layouts in high precision, else None."""
    if not (isinstance(weight, DTensor) and isinstance(input, DTensor)) or weight.device_mesh.ndim != 1:
        return None
    if tensor_already_casted_to_fp8(input) or tensor_already_casted_to_fp8(weight):
        return None  # torchao's float8 TP styles and float8 all-gather: their casts, their scales
    if weight.placements == COLWISE and input.placements == (Replicate(),):
        return "colwise"
    if weight.placements == ROWWISE and input.placements == (Shard(input.ndim - 1),):
        return "rowwise"
    return None


def use_shard_scales(model: torch.nn.Module) -> None:
    """Make every Float8Linear of `model` a ShardScaledFloat8Linear (same state, same config)."""
    for module in model.modules():
        if type(module) is Float8Linear:
            module.__class__ = ShardScaledFloat8Linear
