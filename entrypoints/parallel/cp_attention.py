"""Context-parallel attention of one rank as log-sum-exp-merged pieces, each a fused kernel.

Under zigzag context parallelism (parallel/context.py) a rank holds query chunks n of the
2·size chunks of C tokens and the whole sequence's K/V (all-gathered). Chunk n attends to keys
[0, (n+1)·C) with a causal mask aligned to the lower right. The masked path
(`context.zigzag_attention_masked`) sends that mask to SDPA, which on CUDA goes straight to
FlashAttention-2 (torch's CausalBias dispatch), while plain causal SDPA on sm90 with torch >= 2.9
prefers cuDNN (not yet confirmed by a profile; scripts/gpu_check.py checks): CP attention
measured 0.58-0.64 of plain attention on an H200. Here every chunk is cut into pieces that need
no mask at all:

- the diagonal block: queries of chunk n against keys [n·C, (n+1)·C), plain `is_causal` (the
  block is square, so top-left and lower-right alignment agree);
- the prefix (n > 0): queries of chunk n against keys [0, n·C), not causal: every query sees
  every key.

Merge. Each piece returns its output o_i and log-sum-exp l_i (per query row, fp32). The chunk's
attention is the softmax over the union of the pieces' keys:
    l = logaddexp(l_diag, l_prefix),  o = Σ_i exp(l_i - l) · o_i         (in fp32, then cast)

Backward. The flash-attention backward of a piece needs P = exp(S - L) and D = rowsum(dO ∘ O).
Given the merged O and L instead of the piece's own, P is exactly that piece's block of the full
softmax and D is the full row's, so each piece's (dq, dk, dv) is its share of the exact
gradient: dq of a chunk is the sum over its pieces, dK/dV of the gathered sequence the sum over
all pieces touching each key (the all-gather's backward then reduce-scatters them). The fused
backward kernels take (dO, q, k, v, O, L) as arguments, so they are called with the merged ones.

GQA without copying the gathered K/V. The prefix is not causal, so the G query heads sharing one K/V head
can be stacked along the sequence: q [B, Hkv·G, C, D] is read as [B, Hkv, G·C, D], and the
kernel sees as many heads as K/V have. The diagonal is causal (a row's mask depends on its
position), so its C-token K/V slice is repeated to the query heads; dK/dV sum the repeats back.

Kernels, chosen per call by `piece_backend` (the model's `sdpa.CUDA_BACKEND_ORDER`, restricted
to kernels that return the LSE and honouring what `sdpa_kernel` has switched off):
- CUDA: cuDNN (`_scaled_dot_product_cudnn_attention`, LSE [B, H, S, 1]), then FlashAttention-2
  (`_scaled_dot_product_flash_attention`, LSE [B, H, S]), with their `*_backward` ops. The
  memory-efficient kernel is left out (its LSE is padded to multiples of 32 rows); on sm80+ in
  bf16/fp16 with head dims up to 256, one of the two above takes every piece;
- CPU: `_scaled_dot_product_flash_attention_for_cpu` and its backward (exact in fp32; also
  what fake-tensor traces run, since both have meta kernels);
- anywhere else, or for inputs no fused kernel takes (fp32 on CUDA, odd head sizes): an exact
  math piece that materialises the piece's [C, keys] scores.

Memory saved per layer (what launcher/estimate models): q, K and V, the merged output and an
fp32 LSE per head and token; no piece keeps its own output. The merged output is laid out
[B, S, H, D] so that the model's transpose + reshape into wo's input is a view, not a second copy.
Given the whole sequence's K/V, the call saves them. Given the rank's own K/V and a `KVGather`
(`gather=`), it gathers them itself and saves only the rank's share: its backward gathers them
again and reduce-scatters dK/dV, as Megatron-Core's sequence-parallel linears re-gather their
input in backward (megatron/core/tensor_parallel/layers.py,
LinearWithGradAccumulationAndAsyncCommunication) and TE's ring attention sends K/V round the
ring again in backward. A layer then keeps 1/c of the gathered K/V until its backward, for one
more K/V all-gather per layer; the whole sequence's K/V exist only inside one layer's forward
and backward.

    lse_merged_attention(q, k_full, v_full, chunk_ids)          # [B, H, len(chunk_ids)·C, D]
    lse_merged_attention(q, k, v, chunk_ids, gather=kv_gather)   # K/V regathered in backward
    lse_merged_attention(..., backend="flash")                   # pin one kernel
    piece_backend(q)                                              # the kernel a call would use

`chunk_ids` are the global indices of the rank's query chunks (zigzag: (rank, 2·size-1-rank)).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch.nn.attention import SDPBackend

from entrypoints.model.sdpa import enabled_cuda_backends

aten = torch.ops.aten

BACKENDS = ("cudnn", "flash", "cpu", "math")
_CUDA_KERNELS = {SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.FLASH_ATTENTION: "flash"}


class Piece(NamedTuple):
    """One kernel call: queries q [B, h, Sq, D] against k, v [B, h, Sk, D]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool


