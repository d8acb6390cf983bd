"""Context parallelism: the sequence is split over the `cp` ranks, written for gloo and nccl.

torch's experimental `context_parallel` runs only the CUDA flash/efficient kernels, so this
module does it by hand:

- Load balancing ("zigzag"): the sequence is cut into 2c chunks; rank i of c holds chunks i and
  2c-1-i, so every rank has the same amount of causal attention work. `zigzag_positions` gives
  the global token positions a rank holds; the data loader, RoPE and the causal mask all use them.
- Attention: every rank all-gathers K and V over the cp group (after RoPE), and dK/dV are
  reduce-scattered back in backward. Each local query chunk n
  (global positions [n·C, (n+1)·C)) then attends to the key prefix [0, (n+1)·C):
  - `zigzag_attention` (what training runs): per chunk a non-causal piece against keys
    [0, n·C) and a causal piece against the diagonal block, fused kernels merged by their
    log-sum-exps, with its own backward (parallel/cp_attention.py);
  - `zigzag_attention_masked`: one SDPA call per chunk with a lower-right-aligned causal mask.
    Kept as the reference the fast path is compared with, and as the base of masks that are not
    purely causal. On CUDA the lower-right mask goes to FlashAttention-2
    (`_scaled_dot_product_flash_attention` with is_causal, which is bottom-right aligned); on
    CPU torch materialises it as a bool [C, (n+1)·C] mask.

Memory per layer and rank (what the estimator models). A block that keeps its activations for
backward (not checkpointed) saves only its own K/V: `zigzag_attention` gathers them inside
its autograd function (`KVGather` below) and again in backward, so the whole sequence's K/V,
2·s·kv_dim_local elements, exist only within one layer's attention forward and backward. A
checkpointed block runs its forward again in backward, so it lets autograd keep the gathered
K/V of that recomputation instead of gathering a third time; so does document masking's
masked path (the all-gather of `collectives.py`, whose backward reduce-scatters dK/dV). While
gathering, the raw rank-ordered buffer and the reordered copy coexist briefly.

    apply_context_parallel(model, cp_mesh, checkpointed={1, 3})   # called by parallelize()
    zigzag_positions(seq_len, rank, size)             # LongTensor [seq_len // size]
    shard_sequence(x, dim, rank, size)                # the rank's two chunks of x, concatenated
    zigzag_attention_masked(q, k_full, v_full, rank, size)   # the per-rank kernel, gathered K/V given

`parallel.cp_attention: ulysses` replaces the all-gather with all-to-alls over heads
(parallel/ulysses.py); `apply_context_parallel` installs whichever the config names. With
document masking (model/documents.py) each zigzag chunk attends through the document mask.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from entrypoints.model.documents import DocumentMask
from entrypoints.parallel.collectives import all_gather, all_gather_autograd, reduce_scatter_sum
from entrypoints.parallel.cp_attention import KVGather, lse_merged_attention


def zigzag_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two chunk indices (of 2·size) that `rank` holds."""
    return rank, 2 * size - 1 - rank


