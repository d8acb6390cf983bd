"""The mixture-of-experts MLP of one block on one rank, per micro-batch: what the `fsdp`
accounting (fsdp.py) counts in place of the dense SwiGLU when the model has a `moe:` block.

Derived from entrypoints/model/moe.py and model/dispatch.py and checked against the fake-tensor
trace of them (tests/estimate/test_traced.py). N tokens of the sequence live on the rank
(b x s / (cp x tp): under TP each tp rank routes its own slice of the sequence,
entrypoints/parallel/tensor.py); each goes to top-k experts, so the layer sends C = N x k token copies, and its local experts compute on the R
rows they receive: C without expert parallelism, C x ROUTING_BOUND under it (below).

Saved for backward, per layer:
- the router: fp32 softmax probabilities and the fp32 logits logsumexp reads for the z-loss
  (N x E each), the top-k ids (int64) and the fp32 top-k weights with their sums;
- dispatch: the copies' source tokens and the combine's inverse order (int64, C each); under EP
  also the received rows' regrouping order and its inverse (int64, R each);
- the experts: their input rows (R x h), the SwiGLU's three R x f intermediates (w1 x, w3 x and
  their router-weighted product, w2's input; entrypoints/model/swiglu.py `weighted_swiglu`
  recomputes silu(w1 x) in backward) and each row's router weight;
- the combine: nothing but its index. The router weights are applied to w2's input, which is
  exact (w2 is linear), so no N x k x h copy of the experts' outputs is kept for the weights'
  gradient (entrypoints/model/moe.py `combine`; it was the largest tensor saved, 0.5 GiB over
  Qwen3-30B-A3B's 4 traced layers at 8K);
- shared experts, if any: a dense SwiGLU of N x (shared x f).

A layer's backward peaks inside the experts, at one of three moments:
- w2's backward: the gradient of the experts' output (R x h), of w2's input (R x f) and w2's
  weight gradient are alive;
- the SwiGLU's backward, just after: w2's input is released, and the gradient of w2's input
  with the two gradients it makes (3 x R x f) are alive (the largest when f > h, Mixtral);
- w1's backward (the last grouped GEMM reached): the three intermediates are released; the
  gradient of w1's output (R x f), the two gradients of the experts' input (R x h, one from w3,
  one being made) and all three weight gradients are alive.
Weight gradients are the local experts' (E / ep), unsharded in the compute dtype until FSDP
reduce-scatters the unit.

A checkpointed layer's recomputation, inside backward, peaks as its forward does: where the
experts' outputs are regathered (in token order, or back in source-rank order under EP) while the
outputs themselves still exist, two R x h tensors beside the saved set, and beside the combine's
incoming gradient, which its backward has already copied into C x h rows, where no router loss
reached the layer first (a pipeline stage without the loss).

FP8 experts (precision.fp8_experts; launcher/contract/fp8.py `fp8_experts`; entrypoints/model/fp8_experts.py) compute on
a padded copy of their rows: P = R rounded up to 16, plus 16 x E/ep (each expert's group padded
to a multiple of 16, and at least 16), which replaces the R rows everywhere above, plus the
int64 row map (R). What backward keeps of the rows and of w2's input is their per-group
column-wise float8 copies (1 byte, with fp32 scales per local expert and column), made in
forward, not the bf16 tensors torchao's `_Float8GroupedMM` would keep (fp8_experts.py
`_Float8GroupedLinears`). w1 and w3 are one autograd node, so both their incoming gradients
live until both products are through. A GEMM of K inputs and N outputs holds in backward one
float8 copy of its gradient at a time (P x N): per row beside the weights' transposed copy
(E/ep x N x K) for the input's gradient, then per group column for the weights'.
A checkpointed FP8 layer's recomputation peaks inside the experts' forward, at the unpadding:
the padded output (P x h) and w2's bf16 input (P x f) beside the caller's rows and their
unpadded copy (2 R x h). Traced: Qwen3-30B-A3B 16K, EP 8, FP8 experts, selective, 4 layers:
14.35 GiB before the float8 copies were kept in place of the rows, 13.29 after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.contract.fp8 import padded_group_rows
from launcher.estimate.workload import Workload

FP32 = 4
INT64 = 8

ROUTING_BOUND = 1.25
"""Rows an expert-parallel rank receives, as a multiple of the C it sends. Routing is dropless,
so a rank whose experts are popular receives more than the balanced share, with no cap. The
estimate prices 25% above balance: the capacity factor Switch Transformer trained with (Fedus et
al. 2021, arXiv 2101.03961, section 2.2 and Table 1), which the auxiliary loss keeps routing
under in practice. Past it, each extra row costs the rank (h + 3f + 1) x dtype bytes (and 16
of indices) per layer until backward; the 20% headroom of the verdict's threshold absorbs some of it, and a rank that runs
out of memory fails the job with an OOM the failure file names. Without expert parallelism every
rank computes all C rows of its own tokens whatever the routing, so no bound is needed."""


@dataclass(frozen=True, slots=True)
class MoeMemory:
    """One MoE layer on one rank, per micro-batch (bytes), and its parameter counts."""

    saved: float
    """Kept for backward."""
    backward_working: float
    """Gradients of activations alive at the layer's backward peak, besides the incoming one."""
    weight_grads: float
    """The local experts' unsharded weight gradients alive at that peak."""
    freed_in_backward: float
    """Of `saved`, what the layer's backward has already released at that peak."""
    recompute_working: float
    """A checkpointed layer's recomputation where the experts' outputs are regathered: the
    transient copies beside what is saved."""
    swiglu_recompute_working: float
    """The same recomputation earlier, inside the experts' SwiGLU."""
    local_params: float
    """Parameters this rank computes with: router, shared experts and its E / ep experts."""
    state_params: float
    """Parameters whose FSDP shards this rank holds a share of, as a share of dp_shard x cp
    (`Layout.fsdp_shard`): router, shared experts and every expert over tp, since EP and
    expert_fsdp together split the experts over dp_shard x cp x tp (`Layout.moe_ranks`)."""
    local_expert_params: float
    """The E / ep experts alone: under EP an FSDP unit of their own (entrypoints/parallel/fsdp.py)."""
    expert_saved: float
    """Of `saved`, what the experts' GEMMs and SwiGLU keep: made inside the experts' forward."""
    output_gradient: float
    """The gradient of the experts' output rows, alive before the experts' backward begins."""
    combine_gradient: float
    """The combine's incoming gradient as C x h rows, beside a recomputation that its backward
    starts: the gather's index is the layer's first saved tensor its backward reads where no
    router loss reaches the layer first (`_Block._in_backward`)."""