# --- the kernels: forward -> (out, lse [B, h, Sq] fp32, state for backward) -------------------


def _cpu_forward(p: Piece, scale: float):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(p.q, p.k, p.v, 0.0, p.causal, scale=scale)
    return out, lse, ()


def _cpu_backward(p: Piece, dout, out, lse, state, scale: float):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, p.q, p.k, p.v, out, lse, 0.0, p.causal, scale=scale
    )


def _flash_forward(p: Piece, scale: float):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        p.q, p.k, p.v, 0.0, p.causal, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(p: Piece, dout, out, lse, state, scale: float):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return aten._scaled_dot_product_flash_attention_backward(
        dout, p.q, p.k, p.v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, p.causal, seed, offset, scale=scale
    )


def _cudnn_forward(p: Piece, scale: float):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        p.q, p.k, p.v, None, True, 0.0, p.causal, False, scale=scale
    )
    return out, lse.view(lse.shape[:3]), (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(p: Piece, dout, out, lse, state, scale: float):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    # None stands for the undefined attention-bias tensor the forward was given.
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, p.q, p.k, p.v, out, lse.unsqueeze(-1), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0,
        p.causal, scale=scale,
    )  # fmt: skip


def _math_scores(p: Piece, scale: float) -> torch.Tensor:
    scores = (p.q.float() @ p.k.float().transpose(-1, -2)) * scale
    if p.causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _math_forward(p: Piece, scale: float):
    scores = _math_scores(p, scale)
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse[..., None]).exp() @ p.v.float()
    return out.to(p.q.dtype), lse, ()


def _math_backward(p: Piece, dout, out, lse, state, scale: float):
    probs = (_math_scores(p, scale) - lse[..., None]).exp()  # this piece's block of the full softmax
    dout = dout.float()
    dv = probs.transpose(-1, -2) @ dout
    row_dot = (dout * out.float()).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O) of the merged output
    dscores = probs * (dout @ p.v.float().transpose(-1, -2) - row_dot) * scale
    dq, dk = dscores @ p.k.float(), dscores.transpose(-1, -2) @ p.q.float()
    return dq.to(p.q.dtype), dk.to(p.k.dtype), dv.to(p.v.dtype)


_KERNELS = {
    "cudnn": (_cudnn_forward, _cudnn_backward),
    "flash": (_flash_forward, _flash_backward),
    "cpu": (_cpu_forward, _cpu_backward),
    "math": (_math_forward, _math_backward),
}


