"""The `fsdp` accounting: what the bundled entrypoints allocate on one GPU, term by term.

Derived from the entrypoints' code (entrypoints/model, entrypoints/parallel, optim.py) and
checked against a fake-tensor trace of that code (tests/estimate/test_traced.py); every term
is explained, with the line of code it comes from, in docs/estimator.md. In short:

- Weights are fp32 FSDP shards (masters) over dp_shard x cp; `MixedPrecisionPolicy`
  all-gathers them in the compute dtype. AdamW's two states are fp32 shards; gradients are
  reduce-scattered in fp32 into fp32 shards. That is 16 bytes per parameter / (dp_shard x cp).
- The FSDP root unit (embedding, final norm, output weight) is gathered from the start of
  forward to the end of backward; each block is gathered for its forward and again for its
  backward, where FSDP prefetches the next block and keeps the previous block's fp32
  reduce-scatter input until the next reduce-scatter.
- Under pipeline parallelism every block stays gathered after forward, and gradients accumulate
  unsharded in the reduce dtype until the step's end (torch.distributed.pipelining turns FSDP's
  gradient sync off in between), or under sync_each are reduced into their shards every
  micro-batch (`_pipelined_moments`). Without it, `grad_accumulation` decides
  (`_Accumulation`): sync_last keeps unsharded gradients, sync_last_gathered gathered blocks too.
- Each block saves what autograd needs (listed in `_Block`); full checkpointing keeps only a
  block's input and recomputes the rest in backward; selective checkpoints every other layer of
  each pipeline rank.
- The loss never materialises logits: it saves the final hidden states and an fp32
  log-sum-exp per token, and handles the vocabulary in chunks of about N x hidden values.

The peak is the largest of a few moments of a step: the loss's forward and backward, the
backward of the first three blocks it reaches (and the last two, when gradients outgrow
activations), and the optimizer step. Each pipeline rank is evaluated on its own.
"""

from __future__ import annotations

from functools import cache
from math import ceil
from typing import NamedTuple

from launcher.contract.config import BF16_MOMENTS_CHUNK, OPTIMIZER_STATE_BYTES
from launcher.contract.fp8 import collective_backend, float8_all_gather
from launcher.contract.layout import Layout, checkpointed_layers, rank_layers, rank_stages, stage_layers
from launcher.contract.loss import chunk_tokens
from launcher.estimate.breakdown import StageMemory, empty_breakdown
from launcher.estimate.moe import ROUTING_BOUND, moe_memory
from launcher.estimate.overheads import device_overheads
from launcher.estimate.pipeline import backward_moments, forward_moments, receive_buffers_in_backward
from launcher.estimate.workload import Workload

FP32 = 4
INT64 = 8


