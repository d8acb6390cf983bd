"""The published accounting: Fujii, Watanabe & Yokota 2024 (arXiv:2411.06465), term by term.

"Accelerating Large Language Model Training with 4D Parallelism and Memory Consumption
Estimator" estimates Megatron-LM's memory for bf16 training with TP (+ sequence parallel), CP,
PP and the distributed optimizer; across 454 runs on A100/H100, none under 80% of GPU memory
ran out of memory. Symbols: h hidden, f FFN size, a query heads, k KV heads, L layers, V vocab,
s sequence, b micro-batch; t tensor, c context, p pipeline, d data degrees; v virtual stages.

Each function below is one published term, in bytes. The estimate is their sum, with no
CUDA context, NCCL or fragmentation terms: the paper's 80% rule already absorbs those.
FP8 is not part of the published accounting and does not change this mode's numbers.
"""

from __future__ import annotations

from launcher.catalog import ModelArch
from launcher.contract.layout import Layout, rank_layers
from launcher.estimate.breakdown import StageMemory, empty_breakdown
from launcher.estimate.pipeline import in_flight
from launcher.estimate.workload import Workload

FP32 = 4


def block_params(arch: ModelArch, t: int) -> float:
    """One layer's parameters per GPU: 2h^2(1 + k/a)/t + 3hf/t + 2h.

    Attention (wq, wo: h^2 each; wk, wv: h^2*k/a each) and the SwiGLU MLP (three h x f
    matrices) split over t; the two RMSNorm weights are replicated. With a head_dim other than
    h/a (Qwen3) h^2 is h x q for q = a x head_dim (so k/a is kv/q), and QK-norm weights and
    attention biases, outside the published formula, are added replicated.
    """
    h, f, q, kv = arch.hidden_size, arch.ffn_hidden_size, arch.q_dim, arch.kv_dim
    return 2 * h * q * (1 + kv / q) / t + 3 * h * f / t + 2 * h + arch.attention_extra_params()


def embedding_params(arch: ModelArch, t: int) -> float:
    """h*V/t: the vocabulary-parallel embedding, or the output layer, per GPU."""
    return arch.hidden_size * arch.vocab_size / t


def stage_params(arch: ModelArch, layout: Layout, stage: int) -> float:
    """Parameters on pipeline rank `stage`: its layers (`rank_layers`), plus the embedding on the first
    rank and the output layer on the last. Megatron keeps a copy of a tied embedding on the
    last rank when p > 1, so only a tied single-stage model holds one h*V/t."""
    t, p = layout.tensor, layout.pipeline
    params = rank_layers(arch.num_layers, layout, stage) * block_params(arch, t)
    if stage == 0:
        params += embedding_params(arch, t)
    if stage == p - 1 and (not arch.tie_embeddings or p > 1):
        params += embedding_params(arch, t)
    return params


def bytes_per_param(layout: Layout, *, distributed_optimizer: bool = True) -> float:
    """6 + 12/(d*c) with the distributed optimizer (ZeRO-1), else 18.

    A bf16 weight (2) and an fp32 gradient (4) on every GPU; an fp32 master weight and Adam's
    m and v (12) sharded over the data-parallel x context group.
    """
    if not distributed_optimizer:
        return 18.0
    return 6 + 12 / (layout.data_parallel * layout.context)


def layer_activation_bytes(arch: ModelArch, s: int, b: int, t: int, c: int) -> float:
    """One layer's saved activations, no recomputation: s*b*h*(12 + 4k/a + 8f/h)/(t*c).

    FlashAttention-style attention (no s x s scores), TP with sequence parallel, CP, GQA,
    SwiGLU and RMSNorm.
    """
    h, f, a, k = arch.hidden_size, arch.ffn_hidden_size, arch.num_heads, arch.num_kv_heads
    return s * b * h * (12 + 4 * k / a + 8 * f / h) / (t * c)


def attention_score_bytes(arch: ModelArch, s: int, b: int, t: int, c: int) -> float:
    """Attention that materialises the score matrix adds about 5*a*s^2*b/(t*c) per layer."""
    return 5 * arch.num_heads * s * s * b / (t * c)


def layer_input_bytes(arch: ModelArch, s: int, b: int, t: int, c: int) -> float:
    """Full recomputation keeps only each layer's input: 2*s*b*h/(t*c)."""
    return 2 * s * b * arch.hidden_size / (t * c)


def logits_bytes(arch: ModelArch, s: int, b: int, t: int, c: int) -> float:
    """The last stage's fp32 logits s*b*V/(t*c) and their gradients: two fp32 copies."""
    return 2 * FP32 * s * b * arch.vocab_size / (t * c)


def interleave_factor(p: int, v: int) -> float:
    """Interleaved 1F1B multiplies the first stage's activations by 1 + (p-1)/(p*v)."""
    return 1 + (p - 1) / (p * v)


def stage_peaks(
    workload: Workload, *, device: str = "cuda", attention: str = "flash", distributed_optimizer: bool = True
) -> list[StageMemory]:
    """The published estimate for every pipeline rank. `attention="materialized"` adds the
    score-matrix term (Korthikanti et al. 2022); selective recomputation removes it again."""
    del device  # the published estimate has no device-specific terms
    arch, layout, w = workload.arch, workload.layout, workload
    s, b, t, c = w.seq_len, w.micro_batch_size, layout.tensor, layout.context
    per_layer = layer_activation_bytes(arch, s, b, t, c)
    if attention == "materialized" and w.activation_checkpointing == "none":
        per_layer += attention_score_bytes(arch, s, b, t, c)
    working_set = per_layer
    if attention == "materialized":
        working_set = layer_activation_bytes(arch, s, b, t, c) + attention_score_bytes(arch, s, b, t, c)
    kept_per_layer = layer_input_bytes(arch, s, b, t, c) if w.activation_checkpointing == "full" else per_layer
    per_param = bytes_per_param(layout, distributed_optimizer=distributed_optimizer)

    stages = []
    for rank in range(layout.pipeline):
        layers = rank_layers(arch.num_layers, layout, rank)
        params = stage_params(arch, layout, rank)
        breakdown = empty_breakdown()
        breakdown["parameters"] = round(2 * params)
        breakdown["gradients"] = round(FP32 * params)
        breakdown["optimizer_states"] = round((per_param - 6) * params)
        flight = in_flight(rank, layout, w.pipeline_schedule, w.grad_accum_steps)
        breakdown["activations"] = round(layers * kept_per_layer * flight)
        if w.activation_checkpointing == "full":
            breakdown["working"] = round(working_set)
        if rank == layout.pipeline - 1:
            breakdown["loss"] = round(logits_bytes(arch, s, b, t, c))
        stages.append(StageMemory(stage=rank, layers=layers, phase="backward", breakdown=breakdown))
    return stages


def notes(workload: Workload) -> list[str]:
    found = ["megatron mode: Fujii et al. 2024's bf16 accounting; no CUDA context, NCCL or fragmentation terms"]
    if workload.fp8:
        found.append("megatron mode ignores FP8: the published accounting is for bf16 training")
    if workload.activation_checkpointing == "selective":
        found.append("selective recomputation only drops the attention scores, which flash attention never keeps")
    return found