def routed_rows(workload: Workload) -> tuple[float, float]:
    """(C, R): token copies this rank sends per micro-batch, and rows its experts compute on.

    Under training.moe_force_load_balance every rank sends copy i to expert i mod E
    (entrypoints/model/moe.py `route`), so each expert gets at most ceil(C / E) rows from each
    EP rank: R = E x ceil(C / E), whatever the router learned."""
    moe, layout = workload.arch.moe, workload.layout
    sent = workload.micro_batch_size * workload.seq_len / layout.context / layout.tensor * moe.top_k
    if layout.expert == 1:
        return sent, sent
    if workload.moe_force_load_balance:
        return sent, moe.num_experts * math.ceil(sent / moe.num_experts)
    return sent, sent * ROUTING_BOUND


def _backward_moments(cb: int, computed: float, h: int, f: int, local_experts: float, fp8: bool) -> list[tuple]:
    """(working, weight gradients, freed of the saved set) at the candidate peaks of the experts'
    backward (the module docstring), on `computed` rows. Under FP8 each grouped GEMM's backward
    holds one float8 copy of its incoming gradient at a time (per row for the input's gradient,
    beside the weights' transposed copy; then per group column for the weights'), and w1 and w3
    are one autograd node: both incoming gradients live until both are through, and the rows'
    saved float8 copy is read, not made (entrypoints/model/fp8_experts.py)."""
    one_weight = cb * local_experts * h * f
    if not fp8:
        return [
            (cb * computed * (h + f), one_weight, 0.0),
            (cb * 3 * computed * f, one_weight, cb * computed * f),
            (cb * computed * (f + 2 * h), 3 * one_weight, cb * computed * (3 * f + 1)),
        ]
    swiglu_and_w2 = cb * computed * (2 * f + 1) + computed * f + FP32 * local_experts * f
    return [
        (cb * computed * (h + f) + computed * h, one_weight, 0.0),
        (cb * 3 * computed * f, one_weight, computed * f + FP32 * local_experts * f),
        (cb * computed * 2 * (f + h) + computed * f + local_experts * h * f, 2 * one_weight, swiglu_and_w2),
        (cb * computed * (2 * f + h) + computed * f, 3 * one_weight, swiglu_and_w2),
    ]


