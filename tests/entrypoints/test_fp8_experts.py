"""The experts' FP8 grouped GEMMs (entrypoints/model/fp8_experts.py) on the CPU, where they are emulated:
the padding to 16-row groups is exact, the casts are torchao's (per row, per column, per group), and
an FP8 MoE layer's forward and backward stay within FP8's rounding of the fp32 layer's."""

from __future__ import annotations

import pytest
import torch

from entrypoints.fp8 import Fp8Settings, convert_to_float8
from entrypoints.model.fp8_experts import fp8_expert_linears, fp8_grouped_linear, pad_groups
from entrypoints.model.moe import MoE
from launcher.contract.config import MoeConfig
from launcher.contract.fp8 import fp8_experts, padded_group_rows

from .tiny_models import tiny

torchao = pytest.importorskip("torchao")


def float8_round_trip(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A reference of our own: scale = 448 / amax rounded down to a power of 2, cast, dequantise."""
    amax = t.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(torch.finfo(torch.float8_e4m3fn).max / amax)))
    return (t.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale


def test_groups_are_padded_to_16_rows_in_place_and_unpadded_exactly():
    counts = torch.tensor([3, 0, 17, 16, 1])
    x = torch.randn(int(counts.sum()), 8)
    groups = pad_groups(x, counts)
    assert groups.rows.shape == (padded_group_rows(37, 5), 8) == (48 + 5 * 16, 8)
    # Group ends at 16-row multiples, the empty expert's 16 zero rows included (as torchtitan pads
    # empty experts), and the last one taking the buffer's remaining zero rows.
    assert groups.offsets.tolist() == [16, 32, 64, 80, 128]
    assert groups.offsets.dtype == torch.int32
    starts = [0, 16, 32, 64, 80]
    first = 0
    for expert, count in enumerate(counts.tolist()):
        block = groups.rows[starts[expert] : starts[expert] + max(16, 16 * -(-count // 16))]
        assert torch.equal(block[:count], x[first : first + count])
        assert not block[count:].any()
        first += count
    assert not groups.rows[81:].any()
    assert torch.equal(groups.unpad(groups.rows), x)
    assert torch.equal(groups.pad(torch.arange(1.0, 38.0))[groups.destination], torch.arange(1.0, 38.0))


def test_the_buffer_holds_the_worst_split_of_the_rows():
    # Every expert but one with a single row (16 rows each), the rest on one expert: the most
    # padding any split of R rows over E experts needs, and it fits.
    for rows, experts in ((100, 8), (16, 16), (1, 1), (257, 64)):
        counts = torch.ones(experts, dtype=torch.long)
        counts[0] = rows - (experts - 1)
        groups = pad_groups(torch.randn(rows, 4), counts)
        sizes = torch.diff(groups.offsets, prepend=torch.zeros(1, dtype=torch.int32))
        assert int(groups.offsets[-1]) == padded_group_rows(rows, experts)
        assert bool((sizes >= 16).all()) and bool((sizes % 16 == 0).all()), sizes
        assert int(groups.destination.max()) < padded_group_rows(rows, experts)


def test_padding_changes_no_product_nor_gradient():
    """Each expert's zero rows set no scale and add nothing: the padded FP8 product of each group
    equals that group's own FP8 product, and so do the gradients."""
    torch.manual_seed(0)
    counts = torch.tensor([5, 21, 0, 9])
    x = torch.randn(int(counts.sum()), 32, requires_grad=True)
    weight = torch.randn(4, 48, 32, requires_grad=True)
    groups = pad_groups(x, counts)
    out = groups.unpad(fp8_grouped_linear(groups.rows, weight, groups.offsets, emulate=True))
    grad = torch.randn_like(out)
    out.backward(grad)
    first = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            assert not weight.grad[expert].any()
            continue
        rows = x.detach()[first : first + count].clone().requires_grad_()
        w = weight.detach()[expert : expert + 1].clone().requires_grad_()
        alone = fp8_grouped_linear(rows, w, torch.tensor([count], dtype=torch.int32), emulate=True)
        alone.backward(grad[first : first + count])
        assert torch.equal(out[first : first + count], alone)
        assert torch.equal(x.grad[first : first + count], rows.grad)
        assert torch.equal(weight.grad[expert], w.grad[0])
        first += count


def test_the_emulation_casts_per_row_per_column_and_per_group_as_torchao():
    torch.manual_seed(1)
    counts = torch.tensor([16, 32])
    x = torch.randn(48, 32) * torch.logspace(-2, 2, 48).unsqueeze(1)  # rows of very different size
    x.requires_grad_()
    weight = torch.randn(2, 16, 32, requires_grad=True)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    out = fp8_grouped_linear(x, weight, offsets, emulate=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    w_t = weight.detach().transpose(-2, -1)
    groups = [(0, 0, 16), (1, 16, 48)]
    x_q = float8_round_trip(x.detach(), -1)  # one scale per row
    w_q = float8_round_trip(w_t, -2)  # one per expert and output column
    w_rows = float8_round_trip(w_t, -1)  # for the input's gradient: one per expert and input column
    g_q = float8_round_trip(grad, -1)
    for e, lo, hi in groups:
        torch.testing.assert_close(out[lo:hi], x_q[lo:hi] @ w_q[e], rtol=0, atol=1e-5)
        torch.testing.assert_close(x.grad[lo:hi], g_q[lo:hi] @ w_rows[e].T, rtol=0, atol=1e-5)
        # The weight's gradient: the rows and the gradient scaled per column within the group.
        wgrad = float8_round_trip(x.detach()[lo:hi], 0).T @ float8_round_trip(grad[lo:hi], 0)
        torch.testing.assert_close(weight.grad[e], wgrad.T, rtol=0, atol=1e-4)
    # FP8 rounding really happened: the product is not the fp32 one.
    assert not torch.allclose(out[:16], x.detach()[:16] @ w_t[0], rtol=1e-3, atol=0)


def test_weights_sharing_their_input_give_the_products_and_gradients_of_separate_gemms():
    """w1 and w3 run as one function that casts their input once: outputs and gradients are
    bitwise those of one grouped GEMM per weight, the input's gradient summed as autograd sums."""
    torch.manual_seed(3)
    counts = torch.tensor([7, 0, 30, 16])
    rows = torch.randn(int(counts.sum()), 32)
    weights = [torch.randn(4, 48, 32) for _ in range(2)]
    groups = pad_groups(rows, counts)
    grads = [torch.randn(groups.rows.shape[0], 48) for _ in range(2)]
    results = []
    for together in (True, False):
        x = groups.rows.detach().clone().requires_grad_()
        leaves = [w.clone().requires_grad_() for w in weights]
        if together:
            outs = fp8_expert_linears(x, tuple(leaves), groups.offsets, emulate=True)
        else:
            outs = [fp8_grouped_linear(x, w, groups.offsets, emulate=True) for w in leaves]
        torch.autograd.backward(outs, grads)
        results.append([*outs, x.grad, *(w.grad for w in leaves)])
    for together, apart in zip(*results, strict=True):
        assert torch.equal(together, apart)


def test_backward_keeps_the_experts_inputs_as_float8_copies():
    """What an FP8 expert layer saves for backward: its rows and w2's input only as 1-byte copies
    (with fp32 scales per expert and column), besides the SwiGLU's gate and up."""
    _, layer = moe_pair()
    x = torch.randn(2, 40, 64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    padded = padded_group_rows(2 * 40 * 2, 8)  # tokens x top-k copies, padded per expert
    float8 = {tuple(t.shape) for t in saved if t.dtype == torch.float8_e4m3fn}
    assert float8 == {(padded, 64), (padded, 32)}
    wide = [t for t in saved if t.is_floating_point() and t.dtype != torch.float8_e4m3fn and t.shape[0] == padded]
    assert sorted(tuple(t.shape) for t in wide if t.dim() == 2) == [(padded, 32), (padded, 32)]  # gate, up


def moe_pair(**moe) -> tuple[MoE, MoE]:
    torch.manual_seed(2)
    experts = MoeConfig(**{"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 32, **moe})
    cfg = tiny(family="qwen3_moe", hidden_size=64, moe=experts)
    exact = MoE(cfg)
    for param in exact.parameters():
        torch.nn.init.normal_(param, std=0.05)
    fp8 = MoE(cfg)
    fp8.load_state_dict(exact.state_dict())
    convert_to_float8(fp8, Fp8Settings(recipe="tensorwise", float8_all_gather=False, emulate=True, experts=True))
    return exact, fp8


def test_an_fp8_moe_layer_runs_its_experts_in_fp8_within_its_rounding_of_the_exact_layer():
    exact, fp8 = moe_pair()
    assert fp8.experts.fp8_emulate is True and exact.experts.fp8_emulate is None
    x = torch.randn(2, 40, 64)
    grads = {}
    for name, layer in (("exact", exact), ("fp8", fp8)):
        leaf = x.clone().requires_grad_()
        out = layer(leaf)
        out.square().sum().backward()
        grads[name] = (out.detach(), leaf.grad, layer.experts.w1.grad, layer.experts.w2.grad)
    for name, ours, reference in zip(
        ("output", "grad x", "grad w1", "grad w2"), grads["fp8"], grads["exact"], strict=True
    ):
        relative = ((ours - reference).norm() / reference.norm()).item()
        # e4m3 keeps 3 mantissa bits: a few % per product (6.4% to 8.4% measured here), and
        # never exact, or the experts did not run in FP8.
        assert 0.01 < relative < 0.15, f"{name}: {relative:.3%} from the exact layer"


def test_experts_stay_in_the_compute_dtype_unless_asked_and_their_sizes_allow():
    assert fp8_experts(fp8=True, fp8_experts=True, hidden_size=64, expert_ffn_hidden_size=32)
    assert not fp8_experts(fp8=True, fp8_experts=True, hidden_size=64, expert_ffn_hidden_size=24)
    assert not fp8_experts(fp8=False, fp8_experts=True, hidden_size=64, expert_ffn_hidden_size=32)
    assert not fp8_experts(fp8=True, fp8_experts=False, hidden_size=64, expert_ffn_hidden_size=32)
    _, fp8 = moe_pair(expert_ffn_hidden_size=24)
    assert fp8.experts.fp8_emulate is None
    torch.manual_seed(2)
    layer = MoE(
        tiny(family="qwen3_moe", hidden_size=64, moe=MoeConfig(num_experts=8, top_k=2, expert_ffn_hidden_size=32))
    )
    convert_to_float8(layer, Fp8Settings(recipe="tensorwise", float8_all_gather=False, emulate=True))
    assert layer.experts.fp8_emulate is None  # precision.fp8_experts defaults to false
