"""Expert-parallel token dispatch: each MoE layer's token copies go to the rank that holds their
expert and come back by two all-to-alls, dropless and in a fixed order.

    out = dispatch_to_experts(experts, rows, counts, group)   # rows sorted by global expert id

Anchor: torchtitan `torchtitan/distributed/expert_parallel.py` (`ExpertParallel._token_dispatch`
and `_token_combine`): the per-expert counts are exchanged first with one all-to-all, each rank
derives the split sizes of both directions from them, the rows follow with
`all_to_all_single`, and the rows received (ordered by source rank, then local expert) are
regrouped by local expert for the grouped GEMM and put back before the return trip.

Nothing is dropped and nothing is padded. The order of every sum is fixed: rows arrive by source
rank and keep their order within it (a stable sort), so a step gives the same numbers on every
run, and the same as one process holding every expert up to the order of float sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        grad_in = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_in, None, None, None


def dispatch_to_experts(experts, rows: torch.Tensor, counts: torch.Tensor, group) -> torch.Tensor:
    """`experts(rows)` where `experts` holds only this rank's num_experts / ep experts.

    rows [M, D]: this rank's token copies sorted by global expert id, counts [E] of them per
    expert. Experts are placed in order: rank r of the group holds experts r·E/ep .. (r+1)·E/ep - 1.
    Returns the experts' outputs for `rows`, in the order of `rows`.
    """
    ep = dist.get_world_size(group)
    local_experts = counts.numel() // ep
    # 1. Counts first: received[src, e] copies from rank `src` for local expert e.
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ep, local_experts)
    input_splits = counts.view(ep, local_experts).sum(1).tolist()
    output_splits = received.sum(1).tolist()
    # 2. The rows, grouped by source rank then local expert; regroup by local expert (stable).
    arrived = _AllToAll.apply(rows, output_splits, input_splits, group)
    segment = torch.arange(ep * local_experts, device=counts.device).repeat_interleave(received.flatten())
    by_expert = torch.argsort((segment % local_experts) * ep + segment // local_experts, stable=True)
    out = experts(arrived[by_expert], received.sum(0))
    # 3. Back to source-rank order, and home.
    restored = torch.empty_like(by_expert)
    restored[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    return _AllToAll.apply(out[restored], input_splits, output_splits, group)
