"""Mixture-of-experts MLP: a top-k router, dropless dispatch, and the experts as one grouped GEMM.

    moe = MoE(cfg)                       # cfg.moe set (launcher.contract.config.MoeConfig)
    y = moe(x)                           # x [B, S, D] -> [B, S, D]; moe.routing: this forward's statistics
    router_losses([moe, ...], cfg.moe)   # (load-balancing loss, z-loss) over all MoE layers

Anchor: torchtitan `torchtitan/models/common/moe.py` (router, grouped experts) and
`token_dispatcher.py`; numerics follow transformers' `Qwen3MoeSparseMoeBlock` and
`MixtralSparseMoeBlock` (tests/entrypoints/test_moe.py compares logits, loss and gradients).

Dispatch is dropless: each token is copied once per chosen expert, the copies are sorted by
expert (a stable sort, so the order is deterministic), every expert multiplies its contiguous
run of rows, and the weighted results are summed back into their tokens. No capacity factor,
no padding, no token ever dropped.

Under expert parallelism (entrypoints/parallel/expert.py sets `expert_group`) this rank holds
num_experts / ep of the experts, as DTensor shards of the [E, ...] weights, and the sorted copies
travel to their experts' ranks and back by all-to-all (model/dispatch.py). Under context and
tensor parallelism each rank routes its own slice of the sequence (parallel/tensor.py), and the
auxiliary losses pool the routing of the whole sequence over the cp x tp ranks (`routing_group`),
as one process would.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_reduce
from torch.distributed.tensor import DTensor

from entrypoints.model import fp8_experts
from entrypoints.model.dispatch import dispatch_to_experts
from entrypoints.model.swiglu import swiglu, weighted_swiglu
from launcher.contract.config import ModelConfig, MoeConfig


def expert_counts(flat_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many of the token copies go to each expert. A scatter-add, not `bincount`:
    its length is always E, where bincount's depends on the largest id (so on CUDA it waits for
    the device), and tracing on fake tensors (tests/estimate/memory_tracing.py) needs the shape."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_experts.device)
    return counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))


class Routing(NamedTuple):
    """What one MoE layer's forward leaves for the auxiliary losses."""

    tokens_per_expert: torch.Tensor
    """[E] float: how many of this forward's token copies went to each expert (no gradient)."""
    score_sum: torch.Tensor
    """[E] fp32: the router probabilities of all tokens summed per expert (with gradient)."""
    squared_logsumexp_sum: torch.Tensor
    """fp32 scalar: sum over tokens of logsumexp(router logits)^2, for the z-loss."""
    tokens: int


def route(
    logits: torch.Tensor, moe: MoeConfig, *, force_balance: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-k weights [N, k] in the logits' dtype, top-k expert ids [N, k], probabilities [N, E] fp32).

    As transformers' Qwen3MoeTopKRouter / MixtralTopKRouter: scores in fp32, top-k of the
    scores, optionally renormalised to sum to 1. A sigmoid router scores each expert on its own
    (DeepSeek V3); its probabilities for the balancing loss are the scores normalised per token.

    `force_balance` (training.moe_force_load_balance) assigns the N x k copies to the experts
    round-robin, copy i to expert i mod E, and weights them by their scores, as torchtitan's
    TokenChoiceTopKRouter._debug_force_load_balance_routing (torchtitan/models/moe/moe.py): every
    expert gets the same rows, within one, on every rank and layer.
    """
    if moe.router_score == "softmax":
        scores = F.softmax(logits.float(), dim=-1)
        probabilities = scores
    else:
        scores = torch.sigmoid(logits.float())
        probabilities = scores / scores.sum(dim=-1, keepdim=True)
    if force_balance:
        copies = torch.arange(scores.shape[0] * moe.top_k, device=scores.device)
        experts = (copies % moe.num_experts).view(-1, moe.top_k)
        weights = scores.gather(1, experts)
    else:
        weights, experts = torch.topk(scores, moe.top_k, dim=-1)
    if moe.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts, probabilities


# The public name from torch 2.10 (torch.nn.functional.grouped_mm); the same op as torch._grouped_mm,
# which older images (SageMaker's PyTorch 2.8 DLC) have alone.
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _uses_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch's grouped GEMM runs on CUDA in bf16 with rows 16-byte aligned (dims multiple of 8)."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.shape[-1] % 8 == 0
        and weight.shape[-2] % 8 == 0
        and _GROUPED_MM is not None
    )


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x [M, K], sorted by expert with counts [E] rows each, times weight[e].T ([E, N, K])."""
    if _uses_grouped_mm(x, weight):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return _GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets)
    # The exact fallback (CPU, fp32, odd sizes): one matmul per expert's run of rows.
    runs = torch.split(x, counts.tolist())
    return torch.cat([run @ weight[e].T for e, run in enumerate(runs)])


