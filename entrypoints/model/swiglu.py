"""SwiGLU's gating, silu(gate) * up, keeping only its two inputs for backward.

    hidden = swiglu(self.w1(x), self.w3(x))        # then w2(hidden)
    with product_recomputed(hidden, gate, up):     # w2 keeps no copy of hidden either
        out = self.w2(hidden)

Written out, `F.silu(gate) * up` makes autograd keep three tensors of the MLP's width per token:
silu's input (gate), and both factors of the product (silu(gate) and up); w2 then keeps the
product as its input. This function keeps gate and up and recomputes silu(gate) in backward, as
Megatron-Core's fused SwiGLU does (megatron/core/fusions/fused_bias_swiglu.py saves the
projection's output and recomputes the activation): one T x f/t tensor less per layer, for an
elementwise recomputation. The backward is autograd's own arithmetic, op for op (the product's
gradients, then `aten.silu_backward`), so gradients are bitwise those of the written-out form.

w2 then saves the product as its input, for its weight's gradient: one T x f/t tensor more per
layer, a fifth of a Llama block's saved set. `product_recomputed` drops it: saved-tensor hooks
around w2's call replace whatever w2 saves in the product's storage (the tensor, a view, the
DTensor tensor parallelism wraps around it, or torchao's Float8Linear's high-precision input) by
a token, and backward makes the product again from the gate and up this SwiGLU keeps anyway, the
same elementwise ops on the same values, so bitwise the same. A float8 copy of the product
(Float8RowwiseParallel's input) is another storage and stays saved. Not for a checkpointed
block (the checkpoint's own hooks must stay innermost, and it recomputes the product anyway) nor a
compiled one (the hooks would run inside the compiled graph): parallel/activation.py `keep_product`.

`weighted_swiglu` also multiplies each row by a scale (a mixture of experts' router weight) and
gives the scale its gradient, the dot product of the incoming gradient with the recomputed
unscaled product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from entrypoints.model.saved_views import Layer, View, rewrap_view, storage_id, unwrap, view_of


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        # Three tensors of the MLP's width at most beside the saved ones, as autograd's own
        # backward of the written-out form: the incoming gradient, gate's and one more (the
        # product's gradient, then the recomputed activation that becomes up's in place).
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        grad_up = F.silu(gate).mul_(grad)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, saving gate and up only (the module docstring)."""
    return _SwiGLU.apply(gate, up)


class _WeightedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, scale)
        return F.silu(gate) * up * scale.unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, scale = ctx.saved_tensors
        column = scale.unsqueeze(-1)
        # Each step works in place on the one temporary it made, so at most two tensors of the
        # MLP's width exist beside the incoming gradient, as in _SwiGLU's backward: the scale's
        # gradient (the recomputed product's dot with the gradient), then the gate's and up's.
        grad_scale = F.silu(gate).mul_(up).mul_(grad).sum(-1)
        grad_gate = torch.ops.aten.silu_backward((grad * up).mul_(column), gate)
        grad_up = F.silu(gate).mul_(grad).mul_(column)
        return grad_gate, grad_up, grad_scale


def weighted_swiglu(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up * scale[:, None] for rows [R, f] and a scale per row [R]: a mixture of
    experts' router weights, applied before the down projection (exact: it is linear), so the
    combine need not keep the experts' outputs for the weights' gradient (entrypoints/model/moe.py).
    Saves gate, up and the scale only."""
    return _WeightedSwiGLU.apply(gate, up, scale)


@dataclass(frozen=True)
class _Product:
    """A saved view of the SwiGLU's product, dropped until backward: the two tensors it is made of."""

    gate: torch.Tensor
    up: torch.Tensor
    layers: tuple[Layer, ...]
    view: View


def product_recomputed(product: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """Saved-tensor hooks for the call that consumes `product` = swiglu(gate, up) (the module
    docstring): its saved views of the product are made again in backward, not kept."""
    storage = storage_id(product)

    def pack(tensor):
        layers, plain = unwrap(tensor)
        if plain is None or storage_id(plain) != storage:
            return tensor
        return _Product(gate, up, layers, view_of(plain))

    def unpack(packed):
        if not isinstance(packed, _Product):
            return packed
        with torch.no_grad():
            again = F.silu(packed.gate) * packed.up
        return rewrap_view(packed.layers, packed.view, again)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
