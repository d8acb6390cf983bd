"""Document masking for packed sequences: attention stays inside each document.

A packed sequence holds several documents, each ended by a separator token (EOS). With
`data.document_masking` every query attends only to keys of its own document at or before it
(a block-diagonal causal mask), so a document trains exactly as if it ran on its own; with
`data.document_positions: restart` its RoPE positions start at 0 too.

    documents = document_ids(tokens, separator)          # [B, S] over the FULL sequence (data loader)
    loss = model(tokens, targets=targets, documents=documents)
    mask = DocumentMask(documents)                       # built once per forward by the model
    out = mask.attend(q, k, v, q_start=0, enable_gqa=True)

Every attention path calls `attend` with queries of one contiguous position range
[q_start, q_start + Lq) and keys [0, Lk) in natural order: the plain path and Ulysses with the
whole sequence, the all-gather context-parallel path once per zigzag chunk. The data loader
therefore passes the whole sequence's document ids to every context-parallel rank (one int32
per token, small next to any activation), and no rank needs another's.

Kernels: on CUDA, `flex_attention` with a block mask (compiled; it skips the blocks outside the
mask, and no S x S tensor exists); elsewhere SDPA with an explicit additive [B, 1, Lq, Lk] mask in
the compute dtype, built once per forward and query range and shared by every layer (what the
memory estimator counts on the CPU: launcher/estimate/fsdp.py `document_mask_bytes`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_ids(tokens: torch.Tensor, separator: int) -> torch.Tensor:
    """[B, S] int32: the index of the document each token belongs to; a separator belongs to the
    document it ends."""
    ends = (tokens == separator).to(torch.int32)
    return (ends.cumsum(dim=-1, dtype=torch.int32) - ends).to(torch.int32)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """[B, S] int64: each token's position within its document (0 at every document's start)."""
    index = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def default_kernel(device: torch.device) -> str:
    return "flex" if device.type == "cuda" else "sdpa"


class DocumentMask:
    """The documents of one micro-batch, and the masks built from them (cached per query range,
    so the layers of one forward, and their recomputation under checkpointing, share one)."""

    def __init__(self, documents: torch.Tensor, *, kernel: str | None = None):
        self.documents = documents
        self.kernel = kernel or default_kernel(documents.device)
        self._masks: dict[tuple, object] = {}

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_start: int, enable_gqa: bool
    ) -> torch.Tensor:
        """Causal attention within documents. q [B, H, Lq, D] at positions [q_start, q_start + Lq);
        k, v [B, Hkv, Lk, D] at positions [0, Lk)."""
        key = (q_start, q.shape[2], k.shape[2], q.dtype)
        mask = self._masks.get(key)
        if self.kernel == "flex":
            if mask is None:
                mask = self._masks[key] = self._block_mask(*key[:3])
            return _flex_attention(q.device)(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
        if mask is None:
            # Additive, in the compute dtype: SDPA saves this one tensor for every layer's
            # backward, where a boolean mask would be converted (and saved) once per layer.
            visible = self.boolean_mask(*key[:3])
            mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
            self._masks[key] = mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)

    def boolean_mask(self, q_start: int, q_len: int, k_len: int) -> torch.Tensor:
        """[B, 1, Lq, Lk]: key j is visible to query i when j <= i and both share a document."""
        device = self.documents.device
        q_pos = torch.arange(q_start, q_start + q_len, device=device)
        k_pos = torch.arange(k_len, device=device)
        causal = k_pos[None, :] <= q_pos[:, None]
        same = self.documents[:, q_start : q_start + q_len, None] == self.documents[:, None, :k_len]
        return (causal[None] & same)[:, None]

    def _block_mask(self, q_start: int, q_len: int, k_len: int):
        from torch.nn.attention.flex_attention import create_block_mask

        documents = self.documents

        def same_document_causal(b, h, q_idx, kv_idx):
            q_pos = q_idx + q_start
            return (kv_idx <= q_pos) & (documents[b, q_pos] == documents[b, kv_idx])

        return create_block_mask(same_document_causal, documents.shape[0], None, q_len, k_len, device=documents.device)


_COMPILED_FLEX = None


def _flex_attention(device: torch.device):
    """flex_attention, compiled on CUDA (eager flex materialises the scores); eager elsewhere,
    which the CPU tests use to check the mask function against the boolean masks."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX
