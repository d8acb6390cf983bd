"""The fused SwiGLU gating (entrypoints/model/swiglu.py): the written-out form's values and
gradients bit for bit, keeping one tensor of the MLP's width fewer for backward; and the MLP's
w2 keeping no copy of the product, which backward makes again."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

import entrypoints.model.llama as llama
from entrypoints.fp8 import Fp8Settings, convert_to_float8
from entrypoints.model.llama import FeedForward, build_model
from entrypoints.model.swiglu import swiglu, weighted_swiglu
from entrypoints.parallel.activation import apply_activation_checkpointing
from entrypoints.parallel.parallelize import compile_blocks

from .tiny_models import tiny


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


def feed_forward(recompute: bool, *, fp8: bool) -> FeedForward:
    torch.manual_seed(4)
    block = FeedForward(tiny(hidden_size=64, ffn_hidden_size=96))
    block.recompute_product = recompute
    if fp8:
        convert_to_float8(block, Fp8Settings(recipe="tensorwise", float8_all_gather=False, emulate=True))
    return block.to(torch.bfloat16)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8 emulated"])
def test_the_mlp_makes_its_product_again_in_backward_with_the_same_gradients(fp8, monkeypatch):
    """w2 keeps no copy of the SwiGLU's product (Float8Linear's high-precision input included):
    the product is freed once the forward returns, and backward's gradients are bitwise those of
    the block that keeps it."""
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(5), dtype=torch.bfloat16)
    products = []

    def spy(gate, up):
        product = swiglu(gate, up)
        products.append(weakref.ref(product))
        return product

    monkeypatch.setattr(llama, "swiglu", spy)
    results, alive = [], []
    for recompute in (True, False):
        block = feed_forward(recompute, fp8=fp8)
        leaf = x.clone().requires_grad_()
        out = block(leaf)
        alive.append(products[-1]() is not None)
        out.float().square().sum().backward()
        results.append([out.detach(), leaf.grad, *(p.grad for p in block.parameters())])
    assert alive == [False, True]  # recomputed: freed after forward; kept: w2 holds it
    for recomputed, kept in zip(*results, strict=True):
        assert torch.equal(recomputed, kept)


def test_checkpointed_and_compiled_blocks_keep_their_product():
    """The checkpoint's saved-tensor hooks must stay the innermost, and hooks inside a compiled
    graph are not traced: those blocks' w2 keeps the product (entrypoints/parallel/)."""
    model = build_model(tiny(num_layers=3), seq_len=32, device="meta")
    apply_activation_checkpointing(model, {1})
    assert [model.layers[k].feed_forward.recompute_product for k in ("0", "1", "2")] == [True, False, True]
    compile_blocks(model, set())
    assert not any(block.feed_forward.recompute_product for block in model.layers.values())