def piece_backend(q: torch.Tensor) -> str:
    """The kernel the pieces of q's attention run on: see the module docstring for the order."""
    if q.device.type == "cpu":
        return "cpu"
    # The fused CUDA ops take head dims in multiples of 8 (SDPA pads others before calling them).
    if q.device.type != "cuda" or q.shape[-1] % 8:
        return "math"
    # Representative pieces: a local chunk's queries as they are laid out, causal and not.
    probe = q[:, :, : q.shape[2] // 2]
    params = [torch.backends.cuda.SDPAParams(probe, probe, probe, None, 0.0, causal, False) for causal in (True, False)]
    checks = {
        "cudnn": torch.backends.cuda.can_use_cudnn_attention,
        "flash": torch.backends.cuda.can_use_flash_attention,
    }
    for backend in enabled_cuda_backends():
        name = _CUDA_KERNELS.get(backend)
        if name is not None and all(checks[name](p, False) for p in params):
            return name
    return "math"


# --- pieces and their merge -------------------------------------------------------------------


def _stack_groups(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hkv·G, C, ...] -> [B, Hkv, G·C, ...]: a K/V head's G query heads one after another."""
    return x.reshape(x.shape[0], kv_heads, -1, *x.shape[3:])


def _unstack_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `_stack_groups`."""
    return x.reshape(x.shape[0], heads, -1, *x.shape[3:])


def _chunk_pieces(q_chunk: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor, n: int) -> list[Piece]:
    """Chunk n's diagonal piece, then its prefix piece (none for chunk 0)."""
    chunk, kv_heads = q_chunk.shape[2], k_full.shape[1]
    group = q_chunk.shape[1] // kv_heads
    start = n * chunk
    k_diag, v_diag = k_full[:, :, start : start + chunk], v_full[:, :, start : start + chunk]
    if group > 1:
        k_diag, v_diag = k_diag.repeat_interleave(group, dim=1), v_diag.repeat_interleave(group, dim=1)
    pieces = [Piece(q_chunk, k_diag, v_diag, causal=True)]
    if n > 0:
        pieces.append(Piece(_stack_groups(q_chunk, kv_heads), k_full[:, :, :start], v_full[:, :, :start], causal=False))
    return pieces


def _merge(results: list, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's output (fp32) and LSE from its pieces' (out, lse, state)."""
    outs = [_unstack_groups(out, heads).float() for out, _, _ in results]
    lses = [_unstack_groups(lse, heads).float() for _, lse, _ in results]
    if len(outs) == 1:
        return outs[0], lses[0]
    lse = torch.logaddexp(lses[0], lses[1])
    out = outs[0] * (lses[0] - lse).exp().unsqueeze(-1) + outs[1] * (lses[1] - lse).exp().unsqueeze(-1)
    return out, lse


class KVGather(Protocol):
    """The context-parallel group's K/V collectives, outside autograd (parallel/context.py)."""

    def full(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, 2C, D] of this rank -> [B, Hkv, S, D] of the whole sequence, in natural order."""
        ...

    def reduce(self, x_full: torch.Tensor) -> torch.Tensor:
        """The gradient of `full`: [B, Hkv, S, D] summed over the group, this rank's [B, Hkv, 2C, D]."""
        ...


class _LseMergedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, chunk_ids: tuple[int, ...], backend: str, gather: KVGather | None):
        k_full, v_full = (k, v) if gather is None else (gather.full(k), gather.full(v))
        forward_kernel = _KERNELS[backend][0]
        batch, heads, local, head_dim = q.shape
        scale = head_dim**-0.5
        # [B, S, H, D] in memory: the model's transpose back to [B, S, H·D] is then a view.
        out = q.new_empty(batch, local, heads, head_dim).transpose(1, 2)
        lse = q.new_empty(batch, heads, local, dtype=torch.float32)
        states = []
        for q_chunk, out_chunk, lse_chunk, n in _chunks(q, out, lse, chunk_ids):
            results = [forward_kernel(piece, scale) for piece in _chunk_pieces(q_chunk, k_full, v_full, n)]
            merged_out, merged_lse = _merge(results, heads)
            out_chunk.copy_(merged_out)
            lse_chunk.copy_(merged_lse)
            states.append([state for _, _, state in results])
        # Under `gather` the rank's own K/V are saved; the gathered ones die with this frame.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunk_ids, ctx.backend, ctx.scale, ctx.states, ctx.gather = chunk_ids, backend, scale, states, gather
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        gather = ctx.gather
        k_full, v_full = (k, v) if gather is None else (gather.full(k), gather.full(v))
        dq, dk, dv = _backward_pieces(ctx, dout, q, k_full, v_full, out, lse)
        del k_full, v_full
        if gather is not None:
            dk, dv = gather.reduce(dk), gather.reduce(dv)
        return dq, dk, dv, None, None, None


def _backward_pieces(ctx, dout, q, k_full, v_full, out, lse):
    """(dq, dK, dV of the whole sequence): every piece's backward with the merged output and LSE."""
    backward_kernel = _KERNELS[ctx.backend][1]
    heads, kv_heads = q.shape[1], k_full.shape[1]
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k_full), torch.zeros_like(v_full)
    for (q_chunk, out_chunk, lse_chunk, n), dout_chunk, dq_chunk, states in zip(
        _chunks(q, out, lse, ctx.chunk_ids), dout.chunk(len(ctx.chunk_ids), dim=2),
        dq.chunk(len(ctx.chunk_ids), dim=2), ctx.states, strict=True,
    ):  # fmt: skip
        diag, *prefix = _chunk_pieces(q_chunk, k_full, v_full, n)
        chunk, start = q_chunk.shape[2], n * q_chunk.shape[2]
        # Each piece's backward with the merged output and LSE: its share of the exact gradient.
        args = (dout_chunk.contiguous(), out_chunk.contiguous(), lse_chunk.contiguous())
        dq_diag, dk_diag, dv_diag = backward_kernel(diag, *args, states[0], ctx.scale)
        dq_chunk.copy_(dq_diag)
        dk[:, :, start : start + chunk] += dk_diag.unflatten(1, (kv_heads, -1)).sum(2)
        dv[:, :, start : start + chunk] += dv_diag.unflatten(1, (kv_heads, -1)).sum(2)
        if prefix:
            stacked = [_stack_groups(t, kv_heads).contiguous() for t in args]
            dq_prefix, dk_prefix, dv_prefix = backward_kernel(prefix[0], *stacked, states[1], ctx.scale)
            dq_chunk.add_(_unstack_groups(dq_prefix, heads))
            dk[:, :, :start] += dk_prefix
            dv[:, :, :start] += dv_prefix
    return dq, dk, dv


