"""Fused output projection + cross-entropy that never materialises the full logits.

    loss = linear_cross_entropy(h, weight, targets)                 # h [N, D], weight [V, D]
    loss = linear_cross_entropy(h, weight, targets, tp_mesh=tp)     # weight a DTensor, Shard(0) on tp

With V = 128256 at 128K tokens, fp32 logits are 16.8 GB per rank even at cp 4, and the start
of an unfused backward holds two of them. Here the tokens are processed in chunks:

- forward: per chunk, logits = h_c @ W^T in the compute dtype, upcast to fp32, reduced to the
  log-sum-exp and the target logit, then dropped. Saved for backward: h, W (the same tensors
  nn.Linear would save) and one fp32 log-sum-exp per token (4·N bytes).
- backward: the chunk's logits are recomputed and turned into dlogits = softmax - onehot, which
  gives dh_c = dlogits @ W and accumulates dW += dlogits^T @ h_c (in W's dtype, as Liger does).
  This costs one extra output-projection GEMM (about 2% of a step for Llama 3 8B) instead of
  keeping any N x V tensor alive.

The chunk size keeps one chunk of fp32 logits about as large as h itself, chunks = ceil(V_local
/ D), but never below 1024 tokens (smaller GEMMs waste the GPU). The transient peak is one chunk
of fp32 logits, chunk·V_local·4 bytes = max(N·D, 1024·V_local)·4 (plus half that for the
compute-dtype matmul output), whatever the sequence length.

Vocab-parallel (tensor parallel): each TP rank holds V/tp rows of W. The log-sum-exp and the
target logit are combined across the TP group with three all-reduces of N floats; dh is a
partial sum over vocab shards, which the sequence all-gather's backward (a reduce-scatter)
sums. With sequence parallel the caller's h is the local [B, S/tp, D] slice and is all-gathered
here along the sequence before the projection.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from entrypoints.parallel.collectives import all_gather_autograd
from launcher.contract.loss import MIN_CHUNK_TOKENS, chunk_tokens


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_mesh=None,
    min_chunk_tokens: int = MIN_CHUNK_TOKENS,
) -> torch.Tensor:
    """Mean cross-entropy of softmax(h @ weight^T) against targets, over every token."""
    vocab_start, group = 0, None
    if tp_mesh is not None:
        h = all_gather_autograd(h, dim=1, group=tp_mesh)
        group = tp_mesh.get_group()
    if isinstance(weight, DTensor):
        _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        vocab_start = offset[0]
        weight = weight.to_local()
    hidden = h.shape[-1]
    h, targets = h.reshape(-1, hidden), targets.reshape(-1)
    chunk = chunk_tokens(h.shape[0], hidden, weight.shape[0], min_tokens=min_chunk_tokens)
    return _LinearCrossEntropy.apply(h, weight, targets, vocab_start, group, chunk)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, vocab_start, group, chunk):
        n, vocab_local = h.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        target_logit = torch.empty(n, dtype=torch.float32, device=h.device)
        local_targets = targets - vocab_start
        owned = (local_targets >= 0) & (local_targets < vocab_local)
        index = torch.where(owned, local_targets, 0).unsqueeze(1)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = (h[start:end] @ weight.t()).float()
            lse[start:end] = torch.logsumexp(logits, dim=-1)
            target_logit[start:end] = logits.gather(1, index[start:end]).squeeze(1)
            del logits
        target_logit = torch.where(owned, target_logit, 0.0)
        if group is not None:
            # log(sum_r exp(lse_r)) computed stably across the vocab shards.
            peak = funcol.all_reduce(lse, "max", group)
            total = funcol.all_reduce(torch.exp(lse - peak), "sum", group)
            lse = peak + torch.log(total)
            target_logit = funcol.all_reduce(target_logit, "sum", group)
        ctx.save_for_backward(h, weight, index, owned, lse)
        ctx.chunk = chunk
        return (lse - target_logit).mean()

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, index, owned, lse = ctx.saved_tensors
        n, chunk = h.shape[0], ctx.chunk
        scale = grad_loss.float() / n
        grad_h = torch.empty_like(h)
        grad_weight = torch.zeros_like(weight)
        minus_one = torch.where(owned, -1.0, 0.0).unsqueeze(1)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h_c = h[start:end]
            dlogits = torch.exp((h_c @ weight.t()).float() - lse[start:end].unsqueeze(1))
            dlogits.scatter_add_(1, index[start:end], minus_one[start:end])
            dlogits = (dlogits * scale).to(h.dtype)
            grad_h[start:end] = dlogits @ weight
            grad_weight.addmm_(dlogits.t(), h_c)
            del dlogits
        return grad_h, grad_weight, None, None, None, None