class _Block:
    """Bytes one transformer block holds for one micro-batch, on one GPU.

    T tokens of the sequence live on this rank (b x s / c); sequence-parallel regions
    (norms, residual stream) hold T/t of them. Saved for backward, per block:
    - the block input (saved by attention_norm) and the residual after attention (ffn_norm),
      each T/t x h, with an fp32 rstd per token (CUDA's fused RMSNorm);
    - the inputs of the attention and MLP projections: the norm outputs, all-gathered along
      the sequence under TP, so T x h each (DTensor keeps the gathered tensor, not the shard);
      an MoE block's MLP runs on the shard (parallel/tensor.py), so only the attention's;
    - rotated q (T x h/t), k and v (T x kv/t; under CP a checkpointed block's recomputation
      keeps the K/V all-gathered from the whole sequence, c x that), the attention output
      (T x h/t, once: the CP kernel writes its merged output laid out [B, S, H, D], so wo's
      input is a view of it) and an fp32 log-sum-exp per head and token;
    - the SwiGLU's w1 x and w3 x (entrypoints/model/swiglu.py recomputes silu(w1 x) in
      backward): 2 x T x f/t. Their product, w2's input, too where w2 keeps it: in a compiled
      block and under Float8 TP styles (its float8 copy, `_float8_tp_styles_saved`); elsewhere
      backward makes it again (swiglu.py `product_recomputed`). A checkpointed block's
      recomputation keeps it, which its backward's working set below counts. In a
      mixture-of-experts block, the router, dispatch and experts' tensors instead (moe.py).
    """

    __slots__ = (
        "saved",
        "tp_gathered",
        "tp_regathered",
        "cp_gathered",
        "regathers_kv",
        "recomputed_kv",
        "attention_backward",
        "recomputed_attention_backward",
        "mlp_saved",
        "input_gradient",
        "mlp_input_gradient",
        "layer_input",
        "backward_working",
        "at_w2_backward",
        "fp8_cast",
        "forward_cast",
        "forward_working",
        "params",
        "gathered",
        "last_prefetched",
        "prefetch_holds",
        "copy_temporaries",
        "expert_shards",
        "copy_out",
        "experts_reduced",
        "weight_grad_w2",
        "attention_weight_grads",
        "gating_cast",
        "recomputed_cast",
        "kept_mlp_backward",
        "freed_in_backward",
        "recompute",
        "recompute_swiglu",
        "combine_gradient",
        "state_params",
        "reduce_scatter_params",
        "last_param",
        "checkpointed_forward",
        "_in_backward_memo",
    )

    def __init__(self, w: Workload, cb: int, *, float8_all_gather: bool):
        arch, layout = w.arch, w.layout
        h, kv, heads = arch.hidden_size, arch.kv_dim, arch.num_heads
        q = arch.q_dim  # num_heads x head_dim: h for Llama, not for every Qwen3
        t, c = layout.tensor, layout.context
        tokens = w.micro_batch_size * w.seq_len / c
        sharded = tokens / t
        local = (
            cb * sharded * h * 2  # block input, residual after attention
            + FP32 * sharded * 2  # rstd of both norms
            + cb * sharded * h * 2  # the two norm outputs, as a sequence shard
            + cb * tokens * (q + 2 * kv) / t  # q, k, v
            + cb * tokens * q / t  # attention output
            + FP32 * tokens * heads / t  # log-sum-exp
        )
        float8_tp_styles = float8_all_gather and t > 1
        local += _ulysses_output_copy(w, cb, float8_tp_styles)
        mlp = _Mlp(w, cb, product_recomputed=arch.moe is None and not w.compile and not float8_tp_styles)
        local += mlp.saved
        self.mlp_saved = mlp.saved
        if float8_tp_styles and arch.moe is None:
            # What the MLP's backward lets go of includes w2's input as saved, in float8
            # (`_float8_tp_styles_saved`). Traced: 8B 32K, TP 2, CP 2, no AC, at w1's cast: 1.2%
            # under the trace with a bf16 product counted as let go.
            self.mlp_saved -= (cb - 1) * tokens * arch.ffn_hidden_size / t
        if arch.qk_norm:
            # Qwen3's q_norm and k_norm (RMSNorm per head, before RoPE) save their inputs, the
            # projections' outputs, and an fp32 rstd per head and token.
            local += cb * tokens * (q + kv) / t + FP32 * tokens * (heads + arch.num_kv_heads) / t
        local, self.tp_gathered, self.tp_regathered = _tp_gathered_saved(w, cb, local, float8_all_gather)
        self._context_parallel(w, cb, tokens)
        self.saved = local + self.tp_gathered + self.cp_gathered
        self.input_gradient = _attention_input_gradient(w, cb, float8_all_gather)
        self.mlp_input_gradient = _mlp_input_gradient(w, cb, mlp, float8_tp_styles)
        self.layer_input = cb * sharded * h
        incoming = cb * (sharded * h + (tokens * h if t > 1 and arch.moe is None else 0))  # an MoE's: the shard
        self.backward_working, self.at_w2_backward = _mlp_backward_working(w, cb, mlp, incoming)
        self.freed_in_backward = mlp.freed_in_backward  # released of the saved set by then
        # A checkpointed MoE block may peak in its recomputation instead: its working set there.
        self.recompute = None if mlp.recompute is None else mlp.recompute + incoming
        self.recompute_swiglu = None if mlp.recompute_swiglu is None else mlp.recompute_swiglu + incoming
        self.combine_gradient = mlp.combine_gradient
        self.weight_grad_w2 = mlp.weight_grads
        self.attention_weight_grads = None if arch.moe is not None else cb * (3 * h * arch.ffn_hidden_size + h * q) / t
        self.forward_cast, self.forward_working = _forward_transient(w, cb, float8_tp_styles, mlp.recomputed_product)
        self.checkpointed_forward = _checkpointed_forward(w, cb, float8_all_gather, mlp.recomputed_product)
        self._in_backward_memo: dict[tuple[bool, bool, bool], _BackwardParts] = {}
        self.fp8_cast = 0.0
        self.recomputed_cast = 0.0
        self.kept_mlp_backward = None
        self.gating_cast = None
        # Under training.compile the casts fuse into the compiled block (Inductor writes the
        # float8 tensor directly from the bf16 input), so these eager fp32 temporaries do not
        # exist. What the compiled block holds instead is to be measured on a GPU
        # (scripts/estimator_gpu.py); under fake tensors torch.compile falls back to eager,
        # so the CPU trace cannot see it.
        # A mixture-of-experts block's FP8 experts hold their casts inside their own backward
        # (moe.py), where this block peaks; its dense casts are the attention's alone.
        if w.fp8 and not w.compile and arch.moe is None:
            self._eager_fp8_moments(w, cb, mlp, float8_tp_styles)
        # The weights of nn.Linear modules (float8 under FP8): the attention projections and the
        # dense MLP, or the router and shared experts; then the grouped experts' weights.
        linear = (2 * h * q + 2 * h * kv) / t + mlp.linear_params
        # Norm weights, and Qwen3's q/k norms and any attention biases (counted unsharded).
        small = 2 * h + arch.attention_extra_params()
        # Unsharded, what this rank computes with; sharded, what it holds a 1/(dp_shard x cp) of.
        self.params = linear + small + mlp.grouped_params
        self.state_params = linear + small + mlp.grouped_state_params
        # FSDP all-gathers float8 weights (tensorwise scaling on nccl, entrypoints/fp8.py); an
        # MoE router stays in the compute dtype.
        float8_linear = linear - mlp.router_params
        unconverted = small + mlp.grouped_params + mlp.router_params
        self.gathered = (1 if float8_all_gather else cb) * float8_linear + cb * unconverted
        self._experts_apart(w, cb, mlp, incoming)
        # The reduce-scatter input kept until the next one: the block's unit, or with its experts
        # a unit of their own (`Layout.experts_apart`) the block without them, reduced after them.
        self.reduce_scatter_params = self.params - (mlp.grouped_params if w.layout.experts_apart else 0)
        # The unit's last parameter (feed_forward's w3; an MoE block's experts' w3, for want of a
        # trace): its unsharded gradient outlives the reduce-scatter's copy-in (`_reduce_scatter_transient`).
        self.last_param = mlp.grouped_params / 3 if mlp.grouped_params else mlp.linear_params / 3

    def _context_parallel(self, w: Workload, cb: int, tokens: float) -> None:
        """The gathered K/V a block keeps or gathers again, and its attention's backward under CP."""
        self.regathers_kv, self.recomputed_kv, self.cp_gathered, self.attention_backward = _context_parallel_kv(
            w, cb, tokens
        )
        # A checkpointed block's recomputation keeps the gathered K/V its attention's backward reads.
        self.recomputed_attention_backward = _recomputed_attention_backward(w, cb, tokens, self.attention_backward)

    def _eager_fp8_moments(self, w: Workload, cb: int, mlp: _Mlp, float8_tp_styles: bool) -> None:
        """Eager FP8's casts in the MLP's backward. w2 casts its T x f/t input to float8 through an
        fp32 copy, an fp32 scaled and an fp32 clamped tensor, 9 bytes per value on top of the saved
        set, in its forward (or recomputation) and again in its backward, beside w2's input
        gradient and two float8 copies of its incoming T x h gradient (Float8 TP styles: no
        backward cast, and the bf16 product being cast beside the float8 one the block saves).
        Where that exceeds the bf16 MLP-backward moment the block peaks there, before any of its
        weight gradients exist. Later, without TP, w1's or w3's casts (`_gating_linear_cast`);
        under TP the full-sequence input gradients are reduce-scattered as they come and the
        Float8 TP styles cast w1's and w3's output gradients once (traced 70B 16K, TP 4: the block
        peaks at w2's cast, 4.6% below that moment)."""
        t, h, f = w.layout.tensor, w.arch.hidden_size, w.arch.ffn_hidden_size
        tokens = _tokens(w)
        sharded = tokens / t
        fp8_moment = 9 * tokens * f / t + cb * sharded * h + (cb - 1) * tokens * f / t * float8_tp_styles
        fp8_moment += mlp.recomputed_product  # made again for w2's backward, beside its cast
        if not float8_tp_styles:
            fp8_moment += cb * tokens * f / t + 2 * tokens * h
        if w.fp8_recipe == "rowwise":
            # Rowwise scaling also keeps float8 copies of the MLP input (for w1 and w3) and
            # casts the gathered bf16 w2 weight to float8 (no float8 all-gather).
            fp8_moment += 2 * tokens * h + h * f / t
        if fp8_moment > self.backward_working + self.weight_grad_w2:
            if float8_tp_styles:
                # The block saves w2's float8 input, so only a recomputation casts it again: a
                # block that kept its activations runs w2's backward in bf16 working memory.
                # Traced: 8B 32K, TP 2, CP 2, no AC, sync_each: 2.2% over the trace with w2's
                # cast priced, the block's peak being w1's or w3's (`_gating_linear_cast_tp`).
                self.kept_mlp_backward = self.backward_working, self.weight_grad_w2
            self.fp8_cast = fp8_moment - cb * sharded * h
            self.backward_working = cb * sharded * h
            self.weight_grad_w2 = 0.0
            if float8_tp_styles:
                # A checkpointed block makes w2's input again from inside w2's backward, which
                # starts once the incoming gradient is all-gathered: Float8RowwiseParallel casts
                # it to float8 before the gather (NoopFwToFloat8BwDynamic after the output's
                # redistribute, torchao/float8/float8_tensor_parallel.py), so T x h float8 values.
                # The MLP's bf16 input shard, the recomputed ffn_norm's output, is alive as the
                # MLP's argument while w2 casts. Traced: 8B 16K, TP 2, PP 2, full AC, 3.1% under
                # the trace before these.
                self.recomputed_cast = tokens * h + cb * sharded * h
        if t == 1:
            self.gating_cast = _gating_linear_cast(w, cb, mlp)
        elif float8_tp_styles:
            self.gating_cast = _gating_linear_cast_tp(w, cb, mlp)

    def _experts_apart(self, w: Workload, cb: int, mlp: _Mlp, incoming: float) -> None:
        """What FSDP holds of a block's experts apart from the rest of it (`_gathered_in_backward`)."""
        # The block without its experts where they are a unit of their own (`Layout.experts_apart`),
        # as the root's backward prefetch gathers the last one (`_unpipelined_moments`) and a
        # block's experts' the one below.
        self.last_prefetched = self.gathered - (cb * mlp.grouped_params if w.layout.experts_apart else 0)
        # Over one FSDP rank a prefetch holds nothing: unshard only records an event, and the
        # shard is copied into the parameters when the unit's own pre-hook waits for it
        # (FSDPParamGroup.unshard and wait_for_unshard, `world_size == 1`). Traced: 8B 8K, TP 4,
        # PP 4 GPipe, sync_each, rank 2's second backward: 4.0% over with the block below counted.
        self.prefetch_holds = 1.0 if w.layout.fsdp_shard > 1 else 0.0
        self.copy_temporaries = cb * mlp.grouped_params if _experts_on_dim_1(w) else 0.0
        self.expert_shards = w.layout.expert_fsdp
        self.copy_out = self._copy_out(w, mlp, incoming)
        self.experts_reduced = self._experts_reduced(w, mlp, incoming)

    def _copy_out(self, w: Workload, mlp: _Mlp, incoming: float) -> dict[bool, _BackwardMoment] | None:
        """An MoE block as FSDP copies its experts out of their all-gather (`_gathered_in_backward`),
        checkpointed or not: under expert parallelism at the experts' pre-backward, with the
        gradient of their output rows made, or in a checkpointed block's recomputation, before
        the experts' forward; without it at the block's pre-backward, before any recomputation."""
        if w.arch.moe is None:
            return None
        kept = _BackwardMoment(self.saved, incoming, 0.0, 0.0, self.tp_gathered, self.cp_gathered)
        if not w.layout.experts_apart:
            return {False: kept, True: _BackwardMoment(self.layer_input, incoming, 0.0, 0.0, 0.0, 0.0)}
        recomputing = self.saved + self.tp_regathered + self.recomputed_kv - mlp.expert_saved
        return {
            False: kept._replace(working=incoming + mlp.output_gradient),
            True: _BackwardMoment(
                recomputing,
                incoming,
                0.0,
                0.0,
                self.tp_gathered + self.tp_regathered,
                self.cp_gathered + self.recomputed_kv,
            ),
        }

    def _experts_reduced(self, w: Workload, mlp: _Mlp, incoming: float) -> dict[bool, _BackwardMoment] | None:
        """Under expert parallelism, checkpointed or not, the experts' unit as FSDP reduce-scatters
        their gradients after their backward (FSDPParamGroup.post_backward, foreach_reduce in
        torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): resharded, their gradients
        copied into one reduce-dtype input, beside its output shard (weight_grads,
        `_reduce_scatter_transient`); what they kept for backward is gone, and the gradient of
        their input rows is made. Over expert_fsdp 1 or 2 the input and output hold the local
        experts once or more each, in fp32 by default.
        Traced: Mixtral 4 layers on 8 GPUs, TP 4, EP 2, no AC, sync_each: 3.7% under the trace
        without it."""
        if w.arch.moe is None or not w.layout.experts_apart:
            return None
        cb, experts = _compute_bytes(w), mlp.grouped_params
        reduced = _reduce_scatter_transient(
            cb * experts, experts, _grad_bytes(w), cb * experts / 3, w.layout.expert_fsdp, dim_1=_experts_on_dim_1(w)
        )
        working = incoming + mlp.output_gradient  # the input rows' gradient, as large as the output's
        kept = _BackwardMoment(self.saved - mlp.expert_saved, working, reduced, 0.0, self.tp_gathered, self.cp_gathered)
        recomputed = kept._replace(
            own=kept.own + self.tp_regathered + self.recomputed_kv,
            own_tp=self.tp_gathered + self.tp_regathered,
            own_cp=self.cp_gathered + self.recomputed_kv,
        )
        return {False: kept, True: recomputed}

    def in_backward(
        self, checkpointed: bool, grads_in_place: bool = False, router_loss: bool = True
    ) -> _BackwardMoment:
        """The block at its backward's peak: inside the MLP's backward, or, where it holds more,
        inside the attention's backward under K/V regathering, where its attention input's
        gradients are summed (a dense block's last moment), or for a checkpointed MoE block
        inside its recomputation. With `grads_in_place` (a bf16 reduce with gradient sync off, on
        a later micro-batch) each weight gradient is added into the one accumulated before and let
        go (autograd's AccumulateGrad: FSDP2 keeps no accumulator of its own when the reduce dtype
        is the compute dtype, FSDPParam.to_accumulated_grad_if_needed), so none is alive later in
        the block's backward. Traced: 70B 16K, PP 2 x 2, full AC, bf16 reduce, rank 1's steady
        backward: 2.8% over the trace with w2's counted. `router_loss`: whether a router loss reaches
        an MoE block's backward before its combine's (not on a pipeline stage without the loss)."""
        parts = [part for part in self.in_backward_parts(checkpointed, grads_in_place, router_loss) if part is not None]
        return max(parts, key=_BackwardMoment.total)

    def in_backward_parts(
        self, checkpointed: bool, grads_in_place: bool = False, router_loss: bool = True
    ) -> _BackwardParts:
        """`in_backward` in parts: the block's peak from its MLP's backward on, and, for a
        checkpointed MoE block, its recomputation inside the experts' SwiGLU and where their
        outputs are regathered (None otherwise). Under expert parallelism FSDP holds different
        units at each (`_gathered_in_backward`)."""
        key = checkpointed, grads_in_place, router_loss
        if key not in self._in_backward_memo:  # a pipelined rank asks again at every moment
            self._in_backward_memo[key] = self._in_backward(checkpointed, grads_in_place, router_loss)
        return self._in_backward_memo[key]

    def _in_backward(self, checkpointed: bool, grads_in_place: bool, router_loss: bool) -> _BackwardParts:
        tp_recomputed = self.tp_regathered if checkpointed else 0.0
        kv_recomputed = self.recomputed_kv if checkpointed else 0.0
        own = self.saved - self.freed_in_backward + tp_recomputed + kv_recomputed
        gathered = (self.tp_gathered + tp_recomputed, self.cp_gathered + kv_recomputed)
        working, w2_grad, fp8_cast = self.backward_working, self.weight_grad_w2, self.fp8_cast
        if checkpointed:
            fp8_cast += self.recomputed_cast
        elif self.kept_mlp_backward is not None:
            (working, w2_grad), fp8_cast = self.kept_mlp_backward, 0.0
        at_w2 = None  # a dense block's w2 backward, for gradients added in place (below)
        if self.at_w2_backward is not None:
            at_w2 = _BackwardMoment(own, self.at_w2_backward, self.weight_grad_w2, 0.0, *gathered)
        moments = [_BackwardMoment(own, working, w2_grad, fp8_cast, *gathered)]
        if self.gating_cast is not None:
            # Later in the MLP's backward, eager FP8's casts for w1 or w3, with the MLP's saved set
            # gone but its input, regathered where a kept block saved the shard. Traced: 70B 64K,
            # TP 2, CP 4, PP 2 1F1B, shard saved, FP8, sync_last_gathered, the loss stage's second
            # backward: 2.2% under the trace without it and w2's gradient.
            working, weight_grads, cast = self.gating_cast
            working += 0.0 if checkpointed else self.tp_regathered / 2
            moments.append(_BackwardMoment(own - self.mlp_saved, working, weight_grads, cast, *gathered))
        if not checkpointed and self.regathers_kv:
            # Later, in the attention's backward, the MLP's saved set is gone; a dense block's
            # MLP weight gradients and wo's exist (FSDP reduces the unit after its backward).
            # Traced: 70B 16K, CP 4, no AC, sync_each, bf16 reduce, in layer 2's attention
            # backward: 2.0% under the trace with w2's alone.
            grads = w2_grad if self.attention_weight_grads is None else self.attention_weight_grads
            moments.append(_BackwardMoment(self.saved - self.mlp_saved, self.attention_backward, grads, 0.0, *gathered))
        if checkpointed and self.recomputed_attention_backward:
            # The same in a checkpointed block's attention backward, over its recomputed set.
            # Traced: 70B 16K, CP 4, PP 2 x 2, full AC, sync_each, rank 0's steady backward:
            # 2.6% under the trace before.
            grads = w2_grad if self.attention_weight_grads is None else self.attention_weight_grads
            moments.append(
                _BackwardMoment(own - self.mlp_saved, self.recomputed_attention_backward, grads, 0.0, *gathered)
            )
        if self.mlp_input_gradient is not None:
            # Then w1's input gradient beside w3's: the MLP's saved set is gone but for its
            # gathered input, which w1 still holds (regathered, where the block kept the shard).
            working, weight_grads = self.mlp_input_gradient
            working += 0.0 if checkpointed else self.tp_regathered / 2
            own = self.saved - self.mlp_saved - self.freed_in_backward + tp_recomputed + kv_recomputed
            moments.append(_BackwardMoment(own, working, weight_grads, 0.0, *gathered))
        if self.input_gradient is not None:
            # Last, the attention input's gradient: the attention's half of the regathered
            # inputs is kept by a recomputation, or gathered again beside it. The K/V and the
            # MLP's gathered input are gone.
            kept, working, weight_grads = self.input_gradient
            regathered = self.tp_regathered / 2
            kept_tp = self.tp_gathered / 2 + (regathered if checkpointed else 0.0)
            working += 0.0 if checkpointed else regathered
            moments.append(_BackwardMoment(kept + kept_tp, working, weight_grads, 0.0, kept_tp, 0.0))
        swiglu = outputs = None
        if checkpointed and self.recompute is not None:
            recomputed = self.saved + tp_recomputed + kv_recomputed
            # Without a router loss to reach it first, the layer's first saved tensor read is the
            # combine's gather index, once its incoming gradient is copied into rows (moe.py).
            # Traced: Qwen3-30B-A3B PP 2 1F1B, EP 8, full AC, FP8 experts, rank 0: 2.1% under before.
            combine = 0.0 if router_loss else self.combine_gradient
            swiglu = _BackwardMoment(recomputed, self.recompute_swiglu + combine, 0.0, 0.0, *gathered)
            outputs = _BackwardMoment(recomputed, self.recompute + combine, 0.0, 0.0, *gathered)
        if grads_in_place:
            moments = [moment._replace(weight_grads=0.0) for moment in moments]
            # w2's gradient as its GEMM makes it, before AccumulateGrad adds it in. Traced: 70B
            # 4K, TP 4, PP 4 1F1B, selective, sync_last_gathered, bf16 reduce: rank 1's later
            # backwards peak there, 3.5% above the moment the block had been priced at.
            moments += [at_w2] if at_w2 is not None else []
        return _BackwardParts(max(moments, key=_BackwardMoment.total), swiglu, outputs)


def _forward_transient(w: Workload, cb: int, float8_tp_styles: bool, product: float) -> tuple[float, float]:
    """(float8 cast, other) bytes a dense block holds beyond its saved set at its forward's
    largest moment. Eager FP8: w2's input cast to float8 (torchao's hp_tensor_to_float8_dynamic:
    an fp32 scaled and an fp32 clamped copy beside the float8 result, 9 bytes per value of T x
    f/t; under Float8 TP styles the block saves the float8 copy, so the bf16 product is extra
    too); rowwise scaling also casts w2's gathered weight. Otherwise w2's output, T x h before
    sequence parallel's reduce-scatter (and its copy that feeds it), and the residual sum or the
    reduce-scatter's output after it; beside them w2's input, the gated `product` where the block
    does not save it (backward makes it again), and under sequence parallel with the gathered
    inputs saved, ffn_norm's output shard, the MLP's argument (FeedForward.forward's locals,
    model/llama.py). Traced: 8B 16K, TP 8, PP 4 GPipe, selective, rank 0's fourth forward (a
    kept block): 2.2% under the trace without these two. An MoE block's forward transients are
    its experts' (moe.py): not priced here."""
    arch, t = w.arch, w.layout.tensor
    if arch.moe is not None:
        return 0.0, 0.0
    tokens, h, f = _tokens(w), arch.hidden_size, arch.ffn_hidden_size
    if w.fp8 and not w.compile:
        cast = (9 + (cb - 1) * float8_tp_styles) * tokens * f / t
        if w.fp8_recipe == "rowwise":
            cast += h * f / t
        other = 0.0
        if float8_tp_styles:
            # The MLP's argument, ffn_norm's bf16 output shard, is alive while w2 casts; under
            # tp_saved_inputs shard the float8-gathered MLP input too (T x h, its own storage
            # beside the float8 shard the block keeps). Traced: 70B 32K, TP 2, CP 4, PP 4 1F1B,
            # shard saved: 2.3% under the trace at the steady forward before these.
            other = cb * tokens / t * h
            if w.tp_saved_inputs == "shard":
                other += tokens * h
        return cast, other
    # Sequence parallel reduce-scatters along the sequence, not dim 0: the functional collective
    # first copies the output's t chunks into one tensor (_chunk_or_narrow_cat in
    # reduce_scatter_single, torch/distributed/_functional_collectives.py).
    return 0.0, cb * tokens * h * (2 if t > 1 else 1) + cb * tokens / t * h + _mlp_forward_locals(w, cb, product)


