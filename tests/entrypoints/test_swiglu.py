"""The fused SwiGLU gating (entrypoints/model/swiglu.py): the written-out form's values and
gradients bit for bit, keeping one tensor of the MLP's width fewer for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from entrypoints.model.swiglu import swiglu, weighted_swiglu


def saved_bytes(function, *inputs) -> int:
    """Bytes autograd keeps for backward while `function` runs, each storage once."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function(*inputs)
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_equal_the_written_out_form_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(64, 96, generator=generator, dtype=dtype) for _ in range(3))
    results = []
    for form in (lambda a, b: F.silu(a) * b, swiglu):
        a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = form(a, b)
        out.backward(grad)
        results.append((out.detach(), a.grad, b.grad))
    for written, fused in zip(*results, strict=True):
        assert torch.equal(written, fused)


def test_keeps_gate_and_up_only_where_the_written_out_form_keeps_silu_of_gate_too():
    gate, up = (torch.randn(128, 256, requires_grad=True) for _ in range(2))
    width = 128 * 256 * 4
    # The inputs are leaves here: what each form saves is its inputs and what it computes.
    assert saved_bytes(lambda a, b: F.silu(a) * b, gate, up) == 3 * width
    assert saved_bytes(swiglu, gate, up) == 2 * width


def test_the_weighted_form_scales_each_row_and_gives_the_scale_its_gradient():
    generator = torch.Generator().manual_seed(1)
    gate, up, grad = (torch.randn(64, 96, generator=generator, dtype=torch.float64) for _ in range(3))
    scale = torch.rand(64, generator=generator, dtype=torch.float64)
    results = []
    for form in (lambda a, b, s: F.silu(a) * b * s[:, None], weighted_swiglu):
        a, b, s = (t.clone().requires_grad_() for t in (gate, up, scale))
        out = form(a, b, s)
        out.backward(grad)
        results.append((out.detach(), a.grad, b.grad, s.grad))
    for written, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused, written, rtol=1e-12, atol=1e-12)
    # And it keeps what swiglu keeps, plus the scale: not the product.
    a, b, s = (t.float().requires_grad_() for t in (gate, up, scale))
    assert saved_bytes(weighted_swiglu, a, b, s) == 2 * 64 * 96 * 4 + 64 * 4