def zigzag_positions(seq_len: int, rank: int, size: int) -> torch.Tensor:
    """Global positions of the tokens a cp rank holds, in the order it holds them."""
    if seq_len % (2 * size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context parallel {size}")
    chunk = seq_len // (2 * size)
    first, second = zigzag_chunks(rank, size)
    ranges = [torch.arange(c * chunk, (c + 1) * chunk, device="cpu") for c in (first, second)]
    return torch.cat(ranges)


def shard_sequence(x: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """The rank's zigzag share of `x` along `dim` (contiguous)."""
    if size == 1:
        return x
    chunks = x.chunk(2 * size, dim=dim)
    first, second = zigzag_chunks(rank, size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Natural order from every rank's zigzag share (parts[r] from rank r)."""
    size = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [halves[j][0] for j in range(size)] + [halves[2 * size - 1 - j][1] for j in range(size, 2 * size)]
    return torch.cat(ordered, dim=dim)


def zigzag_attention(
    q: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    rank: int,
    size: int,
    *,
    enable_gqa: bool = False,
    backend: str | None = None,
    gather: KVGather | None = None,
) -> torch.Tensor:
    """Causal attention of a rank's two query chunks against the whole sequence's K/V.

    q: [B, H, 2C, D] (the rank's zigzag chunks); k_full, v_full: [B, Hkv, 2·size·C, D] in
    natural order, or with `gather` the rank's own [B, Hkv, 2C, D] (gathered in forward and
    again in backward). Returns [B, H, 2C, D]. LSE-merged fused pieces (cp_attention.py); the
    K/V head count comes from the shapes, `enable_gqa` is accepted for SDPA's signature.
    `backend` pins a kernel of cp_attention.BACKENDS.
    """
    if not enable_gqa and q.shape[1] != k_full.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads and {k_full.shape[1]} K/V heads need enable_gqa=True")
    return lse_merged_attention(q, k_full, v_full, zigzag_chunks(rank, size), backend=backend, gather=gather)


def zigzag_attention_masked(
    q: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    rank: int,
    size: int,
    *,
    enable_gqa: bool = False,
    documents: DocumentMask | None = None,
) -> torch.Tensor:
    """Causal attention of a rank's two query chunks against the whole sequence's K/V, one
    masked SDPA call per chunk: the path for document masking, and the reference.

    q: [B, H, 2C, D] (the rank's zigzag chunks); k_full, v_full: [B, Hkv, 2·size·C, D] in
    natural order. Returns [B, H, 2C, D]. With `documents`, attention also stays in each document.
    """
    chunk = q.shape[2] // 2
    outputs = []
    for n, q_chunk in zip(zigzag_chunks(rank, size), q.split(chunk, dim=2), strict=True):
        kv_len = (n + 1) * chunk
        k, v = k_full[:, :, :kv_len], v_full[:, :, :kv_len]
        if documents is not None:
            out = documents.attend(q_chunk, k, v, q_start=n * chunk, enable_gqa=enable_gqa)
        elif n == 0:
            out = F.scaled_dot_product_attention(q_chunk, k, v, is_causal=True, enable_gqa=enable_gqa)
        else:
            mask = causal_lower_right(chunk, kv_len)
            out = F.scaled_dot_product_attention(q_chunk, k, v, attn_mask=mask, enable_gqa=enable_gqa)
        outputs.append(out)
    return torch.cat(outputs, dim=2)


class ContextParallelAttention:
    """Replaces SDPA inside `Attention` when cp > 1; holds the cp group and this rank's place.

    `regather`: keep only this rank's K/V for backward and gather them again there (a block
    that is not checkpointed); else autograd keeps the gathered K/V (a checkpointed block)."""

    def __init__(self, cp_mesh, *, regather: bool = True):
        self.mesh = cp_mesh
        self.rank = cp_mesh.get_local_rank()
        self.size = cp_mesh.size()
        self.regather = regather

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        enable_gqa: bool,
        documents: DocumentMask | None = None,
    ) -> torch.Tensor:
        if documents is None and self.regather:
            return zigzag_attention(q, k, v, self.rank, self.size, enable_gqa=enable_gqa, gather=self)
        k_full, v_full = self.gather(k), self.gather(v)
        if documents is None:
            return zigzag_attention(q, k_full, v_full, self.rank, self.size, enable_gqa=enable_gqa)
        # The fused pieces take no mask: document masking runs the masked kernel.
        return zigzag_attention_masked(
            q, k_full, v_full, self.rank, self.size, enable_gqa=enable_gqa, documents=documents
        )

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, 2C, D] zigzag-local -> [B, H, 2·size·C, D] in natural order (autograd)."""
        # Gather along a new leading dim (no copy inside the collective), then put the 2·size
        # chunks in order with one concatenation.
        gathered = all_gather_autograd(x.unsqueeze(0), dim=0, group=self.mesh)
        return unshard_sequence(list(gathered.unbind(0)), dim=2)

    # KVGather, for zigzag_attention's own backward:

    def full(self, x: torch.Tensor) -> torch.Tensor:
        """`gather` outside autograd."""
        gathered = all_gather(x.unsqueeze(0), dim=0, group=self.mesh)
        return unshard_sequence(list(gathered.unbind(0)), dim=2)

    def reduce(self, x_full: torch.Tensor) -> torch.Tensor:
        """dK or dV of the whole sequence -> this rank's share, summed over the group (the
        gradient `gather` gets from autograd)."""
        shares = torch.stack([shard_sequence(x_full, 2, rank, self.size) for rank in range(self.size)])
        return reduce_scatter_sum(shares, dim=0, group=self.mesh).squeeze(0)


def apply_context_parallel(model, cp_mesh, attention=None, *, checkpointed: Collection[int] = ()) -> None:
    """Shard the model's sequence over `cp_mesh`: RoPE positions and every attention layer.

    attention: what every layer calls, per `parallel.cp_attention`: the all-gather above (None)
    or `ulysses.UlyssesAttention` (parallelize.py picks; ulysses.py builds on this module).
    checkpointed: the layer ids activation checkpointing will wrap; under the all-gather their
    attention keeps the gathered K/V, every other layer's gathers them again in backward.
    """
    rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
    model.set_positions(zigzag_positions(model.seq_len, rank, size))
    if attention is not None:
        for block in model.layers.values():
            block.attention.context_parallel = attention
        return
    regathering, keeping = ContextParallelAttention(cp_mesh), ContextParallelAttention(cp_mesh, regather=False)
    for key, block in model.layers.items():
        block.attention.context_parallel = keeping if int(key) in checkpointed else regathering
