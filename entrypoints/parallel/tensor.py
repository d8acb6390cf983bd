"""Tensor parallel + sequence parallel with DTensor `parallelize_module` plans (Megatron style).

    apply_tensor_parallel(model, tp_mesh, float8_styles=False)

Between blocks the residual stream is sequence-sharded: each TP rank holds [B, S/tp, D] as a
plain local tensor. Per block:
- attention_norm / ffn_norm: SequenceParallel (norms run on the local sequence slice), and
  Qwen3's q_norm / k_norm on the local heads (their weights' gradients summed over tp);
- attention / feed_forward inputs: all-gathered along the sequence (Shard(1) -> Replicate);
- wq, wk, wv, w1, w3: ColwiseParallel (heads / ffn columns split over tp);
- wo, w2: RowwiseParallel whose output is reduce-scattered back to Shard(1).
The embedding is vocabulary-parallel (`VocabParallelEmbedding`, Megatron's) with a Shard(1)
output; the final norm is SequenceParallel; the output weight is ColwiseParallel (vocab rows
split over tp) and the loss is vocab-parallel (model/loss.py), so no rank holds logits or
gradients for the whole vocabulary.

A mixture-of-experts block's MLP runs on the rank's own sequence slice, with no collective over
tp: each tp rank routes its own tokens, sends their copies to the experts (over the expert mesh,
whose groups span tp: parallel/expert.py) and gets its slice of the output back. That is
Megatron-Core's sequence-parallel MoE with expert_tensor_parallel_size 1 (its router's weight is
marked `sequence_parallel`, megatron/core/transformer/moe/router.py, so its gradient is summed
over tp); torchtitan's etp = 1 gathers the sequence and splits the routed copies over tp instead
(`ReordererSequenceParallel`, torchtitan/distributed/expert_parallel.py), the same work after an
all-gather and before a reduce-scatter this layout does without. The router and any shared
experts are replicated over tp and run as `SequenceParallel` on the rank's rows (dim 0 of the
flattened tokens): DTensor sums their weights' gradients over tp, as it does the norms'.

`float8_styles` swaps in torchao's Float8 Colwise/Rowwise styles, which all-gather activations
in float8; only backends with float8 collectives (nccl) take them.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from entrypoints.model.llama import FeedForward
from entrypoints.parallel.regather import regathering


def apply_tensor_parallel(
    model, tp_mesh, *, float8_styles: bool = False, saved_inputs: str = "gathered", checkpointed: Collection[int] = ()
) -> None:
    """`saved_inputs`: what the gathered attention and MLP inputs leave for backward ("gathered",
    or "shard": regather.py), in every block whose layer id is not in `checkpointed`."""
    if float8_styles:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel as Colwise,
        )
        from torchao.float8.float8_tensor_parallel import (
            Float8RowwiseParallel as Rowwise,
        )
        from torchao.float8.float8_tensor_parallel import (
            PrepareFloat8ModuleInput as PrepareInput,
        )
    else:
        Colwise, Rowwise, PrepareInput = ColwiseParallel, RowwiseParallel, PrepareModuleInput

    root_plan = {}
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, tp_mesh)
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel(use_local_output=True)
        # Only the weight's sharding is used: the loss reads `output.weight` directly.
        if model.output is not None:
            root_plan["output"] = ColwiseParallel()
        model.loss_tp_mesh = tp_mesh
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)

    for key, block in model.layers.items():
        dense = isinstance(block.feed_forward, FeedForward)
        prepare = PrepareInput
        if saved_inputs == "shard" and int(key) not in checkpointed:
            prepare = regathering(PrepareInput)
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": prepare(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                "attention.wq": Colwise(),
                "attention.wk": Colwise(),
                "attention.wv": Colwise(),
                "attention.wo": Rowwise(output_layouts=Shard(1)),
                **_qk_norm_plan(block.attention),
                "ffn_norm": SequenceParallel(),
                **(_dense_mlp_plan(Colwise, Rowwise, prepare) if dense else _moe_plan(block.feed_forward)),
            },
        )


def _qk_norm_plan(attention) -> dict:
    """Qwen3's q_norm and k_norm run on the rank's heads ([B, S, H/tp, D]): replicated over tp as
    `SequenceParallel` on the heads dim, so DTensor sums their weights' gradients over the tp
    ranks, each of which saw only its own heads (a plain weight kept its own heads' share and the
    tp ranks' copies drifted apart)."""
    if attention.q_norm is None:
        return {}
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)
    return {"attention.q_norm": heads, "attention.k_norm": heads}


def _dense_mlp_plan(Colwise, Rowwise, PrepareInput) -> dict:
    return {
        "feed_forward": PrepareInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": Colwise(),
        "feed_forward.w2": Rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": Colwise(),
    }


def _moe_plan(moe) -> dict:
    """The MoE's input stays the rank's sequence slice; its router and shared experts replicated
    over tp, on the rank's rows of the flattened tokens [N/tp, D]."""
    rows = {"feed_forward.router"}
    if moe.shared_experts is not None:
        rows |= {f"feed_forward.shared_experts.{name}" for name in ("w1", "w2", "w3")}
    # ffn_norm's output is a Shard(1) DTensor: the MoE takes its local slice.
    local = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)
    return {"feed_forward": local, **{name: SequenceParallel(sequence_dim=0, use_local_output=True) for name in rows}}


class VocabParallelEmbedding(nn.Module):
    """The token embedding with its rows split over tp (Megatron-Core's VocabParallelEmbedding,
    megatron/core/tensor_parallel/layers.py), output sequence-sharded [B, S/tp, D].

    Each rank looks up the tokens its rows hold, zeroes the others, and the partial sums are
    reduce-scattered along the sequence; backward all-gathers the output gradient and
    accumulates it into the rank's V/tp rows only. DTensor's RowwiseParallel computes the same
    values, but its embedding_dense_backward runs at the global vocabulary size and keeps the
    rank's shard as a view of that dense V x h gradient: tp times the memory, live from the
    first backward to the optimizer step (the traced grid showed it as rank 0's peak under PP).

    The weight stays a DTensor sharded Shard(0) on the tp mesh, as RowwiseParallel left it, so
    FSDP, checkpoints, the tied output layer and HF export see the same parameter.
    """

    def __init__(self, embedding: nn.Embedding, tp_mesh):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.tp_mesh = tp_mesh
        weight = distribute_tensor(embedding.weight.detach(), tp_mesh, [Shard(0)])
        self.weight = nn.Parameter(weight, requires_grad=embedding.weight.requires_grad)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        rows = weight.shape[0]
        # Shard(0) splits as torch.chunk does: ceil(V / tp) rows per rank, the last ones fewer.
        chunk = -(-self.num_embeddings // self.tp_mesh.size())
        start = min(self.tp_mesh.get_local_rank() * chunk, self.num_embeddings)
        outside = (tokens < start) | (tokens >= start + rows)
        if rows:
            local = F.embedding(torch.where(outside, 0, tokens - start), weight)
            local = local.masked_fill(outside.unsqueeze(-1), 0)
        else:  # a rank past the vocabulary's end holds no rows; its gradient stays an empty tensor, not None
            local = weight.new_zeros((*tokens.shape, self.embedding_dim)) + weight.sum()
        partial = DTensor.from_local(local, self.tp_mesh, [Partial()], run_check=False)
        return partial.redistribute(self.tp_mesh, [Shard(1)]).to_local()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, vocab-parallel over tp {self.tp_mesh.size()}"