def _mlp_forward_locals(w: Workload, cb: int, product: float) -> float:
    """What the eager bf16 forward transient (`_forward_transient`) counts of FeedForward.forward's
    locals while w2 runs (model/llama.py): w2's input, the gated `product`, where the block does
    not save it, and under sequence parallel with the gathered inputs saved, ffn_norm's output
    shard, the MLP's argument (with the shard saved, it is the saved shard)."""
    if w.arch.moe is not None or (w.fp8 and not w.compile):
        return 0.0
    t = w.layout.tensor
    argument = cb * _tokens(w) / t * w.arch.hidden_size if t > 1 and w.tp_saved_inputs != "shard" else 0.0
    return product + argument


def _checkpointed_forward(w: Workload, cb: int, float8_all_gather: bool, product: float) -> float:
    """What a checkpointed dense block holds in its first forward at w2's reduce-scatter, beyond
    its input (all it saves) and `_forward_transient`: nothing is saved for backward there, but
    FeedForward.forward's locals keep gate (w1 x), up (w3 x) and their product (a checkpointed
    block keeps its product, parallel/activation.py `keep_product`) until w2 returns, its argument
    keeps the MLP's input, all-gathered along the sequence under TP, and the block's frame keeps
    the residual after attention and ffn_norm's output shard (entrypoints/model/llama.py).
    Traced: 70B 8K, TP 2, PP 4 x 2, selective, sync_each, rank 1's steady forward of its
    checkpointed stage: 5.5% under the trace before it was priced. An MoE block's forward is its
    experts' (moe.py): not priced here."""
    arch, t = w.arch, w.layout.tensor
    if arch.moe is not None:
        return 0.0
    tokens, h, f = _tokens(w), arch.hidden_size, arch.ffn_hidden_size
    gathered = (1 if float8_all_gather else cb) * tokens * h if t > 1 else 0.0
    locals_ = 3 * cb * tokens * f / t + gathered + 2 * cb * tokens / t * h
    return locals_ - _mlp_forward_locals(w, cb, product)  # those the transient counts already


def _gating_linear_cast(w: Workload, cb: int, mlp: _Mlp) -> tuple[float, float, float]:
    """(working set, weight gradients, float8 cast) of a dense block without TP, eager FP8, where
    the second of w1 and w3 casts its output gradient for its weight's gradient.

    torchao's Float8Linear backward (torchao/float8/float8_linear.py,
    matmul_with_hp_or_float8_args.backward) casts the T x f output gradient once for the input
    gradient and again for the weight gradient, keeping the first float8 copy while the second
    is made through an fp32 scaled and an fp32 clamped tensor: 10 bytes per value. Beside it:
    that output gradient (silu_backward's), the linear's input gradient, the other's and the
    block's incoming residual gradient (T x h each), and w2's and the first linear's weight
    gradients in the compute dtype. The MLP's saved set is gone: the gating's backward let its
    inputs go, and w2 its input. Traced: 70B 8K, CP 2, full AC: 2.4% under the trace at w2's
    cast, where the block had been priced; 70B 4K, PP 2 x 2, sync_each: 5.8% under (with the
    re-gathered block parallel/fsdp.py no longer prefetches)."""
    tokens, h, f = _tokens(w), w.arch.hidden_size, w.arch.ffn_hidden_size
    working = cb * tokens * f + 3 * cb * tokens * h
    return working, 2 * mlp.weight_grads, 10 * tokens * f


def _gating_linear_cast_tp(w: Workload, cb: int, mlp: _Mlp) -> tuple[float, float, float]:
    """`_gating_linear_cast` under the Float8 TP styles: the first of w1 and w3 in backward casts
    its T x f/t output gradient once (Float8ColwiseParallel's NoopFwToFloat8BwDynamic, torchao/
    float8/float8_tensor_parallel.py), through an fp32 scaled and an fp32 clamped tensor beside
    the float8 result: 9 bytes per value. Beside it: the other linear's output gradient
    (silu_backward's, T x f/t), this linear's full-sequence input gradient (T x h), the incoming
    gradient's bf16 shard, and this linear's weight gradient beside w2's: FSDP reduces the
    block's gradients, or makes them the accumulated ones, only once its backward ends (a bf16
    reduce's, added in place, `_Block._in_backward` lets go). The incoming gradient all-gathered in
    float8 for w2 is gone by then. Traced: 70B 32K, TP 2, CP 4, PP 4 1F1B, sync_each, no AC: the
    rank peaks there, 2.3% under the trace at w2's cast, where the block had been priced. With
    the float8-gathered gradient counted here, 8B 32K TP 8 CP 2 PP 2 and 70B 32K TP 8 CP 2 PP 2 x
    2 were 2.2% and 2.4% over the trace; without it they and 8B 32K TP 2 CP 2 are within 0.5%."""
    t, tokens, h, f = w.layout.tensor, _tokens(w), w.arch.hidden_size, w.arch.ffn_hidden_size
    working = cb * tokens * f / t + cb * tokens * h + cb * tokens / t * h
    return working, 2 * mlp.weight_grads, 9 * tokens * f / t


class _BackwardParts(NamedTuple):
    """A block's backward moments apart (`_Block.in_backward_parts`)."""

    inside: _BackwardMoment
    swiglu_recomputed: _BackwardMoment | None
    outputs_recomputed: _BackwardMoment | None


class _BackwardMoment(NamedTuple):
    """One block at a moment of its backward (bytes): what it keeps, of which TP- and CP-gathered
    (`own_tp`, `own_cp`), its working set, its weight gradients and any float8 cast."""

    own: float
    working: float
    weight_grads: float
    fp8_cast: float
    own_tp: float
    own_cp: float

    def total(self) -> float:
        return self.own + self.working + self.weight_grads + self.fp8_cast


def _attention_input_gradient(w: Workload, cb: int, float8_all_gather: bool) -> tuple[float, float, float] | None:
    """(what the block still keeps but its gathered inputs, the working set, the weight
    gradients) where a dense block's backward ends: the gradients wv, wk and wq hand their
    shared input are summed. The input's
    gradient over the whole sequence (T x h) comes from each projection's input-gradient GEMM,
    and autograd adds them as they come: two of them and their sum are alive, with dq (T x q/t)
    not yet through wq, the block's incoming residual gradient and, under TP, its
    reduce-scatter's output (T/t x h each). Every weight gradient of the block but wq's exists
    in the compute dtype (FSDP reduces the unit's gradients after its whole backward). The block
    keeps only what the attention's norm reads: the block input, its rstd and the norm output
    (the shard, and under TP with gathered inputs the other shards). Traced: 70B 8K, TP 8, PP 4,
    shard saved, at that add, 1.8% to 3.1% above the MLP's moment it had been priced at.
    An MoE block's experts peak inside their own backward (moe.py): not priced here."""
    arch, t = w.arch, w.layout.tensor
    if arch.moe is not None:
        return None
    h, q, kv, f = arch.hidden_size, arch.q_dim, arch.kv_dim, arch.ffn_hidden_size
    tokens = _tokens(w)
    sharded = tokens / t
    norm_output = (1 if float8_all_gather and t > 1 else cb) * sharded * h
    kept = cb * sharded * h + FP32 * sharded + norm_output
    incoming = 2 * cb * sharded * h if t > 1 else cb * tokens * h
    working = 3 * cb * tokens * h + cb * tokens * q / t + incoming
    weight_grads = cb * (3 * h * f + h * q + 2 * h * kv) / t
    return kept, working, weight_grads


def _mlp_input_gradient(w: Workload, cb: int, mlp: _Mlp, float8_tp_styles: bool) -> tuple[float, float] | None:
    """(working set, weight gradients) of a dense block under TP as w1's backward makes its input
    gradient: w1 and w3 (ColwiseParallel) each give the whole sequence's partial input gradient
    (T x h), and autograd sums the two before the MLP's input redistribute reduce-scatters them
    (torch/distributed/tensor/parallel/style.py, PrepareModuleInput), so w3's is alive beside
    w1's, with w1's output gradient (silu_backward's, T x f/t), the incoming gradient's shard and
    the three weight gradients in the compute dtype (FSDP reduces the unit's once its backward
    ends). Only where f/t is small beside h (TP 8) does this outgrow w2's moment. Traced: 70B
    16K, TP 8, full AC, shard saved: 2.3% under the trace at that mm, priced at the attention
    input's gradient. Not under the Float8 TP styles, whose linears each prepare their own input
    (`_gating_linear_cast_tp`), nor for an MoE block (moe.py)."""
    t = w.layout.tensor
    if w.arch.moe is not None or t == 1 or float8_tp_styles:
        return None
    tokens, h, f = _tokens(w), w.arch.hidden_size, w.arch.ffn_hidden_size
    working = cb * tokens * f / t + 2 * cb * tokens * h + cb * tokens / t * h
    return working, 3 * mlp.weight_grads


def _mlp_backward_working(w: Workload, cb: int, mlp: _Mlp, incoming: float) -> tuple[float, float | None]:
    """The MLP's backward, where a block's backward peaks (_Mlp): its working set with the
    incoming gradient (and that gradient all-gathered under TP), and apart from it w2's backward
    alone (None for an MoE block), where w2's weight gradient is made. Under TP the gathered
    gradient lives only through w2's backward, beside the gradient of w2's input (and the product
    w2 saved); by the gating's backward, where two more T x f/t exist, it is gone (traced: 70B
    32K pp4 v2 tp2, a checkpointed block's silu_backward, 0.5 GiB below the sum of both
    moments)."""
    if w.arch.moe is not None:
        return mlp.backward_working + incoming, None
    t, tokens, h = w.layout.tensor, _tokens(w), w.arch.hidden_size
    # w2's weight-gradient GEMM reads the product, made again where the block does not save it.
    at_w2 = cb * tokens * w.arch.ffn_hidden_size / t + mlp.recomputed_product + incoming
    if t == 1:
        return mlp.backward_working + incoming, at_w2
    at_gating = mlp.backward_working + cb * tokens / t * h
    return max(at_w2, at_gating), at_w2


def _tp_gathered_saved(w: Workload, cb: int, local: float, float8_all_gather: bool) -> tuple[float, float, float]:
    """(the block's saved bytes but the gathered shards, the (t - 1) other shards of the gathered
    inputs a kept block keeps, those it gathers again in backward instead).

    Sequence parallel keeps the all-gathered norm outputs: (t - 1) more shards of each. Under
    parallel.tp_saved_inputs shard (parallel/regather.py) a kept block keeps only this rank's shard
    of the attention's and the dense MLP's (an MoE block's MLP runs on the shard, tensor.py) and
    gathers the rest again in backward; a checkpointed block's recomputation keeps them."""
    t, tokens, h = w.layout.tensor, _tokens(w), w.arch.hidden_size
    gathered = cb * (tokens - tokens / t) * h * (1 if w.arch.moe else 2)
    if float8_all_gather and t > 1:
        local, gathered = _float8_tp_styles_saved(w, cb, local)
    if w.tp_saved_inputs != "shard" or t == 1:
        return local, gathered, 0.0
    per_value = 1 if float8_all_gather else cb
    regathered = per_value * (tokens - tokens / t) * h * (1 if w.arch.moe else 2)
    return local, gathered - regathered, regathered


def _float8_tp_styles_saved(w: Workload, cb: int, local: float) -> tuple[float, float]:
    """(the block's saved bytes but the gathered shards, and those) under torchao's Float8 TP
    styles (parallel/tensor.py, tensorwise FP8 on nccl). PrepareFloat8ModuleInput casts the norm
    output to float8 before the all-gather, and Float8Linear saves the gathered float8 tensor
    (matmul_with_hp_or_float8_args saves its input as given): the attention's, and the dense
    MLP's (an MoE block's MLP runs on the bf16 shard), 1 byte per value of the whole
    sequence with no bf16 shard kept. Float8RowwiseParallel hands wo and w2 float8 inputs: w2's
    replaces the bf16 gated product, wo's is a copy beside the attention output, which attention
    keeps for its own backward. Found by tracing 8B, 8K, TP 2 without recomputation: 0.81 GiB
    over 8 layers that the bf16 accounting had added."""
    arch, t = w.arch, w.layout.tensor
    tokens = _tokens(w)
    sharded, h = tokens / t, arch.hidden_size
    float8_inputs = 2 if arch.moe is None else 1
    local -= float8_inputs * (cb - 1) * sharded * h  # the float8 inputs' own shards
    local += tokens * arch.q_dim / t  # wo's float8 input
    gathered = float8_inputs * (tokens - sharded) * h
    if arch.moe is None:
        local -= (cb - 1) * tokens * arch.ffn_hidden_size / t  # w2's input, in float8
    return local, gathered