def _chunks(q, out, lse, chunk_ids):
    """Per local chunk: its queries, output rows, LSE rows and global chunk index."""
    parts = len(chunk_ids)
    return zip(q.chunk(parts, dim=2), out.chunk(parts, dim=2), lse.chunk(parts, dim=2), chunk_ids, strict=True)


def lse_merged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk_ids: tuple[int, ...],
    *,
    backend: str | None = None,
    gather: KVGather | None = None,
) -> torch.Tensor:
    """Causal attention of q's chunks (global chunk indices `chunk_ids`) over the whole K/V.

    q: [B, H, len(chunk_ids)·C, D]; k, v: [B, Hkv, S, D] of the whole sequence in natural order,
    or with `gather` this rank's [B, Hkv, len(chunk_ids)·C, D], which `gather.full` makes whole
    (in forward, and again in backward). Hkv divides H. Returns [B, H, len(chunk_ids)·C, D].
    `backend` pins one of BACKENDS; by default `piece_backend(q)`.
    """
    backend = backend or piece_backend(q)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if q.shape[2] % len(chunk_ids) or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q {tuple(q.shape)} does not split into {len(chunk_ids)} chunks or into groups of K/V's {k.shape[1]} heads"
        )
    if gather is None and k.shape[2] < (max(chunk_ids) + 1) * (q.shape[2] // len(chunk_ids)):
        raise ValueError(f"K/V hold {k.shape[2]} tokens, fewer than chunks {chunk_ids} of q reach")
    if gather is not None and k.shape[2] != q.shape[2]:
        raise ValueError(f"K/V to gather hold {k.shape[2]} tokens; this rank's q holds {q.shape[2]}")
    return _LseMergedAttention.apply(q, k, v, tuple(chunk_ids), backend, gather)
