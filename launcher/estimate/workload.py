"""What one estimate or prediction describes: a model, a layout and how each step runs.

A `Workload` is built once from a recipe (`Workload.from_recipe`); the planner derives its
candidates from that one with `dataclasses.replace`. The hardware it runs on is the recipe's
`launcher.recipe.hardware.Hardware`, the other half of every estimate and prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.catalog import ModelArch
from launcher.contract.fp8 import fp8_experts
from launcher.contract.layout import Layout, cp_attention_for
from launcher.recipe import Recipe


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """A model, a layout and how each step runs: everything but the hardware."""

    arch: ModelArch
    layout: Layout
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int
    dtype: str = "bf16"
    fp8: bool = False
    fp8_recipe: str = "tensorwise"
    fp8_experts: bool = False  # precision.fp8_experts as written; `experts_in_fp8` applies the contract's rule
    activation_checkpointing: str = "none"
    pipeline_schedule: str = "1f1b"
    compile: bool = False  # torch.compile of each block: speed, and FP8's cast temporaries
    grad_accumulation: str = "sync_each"  # or sync_last, sync_last_gathered; "auto" until launcher.resolve settles it
    reduce_dtype: str = "fp32"  # FSDP's gradient reduce-scatter dtype
    optimizer_state_dtype: str = "fp32"  # training.optimizer.state_dtype: AdamW's two moments
    tp_saved_inputs: str = "gathered"  # or shard: SP's gathered inputs regathered in backward (parallel/regather.py)
    steps: int | None = None  # optimizer steps of the run, for its time and cost
    cp_attention: str = "auto"  # parallel.cp_attention as written; `cp_attention_path` resolves it per layout
    document_masking: bool = False  # data.document_masking: attention masks per micro-batch
    evaluates: bool = False  # data.validation: a forward-only pass over held-out data between steps
    moe_force_load_balance: bool = False  # training.moe_force_load_balance: round-robin routing, no imbalance
    # Planner-only: what published systems run and the entrypoints do not, so a recipe cannot set
    # them (launcher/plan/throughput.py prices them; docs/planner.md).
    tp_overlap: str = "none"  # TP collectives in t pieces beside their GEMMs: async (torch), userbuffers (TE)
    userbuffers: str = "te_defaults"  # under userbuffers, TE's config by name (launcher/plan/userbuffers.py)
    p2p_overlap: bool = False  # pipeline sends/recvs beside the next chunk's compute: Megatron's overlap_p2p_comm
    cp_ring: bool = False  # CP as Transformer Engine's p2p ring: K/V (and dK/dV) steps beside attention (planner-only)
    # MoE tokens sent once to each other node that holds any of their experts and fanned out there
    # over NVLink, as DeepEP's and Hybrid-EP's dispatchers send them (planner-only; the entrypoints'
    # all_to_all_single sends every token copy to its expert's rank)
    ep_dispatch_per_node: bool = False
    # Each layer's token all-to-alls beside the compute of another micro-batch's same layer, as
    # Megatron-Core's overlap_moe_expert_parallel_comm pairs one micro-batch's forward with
    # another's backward (planner-only; the entrypoints run them in order)
    moe_a2a_overlap: bool = False
    # The MoE's permutes (token copies into expert order and back) as Transformer Engine's fused
    # kernels, one read and one write per element, as Megatron-Core runs them under
    # moe_permute_fusion (planner-only; the entrypoints gather with eager indexing)
    moe_permute_fusion: bool = False
    # The MLP's activation as Megatron-Core runs it without bias_activation_fusion: "squared_relu_unfused",
    # torch.pow(F.relu(x), 2) on a two-matrix FFN 3/2 as wide as the SwiGLU of equal size the arch
    # describes, eager whatever `compile` says (planner-only; the entrypoints run SwiGLU)
    mlp_activation: str = "swiglu"
    # Megatron-Core's recompute_granularity "selective": each layer's core attention (the fused
    # attention kernel) runs its forward again in backward (planner-only)
    recompute_core_attention: bool = False
    # tp_saved_inputs shard's all-gathers in backward issued async beside the input-gradient GEMM,
    # as Megatron-Core and Transformer Engine issue them (planner-only; the entrypoints wait on them)
    regather_overlap: bool = False
    # FP8 weights cast (and transposed) on a step's first micro-batch and reused by the rest, as
    # Transformer Engine caches them when Megatron-Core passes is_first_microbatch (planner-only;
    # torchao's float8 linears in the entrypoints cast every micro-batch)
    fp8_weights_cached: bool = False
    # Whose float8 casts run: "torchao" (the entrypoints' float8 linears), or Transformer Engine's
    # fused cast-transposes with delayed scaling ("te_delayed") or current scaling ("te_current"),
    # as Megatron-Core runs them (planner-only; launcher/plan/throughput.py fp8_cast_time)
    fp8_casts: str = "torchao"
    # Megatron-Core's recompute_method "block" with recompute_granularity "full": the first
    # `recompute_layers` layers of each (virtual) pipeline stage recompute their forward in backward,
    # the rest keep their activations (planner-only; the entrypoints checkpoint every other block or
    # every block). 0: activation_checkpointing alone says what is recomputed.
    recompute_layers: int = 0
    # The output layer's logits for the whole micro-batch, kept for the loss's backward, as
    # Megatron-Core and torchtitan compute them: 6 FLOPs per output weight and token in GEMMs of all
    # the micro-batch's rows (planner-only; the entrypoints' fused loss recomputes them chunk by chunk).
    logits_materialized: bool = False

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> Workload:
        training, precision, parallel = recipe.training, recipe.precision, recipe.parallel
        return cls(
            arch=recipe.arch,
            layout=recipe.layout,
            seq_len=training.seq_len,
            micro_batch_size=training.micro_batch_size,
            grad_accum_steps=recipe.grad_accum_steps,
            dtype=precision.dtype,
            fp8=precision.fp8,
            fp8_recipe=precision.fp8_recipe,
            fp8_experts=precision.fp8_experts,
            activation_checkpointing=parallel.activation_checkpointing,
            pipeline_schedule=parallel.pipeline_schedule,
            compile=training.compile,
            grad_accumulation=recipe.grad_accumulation(),
            reduce_dtype=parallel.reduce_dtype,
            optimizer_state_dtype=training.optimizer.state_dtype,
            tp_saved_inputs=parallel.tp_saved_inputs,
            steps=training.steps,
            cp_attention=parallel.cp_attention,
            document_masking=recipe.data.document_masking,
            evaluates=recipe.data.validation is not None,
            moe_force_load_balance=training.moe_force_load_balance,
        )

    @property
    def cp_attention_path(self) -> str:
        """The concrete path, allgather or ulysses, that the entrypoints run for this layout (the contract's rule)."""
        return cp_attention_for(
            self.cp_attention,
            self.arch,
            self.layout,
            activation_checkpointing=self.activation_checkpointing,
            document_masking=self.document_masking,
        )

    @property
    def experts_in_fp8(self) -> bool:
        """Whether the experts' grouped GEMMs run in FP8 (the contract's rule, entrypoints/fp8.py)."""
        moe = self.arch.moe
        return moe is not None and fp8_experts(
            fp8=self.fp8,
            fp8_experts=self.fp8_experts,
            hidden_size=self.arch.hidden_size,
            expert_ffn_hidden_size=moe.expert_ffn_hidden_size,
        )

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on, over all data-parallel ranks."""
        return self.seq_len * self.micro_batch_size * self.grad_accum_steps * self.layout.data_parallel
