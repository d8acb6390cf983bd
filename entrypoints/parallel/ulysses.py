"""Ulysses context parallelism: attention on the whole sequence for 1/cp of the heads.

`parallel.cp_attention: ulysses`. Each cp rank holds its zigzag share of the sequence
(context.py) for every head it has after tensor parallelism. Per attention layer:

1. one all-to-all each for q, k and v turns [B, H, S/c, D] (zigzag share, all heads) into
   [B, H/c, S, D] (the whole sequence in natural order, head group `rank`): rank j sends head
   group i of its share to rank i, and the received shares are put in order with
   `unshard_sequence`;
2. plain causal SDPA on that (or the document mask, model/documents.py) - the fastest causal
   kernel, with no partial blocks;
3. one all-to-all turns the output back into [B, H, S/c, D].

The all-to-all is `_functional_collectives.all_to_all_single_autograd`, whose backward is the
inverse all-to-all; it runs on gloo for fp32, bf16 and fp64 (checked on torch 2.13), so no
all-gather fallback is needed. GQA: query head group i uses KV head group i, which holds exactly
the KV heads those queries read, because both counts are divisible by cp (the rule in
`launcher.contract.layout.ulysses_fits`).

Memory per layer and rank (what the estimator models): SDPA saves q, k, v and the output for
H/c heads of the whole sequence, the same number of elements as the local q, k, v and output
they replace, so nothing grows with cp (the all-gather path holds K/V of the whole sequence
within each layer's attention, and keeps them where a layer is recomputed). One more copy of the
output is kept: the inverse all-to-all returns [B, H, S/c, D], which the attention's
transpose(1, 2).reshape copies into wo's input, and wo saves that copy beside SDPA's own (a
float8 cast of it under the Float8 TP styles, parallel/tensor.py).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from entrypoints.model.documents import DocumentMask
from entrypoints.model.sdpa import causal_attention
from entrypoints.parallel.context import shard_sequence, unshard_sequence


def _all_to_all(parts: torch.Tensor, group) -> torch.Tensor:
    """parts [size, ...]: part i goes to rank i; returns [size, ...] with part j from rank j."""
    return funcol.all_to_all_single_autograd(parts.contiguous(), None, None, group)


class UlyssesAttention:
    """Replaces SDPA inside `Attention` when cp > 1 and cp_attention is ulysses."""

    def __init__(self, cp_mesh):
        self.mesh = cp_mesh
        self.rank = cp_mesh.get_local_rank()
        self.size = cp_mesh.size()

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        enable_gqa: bool,
        documents: DocumentMask | None = None,
    ) -> torch.Tensor:
        q_full, k_full, v_full = (self.sequence_from_heads(x) for x in (q, k, v))
        if documents is not None:
            out = documents.attend(q_full, k_full, v_full, q_start=0, enable_gqa=enable_gqa)
        else:
            out = causal_attention(q_full, k_full, v_full, enable_gqa=enable_gqa)  # the pinned backend order
        return self.heads_from_sequence(out)

    def sequence_from_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, S/c, D] zigzag share of all heads -> [B, H/c, S, D] whole sequence of head group `rank`."""
        heads = x.shape[1]
        if heads % self.size:
            raise ValueError(f"ulysses: {heads} heads on this rank do not split over context parallel {self.size}")
        parts = x.unflatten(1, (self.size, heads // self.size)).movedim(1, 0)
        received = _all_to_all(parts, self.mesh)
        return unshard_sequence(list(received.unbind(0)), dim=2)

    def heads_from_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse: [B, H/c, S, D] -> [B, H, S/c, D] (this rank's zigzag share, all heads)."""
        parts = torch.stack([shard_sequence(x, 2, j, self.size) for j in range(self.size)])
        received = _all_to_all(parts, self.mesh)
        return received.movedim(0, 1).flatten(1, 2)