def _ulysses_output_copy(w: Workload, cb: int, float8_tp_styles: bool) -> float:
    """Under Ulysses CP, wo's input: SDPA saves its output for the whole sequence and H/c heads,
    and wo saves its own input, a copy, since the inverse all-to-all returns [B, H, S/c, D] and
    the attention's transpose(1, 2).reshape cannot view that as [B, S/c, H x D]
    (parallel/ulysses.py `heads_from_sequence`, model/llama.py Attention.forward). Under the
    Float8 TP styles wo saves a float8 cast of it instead, counted already
    (`_float8_tp_styles_saved`). Traced: 8B 64K, TP 2, CP 4, no AC, shard saved: 2.8% under the
    trace without it."""
    if w.layout.context == 1 or w.cp_attention_path != "ulysses" or float8_tp_styles:
        return 0.0
    return cb * _tokens(w) * w.arch.q_dim / w.layout.tensor


def _recomputed_attention_backward(w: Workload, cb: int, tokens: float, regathering: float) -> float:
    """The attention backward's working set (`_context_parallel_kv`) in a checkpointed block,
    which reads the K/V of the whole sequence its recomputation kept (context.py hands
    zigzag_attention the gathered K/V, and autograd's all-gather reduces their gradients): all
    but the K/V gathered again; 0 where a kept block does not regather either."""
    if not regathering:
        return 0.0
    return regathering - 2 * cb * tokens * w.layout.context * w.arch.kv_dim / w.layout.tensor


def _context_parallel_kv(w: Workload, cb: int, tokens: float) -> tuple[bool, float, float, float]:
    """(whether kept blocks regather K/V in backward, what a checkpointed block's recomputation
    keeps of the gathered K/V, what a kept block saves of it, the attention backward's working
    set under regathering), per block and micro-batch on one rank of T = `tokens` tokens.

    Context parallel gathers K and V of the whole sequence: (c - 1) more chunks of each.
    Ulysses (parallel/ulysses.py) instead saves q, k, v and the output of the whole sequence for
    heads/c heads, as many values as the local ones `_Block` counts, and wo's input beside them
    (a copy, which `_Block` adds): no K/V of the whole sequence. A block that
    keeps its activations saves only the rank's K/V and gathers the rest again in its backward
    (parallel/context.py); a checkpointed block's recomputation, and document masking's masked
    path, keep the gathered K/V. The attention's backward under regathering
    (cp_attention._LseMergedAttention) holds K, V gathered again and dK, dV of the whole
    sequence, the incoming gradient and dq of the rank's queries, and at its peak, the backward
    of the prefix piece of the rank's later chunk (cp_attention._backward_pieces), per query
    value of that chunk (T/2 x q): the prefix's dK and dV (up to (2c - 1)/2c of the whole K/V)
    and its dq; the diagonal piece's dq, dK and dV (on every query head), still bound, and under
    GQA its K and V repeated per query head; the contiguous copies of the chunk's incoming
    gradient and output; and its queries stacked by K/V head, a copy. Traced: 70B 16K, CP 4, no
    AC, sync_each, in layer 2's attention backward: 2.0% under the trace before the per-chunk
    terms and the MLP's weight gradients (`_Block._in_backward`)."""
    arch, t, c = w.arch, w.layout.tensor, w.layout.context
    kv, q = arch.kv_dim, arch.q_dim
    gathered_kv = 0 if w.cp_attention_path == "ulysses" else cb * tokens * (c - 1) * 2 * kv / t
    if gathered_kv == 0 or w.document_masking:
        return False, 0.0, gathered_kv, 0.0
    whole_kv = cb * tokens * c * kv / t
    chunk = cb * tokens / 2 * q / t  # the zigzag layout gives each rank two query chunks
    repeated_kv = 2 if arch.num_heads > arch.num_kv_heads else 0
    pieces = (1 + 3 + repeated_kv + 2 + 1) * chunk
    attention_backward = (4 + 2 * (2 * c - 1) / (2 * c)) * whole_kv + 2 * cb * tokens * q / t + pieces
    return True, gathered_kv, 0.0, attention_backward


class _Mlp:
    """The MLP's part of a block: the dense SwiGLU (f/t columns per tp rank), or a mixture of
    experts (moe.py; on the rank's own T/t tokens under TP)."""

    __slots__ = (
        "saved",
        "backward_working",
        "weight_grads",
        "freed_in_backward",
        "recompute",
        "recompute_swiglu",
        "recomputed_product",
        "linear_params",
        "router_params",
        "grouped_params",
        "grouped_state_params",
        "expert_saved",
        "output_gradient",
        "combine_gradient",
    )

    def __init__(self, w: Workload, cb: int, *, product_recomputed: bool):
        arch, t = w.arch, w.layout.tensor
        h, f = arch.hidden_size, arch.ffn_hidden_size
        self.recomputed_product = 0.0
        self.expert_saved = self.output_gradient = self.combine_gradient = 0.0
        if arch.moe is None:
            tokens = _tokens(w)
            product = cb * tokens * f / t
            # w1 x and w3 x, and their gated product where w2 keeps it (_Block).
            self.saved = cb * tokens * 2 * f / t + (0.0 if product_recomputed else product)
            # MLP backward: the gradient of w2's input and the two the gating makes are alive
            # while w2's input is freed (net: two T x f/t), with w2's weight gradient. Where
            # backward makes the product again it is that input, alive until w2's backward
            # is through (three T x f/t); a checkpointed block's recomputation keeps it
            # instead, for the same total.
            self.recomputed_product = product if product_recomputed else 0.0
            self.backward_working = cb * 2 * tokens * f / t + self.recomputed_product
            self.weight_grads = cb * h * f / t
            self.freed_in_backward = 0.0
            self.recompute = self.recompute_swiglu = None
            self.linear_params = 3 * h * f / t
            self.router_params = self.grouped_params = self.grouped_state_params = 0.0
            return
        experts = moe_memory(w, cb)
        self.saved = experts.saved
        self.backward_working = experts.backward_working
        self.weight_grads = experts.weight_grads
        self.freed_in_backward = experts.freed_in_backward
        self.recompute = experts.recompute_working
        self.recompute_swiglu = experts.swiglu_recompute_working
        self.linear_params = experts.local_params - experts.local_expert_params
        self.router_params = arch.moe.num_experts * h  # in linear_params, never float8 (entrypoints/fp8.py)
        self.grouped_params = experts.local_expert_params
        self.grouped_state_params = experts.state_params - self.linear_params
        self.expert_saved = experts.expert_saved
        self.output_gradient = experts.output_gradient
        self.combine_gradient = experts.combine_gradient


def _checkpointed_below(mode: str, index: int) -> int:
    """How many of layers 0 .. index-1 entrypoints/parallel/activation.py checkpoints without
    pipelining (launcher.contract.layout.checkpointed_layers): full wraps every block, selective
    the odd layers."""
    return index if mode == "full" else index // 2 if mode == "selective" else 0


def _checkpointed_by_stage(workload: Workload, rank: int) -> tuple[tuple[int, int], ...]:
    """(layers, of those checkpointed) of each stage pipeline rank `rank` holds, in order (its
    stages are rank, rank + p, ... of p x v, each a contiguous run of layers)."""
    layout = workload.layout
    return _stage_checkpointing(
        workload.activation_checkpointing,
        workload.arch.num_layers,
        Layout(pipeline=layout.pipeline, virtual_stages=layout.virtual_stages, pipeline_layers=layout.pipeline_layers),
        rank,
    )


@cache
def _stage_checkpointing(mode: str, num_layers: int, layout: Layout, rank: int) -> tuple[tuple[int, int], ...]:
    # Cached on what decides it: the planner estimates thousands of layouts that share these.
    chosen = checkpointed_layers(mode, num_layers, layout)
    runs = (stage_layers(num_layers, layout, s) for s in rank_stages(rank, layout))
    return tuple((len(run), len(chosen.intersection(run))) for run in runs)


def _checkpointed_on_rank(workload: Workload, rank: int) -> int:
    """How many of the layers pipeline rank `rank` holds are checkpointed."""
    return sum(checkpointed for _, checkpointed in _checkpointed_by_stage(workload, rank))


def rope_values(w: Workload) -> float:
    """Values of the RoPE table a stage's forward casts to the compute dtype (model/llama.py
    Transformer.forward: `self.rope.to(h.dtype)`), which every layer's rotation saves, so each
    micro-batch in flight keeps one: [2, s/c, head_dim/2], or per sample [2, b, s/c, head_dim/2]
    where document masking restarts the positions in each document (`document_rope`, the
    default `document_positions: restart`). Traced: a pipelined rank holds one per chunk in
    flight (llama-tiny, TP 2, PP 2 x 2, FP8: five at its steady forward)."""
    per_sample = w.micro_batch_size if w.document_masking else 1
    return per_sample * w.seq_len / w.layout.context * w.arch.head_dim


def document_mask_bytes(w: Workload, cb: int, device: str) -> float:
    """What document masking (entrypoints/model/documents.py) keeps per micro-batch, shared by
    every layer of a rank until its backward: the int32 document ids of the whole sequence, and
    - on the CPU, an additive mask [b, 1, Lq, Lk] in the compute dtype per query range
      (SDPA saves it): the whole sequence for plain attention and Ulysses, the two zigzag chunks
      against their key prefixes for the all-gather path;
    - on CUDA, flex_attention's block mask: four int32 tables of 128 x 128 blocks.
    """
    if not w.document_masking:
        return 0.0
    b, s, c = w.micro_batch_size, w.seq_len, w.layout.context
    ids = 4 * b * s
    if c > 1 and w.cp_attention_path == "allgather":
        chunk = s / (2 * c)
        # Rank r's chunks r and 2c-1-r see r+1 and 2c-r chunks of keys: 2c+1 chunk pairs in all.
        ranges = [(chunk, chunk * (2 * c + 1))]
    else:
        ranges = [(s, s)]
    if device == "cpu":
        return ids + sum(cb * b * q_len * k_keys for q_len, k_keys in ranges)
    return ids + sum(4 * 4 * b * ceil(q_len / 128) * ceil(k_keys / 128) for q_len, k_keys in ranges)


class _Context:
    """What every rank's moments share: the compute dtype, one block, the loss, and what each
    micro-batch keeps for all its layers (`shared`)."""

    __slots__ = ("w", "cb", "block", "loss", "device", "documents", "shared")

    def __init__(self, workload: Workload, device: str):
        self.w, self.device = workload, device
        self.cb = _compute_bytes(workload)
        self.documents = document_mask_bytes(workload, self.cb, device)
        self.shared = self.cb * rope_values(workload) + self.documents
        # Float8 collectives exist on nccl only; gloo (the CPU) all-gathers in the compute dtype.
        gather = float8_all_gather(fp8=workload.fp8, fp8_recipe=workload.fp8_recipe, backend=collective_backend(device))
        self.block = _Block(workload, self.cb, float8_all_gather=gather)
        self.loss = _Loss(workload, self.cb)


def stage_peaks(
    workload: Workload, *, device: str = "cuda", limit_bytes: float | None = None
) -> list[StageMemory] | None:
    """Each pipeline rank at its largest moment, with the device overheads added. Under uneven
    stages each rank is counted with the layers it really holds; the largest must fit.

    With `limit_bytes`, None as soon as one rank's peak is above it: the planner rejects most of
    its candidates this way at the cost of one or two ranks. The ranks that usually peak go
    first: rank 0 keeps the most micro-batches in flight, the last holds the loss."""
    context = _Context(workload, device)
    p = workload.layout.pipeline
    order = [0, *([p - 1] if p > 1 else []), *range(1, p - 1)]
    stages = {}
    for rank in order:
        stage = _stage_peak(context, rank, device)
        if limit_bytes is not None and stage.peak_bytes > limit_bytes:
            return None
        stages[rank] = stage
    return [stages[rank] for rank in range(p)]


def _stage_peak(context: _Context, rank: int, device: str) -> StageMemory:
    workload = context.w
    layers = rank_layers(workload.arch.num_layers, workload.layout, rank)
    found = _rank_moments(context, rank)
    phase, breakdown = max(found.items(), key=lambda item: sum(item[1].values()))
    breakdown = {name: round(value) for name, value in breakdown.items()}
    breakdown.update(device_overheads(workload.layout, sum(breakdown.values()), device))
    return StageMemory(stage=rank, layers=layers, phase=phase, breakdown=breakdown)


def saved_activation_bytes(workload: Workload, *, rank: int = 0) -> int:
    """Bytes one micro-batch keeps for backward on pipeline rank `rank`, over all its layers
    (with the TP- and CP-gathered parts), after its forward: what more TP, CP or
    checkpointing reduce and longer sequences increase."""
    context = _Context(workload, "cuda")
    block, cb = context.block, context.cb
    layers = rank_layers(workload.arch.num_layers, workload.layout, rank)
    checkpointed = _checkpointed_on_rank(workload, rank)
    total = checkpointed * block.layer_input + (layers - checkpointed) * block.saved
    if rank == workload.layout.pipeline - 1:
        total += context.loss.head_saved
    return round(total + cb * _tokens(workload) * workload.arch.head_dim)