def combine(expert_out: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """[N, D]: each token's top-k expert outputs (rows of `expert_out` [N·k, D] in `order`, sorted
    by expert, already weighted by the router) back in token order and summed in top-k order.

    The router weights are applied inside the experts, to w2's input (`weighted_swiglu`): w2 is
    linear, so w2(p · h) = p · w2(h), and the weights' gradient comes from the SwiGLU's product,
    which is recomputed there anyway. Weighting here instead would make autograd keep the
    gathered N·k x D outputs for that gradient, the largest tensor a layer saved (Qwen3-30B-A3B:
    as much as its experts' input). The gather and the sum keep only the index."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    unsorted = expert_out[inverse]
    del expert_out  # the caller keeps no reference: released before the sum
    return unsorted.view(-1, top_k, unsorted.shape[-1]).sum(1)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as [E, ...] weights: w2(silu(w1 x) * w3 x) per expert."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.grad_scale = 1.0
        """Set to 1/ep under expert parallelism. Each rank's expert gradients then sum the tokens
        of the whole EP group, and FSDP divides them by the expert_fsdp ranks alone; the scale
        makes that the mean over all data ranks, as torchtitan's `fsdp_gradient_divide_factor`
        (torchtitan/distributed/parallel_dims.py) does with FSDP's divide factor, whose
        PREMUL_SUM reduction gloo lacks."""
        self.fp8_emulate: bool | None = None
        """Set by entrypoints/fp8.py under FP8: None keeps the compute dtype; False runs torchao's
        FP8 grouped GEMM (CUDA), True the same casts emulated (model/fp8_experts.py)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Rows x [R, h] sorted by expert (counts [E]), each expert's output times its row's
        router weight `scale` [R], applied to w2's input (`weighted_swiglu`)."""
        # Under expert parallelism the weights are DTensors sharded by expert: this rank's rows
        # are its own experts, which `counts` describes.
        w1, w2, w3 = (_local(w, self.grad_scale) for w in (self.w1, self.w2, self.w3))
        if self.fp8_emulate is not None:
            return self._fp8_forward(x, counts, scale, w1, w2, w3)
        gate, up = grouped_linear(x, w1, counts), grouped_linear(x, w3, counts)
        return grouped_linear(weighted_swiglu(gate, up, scale), w2, counts)

    def _fp8_forward(self, x, counts, scale, w1, w2, w3) -> torch.Tensor:
        # One padded copy of the rows feeds w1 and w3, cast to float8 once for both; backward
        # keeps only its float8 copy (model/fp8_experts.py). The padding rows stay zero through
        # the SwiGLU (silu(0) x 0, whatever their scale) and w2, and only the real rows come back.
        groups = fp8_experts.pad_groups(x, counts)
        del x
        row_scale = groups.pad(scale)
        gate, up = fp8_experts.fp8_expert_linears(groups.rows, (w1, w3), groups.offsets, emulate=self.fp8_emulate)
        groups = groups._replace(rows=None)  # released before w2's forward
        hidden = weighted_swiglu(gate, up, row_scale)
        del gate, up
        out = fp8_experts.fp8_grouped_linear(hidden, w2, groups.offsets, emulate=self.fp8_emulate)
        return groups.unpad(out)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _local(weight: torch.Tensor, grad_scale: float) -> torch.Tensor:
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return local if grad_scale == 1.0 else _ScaleGrad.apply(local, grad_scale)


class SharedExperts(nn.Module):
    """The experts every token goes through, as one dense SwiGLU (no gate)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.moe = moe
        self.router = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = GroupedExperts(moe.num_experts, cfg.hidden_size, moe.expert_ffn_hidden_size)
        shared_size = moe.shared_experts * moe.expert_ffn_hidden_size
        self.shared_experts = SharedExperts(cfg.hidden_size, shared_size) if shared_size else None
        self.routing: Routing | None = None
        self.force_balance = False
        """training.moe_force_load_balance (`force_load_balance`): round-robin routing, for benchmarks."""
        # Set by parallel/expert.py: the EP group the experts are split over, and the cp x tp
        # group whose ranks hold the other parts of this rank's sequences (tp of them).
        self.expert_group = None
        self.routing_group = None
        self.routing_tensor = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens)
        weights, experts, probabilities = route(logits, self.moe, force_balance=self.force_balance)
        flat_experts = experts.reshape(-1)
        # Stable: copies of one expert keep token order, so the sums below are deterministic.
        order = torch.argsort(flat_experts, stable=True)
        counts = expert_counts(flat_experts, self.moe.num_experts)
        source_token = order // self.moe.top_k
        copy_weights = weights.reshape(-1)[order]  # each copy's router weight, in expert order
        # No name holds the experts' output: `combine` releases it once it has gathered it.
        out = combine(self._run_experts(tokens, source_token, copy_weights, counts), order, self.moe.top_k)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        self.routing = Routing(
            tokens_per_expert=counts.detach().float(),
            score_sum=probabilities.sum(dim=0),
            squared_logsumexp_sum=torch.logsumexp(logits.float(), dim=-1).square().sum(),
            tokens=tokens.shape[0],
        )
        return out.reshape(shape)

    def _run_experts(
        self, tokens: torch.Tensor, source_token: torch.Tensor, copy_weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        # The copies are made where they are used: under EP they go to other ranks, and no frame
        # here keeps them alive after they are sent.
        if self.expert_group is None:
            return self.experts(tokens[source_token], counts, copy_weights)
        return dispatch_to_experts(self.experts, tokens, source_token, copy_weights, counts, self.expert_group)


def force_load_balance(model: nn.Module) -> None:
    """Every MoE layer of `model` routes round-robin (training.moe_force_load_balance)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.force_balance = True


def router_losses(layers: list[MoE], moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, router z-loss) of the last forward of `layers`, unweighted.

    The balancing loss is Switch Transformer's E x sum_e f_e P_e with f_e the share of token
    copies and P_e the mean router probability of expert e, both pooled over every MoE layer
    and token, exactly as transformers' `load_balancing_loss_func` (which Qwen3-MoE and Mixtral
    train with): f counts copies, so it sums to top_k. The z-loss is the mean over layers and
    tokens of logsumexp(router logits)^2 (ST-MoE, arXiv 2202.08906, eq. 5).
    """
    routings = [layer.routing for layer in layers]
    experts = moe.num_experts
    rows = torch.tensor([float(sum(r.tokens for r in routings))], device=routings[0].score_sum.device)
    pooled = torch.cat(
        [
            torch.stack([r.tokens_per_expert for r in routings]).sum(0),
            torch.stack([r.score_sum for r in routings]).sum(0),
            torch.stack([r.squared_logsumexp_sum for r in routings]).sum().reshape(1),
            rows,
        ]
    )
    group, tensor = layers[0].routing_group, layers[0].routing_tensor
    if group is not None:
        # Context and tensor parallel: the sequences' other tokens are on the cp x tp ranks. The
        # sum's backward sums the gradients of every rank's copy of the loss: FSDP's mean over cp
        # undoes the cp copies. The tp copies are scaled away here, since the tp ranks' router
        # gradients are summed (the router's weight is replicated over tp: parallel/tensor.py).
        if tensor > 1:
            pooled = _ScaleGrad.apply(pooled, 1.0 / tensor)
        pooled = all_reduce(pooled, group=group)
    rows = pooled[-1].detach()
    tokens_per_expert = pooled[:experts].detach() / rows
    probability_per_expert = pooled[experts : 2 * experts] / rows
    balance = experts * torch.sum(tokens_per_expert * probability_per_expert)
    z_loss = pooled[2 * experts] / rows
    return balance, z_loss
