"""Context-parallel attention as LSE-merged pieces (entrypoints/parallel/cp_attention.py), in one
process: every rank's kernel on its zigzag shard against full causal attention of the whole
sequence, forward and backward, exact in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from entrypoints.model.sdpa import CUDA_BACKEND_ORDER, causal_attention, enabled_cuda_backends
from entrypoints.parallel.context import shard_sequence, unshard_sequence, zigzag_attention, zigzag_attention_masked
from entrypoints.parallel.cp_attention import lse_merged_attention, piece_backend

TOLERANCE = 1e-5


def simulate_ranks(attention, q, k, v, grad_out, cp):
    """Run `attention` for every cp rank on its shard of q with the whole K/V; return the
    unsharded output and dq, and dK/dV summed over ranks (what the all-gather's backward does)."""
    outs, dqs = [], []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        q_local = shard_sequence(q, 2, rank, cp).requires_grad_()
        k_full, v_full = k.clone().requires_grad_(), v.clone().requires_grad_()
        out = attention(q_local, k_full, v_full, rank, cp)
        out.backward(shard_sequence(grad_out, 2, rank, cp))
        outs.append(out.detach())
        dqs.append(q_local.grad)
        dk += k_full.grad
        dv += v_full.grad
    return unshard_sequence(outs, 2), unshard_sequence(dqs, 2), dk, dv


def full_causal(q, k, v, grad_out):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(grad_out)
    return out.detach(), *(t.grad for t in leaves)


IMPLEMENTATIONS = {
    "fused-cpu": lambda q, k, v, rank, cp: zigzag_attention(q, k, v, rank, cp, enable_gqa=True, backend="cpu"),
    "math": lambda q, k, v, rank, cp: zigzag_attention(q, k, v, rank, cp, enable_gqa=True, backend="math"),
    "masked": lambda q, k, v, rank, cp: zigzag_attention_masked(q, k, v, rank, cp, enable_gqa=q.shape[1] != k.shape[1]),
}


# (implementation, heads, kv_heads, cp): GQA 8/2, odd 6/3 and 3/1, MHA 4/4; every case batch 2.
CASES = [
    *[("fused-cpu", h, kv, cp) for h, kv in [(8, 2), (6, 3), (4, 4), (3, 1)] for cp in (2, 4)],
    *[(name, h, kv, cp) for name in ("math", "masked") for h, kv, cp in [(8, 2, 4), (6, 3, 2)]],
]


@pytest.mark.parametrize(("implementation", "heads", "kv_heads", "cp"), CASES)
def test_every_rank_together_equal_full_causal_attention_forward_and_backward(implementation, heads, kv_heads, cp):
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads + cp)
    batch, seq, dim = 2, 16 * cp, 16
    q, grad_out = (torch.randn(batch, heads, seq, dim, generator=generator) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=generator) for _ in range(2))
    want = full_causal(q, k, v, grad_out)
    got = simulate_ranks(IMPLEMENTATIONS[implementation], q, k, v, grad_out, cp)
    for name, mine, reference in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(mine, reference, atol=TOLERANCE, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_more_than_two_chunks_and_chunk_zero_alone():
    # chunk_ids need not be zigzag: chunk 0 (diagonal piece only) and chunks 1 and 3 of 4.
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 32, 8, generator=generator) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows = torch.cat([torch.arange(0, 8), torch.arange(8, 16), torch.arange(24, 32)])
    got = lse_merged_attention(q[:, :, rows], k, v, (0, 1, 3))
    torch.testing.assert_close(got, full[:, :, rows], atol=TOLERANCE, rtol=0)


def test_output_is_laid_out_so_the_models_transpose_to_wo_is_a_view():
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    out = zigzag_attention(shard_sequence(q, 2, 1, 2), k, v, 1, 2)
    merged_heads = out.transpose(1, 2).reshape(2, 8, -1)  # what Attention.forward does before wo
    assert merged_heads.data_ptr() == out.data_ptr() and merged_heads._base is not None


def test_runs_under_fake_tensors_as_the_memory_trace_does():
    with FakeTensorMode():
        q = torch.randn(1, 32, 2048, 128, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, 8, 8192, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        out = zigzag_attention(q, k, v, 1, 4, enable_gqa=True)
        out.sum().backward()
        assert out.shape == q.shape and k.grad.shape == k.shape and q.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_cuda_kernels_are_called_with_their_signatures_on_the_meta_device(backend):
    # The CUDA ops' meta kernels check argument count and types: what can be checked without a GPU.
    q = torch.empty(2, 8, 256, 128, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(2, 2, 512, 128, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = lse_merged_attention(q, k, v, (1, 2), backend=backend)
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape and k.grad.shape == k.shape == v.grad.shape


def test_kernel_choice_is_the_cpu_kernel_on_cpu_and_math_elsewhere_without_cuda():
    assert piece_backend(torch.empty(1, 2, 8, 16)) == "cpu"
    assert piece_backend(torch.empty(1, 2, 8, 16, device="meta")) == "math"


def test_unknown_backend_and_mismatched_heads_are_refused_by_name():
    q, k = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match="unknown attention backend 'triton'; valid: cudnn, flash, cpu, math"):
        lse_merged_attention(q, k, k, (0, 1), backend="triton")
    with pytest.raises(ValueError, match="4 query heads and 2 K/V heads need enable_gqa=True"):
        zigzag_attention(q, k, k, 0, 1)
    with pytest.raises(ValueError, match="K/V hold 16 tokens, fewer than chunks"):
        lse_merged_attention(q, k, k, (1, 4))


def test_cuda_backend_order_prefers_cudnn_and_follows_sdpa_kernel():
    assert CUDA_BACKEND_ORDER[:2] == (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]):
        assert enabled_cuda_backends() == [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    assert enabled_cuda_backends()[0] == SDPBackend.CUDNN_ATTENTION


def test_plain_causal_attention_on_cpu_is_sdpa():
    q, k, v = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(causal_attention(q, k, v, enable_gqa=True), want)
