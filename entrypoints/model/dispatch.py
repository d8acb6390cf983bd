"""Expert-parallel token dispatch: each MoE layer's token copies go to the rank that holds their
expert and come back by two all-to-alls, dropless and in a fixed order.

    out = dispatch_to_experts(experts, tokens, source_token, copy_weights, counts, group)   # copies sorted by expert id

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


def exchange_counts(counts: torch.Tensor, group) -> tuple[torch.Tensor, list[int], list[int]]:
    """(received [ep, E/ep]: copies from rank src for local expert e, rows this rank sends to each
    rank, rows it receives from each): the one step whose sizes depend on the routing."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ep, -1)
    return received, counts.view(ep, -1).sum(1).tolist(), received.sum(1).tolist()


def dispatch_to_experts(
    experts, tokens: torch.Tensor, source_token: torch.Tensor, copy_weights: torch.Tensor, counts: torch.Tensor, group
) -> torch.Tensor:
    """`experts(tokens[source_token], counts, copy_weights)` where `experts` holds only this rank's
    num_experts / ep experts.

    tokens [N, D]; source_token [M]: the token of each of this rank's copies, sorted by global
    expert id, counts [E] of them per expert; copy_weights [M]: each copy's router weight, which
    the experts apply (moe.py `combine`) and which travels with its row. Experts are placed in
    order: rank r of the group holds experts r·E/ep .. (r+1)·E/ep - 1.
    Returns the experts' outputs for the copies [M, D], in their order.
    """
    ep = dist.get_world_size(group)
    local_experts = counts.numel() // ep
    # 1. Counts first.
    received, input_splits, output_splits = exchange_counts(counts, group)
    # 2. The rows, grouped by source rank then local expert; regroup by local expert (stable).
    rows = tokens[source_token]
    arrived = _AllToAll.apply(rows, output_splits, input_splits, group)
    arrived_weights = _AllToAll.apply(copy_weights, output_splits, input_splits, group)
    # Each intermediate is released as soon as it is used (`del`): the ones autograd does not
    # save would otherwise live until the return, a peak a checkpointed layer's recomputation
    # pays in the middle of backward.
    del rows
    # With its output size given, repeat_interleave need not read the counts back from the device.
    segment = torch.arange(ep * local_experts, device=counts.device).repeat_interleave(
        received.flatten(), output_size=sum(output_splits)
    )
    by_expert = torch.argsort((segment % local_experts) * ep + segment // local_experts, stable=True)
    local_rows = arrived[by_expert]
    del arrived
    out = experts(local_rows, received.sum(0), arrived_weights[by_expert])
    del local_rows
    # 3. Back to source-rank order, and home.
    restored = torch.empty_like(by_expert)
    restored[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    home = out[restored]
    del out
    return _AllToAll.apply(home, input_splits, output_splits, group)