def moe_memory(workload: Workload, cb: int) -> MoeMemory:
    arch, layout = workload.arch, workload.layout
    moe, h = arch.moe, arch.hidden_size
    f, experts, k, ep = moe.expert_ffn_hidden_size, moe.num_experts, moe.top_k, layout.expert
    tokens = workload.micro_batch_size * workload.seq_len / layout.context / layout.tensor
    sent, rows = routed_rows(workload)
    shared_f = moe.shared_experts * f
    fp8 = workload.experts_in_fp8
    computed = padded_group_rows(rows, experts / ep) if fp8 else rows  # the rows the grouped GEMMs see

    router = FP32 * tokens * (2 * experts + 1) + INT64 * tokens * k + FP32 * tokens * (k + 1) + FP32 * tokens
    dispatch = INT64 * 2 * sent + (INT64 * 2 * rows if ep > 1 else 0) + (INT64 * rows if fp8 else 0)
    local_experts = experts / ep
    # The rows, the SwiGLU's gate and up and w2's (router-weighted) input, and the router weight
    # of each row (model/swiglu.py `weighted_swiglu`). FP8 experts keep the rows and w2's input
    # only as their per-group column-wise float8 copies, with fp32 scales per expert and column
    # (entrypoints/model/fp8_experts.py `_Float8GroupedLinears`).
    if fp8:
        expert_set = computed * (h + f) + FP32 * local_experts * (h + f) + cb * 2 * computed * f + cb * computed
    else:
        expert_set = cb * computed * h + cb * 3 * computed * f + cb * computed
    shared = cb * 3 * tokens * shared_f
    saved = router + dispatch + expert_set + shared
    working, weights, freed = max(
        _backward_moments(cb, computed, h, f, local_experts, fp8),
        key=lambda moment: moment[0] + moment[1] - moment[2],
    )
    # Recomputed forward: the outputs regathered beside themselves (padded, then in token order).
    # Under FP8 that happens inside the experts' forward, where its padded output and w2's bf16
    # input are still alive, beside the rows the caller holds (R x h) and their unpadded copy.
    # Earlier, inside the SwiGLU's forward, silu(gate) and its product with up live beside gate
    # and up (model/swiglu.py `weighted_swiglu`) before w2's input exists: one R x f more than
    # the saved set, or under FP8, where w2 keeps its input as a float8 copy not yet made, two
    # in the compute dtype less that copy. Traced: Mixtral 4 layers, 16 GPUs, EP 4, full AC,
    # sync_each: 0.9% under the trace with the outputs' moment alone.
    recompute = cb * (computed + rows) * h
    swiglu = cb * computed * f
    if fp8:
        recompute = cb * (computed + 2 * rows) * h + cb * computed * f
        swiglu = (2 * cb - 1) * computed * f

    router_params = experts * h
    expert_params = moe.expert_params(h)
    shared_params = 3 * h * shared_f
    return MoeMemory(
        saved=saved,
        backward_working=working,
        weight_grads=weights,
        freed_in_backward=freed,
        recompute_working=recompute,
        swiglu_recompute_working=swiglu,
        local_params=router_params + shared_params + experts / ep * expert_params,
        state_params=router_params + shared_params + experts * expert_params / layout.tensor,
        local_expert_params=experts / ep * expert_params,
        expert_saved=expert_set,
        output_gradient=cb * rows * h,
        combine_gradient=cb * sent * h,
    )