def moments(workload: Workload, *, rank: int = 0, device: str = "cuda") -> dict[str, dict[str, int]]:
    """Allocated bytes by component at each candidate peak moment of pipeline rank `rank`.

    Without pipeline parallelism: the loss's forward and backward, the backward of the
    first two and last two blocks reached (activations shrink and gradient shards grow by
    one block per step, so the largest block moment is at one of those ends), the
    embedding's backward and the optimizer step.
    """
    found = _rank_moments(_Context(workload, device), rank)
    return {name: {k: round(v) for k, v in breakdown.items()} for name, breakdown in found.items()}


def _rank_moments(context: _Context, rank: int) -> dict[str, dict[str, float]]:
    workload, block, device = context.w, context.block, context.device
    w, arch, layout = workload, workload.arch, workload.layout
    h, V = arch.hidden_size, arch.vocab_size
    t, p = layout.tensor, layout.pipeline
    shard = layout.fsdp_shard
    first, last = rank == 0, rank == p - 1
    n = rank_layers(arch.num_layers, layout, rank)

    vocab_matrix = V * h / t
    root_params = (vocab_matrix if first else 0) + ((0 if arch.tie_embeddings else vocab_matrix) + h if last else 0)
    if arch.tie_embeddings and last and not first:
        root_params += vocab_matrix
    stage_params = n * block.state_params + root_params

    base = empty_breakdown()
    # Each of the rank's stage modules holds its fp32 RoPE table, [2, s/c, head_dim/2].
    rope_tables = len(rank_stages(rank, layout)) * FP32 * w.seq_len / layout.context * arch.head_dim
    base["parameters"] = FP32 * stage_params / shard + rope_tables
    base["optimizer_states"] = 2 * OPTIMIZER_STATE_BYTES[w.optimizer_state_dtype] * stage_params / shard
    grads_full = FP32 * stage_params / shard

    found: dict[str, dict] = {}
    if p > 1:
        loss = context.loss if last else None
        head_saved = loss.head_saved if last else 0
        found.update(_pipelined_moments(w, block, context, rank, base, loss, head_saved, root_params))
    else:
        found.update(_unpipelined_moments(context, n, base, root_params, grads_full))
    if w.evaluates:
        found["evaluation (forward only)"] = _evaluation_moment(context, n, base, root_params, last=last)
    optimizer = dict(base)
    optimizer["gradients"] = grads_full
    if w.optimizer_state_dtype == "bf16":  # AdamWBf16Moments: two fp32 chunks of one shard at a time
        largest = max(vocab_matrix if first or last else 0, h * max(arch.ffn_hidden_size, arch.q_dim) / t) / shard
        optimizer["optimizer_temp"] = 2 * FP32 * min(BF16_MOMENTS_CHUNK, largest)
    elif device == "cpu":
        optimizer["optimizer_temp"] = FP32 * stage_params / shard  # foreach AdamW on the CPU
    found["optimizer step"] = optimizer
    return found


def _evaluation_moment(context: _Context, n: int, base: dict, root_params: float, *, last: bool) -> dict:
    """data.validation's pass (entrypoints/evaluate.py) at its largest: inside a block's forward.

    It runs between steps, after zero_grad(set_to_none) freed the gradients, under no_grad, so
    nothing is saved for a backward: one block's forward set and its input are alive, never the
    kept activations of every layer a training step holds. Blocks are gathered one at a time
    with the next one's all-gather prefetched, or all of them where they are not resharded
    after forward (pipelining, sync_last_gathered). Every term is at most the same term of the
    training step's moments, so the pass never sets the peak (tests/estimate/test_evaluation.py)."""
    w, block, cb = context.w, context.block, context.cb
    gathered = n if w.layout.pipeline > 1 or w.grad_accumulation == "sync_last_gathered" else min(n, 2)
    moment = dict(base)
    moment["fsdp_buffers"] = cb * root_params + gathered * block.gathered
    moment["activations"] = block.saved + block.recomputed_kv + block.layer_input + context.shared
    moment["loss"] = context.loss.forward_working if last else 0.0
    return moment


def _kept(block: _Block, count: int, checkpointed: int) -> tuple[float, float, float]:
    """(bytes, of which TP-gathered, of which CP-gathered) kept by `count` layers."""
    full = count - checkpointed
    return (
        checkpointed * block.layer_input + full * block.saved,
        full * block.tp_gathered,
        full * block.cp_gathered,
    )


def _with_activations(breakdown: dict, alive: tuple[float, float, float], extra: float) -> dict:
    total, tp, cp = alive
    breakdown["activations"] = total - tp - cp + extra
    breakdown["tp_buffers"] = tp
    breakdown["cp_buffers"] = cp
    return breakdown


def _compute_bytes(w: Workload) -> int:
    """Bytes per value of activations and gathered weights: the compute dtype's."""
    return FP32 if w.dtype == "fp32" else 2


def _grad_bytes(w: Workload) -> int:
    """Bytes per value of unsharded gradients and of the reduce-scatter input: reduce_dtype's.
    (FSDP2 drops reduce_dtype when it equals the compute dtype; gradients then stay in it.)"""
    return 2 if w.reduce_dtype == "bf16" else FP32


def accumulation_changes_memory(workload: Workload) -> bool:
    """Whether `grad_accumulation` changes this accounting's bytes: with more than one micro-batch
    per step (`_Accumulation`; under pipelining, sync_each against the others, which keep
    gradients unsharded: `_pipelined_moments`)."""
    return workload.grad_accum_steps > 1


class _Accumulation:
    """What a step without pipeline parallelism keeps across micro-batches, by
    `grad_accumulation` (entrypoints/parallel/accumulate.py), at the last micro-batch's moments,
    which hold everything the earlier ones do.

    - sync_each (and any mode with one micro-batch): earlier micro-batches' gradients are
      reduce-scattered into the fp32 gradient shards; blocks are gathered one at a time.
    - sync_last: FSDP2 keeps each parameter's gradient unsharded, in the reduce dtype
      (`unsharded_accumulated_grad`, fp32 unless reduce_dtype is bf16), until the last
      micro-batch's backward reduce-scatters it; the root unit's (embedding, output weight)
      at the very end of backward. Gradient shards appear only for blocks already reduced.
    - sync_last_gathered: blocks also stay gathered from the first forward until the last
      micro-batch's backward reshards each one after its gradient is reduced.
    """

    __slots__ = ("block", "n", "shard", "grad_bytes", "unsynced", "gathered", "earlier_shards", "root_grads")

    def __init__(self, w: Workload, block: _Block, n: int, root_params: float, grads_full: float, cb: int):
        mode = w.grad_accumulation if w.grad_accum_steps > 1 else "sync_each"
        self.block, self.n, self.shard = block, n, w.layout.fsdp_shard
        self.grad_bytes = _grad_bytes(w)
        self.unsynced = mode != "sync_each"
        self.root_grads = self.grad_bytes * root_params
        self.gathered = mode == "sync_last_gathered"
        # sync_each: every shard already holds the earlier micro-batches' gradient sums.
        self.earlier_shards = grads_full if w.grad_accum_steps > 1 and not self.unsynced else 0.0

    def gradients(self, reduced_blocks: int) -> float:
        """Gradient shards once `reduced_blocks` blocks' gradients are reduce-scattered."""
        return self.earlier_shards or FP32 * reduced_blocks * self.block.state_params / self.shard

    def unsharded_grads(self, reduced_blocks: int) -> float:
        """Accumulated unsharded gradients of the units not yet reduce-scattered (with the root's)."""
        if not self.unsynced:
            return 0.0
        return self.root_grads + self.grad_bytes * (self.n - reduced_blocks) * self.block.params

    def gathered_blocks(self, one_at_a_time: float, still_gathered: int) -> float:
        """Bytes of gathered blocks: `one_at_a_time` under resharding, else `still_gathered` blocks."""
        return still_gathered * self.block.gathered if self.gathered else one_at_a_time


def _unpipelined_moments(context: _Context, n: int, base: dict, root_params: float, grads_full: float) -> dict:
    """The one rank of a layout without pipeline parallelism, holding all `n` layers: the loss's
    forward and backward, the blocks' backward and the embedding's backward."""
    w, block, cb, loss = context.w, context.block, context.cb, context.loss
    arch, t = w.arch, w.layout.tensor
    h, V = arch.hidden_size, arch.vocab_size
    mode = w.activation_checkpointing
    vocab_matrix = V * h / t
    rope_cast = context.shared
    all_kept = _kept(block, n, _checkpointed_below(mode, n))
    acc = _Accumulation(w, block, n, root_params, grads_full, cb)
    gathered_root = cb * root_params
    found: dict[str, dict] = {}
    # The loss: forward, then backward (the output weight's gradient stays unsharded until
    # the root's reduce-scatter at the very end of backward).
    forward = dict(base)
    forward["gradients"] = acc.gradients(0)
    forward["fsdp_buffers"] = gathered_root + acc.gathered_blocks(0, n) + acc.unsharded_grads(0)
    forward["loss"] = loss.forward_working
    found["loss forward"] = _with_activations(forward, all_kept, rope_cast + loss.head_saved)
    # FSDP's root pre-backward hook has already prefetched the unit whose forward ended before the
    # root's (FSDPParamGroup._backward_prefetch, torch/distributed/fsdp/_fully_shard/
    # _fsdp_param_group.py): the last block, under EP without its experts (a unit of their own).
    backward = dict(forward)
    backward["fsdp_buffers"] = (
        gathered_root
        + cb * vocab_matrix
        + acc.gathered_blocks(block.last_prefetched * block.prefetch_holds if n else 0, n)
        + acc.unsharded_grads(0)
    )
    backward["loss"] = loss.backward_working
    found["loss backward"] = _with_activations(backward, all_kept, rope_cast + loss.head_saved)
    # Blocks in backward, last layer first. The k-th one reached holds the kept
    # activations of the layers below it, its own full set (recomputed if checkpointed),
    # its gathered weights and the next block's prefetched all-gather buffer; from the
    # second block on also the previous block's reduce-scatter input and the
    # gradient shards of the blocks done.
    output_grad = 0 if arch.tie_embeddings else cb * vocab_matrix
    # Accumulated in the compute dtype (a bf16 reduce, gradients unsynced over micro-batches),
    # the output weight's gradient is added into the one the earlier micro-batches left (autograd's
    # AccumulateGrad: FSDP2 keeps no accumulator of its own when the reduce dtype is the
    # gradient's, FSDPParam.to_accumulated_grad_if_needed in torch/distributed/fsdp/_fully_shard/
    # _fsdp_param.py) as the loss's backward ends: by the blocks' backward it is root_grads alone
    # (traced: 70B 16K, TP 4, CP 4, sync_last, 6.1% over the trace when counted twice).
    beside_blocks = 0 if acc.unsynced and acc.grad_bytes == cb else output_grad
    # So is each block's weight gradients (`_Block.in_backward`).
    grads_in_place = acc.unsynced and acc.grad_bytes == cb
    reduce_scatter = acc.grad_bytes * block.reduce_scatter_params
    # From the second block reached on, each block adds a gradient shard and lets go of what the
    # layer below it kept; selective checkpointing alternates kept and recomputed layers, so each
    # kind's moments grow or shrink steadily and peak at its first or last block: the first,
    # second and third reached (the first recomputed one after a kept one, or the reverse), and
    # the last two. Traced: 70B 32K, TP 8, CP 4, selective, the third block: 2.2% under the
    # trace with the first two alone.
    beside = gathered_root + beside_blocks + reduce_scatter
    for k in sorted({k for k in (0, 1, 2, n - 2, n - 1) if 0 <= k < n}):
        index = n - 1 - k
        below_checkpointed = _checkpointed_below(mode, index)
        below = _kept(block, index, below_checkpointed)
        recomputed = _checkpointed_below(mode, index + 1) > below_checkpointed
        candidates = []
        for part, when in _block_parts(block, recomputed, grads_in_place, reduces=not acc.unsynced):
            own, working, weight_grads, fp8_cast, own_tp, own_kv = part
            moment = dict(base)
            moment["gradients"] = acc.gradients(k)
            moment["fsdp_buffers"] = (
                (beside if k >= 1 else beside - reduce_scatter)
                + acc.gathered_blocks(_gathered_in_backward(block, index, when), index + 1)
                + acc.unsharded_grads(k)
                + weight_grads
            )
            moment["working"] = working
            moment["fp8"] = fp8_cast
            alive = (below[0] + own, below[1] + own_tp, below[2] + own_kv)
            candidates.append(_with_activations(moment, alive, rope_cast))
        found[f"backward of layer {index}"] = max(candidates, key=lambda moment: sum(moment.values()))
    found["backward of the embedding"] = _embedding_backward(w, acc, base, beside, vocab_matrix)
    output = 0 if arch.tie_embeddings else vocab_matrix
    found["root reduce-scatter"] = _root_reduce_scatter(w, acc, base, root_params, output)
    return found


def _block_parts(block: _Block, recomputed: bool, grads_in_place: bool, *, reduces: bool) -> list[tuple]:
    """(moment, when) for each candidate peak of a block's backward without pipelining, `when`
    as `_gathered_in_backward` takes it; `reduces`: FSDP reduce-scatters every micro-batch."""
    inside, swiglu, outputs = block.in_backward_parts(recomputed, grads_in_place)
    copy_out = block.copy_out[recomputed] if block.copy_out else None
    reduced = block.experts_reduced[recomputed] if block.experts_reduced and reduces else None
    parts = (
        (inside, "inside"),
        (swiglu, "recomputing"),
        (outputs, "recomputed_outputs"),
        (copy_out, "copy_out"),
        (reduced, "reduced"),
    )
    return [(part, when) for part, when in parts if part is not None]


def _experts_on_dim_1(w: Workload) -> bool:
    """Whether FSDP shards the experts' weights on dim 1: where a rank's experts do not divide
    over their shard ranks (entrypoints/parallel/fsdp.py `expert_placement`)."""
    moe, layout = w.arch.moe, w.layout
    if moe is None:
        return False
    shards = layout.expert_fsdp if layout.experts_apart else layout.fsdp_shard
    return (moe.num_experts // layout.expert) % shards != 0


def _gathered_in_backward(block: _Block, index: int, when: str) -> float:
    """What FSDP holds gathered while block `index` is in backward (not pipelined, resharding):
    the block, and the block below it, prefetched (FSDPParamGroup._backward_prefetch, torch/
    distributed/fsdp/_fully_shard/_fsdp_param_group.py: the unit whose forward finished just
    before this one's). Under expert parallelism the experts are a unit of their own, whose
    forward ends inside the block's: the block's pre-backward prefetches its own experts, and
    the experts' pre-backward the block below without its experts, so the MLP's backward and
    the rest of the block see no other experts. A checkpointed block recomputes before the
    experts' pre-backward: the experts run their forward again, gathered, while FSDP keeps the
    prefetch's all-gather output as a forward does (FSDPParamGroup.wait_for_unshard keeps it in
    comm_ctx.all_gather_state), and the block below is not yet prefetched. Traced: Mixtral 4
    layers, 16 GPUs, EP 4, full AC, sync_each: 6.1% over the trace with the block below's experts
    counted in the MLP's backward.

    `when`: "inside" the MLP's backward or later, "recomputing" (a checkpointed MoE block, in
    the experts' SwiGLU) and "recomputed_outputs" (later, where their outputs are regathered),
    "reduced" (the experts' reduce-scatter under expert parallelism, `_Block._experts_reduced`),
    or at the experts' "copy_out" from their all-gather output (FSDP's foreach_all_gather_copy_out,
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), into the parameters' own storage
    beside that output, and for weights sharded on dim 1 through a temporary copy each first
    (`copy_temporaries`). Traced: Mixtral 4 layers, 16 GPUs, EP 2, no AC, sync_each: 6.0% under
    the trace without the copy-out."""
    experts = block.gathered - block.last_prefetched  # none without expert parallelism
    below = block.prefetch_holds if index > 0 else 0.0  # the block below, prefetched
    if when == "reduced":  # under expert parallelism: the experts are resharded
        return block.last_prefetched * (1 + below)
    if when == "copy_out":  # the block below is not prefetched yet
        return block.gathered + (experts or block.gathered) + block.copy_temporaries
    if not experts:
        return block.gathered * (1 + below)
    if when == "recomputing":  # over one expert_fsdp rank no all-gather output is kept (`_chunk_forward`)
        return block.gathered + (experts if block.expert_shards > 1 else 0)
    if when == "recomputed_outputs":  # the all-gather output is let go by the experts' forward's end
        return block.gathered
    return block.gathered + block.last_prefetched * below


def _embedding_backward(w: Workload, acc: _Accumulation, base: dict, beside: float, vocab_matrix: float) -> dict:
    """The embedding's backward, last without pipelining: every block's gradient shard and the
    last block's reduce-scatter input exist (in `beside`, with the gathered root and the output
    weight's gradient), with the embedding's dense gradient over the rank's V / tp rows
    (parallel/tensor.py's VocabParallelEmbedding) and the output gradient it reads, all-gathered
    along the sequence under TP. The output weight's gradient is there once, as beside the blocks
    (traced under TP 2 and 8, FP8 or not, sync_each and sync_last: a second copy the estimate
    had counted is not made, 2-5% over the trace here)."""
    cb = _compute_bytes(w)
    moment = dict(base)
    moment["gradients"] = acc.gradients(acc.n)
    moment["fsdp_buffers"] = beside + cb * vocab_matrix + acc.unsharded_grads(acc.n)
    moment["working"] = cb * _tokens(w) * w.arch.hidden_size
    return moment


def _root_reduce_scatter(w: Workload, acc: _Accumulation, base: dict, root_params: float, output: float) -> dict:
    """The root unit (embedding, final norm, output weight) reduced at the very end of backward,
    by FSDP's final callback: every block is resharded and reduced, the activations are gone, and
    the root, resharded too, copies its unsharded gradients (the compute dtype's, or accumulated
    in the reduce dtype) into a reduce-scatter input in the reduce dtype. foreach_reduce's loop
    variable `unsharded_grad` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) keeps
    the last one, the output weight's (`output` values; the final norm's where tied), beside the
    input and the output shard. Traced: 8B 8K, CP 2, selective, sync_each, FP8, the root's
    reduce-scatter input beside both dense gradients: 2.5% under the trace before it was
    priced."""
    per_value = acc.grad_bytes if acc.unsynced else _compute_bytes(w)
    last = output or w.arch.hidden_size
    gb, shard = acc.grad_bytes, w.layout.fsdp_shard
    moment = dict(base)
    moment["gradients"] = acc.gradients(acc.n)
    moment["fsdp_buffers"] = _reduce_scatter_transient(
        per_value * root_params, root_params, gb, per_value * last, shard
    )
    return moment


def _tokens(w: Workload) -> float:
    """Tokens of one micro-batch on one rank: context parallelism splits the sequence."""
    return w.micro_batch_size * w.seq_len / w.layout.context


def _pipelined_moments(w, block, context, rank, base, loss, head_saved, root_params) -> dict:
    """A pipeline rank at the backwards where it can peak (`backward_moments`), with all its
    blocks gathered.

    Blocks are not resharded after forward (parallelize.py). Under sync_last_gathered (what
    `auto` picks where it fits) torch.distributed.pipelining turns FSDP's gradient sync off
    until the end of the step, so each block's gradient accumulates unsharded in the reduce dtype
    (`unsharded_accumulated_grad`) from its first backward on. Under sync_each
    (pipeline.py's _GradientSyncEachMicroBatch) every backward reduce-scatters instead: the
    stages done hold fp32 gradient shards. The moments are the chunk's first block in backward,
    whose gradients are not reduced yet and before which no reduce-scatter input is pending (the
    last backward's was released at its end: FSDP's final callback under is_last_backward), and
    under sync_each that block's reduce-scatter and the next block's backward (_chunk_moments).
    Receive buffers exist only around the chunk that consumes them (receive_buffers_in_backward).
    """
    layout, cb = w.layout, context.cb
    m = w.grad_accum_steps
    n = rank_layers(w.arch.num_layers, layout, rank)
    last_stage = layout.num_stages - 1
    boundary = cb * _tokens(w) / layout.tensor * w.arch.hidden_size
    # A chunk in flight holds what its stage's layers keep (an end stage may hold none, and the
    # stages' checkpointed layers differ) and its micro-batch's document masks.
    by_stage = _checkpointed_by_stage(w, rank)
    per_chunk = [_kept(block, layers, checkpointed) for layers, checkpointed in by_stage]
    chosen = checkpointed_layers(w.activation_checkpointing, w.arch.num_layers, layout)
    # The embedding's gradient comes with stage 0's backward, the output layer's with the last's.
    root_stage = 0 if rank == 0 else last_stage

    sync_each = w.grad_accumulation == "sync_each"
    counts = {s: len(stage_layers(w.arch.num_layers, layout, s)) for s in rank_stages(rank, layout)}
    output_grad = cb * w.arch.vocab_size * w.arch.hidden_size / layout.tensor
    weights = tuple(kept[0] for kept in per_chunk)
    moments = {}
    for at in forward_moments(rank, layout, w.pipeline_schedule, m, weights):
        moment = _with_gradients(w, block, base, at, n, root_params, root_stage, counts)
        activations, tp, cp = _in_flight(w, context, at, per_chunk, head_saved)
        # A chunk of the loss stage in its blocks' forward has not reached the head yet.
        activations -= head_saved if at.stage == last_stage else 0.0
        run = stage_layers(w.arch.num_layers, layout, at.stage)
        if run and run[-1] in chosen:  # the chunk's last block runs its forward checkpointed
            activations += block.checkpointed_forward
        # Resharded after the stage's last backward; over one rank FSDP copies the shard in place
        # of an all-gather and keeps no output (`_chunk_forward`).
        regathered = sync_each and at.stage in at.done and layout.fsdp_shard > 1
        moments[f"{at.name} (pipeline)"] = _chunk_forward(block, moment, activations, tp, cp, regathered=regathered)
    for at in backward_moments(rank, layout, w.pipeline_schedule, m, weights):
        moment = _with_gradients(w, block, base, at, n, root_params, root_stage, counts)
        kept_activations, tp, cp = _in_flight(w, context, at, per_chunk, head_saved)
        moment["tp_buffers"] = tp
        moment["cp_buffers"] = cp
        with_loss = loss is not None and at.stage == last_stage
        receive_buffers = boundary * receive_buffers_in_backward(at.stage, layout)
        in_place = not sync_each and _grad_bytes(w) == cb and last_stage in at.done
        beside = output_grad if with_loss and not in_place else 0.0
        # The loss stage's chunk reaches its blocks once the loss's and the final norm's backward
        # let their saved set go. Traced: 8B 16K, TP 2, PP 2 1F1B, last rank: 0.19 GiB over.
        in_blocks = kept_activations - (head_saved if with_loss else 0.0)
        moments.update(_chunk_moments(w, block, at, moment, beside, in_blocks, receive_buffers, chosen))
        if at.stage == 0:
            moments.update(
                _embedding_moments(w, block, context, at, moment, (kept_activations, tp, cp), per_chunk[0], counts)
            )
        if with_loss:
            own = per_chunk[at.stage // layout.pipeline]
            moments.update(
                _loss_stage_moments(
                    w, block, context, at, moment, (kept_activations, tp, cp), own, counts, receive_buffers
                )
            )
    if not sync_each:
        moments.update(_step_end_reduce_scatters(w, block, base, rank))
    return moments


def _embedding_moments(w, block, context, at, moment: dict, in_flight: tuple, first: tuple, counts: dict) -> dict:
    """Stage 0's chunk at `at`, done with its layers (their saved set, `first`, and its document
    masks are gone): the embedding's backward and, under sync_each, its reduce-scatter, or
    otherwise on the stage's first backward its gradient made the accumulated one."""
    cb = context.cb
    kept_activations, tp, cp = in_flight
    root_params = w.arch.vocab_size * w.arch.hidden_size / w.layout.tensor
    freed = first[0] - first[1] - first[2] + context.shared
    embedding = _pipelined_embedding_backward(w, cb, moment, kept_activations - freed, (tp - first[1], cp - first[2]))
    first_time = 0 not in at.done
    if first_time:
        _with_stage_gradients(w, block, embedding, stage=0)
    found = {f"{at.name}, embedding (pipeline)": embedding}
    if w.grad_accumulation == "sync_each":
        found[f"{at.name}, embedding reduce-scatter (pipeline)"] = _embedding_reduce_scatter(
            w, block, embedding, cb * root_params, _own_stage_gathered(w, at, counts)
        )
    elif first_time and _grad_bytes(w) != cb:
        # FSDP's post_backward turns the embedding's gradient into the accumulated one in the
        # reduce dtype: `unsharded_grad.to(reduce_dtype)` beside the gradient it copies
        # (FSDPParam.to_accumulated_grad_if_needed). Traced: 70B 4K, PP 4 x 2, sync_last_gathered,
        # rank 0's first backward of stage 0: 3.4% under the trace before it and the stage's
        # accumulated block gradients were priced.
        accumulating = dict(embedding)
        accumulating["fsdp_buffers"] += _grad_bytes(w) * root_params
        found[f"{at.name}, embedding accumulated (pipeline)"] = accumulating
    return found


def _loss_stage_moments(
    w, block, context, at, moment: dict, in_flight: tuple, own: tuple, counts: dict, receive_buffers: float
) -> dict:
    """The loss stage's chunk at `at`: the loss's backward, with the output weight's bf16
    gradient, and under sync_each the root's reduce-scatter once the chunk (its saved set `own`,
    its head and document masks) is through."""
    kept_activations, tp, cp = in_flight
    loss = context.loss
    found = {}
    if w.grad_accumulation == "sync_each":
        freed = own[0] - own[1] - own[2] + context.shared + loss.head_saved
        found[f"{at.name}, output reduce-scatter (pipeline)"] = _output_reduce_scatter(
            w,
            block,
            moment,
            kept_activations - freed,
            (tp - own[1], cp - own[2]),
            _own_stage_gathered(w, at, counts),
            first_time=w.layout.num_stages - 1 not in at.done,
        )
    in_loss = dict(moment)
    in_loss["fsdp_buffers"] += context.cb * w.arch.vocab_size * w.arch.hidden_size / w.layout.tensor
    if w.grad_accumulation == "sync_each" and at.own_resharded:
        # The stage's blocks, resharded after its previous backward, are gathered again only as
        # this backward reaches them (FSDP unshards a block in the pre-backward hook on its
        # outputs), after the loss's. Traced: 70B 8K, TP 8, PP 2 GPipe, full AC, sync_each, the
        # last rank's second backward: 2.1% over the trace with two blocks gathered at its loss.
        in_loss["fsdp_buffers"] -= _own_stage_gathered(w, at, counts) * block.gathered
    in_loss["working"] = receive_buffers
    in_loss["loss"] = loss.backward_working
    in_loss["activations"] = kept_activations
    found[f"{at.name}, loss (pipeline)"] = in_loss
    return found


def _step_end_reduce_scatters(w: Workload, block: _Block, base: dict, rank: int) -> dict:
    """Without sync_each, the reduce-scatters that end a pipelined step, once every backward is
    through: the schedule's `perform_reduce_grad` runs each of the rank's stages in turn (stage
    order), and in each FSDP's post_backward goes through the stage's units root first
    (`_state_ctx.all_states`, the modules in pre-order): a unit is resharded, then its
    accumulated gradients are copied into a reduce-scatter input in the reduce dtype and the
    output shard is made, while every later unit is still gathered and holds its accumulated
    gradients. The unit's last gradient outlives the copy-in: foreach_reduce's loop variable
    `unsharded_grad` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) keeps it until
    the call returns, so a root of one parameter (the embedding) has its gradient, the input and
    the output alive together. Each unit frees more than its shard adds, so the moments are the
    first unit and each stage's root. Traced: 70B 8K, PP 4 x 2, full AC, rank 0, the embedding's
    reduce-scatter: 6.3% under the trace before it was priced."""
    layout, arch = w.layout, w.arch
    cb, gb, shard = _compute_bytes(w), _grad_bytes(w), layout.fsdp_shard
    vocab_matrix = arch.vocab_size * arch.hidden_size / layout.tensor
    last_stage = layout.num_stages - 1
    # (root's stage or None, unsharded params, its last parameter, gathered bytes, sharded params)
    units = []
    for stage in rank_stages(rank, layout):
        if stage in (0, last_stage):
            root = vocab_matrix + (arch.hidden_size if stage == last_stage else 0)  # + the final norm
            units.append((stage, root, vocab_matrix, cb * root, root))
        units += [(None, block.params, block.last_param, block.gathered, block.state_params)] * len(
            stage_layers(arch.num_layers, layout, stage)
        )
    still_gathered = sum(unit[3] for unit in units)
    accumulated = gb * sum(unit[1] for unit in units)
    reduced = 0.0
    found = {}
    for index, (root_stage, params, last, gathered, state) in enumerate(units):
        still_gathered -= gathered
        accumulated -= gb * params
        if index == 0 or root_stage is not None:
            moment = dict(base)
            moment["gradients"] = FP32 * reduced / shard
            # Accumulated gradients and the input, then (the last gradient kept) the output.
            transient = _reduce_scatter_transient(gb * params, params, gb, gb * last, shard)
            moment["fsdp_buffers"] = still_gathered + accumulated + transient
            where = "a block" if root_stage is None else f"stage {root_stage}'s root"
            found[f"step-end reduce-scatter, {where} (pipeline)"] = moment
        reduced += state
    return found


def _with_gradients(
    w: Workload, block: _Block, base: dict, at, n: int, root_params: float, root_stage: int, counts: dict[int, int]
) -> dict:
    """The rank at a pipeline moment before its chunk's own bytes: its `n` blocks and its root
    unit gathered, and the gradients of the stages done (`counts`: layers per stage of the rank). Under
    sync_each those are fp32 shards; otherwise they accumulate unsharded in the reduce dtype until
    the step's end."""
    layout = w.layout
    done_layers = sum(counts[s] for s in at.done)
    done_root = root_params if root_stage in at.done else 0
    moment = dict(base)
    accumulated = 0.0
    gathered = n
    root_gathered = root_params
    if w.grad_accumulation == "sync_each":
        moment["gradients"] = FP32 * (done_layers * block.state_params + done_root) / layout.fsdp_shard
        # Traced: 70B 4K, PP 2 x 2, full AC, the last stage's steady backward: the other stage's
        # two blocks, resharded, 1.6 GiB less than the estimate had.
        gathered -= sum(counts[s] for s in at.resharded)
        gathered -= counts[at.stage] - _own_stage_gathered(w, at, counts)
        # The stage's set_reshard_after_backward(True) reaches its root unit too (FSDPModule's
        # recurse), so the embedding or output layer is resharded with its stage's blocks and
        # gathered again by that stage's next forward. Traced: 70B 8K, TP 2, PP 2 x 2, full AC,
        # the last rank in stage 1's backward: 3.4% over the trace with the output layer gathered.
        if root_stage in at.resharded:
            root_gathered = 0.0
    else:
        accumulated = _grad_bytes(w) * (done_layers * block.params + done_root)
    moment["fsdp_buffers"] = gathered * block.gathered + _compute_bytes(w) * root_gathered + accumulated
    return moment


def _own_stage_gathered(w: Workload, at, counts: dict[int, int]) -> int:
    """How many blocks of the chunk's own stage a backward moment counts gathered: all (blocks
    stay gathered after forward), or under sync_each, where the stage's latest action was a
    backward too (`BackwardMoment.own_resharded`), the two it gathers again as it reaches them:
    the block in backward and the one below it, prefetched (`_second_block_sync_each` adds the
    third). Traced: 70B 4K, PP 2 GPipe, full AC, the last rank: its second backward 5.4% over
    the trace with the stage's four blocks counted gathered."""
    own = counts[at.stage]
    if w.grad_accumulation == "sync_each" and at.own_resharded:
        return min(own, 2 if w.layout.fsdp_shard > 1 else 1)  # no prefetch over one rank (`_Block`)
    return own


def _in_flight(w: Workload, context: _Context, at, per_chunk: list, head_saved: float) -> tuple[float, float, float]:
    """(activations, TP-gathered, CP-gathered bytes) the rank's chunks in flight keep at `at`: their
    layers' saved sets, the loss stage's kept head, each micro-batch's RoPE table and document masks, the
    outputs still held by their sends and, on gloo, the input gradients sent back."""
    total = tp = cp = 0.0
    for count, (kept, kept_tp, kept_cp) in zip(at.by_stage, per_chunk, strict=True):
        total, tp, cp = total + count * kept, tp + count * kept_tp, cp + count * kept_cp
    boundary = context.cb * _tokens(w) / w.layout.tensor * w.arch.hidden_size
    activations = total - tp - cp + head_saved * (at.in_flight - at.outputs)
    activations += context.shared * at.in_flight
    activations += boundary * _outputs_kept(w, context.device, at.outputs)
    if collective_backend(context.device) == "gloo":
        activations += boundary * at.sent_gradients
    return activations, tp, cp


def _chunk_forward(block: _Block, moment: dict, activations: float, tp: float, cp: float, *, regathered: bool) -> dict:
    """A chunk's forward after its stage's first backward, at its last block's largest moment:
    every chunk in flight keeps its saved set (this one's whole, the block's included) and the
    block holds its forward's transient (`_forward_transient`). Under sync_each (`regathered`)
    FSDP, which resharded the stage's blocks after that backward, has gathered them again and
    keeps the last all-gather's output until the stage's forward ends (FSDPParamGroup.
    wait_for_unshard defers its free in forward; the root's _post_forward frees it: torch/
    distributed/fsdp/_fully_shard/). Traced: 70B 32K, TP 2, CP 4, PP 4 1F1B, FP8, one layer per
    stage, rank 2: 6.1% under the trace at the second backward before this was priced, 1.2%
    after. In the other modes the blocks stay gathered, but a forward can still be the peak: 70B
    8K, TP 4, PP 4 x 2, FP8, no AC, shard saved peaks at w2's float8 cast in a steady forward
    (traced grid: -1.3% while only the backwards were priced). Over one FSDP rank there is no
    all-gather output to keep: FSDPParamGroup.unshard records none and wait_for_unshard copies
    the shard into the parameters and defers nothing (`world_size > 1`). Traced: 8B 8K, TP 8,
    PP 4 1F1B, no AC, sync_each, rank 1's steady forward: 2.1% over the trace with it counted."""
    at = dict(moment)
    if regathered:
        at["fsdp_buffers"] += block.gathered
    at["activations"] = activations
    at["tp_buffers"], at["cp_buffers"] = tp, cp
    at["fp8"] = block.forward_cast
    at["working"] = block.forward_working
    return at


def _chunk_moments(
    w: Workload,
    block: _Block,
    at,
    rank_moment: dict,
    output_grad: float,
    kept_activations: float,
    receive_buffers: float,
    chosen,
) -> dict[str, dict]:
    """The blocks of the chunk in backward at `at` (a BackwardMoment): where a block's backward
    peaks (_blocks_in_backward) and, under sync_each, where FSDP reduces the first block and
    where the second runs beside its pending reduce-scatter input.

    The loss stage's blocks run their backward beside the output weight's gradient of this
    micro-batch (`output_grad`): FSDP reduces the stage's root unit only once the whole stage is
    through backward. Accumulated unsharded in the compute dtype (a bf16 reduce), it is the
    accumulated gradient itself once the stage has run a backward, and the caller passes 0."""
    moment = dict(rank_moment)
    moment["fsdp_buffers"] += output_grad
    found = {}
    in_backward = _blocks_in_backward(w, at.stage, chosen)
    accumulating = w.grad_accumulation != "sync_each"
    in_place = accumulating and _grad_bytes(w) == _compute_bytes(w) and at.stage in at.done
    router_loss = at.stage == w.layout.num_stages - 1  # the loss reaches this stage's routers

    def at_block(done: int, recomputed: bool, **how) -> dict:
        return _in_block(block, moment, kept_activations, receive_buffers, done, recomputed, **how)

    for name, blocks_done, recomputed in in_backward:
        in_block = at_block(blocks_done, recomputed, grads_in_place=in_place, router_loss=router_loss)
        if accumulating and at.stage not in at.done:
            # On the stage's first backward the blocks done have just made their unsharded
            # gradients the accumulated ones, in the reduce dtype (FSDPParam.
            # to_accumulated_grad_if_needed). Traced: 8B 16K, PP 2 x 2, selective, fp32 reduce,
            # rank 0's first backward in the chunk's recomputed block: 4.5% under before.
            in_block["fsdp_buffers"] += blocks_done * _grad_bytes(w) * block.params
        found[f"{at.name}{name} (pipeline)"] = in_block
    if w.grad_accumulation != "sync_each" or not in_backward:
        return found
    if block.experts_reduced:  # resharded, the experts' unit reduces mid-block (`_Block._experts_reduced`)
        for name, blocks_done, recomputed in in_backward:
            reduced = at_block(blocks_done, recomputed, part=block.experts_reduced[recomputed])
            reduced["fsdp_buffers"] -= block.gathered - block.last_prefetched
            found[f"{at.name}{name}, experts reduce-scatter (pipeline)"] = reduced
    found[f"{at.name}, reduce-scatter (pipeline)"] = _pipelined_reduce_scatter(
        w, block, moment, kept_activations, receive_buffers, recomputed=in_backward[0][2]
    )
    run = stage_layers(w.arch.num_layers, w.layout, at.stage)
    if len(run) > 1:
        found[f"{at.name}, second block (pipeline)"] = _second_block_sync_each(
            w,
            block,
            moment,
            kept_activations,
            receive_buffers,
            run,
            chosen,
            first_time=at.stage not in at.done,
            own_resharded=at.own_resharded,
            router_loss=router_loss,
        )
    return found


def _in_block(
    block,
    moment: dict,
    kept_activations: float,
    receive_buffers: float,
    done: int,
    recomputed: bool,
    *,
    grads_in_place: bool = False,
    part: _BackwardMoment | None = None,
    router_loss: bool = True,
) -> dict:
    """A pipelined chunk's block in backward: its full set (recomputed if checkpointed) and its
    working set, beside what the rank keeps, at its peak or at `part` of its backward. The
    chunk's `done` blocks already through backward kept everything (_blocks_in_backward), and
    the kept set counts this block as saved (or, checkpointed, as its input alone)."""
    at = part or block.in_backward(recomputed, grads_in_place, router_loss)
    in_block = dict(moment)
    in_block["fsdp_buffers"] += at.weight_grads
    in_block["fp8"] = at.fp8_cast
    in_block["working"] = at.working + receive_buffers
    # The kept set counts this block's gathered inputs (none if checkpointed) and the done
    # blocks'; the moment's own gathered part replaces them.
    kept_tp, kept_cp = (0.0, 0.0) if recomputed else (block.tp_gathered, block.cp_gathered)
    in_block["tp_buffers"] += at.own_tp - kept_tp - done * block.tp_gathered
    in_block["cp_buffers"] += at.own_cp - kept_cp - done * block.cp_gathered
    done_saved = done * (block.saved - block.tp_gathered - block.cp_gathered)
    this_block = block.layer_input if recomputed else block.saved - kept_tp - kept_cp
    in_block["activations"] = kept_activations - done_saved + at.own - at.own_tp - at.own_cp - this_block
    return in_block


def _second_block_sync_each(
    w: Workload,
    block: _Block,
    moment: dict,
    kept_activations: float,
    receive_buffers: float,
    run: list[int],
    chosen: frozenset[int],
    *,
    first_time: bool,
    own_resharded: bool = False,
    router_loss: bool = True,
) -> dict:
    """Under sync_each, a chunk's second block in backward: the first one, reduced and resharded,
    left its reduce-scatter input pending until the next reduce-scatter (FSDP keeps it in
    reduce_scatter_state) and, on the stage's first backward, a new fp32 gradient shard. Traced:
    70B 4K, PP 2 x 2, two layers per chunk, 5.9% under the trace before and 5.6% after; the rest
    was eager FP8's gating-linear moment (`_gating_linear_cast`) and a block FSDP's default
    backward prefetch gathered again, which the program no longer does (parallel/fsdp.py
    `chunk_backward_prefetch`): within 0.1% now (tests/estimate/traced_configs.py)."""
    first_checkpointed, second_checkpointed = run[-1] in chosen, run[-2] in chosen
    at = _in_block(block, moment, kept_activations, receive_buffers, 1, second_checkpointed, router_loss=router_loss)
    if first_checkpointed:  # _in_block let the first block's whole set go; it kept its input alone
        at["activations"] += block.saved - block.tp_gathered - block.cp_gathered - block.layer_input
        at["tp_buffers"] += block.tp_gathered
        at["cp_buffers"] += block.cp_gathered
    at["fsdp_buffers"] += _grad_bytes(w) * block.reduce_scatter_params - block.gathered
    if own_resharded and len(run) > 2 and w.layout.fsdp_shard > 1:  # the third, prefetched by the second
        at["fsdp_buffers"] += block.gathered
    if first_time:
        at["gradients"] += FP32 * block.state_params / w.layout.fsdp_shard
    return at


def _reduce_scatter_transient(
    grads: float, params: float, grad_bytes: int, last: float, shard: int, *, dim_1: bool = False
) -> float:
    """Bytes FSDP's foreach_reduce holds for one unit of `params` values
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): its unsharded gradients (`grads`
    bytes) beside the reduce-scatter input in the reduce dtype (`grad_bytes` per value), then,
    the gradients let go once copied in, the output shard beside the input and, in a bf16 reduce,
    the output's cast to the fp32 shard (`_to_dtype_if_needed`). Over more than one rank the loop
    that checks each gradient's shard dim leaves its variable `unsharded_grad` on the last
    gradient (`last` bytes) until the call returns; on one rank that loop does not run. Traced:
    70B 8K, TP 4, CP 2, full AC, bf16 reduce, the root unit's: 3.0% under the trace without the
    cast. Gradients of parameters sharded on dim 1 (`dim_1`: experts, `_experts_on_dim_1`) are
    first replaced in that loop by a copy laid out by shard (`torch.cat(chunks, dim=0)`), all of
    them alive beside the input with the last original the variable still holds. Traced: Mixtral
    6 layers on 16 GPUs, EP 2 (4 experts a rank over 8 dim-1 shards), selective, sync_each: 2.6%
    under the trace without it (estimator_fuzz --family moe, seed 31)."""
    reduced = grad_bytes * params
    cast = FP32 * params / shard if grad_bytes != FP32 else 0.0
    kept = last if shard > 1 else 0.0
    copies = kept if dim_1 else 0.0
    return max(grads + copies + reduced, kept + reduced * (1 + 1 / shard) + cast)


def _pipelined_reduce_scatter(
    w: Workload, block: _Block, moment: dict, kept_activations: float, receive_buffers: float, *, recomputed: bool
) -> dict:
    """Under sync_each, the chunk's first block right after its backward, when FSDP reduces its
    gradients: its saved set is gone and, resharded after backward, so are its gathered weights
    (_GradientSyncEachMicroBatch); its unsharded gradients in the compute dtype and FSDP's
    reduce-scatter input in the reduce dtype are alive together until the gradients are copied
    in and let go (all but the last), before the output, a shard of the input, is made
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce). With few layers
    per chunk and a short sequence this is where the rank peaks (traced: 70B 4K, TP 2, PP 4 x 2,
    one layer per chunk, 12.7% under the trace before it was priced)."""
    cb = _compute_bytes(w)
    kept_tp, kept_cp = (0.0, 0.0) if recomputed else (block.tp_gathered, block.cp_gathered)
    freed = block.layer_input if recomputed else block.saved - kept_tp - kept_cp
    reduced = block.reduce_scatter_params
    at = dict(moment)
    at["activations"] = kept_activations - freed
    at["tp_buffers"] -= kept_tp
    at["cp_buffers"] -= kept_cp
    at["working"] = block.layer_input + receive_buffers  # the gradient on its way to the next block
    # The gradients and the input, then the output beside the input and the last gradient, which
    # foreach_reduce's loop variable keeps (`_step_end_reduce_scatters`).
    transient = _reduce_scatter_transient(
        cb * reduced, reduced, _grad_bytes(w), cb * block.last_param, w.layout.fsdp_shard
    )
    at["fsdp_buffers"] += transient - block.gathered
    return at


def _blocks_in_backward(w: Workload, stage: int, chosen: frozenset[int]) -> list[tuple[str, int, bool]]:
    """Where a chunk's backward can peak, as (name suffix, blocks already done in backward,
    whether this block recomputes): its first block in backward, the stage's last layer, and, if
    that keeps its activations, the first checkpointed block after it, whose recomputation adds its
    full set once the blocks done have let theirs go. A stage without layers has none."""
    run = stage_layers(w.arch.num_layers, w.layout, stage)
    if not run:
        return []
    found = [("", 0, run[-1] in chosen)]
    if run[-1] not in chosen:
        later = [done for done, layer in enumerate(reversed(run)) if layer in chosen]
        if later:
            found.append((", first recomputed block", later[0], True))
    return found


def _outputs_kept(w: Workload, device: str, outputs: int) -> int:
    """How many in-flight chunks' outputs are still alive: each is let go once sent
    (pipeline.py's _release_sent_outputs) and lives on only while its send holds it. Under torch's
    own 1F1B and GPipe runtime a forward send is waited for before the rank's next backward, but
    the runtime still holds the latest one's ops (`fwd_sends`) and the Work of the one before it
    (`send_work`, which 1F1B's steady phase keeps until its cooldown; a gloo Work keeps its
    tensor until dropped, tests/entrypoints/test_pipeline_memory.py); under the interleaved
    schedule on NCCL _SendsInFlight drops a Work once complete, at the rank's next send: two at
    most. On gloo it waits for a forward send only when its micro-batch's backward starts, since
    gloo reports a send complete only once waited for: every one."""
    if collective_backend(device) == "gloo" and w.pipeline_schedule == "interleaved_1f1b":
        return outputs
    return min(outputs, 2)


def _pipelined_embedding_backward(w, cb, moment, kept_activations, kept_tp_cp) -> dict:
    """Stage 0's embedding backward, right after its first block's: that chunk's saved set is
    freed, and the micro-batch's dense embedding gradient over the rank's V / tp rows exists
    beside the one accumulated from earlier micro-batches and the output gradient it reads
    (all-gathered along the sequence under TP). With few layers per rank this can be rank 0's
    peak (traced: "70B 8K pp4 v2 tp4 dp2 fp8 none, bf16 reduce, 8 micro-batches")."""
    arch = w.arch
    at_embedding = dict(moment)
    at_embedding["fsdp_buffers"] += cb * arch.vocab_size * arch.hidden_size / w.layout.tensor
    at_embedding["tp_buffers"], at_embedding["cp_buffers"] = kept_tp_cp
    at_embedding["activations"] = kept_activations
    at_embedding["working"] = cb * _tokens(w) * arch.hidden_size
    return at_embedding


def _with_stage_gradients(w: Workload, block: _Block, moment: dict, *, stage: int) -> None:
    """After a stage's first backward of the step, its blocks' gradients exist where the
    moments before it (`_with_gradients`, over the stages done) had none: under sync_each as new
    fp32 shards, otherwise accumulated unsharded in the reduce dtype (each block's post_backward
    made them before the stage's root unit's)."""
    blocks = len(stage_layers(w.arch.num_layers, w.layout, stage))
    if w.grad_accumulation == "sync_each":
        moment["gradients"] += FP32 * blocks * block.state_params / w.layout.fsdp_shard
    else:
        moment["fsdp_buffers"] += _grad_bytes(w) * blocks * block.params


def _embedding_reduce_scatter(
    w: Workload, block: _Block, at_embedding: dict, gathered_root: float, gathered_blocks: int
) -> dict:
    """Under sync_each, stage 0's root unit reduced right after the embedding's backward: its
    dense gradient, FSDP's reduce-scatter input in the reduce dtype and the output shard alive
    together, the output gradient the embedding read let go (traced: Llama 3.1 8B, 16K, CP 2,
    PP 4, 6.3% under the trace before). FSDP reshards a unit before reducing it, and stage 0's
    blocks were resharded after their backward (_GradientSyncEachMicroBatch; the moment counted
    `gathered_blocks` of them), their gradients reduced into fp32 shards (on the stage's first
    backward new ones, which the embedding's moment counts: `_with_stage_gradients`)."""
    layout = w.layout
    embedding = w.arch.vocab_size * w.arch.hidden_size / layout.tensor
    at = dict(at_embedding)
    at["working"] = 0.0
    dense = _compute_bytes(w) * embedding  # the gradient `_pipelined_embedding_backward` counted
    at["fsdp_buffers"] += _reduce_scatter_transient(dense, embedding, _grad_bytes(w), dense, layout.fsdp_shard) - dense
    at["fsdp_buffers"] -= gathered_root + gathered_blocks * block.gathered
    return at


def _output_reduce_scatter(
    w: Workload,
    block: _Block,
    moment: dict,
    kept_activations: float,
    kept_tp_cp: tuple,
    gathered_blocks: int,
    *,
    first_time: bool,
) -> dict:
    """Under sync_each, the loss stage's root unit (the final norm and the output weight) reduced
    once its chunk's backward is through, as `_embedding_reduce_scatter` is stage 0's: the chunk's
    saved set, its head's included, is gone, its input gradient is on its way back, the stage's
    blocks are resharded and reduced, and the root, resharded too, holds its bf16 gradients beside
    the reduce-scatter (`_reduce_scatter_transient`; the output weight's is the one kept) and the
    shard an earlier micro-batch left. Traced: 70B 4K, TP 2, PP 4 x 2, FP8, rank 3, whose loss
    stage holds no layers: 6.7% under the trace before it was priced."""
    layout, arch, cb = w.layout, w.arch, _compute_bytes(w)
    output = arch.vocab_size * arch.hidden_size / layout.tensor
    root = output + arch.hidden_size
    blocks = len(stage_layers(arch.num_layers, layout, layout.num_stages - 1))
    at = dict(moment)
    at["activations"] = kept_activations
    at["tp_buffers"], at["cp_buffers"] = kept_tp_cp
    at["working"] = cb * _tokens(w) / layout.tensor * arch.hidden_size  # the input gradient sent back
    transient = _reduce_scatter_transient(cb * root, root, _grad_bytes(w), cb * output, layout.fsdp_shard)
    at["fsdp_buffers"] += transient - cb * root - gathered_blocks * block.gathered
    if first_time:
        at["gradients"] += FP32 * blocks * block.state_params / layout.fsdp_shard
    return at


class _Loss:
    """entrypoints/model/loss.py, on the last stage, per micro-batch.

    Saves the final hidden states (all-gathered along the sequence under TP), the targets as
    int64 indices, a bool mask and an fp32 log-sum-exp per token. Works in chunks of
    ceil(N / ceil(V_local / h)) tokens, but at least 1024, so one chunk's logits hold about
    max(N x h, 1024 x V_local) values:
    - forward: fp32 logits and one fp32 temporary inside logsumexp (8 bytes per value);
    - backward: the recomputed logits go bf16 -> fp32 -> exp -> scaled -> bf16; the old fp32
      dlogits, the scaled copy and the bf16 result coexist (10 bytes per value), next to
      grad_h (N x h) and the output weight's unsharded gradient.
    """

    __slots__ = ("saved", "head_saved", "forward_working", "backward_working")

    def __init__(self, w: Workload, cb: int):
        h, t = w.arch.hidden_size, w.layout.tensor
        tokens = _tokens(w)
        vocab_local = w.arch.vocab_size / t
        chunk = chunk_tokens(tokens, h, vocab_local)
        values = chunk * vocab_local
        self.saved = cb * tokens * h + (INT64 + 1 + FP32) * tokens
        # With the final norm's input and rstd (sequence shards under TP): what the last
        # stage saves after the blocks.
        self.head_saved = self.saved + (cb * h + FP32) * tokens / t
        self.forward_working = 8 * values
        self.backward_working = 10 * values + cb * tokens * h


def notes(workload: Workload) -> list[str]:
    found = []
    moe = workload.arch.moe
    if moe is not None and workload.layout.expert > 1 and workload.moe_force_load_balance:
        found.append(
            "experts: routing is round-robin (training.moe_force_load_balance): every EP rank gets the balanced share"
        )
    elif moe is not None and workload.layout.expert > 1:
        found.append(
            f"experts: each EP rank's routed rows are priced at {ROUTING_BOUND:g}x the balanced share "
            "(dropless routing has no cap; docs/estimator.md)"
        )
    if not workload.fp8:
        return found
    if moe is not None and workload.experts_in_fp8:
        found.append(
            "fp8: the experts run torchao's rowwise FP8 grouped GEMMs whatever fp8_recipe says, on rows padded "
            "to 16 per expert (on Hopper and Blackwell; elsewhere in the compute dtype)"
        )
    elif moe is not None:
        found.append(
            "fp8: the experts run in the compute dtype; precision.fp8_experts: true runs them as FP8 grouped GEMMs"
        )
    if workload.fp8_recipe == "tensorwise":
        return [*found, "fp8 tensorwise: FSDP all-gathers float8 weights on GPUs (nccl); gloo gathers bf16"]
    return [*found, "fp8 rowwise: weights are all-gathered in bf16 and cast to float8 in each matmul"]
