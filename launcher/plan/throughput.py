"""Predicted training throughput and cost of one layout: an analytic step-time model.

One optimizer step runs `m` micro-batches (grad_accum_steps) through every pipeline rank, and the
slowest rank sets the pace: the last (its blocks plus the output layer and the loss) or, where the
stages are uneven (`launcher.contract.layout.stage_layer_counts`), the one with the most layers.
For one micro-batch on one GPU of that rank:

    compute  = matmul FLOPs    / (peak x matmul efficiency x shape efficiency)
             + attention FLOPs / (bf16 peak x attention efficiency)
             + elementwise bytes (norms, RoPE, SwiGLU, residuals, FP8 casts, loss) / HBM bandwidth
             (+ the forward again for the blocks activation checkpointing recomputes)
    exposed  = tensor-parallel collectives + context-parallel K/V collectives + pipeline send/recv
             + the FSDP all-gathers and reduce-scatters the compute cannot hide

    step     = (compute + exposed) x (m + (p - 1) / v)       # pipeline bubble (p-1)/(m*v + p-1)
             + HSDP gradient all-reduce between replicas (partly hidden) + optimizer step (HBM-bound)

FLOPs per token:
- dense: 6 x (matmul parameters of the blocks + the output layer), forward and backward;
- attention: 12·L·h·s with a full mask, 6·L·h·s with the causal mask the model uses (each query
  sees s/2 keys on average). Context parallelism splits the queries of a sequence over its ranks
  with zigzag load balancing, so each rank does 1/c of it;
- recomputation: activation checkpointing runs the forward of the checkpointed blocks again:
  all of them (full) or every other one (selective).

MFU is computed as the entrypoints log it (entrypoints/metrics.py), so a prediction and a job's
`mfu=` line compare: model FLOPs 6·N + 6·L·h·s per token (causal attention, no recomputation) over
the dense BF16 peak, also under FP8. torchtitan and NeMo count attention as 12·L·h·s;
`model_flops_per_token(..., causal=False)` gives their count.

Every tunable number is a field of `Constants`, documented where it is defined; `CONSTANTS` is the
calibrated set (docs/planner.md: each published measurement, the prediction and its error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import cache
from math import ceil
from operator import attrgetter
from typing import Any, NamedTuple

from launcher import catalog
from launcher.catalog import Accelerator, ModelArch
from launcher.contract.fp8 import collective_backend, float8_all_gather, padded_group_rows
from launcher.contract.layout import layers_by_rank, rank_layers
from launcher.contract.loss import chunk_tokens
from launcher.errors import UsageError
from launcher.estimate.workload import Workload
from launcher.plan.host_cpu import cpu_step_seconds
from launcher.plan.modes import AC_RECOMPUTE, mode, priced_cp_attention
from launcher.plan.userbuffers import userbuffers_config
from launcher.recipe import Recipe
from launcher.recipe.hardware import Hardware

GB = 1e9


@dataclass(frozen=True, slots=True, kw_only=True)
class Constants:
    """Every constant of the throughput model, in one place.

    Efficiencies are fractions of a datasheet peak that a real training step sustains. They come
    from measurements of the entrypoints' own kernels and model on an H200
    (scripts/planner_gpu_kernels.py -> docs/planner_gpu.json) and from NVIDIA's datasheets; the
    published end-to-end points in docs/planner.md then check them. No constant belongs to one
    calibration point; the few fitted to a measurement say so.
    """

    matmul_efficiency: dict[str, float] = field(
        default_factory=lambda: {"hopper:bf16": 0.74, "hopper:fp8": 0.62, "ampere:bf16": 0.80}
    )
    """Fraction of the dense peak that large GEMMs sustain, before the shape term. Measured on an
    H200 (docs/planner_gpu.json): bf16 GEMMs of Llama 8B shapes at 8192 tokens run at 755-828
    TFLOP/s in short bursts, but the power limit (700 W) brings the clock down from 1980 to about
    1400 MHz within a second of dense work, and the 8192x4096x14336 GEMM then holds 685 TFLOP/s
    (0.69; 0.74 x its shape term 0.95). FP8 tensorwise `_scaled_mm` bursts at 1270-1470 TFLOP/s;
    0.62 assumes the same power-limited drop."""

    fp8_rowwise_factor: float = 0.85
    """Rowwise FP8 scaling runs slower GEMMs than tensorwise (a scale per row of each operand,
    applied in the GEMM's epilogue; its casts are priced apart, `torchao_cast_bytes`). 0.85 is an
    assumption, not a measurement: no rowwise GEMM of ours has run on a GPU, and it is not fitted
    to the published rowwise rows that docs/planner.md prices with it."""

    gemm_half_dim: dict[str, int] = field(default_factory=lambda: {"bf16": 128, "fp8": 256, "fp32": 128})
    """Shape efficiency: each GEMM dimension d (M, K, N) multiplies the rate by d / (d + half_dim).
    Large tensor-parallel degrees cut K or N (1024 KV columns / 8 = 128), which is where small
    per-GPU matrices lose. Measured on an H200 relative to the large shape: N=512 0.88, K=512
    0.75, N=128 0.47, M=1024 0.9; the product form with 128 gives 0.76, 0.76, 0.48, 0.86. FP8
    needs larger tiles: N=512 runs at 0.62 of its large shape (256 gives 0.64)."""

    attention_efficiency: dict[str, float] = field(default_factory=lambda: {"hopper": 0.48, "ampere": 0.55})
    """Fraction of the BF16 peak that causal SDPA (forward and backward, GQA) reaches on long
    sequences, counting 6·s·h FLOPs per token per layer. Measured on an H200 with torch 2.11: 458
    TFLOP/s at 8K, 466 at 32K (docs/planner_gpu.json); FlashAttention-2 reaches about 60% of an
    A100. Attention stays in BF16 under FP8 training."""

    attention_kernel: str = "cudnn"
    """The fused attention kernel the step's SDPA runs, a key of `attention_kernel_factor`. The
    entrypoints call torch's SDPA, which from torch 2.11 prefers cuDNN's fused attention on sm90 and
    sm100 (pytorch/pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
    check_prefer_cudnn_attention, gated on the bundled cuDNN > 9.15; earlier builds made cuDNN
    opt-in after pytorch/pytorch#138522): `attention_efficiency` was measured on that kernel.
    Published runs that ran another kernel are priced with theirs (scripts/planner_calibration.py)."""

    attention_kernel_factor: dict[str, float] = field(default_factory=lambda: {"cudnn": 1.0, "flash2": 0.62})
    """Each attention kernel's long-sequence rate as a fraction of cuDNN's, counting 6·s·h FLOPs
    per token (forward 2, backward 4). From FlashAttention-3 (Shah et al., arXiv 2407.08608,
    Figures 5 and 6: H100 SXM5, head dim 128, 16K tokens): causal forward FlashAttention-2 335 and
    cuDNN 539 TFLOP/s, backward 322 and 516, where the paper counts the backward as 2.5 forwards;
    per 3 forwards of work that is 3/(1/335 + 2.5/322) = 279 against 3/(1/539 + 2.5/516) = 448
    TFLOP/s, 0.62. flash2 is torch SDPA's FLASH_ATTENTION backend (FlashAttention-2), the default
    on H100 before cuDNN was preferred (pytorch/pytorch#142132: nightly 2.6.0.dev20241204 runs
    its default SDPA at 329 TFLOP/s against cuDNN's 631 on one shape) and the backend torchtitan
    pins on Hopper (pytorch/torchtitan#1196, torchtitan/models/attention.py). cuDNN is also
    Transformer Engine's fused attention in NeMo and Megatron. Our own measurement agrees: 458-466
    TFLOP/s at 8K-32K on an H200 with torch 2.11 (0.47 of the peak) against cuDNN's 448 above."""

    attention_half_seq: int = 1024
    """Sequence length at which attention runs at half its long-sequence rate (measured: 260 TFLOP/s
    at 2K, 458 at 8K)."""

    cp_attention_factor: dict[str, float | dict[int, float]] = field(
        default_factory=lambda: {
            "zigzag_sdpa": 0.58,
            "allgather": {16384: 0.95, 8192: 0.92, 4096: 0.88},
            "ulysses": 1.0,
        }
    )
    """Context-parallel attention's rate as a fraction of plain causal SDPA, by `parallel.cp_attention`:
    one value, or one per length of the queries a CP rank holds (`cp_attention_rate`). zigzag_sdpa,
    the all-gather path's masked kernel (the first CP kernel; document masking still runs it: two
    SDPA calls per layer against key prefixes, the second with a lower-right causal mask): measured
    255-290 against 466 TFLOP/s at 32K for cp 2, 4 and 8 on an H200. allgather (LSE-merged
    fused-kernel pieces): per-rank TFLOP/s against plain causal cuDNN attention at 32K on an H100,
    cp 2/4/8 (16K, 8K and 4K queries per rank, each in two zigzag chunks against the gathered
    keys) at 0.95/0.92/0.88 (scripts/gpu_check.py `cp_speed_check`, docs/gpu_check_h100.json
    "cp_speed"; FlashAttention-2 there gave 0.89/0.87/0.80 of its own rate). One sequence length
    was measured, so degree and per-rank length are not told apart; keyed by the length, since the
    pieces' tiles, not the rank count, set a kernel's rate, and each rank runs two chunks whatever
    the degree. ulysses (plain causal attention on the whole sequence for a subset of heads): a
    target, pending GPU measurement."""

    hbm_efficiency: float = 0.85
    """Fraction of the HBM bandwidth that elementwise kernels and the optimizer step reach (a large
    bf16 add: 0.92 of an H200's 4.8 TB/s)."""

    elementwise_bytes_per_hidden: float = 70.0
    elementwise_bytes_per_ffn: float = 10.0
    """Forward HBM traffic of the non-matmul work of one block, per token: a·h + b·f bytes; backward
    moves about twice the forward's. SwiGLU's SiLU and product move about 10 bytes per FFN element;
    the rest (fused RMSNorms, eager RoPE on q and k with its chunk/cat copies, the attention output
    reshape, residual adds) was fitted to the entrypoints' blocks on an H200: what 4 blocks of 8B
    forward + backward take beyond their GEMMs (at the sustained rate) and attention: about 0.3 us
    per token and layer, at 8K and at 32K alike."""

    unfused_squared_relu_bytes: float = 28.0
    """Forward and backward HBM traffic per FFN element of Megatron-Core's unfused squared ReLU
    (Workload.mlp_activation "squared_relu_unfused": NeMo's squared_relu, torch.pow(F.relu(x), 2),
    nemo/collections/nlp/parts/utils_funcs.py at v2.0.0rc0; Megatron-Core core_r0.8.0
    transformer/mlp.py applies it eagerly without bias_activation_fusion), counted for bf16, not
    measured: relu reads and writes (4 bytes), pow writes its square (4); backward, pow's gradient
    makes self.pow(1) (4), scales it by 2 (4) and multiplies the incoming gradient (6), and relu's
    threshold_backward reads the gradient and the output and writes (6): 28."""

    moe_permute_bytes: float = 14.1
    """HBM bytes per element that one of the MoE's permutes costs in the entrypoints: the token
    copies gathered into expert order and back to token order (model/moe.py, model/dispatch.py;
    under EP regrouped by local expert and back as well), counted over their forward as every
    elementwise term is, backward twice that. Eager `x[index]` gathers, whose backward is an
    accumulating index_put that sorts its indices first; the router's softmax and top-k, the
    copies' sort and the combine's sum over top-k ride on this count. Fitted to our bf16 MoE layer
    on one H100 (docs/gpu_check_h100.json "moe_layer", scripts/gpu_moe_check.py: Qwen3-30B-A3B's
    layer on 8,192 tokens, forward and backward 8.48 ms): what the model's GEMMs (the router's and
    the experts') and the experts' SwiGLU leave of it (`moe_layer_seconds`; docs/planner.md shows
    the fit). One read and one write of bf16 is 4, which fused permute kernels move
    (Workload.moe_permute_fusion)."""

    compiled_elementwise_factor: float = 0.35
    """torch.compile fuses the norms, RoPE and SwiGLU into a few kernels: about a third of the eager
    traffic remains. On torchtitan's 8B, compile gives +16%; this factor predicts +11% there."""

    torchao_cast_bytes: dict[str, dict[str, float]] = field(
        default_factory=lambda: {
            "tensorwise": {"input": 13.0, "grad_output": 5.2, "weight": 7.6},
            "rowwise": {"input": 16.1, "grad_output": 2.2, "weight": 11.4},
        }
    )
    """HBM bytes torchao's float8 casts add per element, by `precision.fp8_recipe`, in a
    torch.compile'd block (Workload.fp8_casts "torchao"): of each linear's input (the attention's
    and the MLP's inputs, shared by their linears, once each), of each linear's output gradient,
    and of each weight. Measured, not assumed: scripts/fp8_cast_bytes.py sums inductor's own
    per-kernel byte counts over the entrypoints' compiled Llama block, forward and backward, float8
    against bf16, at six widths, and fits these three (docs/fp8_cast_bytes.json: torch 2.13,
    torchao 0.18, every shape within 1.5%). An input costs more than its one amax and cast (5
    bytes): the backward's casts for the weight gradient (torchao/float8/float8_linear.py
    matmul_with_hp_or_float8_args recasts the saved bf16 input) are moved into the forward graph
    with an amax of their own, and the layouts `_scaled_mm` needs are copies (float8_ops.py
    preprocess_addmm)."""

    te_cast_bytes: dict[str, float] = field(default_factory=lambda: {"te_delayed": 4.0, "te_current": 6.0})
    """HBM bytes per element Transformer Engine's float8 casts move (Workload.fp8_casts), counted
    from its source, not measured. Delayed scaling (TE 1.x, NeMo 24.07): every GEMM input and
    output gradient goes through one fused cast-transpose, which reads it (2 bytes) and writes the
    float8 copy and its transpose (1 + 1), the amax taken in the same pass from the previous
    steps' history (v1.8 transformer_engine/pytorch/module/linear.py fp8_cast_transpose_fused,
    module/base.py grad_output_preprocess). Current scaling (fp8-cs): an amax pass over the input
    first, then the scale, then the cast (Float8CurrentScalingQuantizer::quantize_impl,
    transformer_engine/pytorch/csrc/quantizer.cpp at d0067d0d: nvte_compute_amax_with_config,
    nvte_compute_scale_from_amax, nvte_quantize_v2): 2 bytes more."""

    fp8_cast_bytes_per_element: float = 5.0
    """torchao's fused Triton casts of the FP8 experts' rows and weights (_expert_cast_elements): read
    for the amax (2 bytes), read again and write the float8 copy (3)."""

    fp8_eager_cast_factor: float = 17.0
    """Without torch.compile, torchao's float8 linears run separate amax, scale, cast and transpose
    kernels through a tensor subclass: about 17 times the compiled traffic (`torchao_cast_bytes`).
    Fitted to the entrypoints' own run (scripts/gpu_check.sh, Llama 3.2 1B at 8K on an H200): FP8
    eager 22,520 tokens/s against 41,437 in bf16. FP8 pays off only with training.compile."""

    loss_bytes_per_logit: float = 123.0
    """What the chunked loss costs per logit beyond its GEMMs, as HBM traffic: bf16 logits upcast to
    fp32, log-sum-exp, and in backward the recomputed logits' softmax minus the one-hot, scaled and
    cast back, each an eager kernel over the chunk, plus the per-chunk accumulation into the output
    weight's gradient. Fitted to the entrypoints' loss at 8K tokens and 128256 words on an H200:
    86.4 ms, of which the model's GEMMs on the contract's 1024-token chunks take 54.6 ms. (Fitted
    while the model sized the chunks without the 1024-token floor, so that its GEMMs took ~73 ms,
    this was 50: the split between GEMMs and the rest is the model's, the total the measurement.)"""

    materialized_loss_bytes_per_logit: float = 40.0
    """The same for a loss over the whole micro-batch's kept logits (Workload.logits_materialized),
    counted, not measured, for torchtitan's cross_entropy of the upcast logits: forward reads the
    bf16 logits and writes them in fp32 (2 + 4), log_softmax reads them twice and writes its output
    (12); backward writes the NLL gradient (4), log_softmax's backward reads it and the output and
    writes the gradient (12), and the cast back reads 4 and writes 2: 40 bytes. Megatron-Core's fused
    vocab-parallel cross-entropy moves less, so this is an upper bound there."""

    fp32_peak_factor: float = 0.5
    """fp32 matmuls run as TF32 at half the dense BF16 peak (NVIDIA A100/H100/H200 datasheets)."""

    nvlink_efficiency: float = 0.8
    """Fraction of one direction of NVLink (half the catalog's bidirectional GB/s) that NCCL ring
    collectives sustain as bus bandwidth: about 360 of 450 GB/s on an H100 node."""

    network_efficiency: float = 0.8
    """Fraction of a node's network bandwidth (the catalog's efa_gbps: every NIC of the node) that
    NCCL sustains. A ring or tree collective whose group has r ranks on each node drives r NICs at
    once, so the groups of one mesh dimension share the node's NICs: each gets r/g of them (g GPUs
    per node), capped by NVLink for its intra-node hops. A group with one rank per node gets one
    GPU's share; point-to-point sends (pipeline stages) always do. NCCL's tests reach about 80% of
    the line rate across nodes (nccl-tests all_reduce bus bandwidth on 8 x 400 Gb/s nodes)."""

    latency_intra_s: float = 15e-6
    latency_inter_s: float = 40e-6
    """Fixed cost of one collective or send/recv inside a node and across nodes."""

    fsdp_overlap: float = 0.85
    """Fraction of a micro-batch's compute that can hide FSDP's all-gathers and reduce-scatters
    (FSDP2 prefetches the next block's parameters; NCCL kernels take some SMs). The first block's
    all-gather of each micro-batch is always exposed."""

    fsdp_param_bytes: int = 2
    fsdp_grad_bytes: dict[str, int] = field(default_factory=lambda: {"fp32": 4, "bf16": 2})
    """FSDP all-gathers bf16 parameters (float8 block weights with tensorwise FP8) and reduce-scatters
    gradients in `parallel.reduce_dtype`: the entrypoints' MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32 unless the recipe says bf16)."""

    tp_overlap_interference: float = 0.53
    """torch's async TP (Workload.tp_overlap "async") and regathers issued async beside a GEMM
    (regather_overlap, outside userbuffers): the fraction of each hidden collective piece's time the
    step still pays, since the copy and the GEMM beside it share SMs and HBM. Fitted to the vanilla
    and async TP pairs of torchtitan's Llama 3.1 8B rows (benchmarks/asyncTP_llama3_h100_2025-06_
    torchtitan.md): scripts/planner_calibration.py prints the fit; the 70B pairs check it.
    Transformer Engine's userbuffers is priced from its own configs instead (launcher/plan/userbuffers.py)."""

    cp_overlap: float = 0.0
    """The K/V all-gather (or Ulysses' all-to-alls) must finish before attention starts, and the
    gradients' reduce-scatter before the K/V projections' backward: not hidden."""

    hsdp_overlap: float = 0.5
    """The gradient all-reduce between HSDP replicas runs once per step, block by block as the last
    micro-batch's backward finishes them: about half of it hides."""

    optimizer_bytes_per_param: float = 32.0
    bf16_moments_bytes_per_param: float = 104.0
    """AdamWBf16Moments (training.optimizer.state_dtype: bf16) runs its update as separate eager
    kernels on fp32 chunks, each reading and writing what it touches: the moments read from bf16
    and widened (2 + 4 bytes each), lerp, mul and addcmul (32), both written back to bf16 (12),
    the weight decay (8), sqrt, div and add on the denominator (24), addcdiv (16): 104 bytes per
    parameter, counted, not measured."""
    """AdamW over fp32 shards: reads parameter, gradient, exp_avg and exp_avg_sq, writes three."""

    activation_bytes: int = 2
    """Activations, K/V and pipeline messages travel in bf16."""


CONSTANTS = Constants()


BREAKDOWN = (
    "matmul",
    "attention",
    "elementwise",
    "recompute",
    "tensor_parallel",
    "context_parallel",
    "expert_parallel",
    "fsdp",
    "pipeline_p2p",
    "pipeline_bubble",
    "data_replicate",
    "optimizer",
    "host_overhead",
)
"""Where a step's time goes, in seconds per step; they add up to the step time."""

HOST_CPU_TERMS = {
    "per_step": "host_overhead",
    "per_layer": "host_overhead",
    "per_layer_micro_batch": "host_overhead",
    "matmul_gflop": "matmul",
    "attention_gflop": "attention",
    "recompute_gflop": "recompute",
    "fsdp_mb": "fsdp",
    "replicate_mb": "data_replicate",
    "tp_layer_micro_batch": "tensor_parallel",
    "tp_replicated_layer_micro_batch": "tensor_parallel",
    "tp_mb": "tensor_parallel",
    "cp_layer_micro_batch": "context_parallel",
    "pp_step": "pipeline_p2p",
    "expert_layer_micro_batch": "host_overhead",
    "ep_mb": "expert_parallel",
}
"""The BREAKDOWN term each kind of host-CPU work (launcher.plan.host_cpu.cpu_work) is counted under."""

BREAKDOWN_WORDS = {
    "matmul": "matrix multiplies",
    "attention": "attention",
    "elementwise": "elementwise kernels",
    "recompute": "activation recomputation",
    "tensor_parallel": "tensor-parallel communication",
    "context_parallel": "context-parallel K/V communication",
    "expert_parallel": "expert-parallel token all-to-alls",
    "fsdp": "exposed FSDP communication",
    "pipeline_p2p": "pipeline send/recv",
    "pipeline_bubble": "the pipeline bubble",
    "data_replicate": "the HSDP gradient all-reduce",
    "optimizer": "the optimizer step",
    "host_overhead": "per-operation host overhead",
}


class ThroughputUnknown(UsageError):
    """A GPU with no known peak FLOP/s or memory bandwidth: there is nothing to predict from."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Throughput:
    """Predicted speed and cost of one layout on one cluster."""

    tokens_per_s_per_gpu: float
    mfu: float
    step_time_s: float
    tokens_per_step: int
    world_size: int
    bubble_fraction: float
    model_flops_per_token: float
    breakdown: dict[str, float]
    instance_count: int
    usd_per_hour: float  # the whole cluster
    steps: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_s_per_gpu * self.world_size

    def mfu_text(self, places: int = 0) -> str:
        """The MFU as a percentage; "-" where no peak is known (host CPUs)."""
        return "-" if math.isnan(self.mfu) else f"{self.mfu:.{places}%}"

    @property
    def time_to_train_s(self) -> float | None:
        return None if self.steps is None else self.steps * self.step_time_s

    @property
    def usd_per_million_tokens(self) -> float:
        return self.usd_per_hour / 3600 / self.tokens_per_s * 1e6

    @property
    def usd_per_run(self) -> float | None:
        seconds = self.time_to_train_s
        return None if seconds is None else self.usd_per_hour * seconds / 3600

    @property
    def communication_s(self) -> float:
        """Exposed communication per step: what the GPUs wait for rather than compute."""
        kinds = ("tensor_parallel", "context_parallel", "expert_parallel", "fsdp", "pipeline_p2p", "data_replicate")
        return sum(self.breakdown[k] for k in kinds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1),
            "mfu": None if math.isnan(self.mfu) else round(self.mfu, 4),
            "step_time_s": round(self.step_time_s, 4),
            "tokens_per_step": self.tokens_per_step,
            "time_to_train_s": None if self.time_to_train_s is None else round(self.time_to_train_s, 1),
            "usd_per_hour": round(self.usd_per_hour, 2),
            "usd_per_million_tokens": round(self.usd_per_million_tokens, 4),
            "usd_per_run": None if self.usd_per_run is None else round(self.usd_per_run, 2),
            "bubble_fraction": round(self.bubble_fraction, 4),
            "breakdown_s": {k: round(v, 5) for k, v in self.breakdown.items()},
        }


HOST_CPU_NOTE = (
    "the host CPU has no datasheet peak: speeds are this layout's counted work at the seconds per unit measured on "
    "{measured_on} (launcher/catalog/host_cpu.yaml), with {cores} cores here; tokens/s are per CPU rank"
)


def on_host_cpus(hardware: Hardware) -> bool:
    """The catalog's host CPU (`cluster.device: cpu`): `launcher.plan.host_cpu` prices its steps."""
    return hardware.accelerator_key == "cpu"


def host_cpu_note(hardware: Hardware) -> str | None:
    """What `launcher plan` says of CPU speeds; None for GPUs."""
    if not on_host_cpus(hardware):
        return None
    return HOST_CPU_NOTE.format(measured_on=catalog.host_cpu_rates().measured_on, cores=_cores(hardware))


def _cores(hardware: Hardware) -> int:
    """The cores the job's CPU ranks share per node (`Hardware.cpu_cores`), or this machine's."""
    return hardware.cpu_cores or catalog.host_cores()


def generation(accelerator: Accelerator) -> str:
    """The catalog's GPUs by tensor-core generation: FP8 tensor cores mean Hopper."""
    return "hopper" if accelerator.has_fp8 else "ampere"


def predict(workload: Workload, hardware: Hardware, *, constants: Constants = CONSTANTS) -> Throughput:
    """Predicted tokens/s/GPU, MFU, step time and cost of one workload on one cluster.

    Each term of the step time is one function below, in seconds per micro-batch or per step; on
    host CPUs, `launcher.plan.host_cpu` prices the step instead. Raises ThroughputUnknown for a
    GPU without datasheet peaks.
    """
    if on_host_cpus(hardware):
        return _predict_host_cpu(workload, hardware)
    return _predict(workload, _Machine(hardware, constants))


def predict_many(
    workloads: list[Workload], hardware: Hardware, *, constants: Constants = CONSTANTS
) -> list[Throughput]:
    """`predict` of each workload on one cluster: the planner's thousands of candidates.

    The cluster's rates, its links and each distinct layer's compute are worked out once for
    all of them (`_Machine`); every number is the one `predict` gives."""
    if not workloads:
        return []
    if on_host_cpus(hardware):
        return [_predict_host_cpu(workload, hardware) for workload in workloads]
    machine = _Machine(hardware, constants)
    return [_predict(workload, machine) for workload in workloads]


def _predict(workload: Workload, machine: _Machine) -> Throughput:
    """The step of the slowest rank that can be the slowest (the first of equals)."""
    slowest, longest = None, -1.0
    for step in machine.steps_for(workload):
        breakdown = _rank_breakdown(step)
        step_s = sum(breakdown.values())
        if step_s > longest:
            slowest, longest = (step, breakdown), step_s
    assert slowest is not None
    return _throughput(*slowest, longest)


def _predict_host_cpu(workload: Workload, hardware: Hardware) -> Throughput:
    """A CPU step priced by `launcher.plan.host_cpu`, its seconds put under BREAKDOWN's terms;
    MFU is NaN, as the entrypoints log it where no peak is known."""
    seconds = cpu_step_seconds(workload, catalog.host_cpu_rates(), cores=_cores(hardware))
    breakdown = dict.fromkeys(BREAKDOWN, 0.0)
    for kind, value in seconds.items():
        breakdown[HOST_CPU_TERMS[kind]] += value
    step_s = sum(breakdown.values())
    world = workload.layout.world_size
    return Throughput(
        tokens_per_s_per_gpu=workload.tokens_per_step / step_s / world,
        mfu=math.nan,
        step_time_s=step_s,
        tokens_per_step=workload.tokens_per_step,
        world_size=world,
        bubble_fraction=bubble_fraction(workload.layout.pipeline, workload.grad_accum_steps),
        model_flops_per_token=model_flops_per_token(workload.arch, workload.seq_len),
        breakdown=breakdown,
        instance_count=hardware.instance_count,
        usd_per_hour=hardware.usd_per_hour * hardware.instance_count,
        steps=workload.steps,
    )


def _slowest_rank_candidates(workload: Workload) -> list[int]:
    """The pipeline ranks that can be the slowest: the last, which holds the output layer and
    the loss, and the other rank with the most layers if it has more than the last (the
    embedding's lookup is not timed)."""
    per_rank = layers_by_rank(workload.arch.num_layers, workload.layout)
    last = len(per_rank) - 1
    most = max(per_rank)
    return [last] if most <= per_rank[last] else [per_rank.index(most), last]


def _rank_breakdown(step: _Step) -> dict[str, float]:
    """The step's seconds by BREAKDOWN term if every pipeline rank were as slow as `step`'s."""
    workload, family = step.w, step.family_terms()
    compute, tp_mb, cp_mb, ep_mb, p2p_mb = step.micro_batch_terms()
    fsdp_mb, fsdp_step = fsdp_time(step, compute.total)
    micro_batch_s = compute.total + tp_mb + cp_mb + ep_mb + fsdp_mb + p2p_mb
    m = workload.grad_accum_steps
    return {
        "matmul": m * compute.matmul,
        "attention": m * compute.attention,
        "elementwise": m * compute.elementwise,
        "recompute": m * compute.recompute,
        "tensor_parallel": m * tp_mb,
        "context_parallel": m * cp_mb,
        "expert_parallel": m * ep_mb,
        "fsdp": m * fsdp_mb + fsdp_step,
        "pipeline_p2p": m * p2p_mb,
        "pipeline_bubble": pipeline_bubble_time(step, micro_batch_s),
        "data_replicate": family.data_replicate,
        "optimizer": family.optimizer,
        "host_overhead": 0.0,  # a GPU's kernels run behind the host's launches (host CPUs: _predict_host_cpu)
    }


def predicted_summary(recipe: Recipe) -> dict[str, float] | None:
    """`{tokens_per_s_per_gpu, mfu, step_time_s}` for the recipe's layout (mfu None on host CPUs);
    None where nothing predicts it (a GPU without datasheet peaks)."""
    try:
        speed = predict(Workload.from_recipe(recipe), recipe.hardware)
    except ThroughputUnknown:
        return None
    summary = speed.to_dict()
    return {key: summary[key] for key in ("tokens_per_s_per_gpu", "mfu", "step_time_s")}


_VARIANT_FIELDS = ("activation_checkpointing", "grad_accumulation")
"""What `_Step.switch` changes: the Workload fields a step reads only through `w`, `recompute` and
`accumulation`."""
_FAMILY_FIELDS = tuple(f.name for f in fields(Workload) if f.name not in (*_VARIANT_FIELDS, "arch"))
_family_fields = attrgetter(*_FAMILY_FIELDS)  # one C call for the planner's 100,000 keys


class _Machine:
    """What every prediction on one cluster with one set of constants shares: the rates, each
    link's (bandwidth, latency), and each distinct layer's compute (`compute_time`), kept for as
    long as the predictions that share them (one `predict` or `predict_many` call)."""

    __slots__ = (
        "hardware", "k", "accelerator", "gen", "bf16_peak", "hbm", "intra", "gpus_per_node", "usd_per_hour",
        "node_network", "inter", "links", "layer_terms", "steps",
    )  # fmt: skip

    def __init__(self, hardware: Hardware, k: Constants):
        accelerator = hardware.accelerator
        if not accelerator.peak_bf16_tflops or not accelerator.hbm_gbps:
            raise ThroughputUnknown(
                f"{accelerator.name} has no known peak FLOP/s or memory bandwidth; throughput is predicted for GPUs only"
            )
        self.hardware, self.k, self.accelerator, self.gen = hardware, k, accelerator, generation(accelerator)
        self.bf16_peak = accelerator.peak_bf16_tflops * 1e12
        self.hbm = accelerator.hbm_gbps * GB * k.hbm_efficiency
        self.intra = accelerator.nvlink_gbps / 2 * GB * k.nvlink_efficiency if accelerator.nvlink_gbps else 0.0
        self.gpus_per_node, self.usd_per_hour = hardware.procs_per_node, hardware.usd_per_hour
        self.node_network = hardware.instance.efa_gbps / 8 * GB * k.network_efficiency  # every NIC of a node
        self.inter = self.node_network / self.gpus_per_node  # one GPU's share
        self.links: dict[tuple[int, int], tuple[float, float]] = {}
        self.layer_terms: dict[tuple, tuple[float, ...]] = {}
        self.steps: dict[tuple, list[_Step]] = {}

    def steps_for(self, workload: Workload) -> list[_Step]:
        """A `_Step` of each rank of `workload` that can be the slowest.

        The planner's candidates come in families that differ only in activation checkpointing
        and accumulation mode; a family shares its steps, each switched to the member asked for
        (`_Step.switch`). The family key is every other Workload field (the model by identity:
        the workloads outlive this machine's call)."""
        # The context-parallel path follows the checkpointing (contract.layout.cp_attention_for):
        # members that resolve `auto` differently are priced apart.
        cp_path = workload.cp_attention_path
        key = (id(workload.arch), cp_path, _family_fields(workload))
        steps = self.steps.get(key)
        if steps is None:
            ranks = _slowest_rank_candidates(workload)
            steps = self.steps[key] = [_Step(workload, self.hardware, self.k, rank, machine=self) for rank in ranks]
        else:
            for step in steps:
                step.switch(workload, cp_path)
        return steps


class _Step:
    """What every term shares: one micro-batch on one GPU of pipeline rank `rank`."""

    __slots__ = (
        "w", "k", "gen", "accelerator", "h", "q", "kv", "f", "vocab", "t", "c", "p", "v", "shard", "replicas", "b",
        "s", "layers", "recompute", "fp8", "fp8_gather", "rows", "bf16_peak", "hbm", "intra", "inter",
        "gpus_per_node", "usd_per_hour", "block_params", "stage_params", "has_output", "node_network",
        "accumulation", "grad_bytes", "cp_attention", "machine", "moe", "ep", "copies", "state_params", "active_f",
        "fp8_experts", "expert_rows", "expert_block_params", "family", "by_recompute", "moe_rows", "experts_apart",
    )  # fmt: skip

    def __init__(
        self,
        workload: Workload,
        hardware: Hardware,
        k: Constants,
        rank: int | None = None,
        *,
        machine: _Machine | None = None,
    ):
        machine = machine or _Machine(hardware, k)
        arch, layout, accelerator = workload.arch, workload.layout, machine.accelerator
        self.machine, self.w, self.k, self.accelerator, self.gen = machine, workload, k, accelerator, machine.gen
        self.h, self.kv, self.f, self.vocab = arch.hidden_size, arch.kv_dim, arch.ffn_hidden_size, arch.vocab_size
        self.q = arch.q_dim  # query width: h for Llama, num_heads x head_dim for Qwen3
        self.t, self.c, self.p, self.v = layout.tensor, layout.context, layout.pipeline, layout.virtual_stages
        self.shard, self.replicas = layout.fsdp_shard, layout.data_replicate
        self.b, self.s = workload.micro_batch_size, workload.seq_len
        rank = layout.pipeline - 1 if rank is None else rank
        self.layers = rank_layers(arch.num_layers, layout, rank)
        self.has_output = rank == layout.pipeline - 1
        self.family: _FamilyTerms | None = None
        self.by_recompute: dict[float, _MicroBatchTerms] = {}
        self.switch(workload)
        fp8, fp8_recipe = workload.fp8 and accelerator.has_fp8, workload.fp8_recipe
        self.fp8 = fp8
        # Tensorwise FP8 on NCCL all-gathers float8 weights (FSDP) and activations (TP): the entrypoints'
        # fp8.py. Weights are then cast on the local shard before the gather. Predictions are for GPUs.
        self.fp8_gather = float8_all_gather(fp8=fp8, fp8_recipe=fp8_recipe, backend=collective_backend("cuda"))
        self.rows = self.b * self.s // self.c  # GEMM M: tokens of one micro-batch on one CP rank (SP gathers them)
        self.bf16_peak, self.hbm, self.intra = machine.bf16_peak, machine.hbm, machine.intra
        self.gpus_per_node, self.usd_per_hour = machine.gpus_per_node, machine.usd_per_hour
        self.node_network, self.inter = machine.node_network, machine.inter
        self.grad_bytes = k.fsdp_grad_bytes[mode(workload, "reduce_dtype")]
        h, q, kv, f = self.h, self.q, self.kv, self.f
        small = 2 * h + arch.attention_extra_params()  # norms (QK-norms), attention biases
        self.moe, self.ep = arch.moe, layout.expert
        self.experts_apart = arch.moe is not None and layout.experts_apart  # a unit of their own
        self.moe_rows = 0.0
        self.active_f = f  # the MLP width a token's FLOPs see (MFU): the dense f, or the MoE's below
        output = self.vocab * h + h if self.has_output else 0  # the last rank's final norm and output layer
        if self.moe is None:
            self.copies = self.expert_rows = self.expert_block_params = 0
            self.fp8_experts = False
            self.block_params = self.layers * (2 * h * q + 2 * h * kv + 3 * h * f + small)
            self.stage_params = self.state_params = self.block_params + output
        else:
            self._moe_params(h, q, kv, small, output)

    def _moe_params(self, h: int, q: int, kv: int, small: int, output: int) -> None:
        """A mixture-of-experts model (entrypoints/model/moe.py): each tp rank routes its own
        slice of the sequence (parallel/tensor.py). The router and shared experts are whole on
        every tp rank, where the per-layer counts here are divided by t (fsdp_traffic,
        optimizer_time), so they are counted t times; a rank gathers and reduces its E / ep
        experts, and holds state shards of all E over dp_shard x cp x tp (ep x expert_fsdp,
        `Layout.moe_ranks`). The dense f goes to 0: the experts' work is priced on its own
        (expert_gemm_time)."""
        moe, t = self.moe, self.t
        expert = moe.expert_params(h)
        dense = moe.num_experts * h + 3 * h * moe.shared_experts * moe.expert_ffn_hidden_size  # router, shared
        attention = 2 * h * q + 2 * h * kv + small
        self.moe_rows = self.rows // t  # tokens one rank routes per micro-batch
        self.copies = self.moe_rows * moe.top_k  # their token copies
        # FP8 experts (entrypoints/model/fp8_experts.py) compute on a buffer of R rounded up to 16
        # plus 16 x E/ep rows, every row of it (the rows past the last group join the last expert).
        self.fp8_experts = self.fp8 and self.w.experts_in_fp8
        padded = padded_group_rows(self.copies, moe.num_experts // self.ep)
        self.expert_rows = padded if self.fp8_experts else self.copies
        self.expert_block_params = self.layers * t * moe.num_experts // self.ep * expert  # this rank's experts
        self.block_params = self.layers * (attention + t * dense) + self.expert_block_params
        self.stage_params = self.block_params + output
        self.state_params = self.layers * (attention + t * dense + moe.num_experts * expert) + output
        self.active_f = moe.active_ffn_width()
        self.f = 0

    def switch(self, workload: Workload, cp_path: str | None = None) -> None:
        """Make this the step of `workload`, which may differ from the one it was built for only in
        `_VARIANT_FIELDS`: every other field reads the same (`family_terms` too). `cp_path`:
        `workload.cp_attention_path`, where the caller has it."""
        self.w = workload
        self.recompute = AC_RECOMPUTE[workload.activation_checkpointing]
        if workload.recompute_layers:  # k of each virtual stage's layers (Workload.recompute_layers)
            block = min(1.0, workload.recompute_layers * self.v / self.layers) if self.layers else 0.0
            self.recompute = max(self.recompute, block)
        self.accumulation = mode(workload, "grad_accumulation")
        path = workload.cp_attention_path if cp_path is None else cp_path
        self.cp_attention = priced_cp_attention(path, document_masking=workload.document_masking)

    def micro_batch_terms(self) -> _MicroBatchTerms:
        """One micro-batch's compute and the collectives FSDP's are not: of the family, they
        change only with the share recomputed, so members that differ in accumulation alone
        share them."""
        terms = self.by_recompute.get(self.recompute)
        if terms is None:
            terms = self.by_recompute[self.recompute] = _MicroBatchTerms(
                compute_time(self),
                tensor_parallel_time(self),
                context_parallel_time(self),
                expert_parallel_time(self),
                pipeline_p2p_time(self),
            )
        return terms

    def family_terms(self) -> _FamilyTerms:
        """The terms that read nothing `switch` changes, worked out once for the whole family."""
        terms = self.family
        if terms is None:
            w = self.w
            flops = _model_flops(self.h, self.q, self.kv, self.active_f, w.arch.num_layers, self.vocab, w.seq_len, 6)
            terms = self.family = _FamilyTerms(
                fsdp_traffic(self), data_replicate_time(self), optimizer_time(self), flops
            )
        return terms

    def link(self, stride: int, size: int) -> tuple[float, float]:
        """(bus bandwidth, latency) of a collective over `size` ranks `stride` apart in the mesh.

        Every group of a mesh dimension runs its collective at the same time (SPMD), so the groups
        with ranks on a node share that node's NICs: a group with r ranks per node gets r/g of them.
        Its intra-node hops run over NVLink, which caps the ring's rate when r > 1."""
        known = self.machine.links
        found = known.get((stride, size))
        if found is None:
            found = known[stride, size] = self._link(stride, size)
        return found

    def _link(self, stride: int, size: int) -> tuple[float, float]:
        k, g = self.k, self.gpus_per_node
        if self._within_node(stride, size):
            return self.intra, k.latency_intra_s
        if self.node_network <= 0:
            return self.intra or self.hbm, k.latency_intra_s  # one machine without a network: stays local
        per_node = self.ranks_per_node(stride, size)
        network = self.node_network * per_node / g
        return (min(network, self.intra) if per_node > 1 and self.intra else network), k.latency_inter_s

    def ranks_per_node(self, stride: int, size: int) -> int:
        """How many of a group's `size` ranks, `stride` apart in the mesh, share one node."""
        return max(1, min(size, self.gpus_per_node // stride))

    def even_split(self, stride: int, size: int, sent: float) -> tuple[float, float]:
        """(to this node's ranks, to other nodes' ranks) of `sent` bytes spread evenly over a
        group of `size` ranks `stride` apart, 1/size of them to the sender itself."""
        local = self.ranks_per_node(stride, size)
        return sent * (local - 1) / size, sent * (size - local) / size

    def exchange_time(self, stride: int, size: int, on_node: float, off_node: float) -> float:
        """Seconds of one all-to-all over `size` ranks `stride` apart, in which each rank sends
        `on_node` bytes to the group's ranks on its own node and `off_node` bytes to those on others.

        An all-to-all is not a ring: what a rank sends to another node leaves through the NICs,
        and every GPU of the node sends its own at once (SPMD), so it gets one GPU's share of them
        (`inter`) whatever the group's shape, while its bytes for its own node go over NVLink at
        the same time; the slower of the two sets the time. Within a node, or on one machine
        without a network, it runs at the group's link rate."""
        if self._within_node(stride, size) or self.node_network <= 0:
            bandwidth, latency = self.link(stride, size)
            return (on_node + off_node) / bandwidth + latency
        nvlink = on_node / (self.intra or self.inter)
        return max(nvlink, off_node / self.inter) + self.k.latency_inter_s

    def p2p_link(self, stride: int, size: int) -> tuple[float, float]:
        """(bandwidth, latency) of a send/recv between ranks `stride` apart: one GPU's NIC share across
        nodes, since every GPU of the node sends its own message at the same time."""
        k = self.k
        if self._within_node(stride, size):
            return self.intra, k.latency_intra_s
        if self.inter <= 0:
            return self.intra or self.hbm, k.latency_intra_s
        return self.inter, k.latency_inter_s

    def _within_node(self, stride: int, size: int) -> bool:
        g = self.gpus_per_node
        return bool(self.intra) and stride * size <= g and g % (stride * size) == 0


class _FamilyTerms(NamedTuple):
    """A step's terms that its family's members share (`_Step.family_terms`)."""

    fsdp: _FsdpTraffic
    data_replicate: float  # seconds per step
    optimizer: float  # seconds per step
    model_flops_per_token: float  # model_flops_per_token(arch, seq_len, causal=True)


class _MicroBatchTerms(NamedTuple):
    """Seconds of one micro-batch by kind, but FSDP's (`_Step.micro_batch_terms`)."""

    compute: _Compute
    tensor_parallel: float
    context_parallel: float
    expert_parallel: float
    pipeline_p2p: float


class _Compute(NamedTuple):
    """The compute of one micro-batch on one GPU, by kind, in seconds."""

    matmul: float
    attention: float
    elementwise: float
    recompute: float

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.elementwise + self.recompute


def compute_time(step: _Step) -> _Compute:
    """Matmuls, attention and elementwise work, forward and backward, plus the forward again of the
    blocks activation checkpointing recomputes."""
    block_gemm_s, head_s, attention_s, forward_ew_s, (cast_forward_s, cast_backward_s), loss_s = _layer_terms(step)
    per_layer_forward = (block_gemm_s + attention_s) / 3 + forward_ew_s + cast_forward_s
    layers = step.layers
    kept_products = (1 - step.recompute) * layers * product_recompute_time(step)
    # Megatron's selective recomputation: the kept layers' core attention forward again
    core_attention = (1 - step.recompute) * layers * attention_s / 3 if step.w.recompute_core_attention else 0.0
    return _Compute(
        matmul=layers * block_gemm_s + (head_s if step.has_output else 0.0),
        attention=layers * attention_s,
        elementwise=layers * (3 * forward_ew_s + cast_forward_s + cast_backward_s)
        + kept_products
        + (loss_s if step.has_output else 0.0),
        recompute=step.recompute * layers * per_layer_forward + core_attention,
    )


def product_recompute_time(step: _Step) -> float:
    """A kept dense block's backward making its SwiGLU product again for w2 (entrypoints/model/
    swiglu.py `product_recomputed`): gate and up read and the product written, T x f/t each. Not
    in a compiled block, nor under Float8 TP styles, where w2 keeps the product (its float8 copy);
    a checkpointed block's recomputation makes it anyway (the caller counts kept blocks)."""
    w = step.w
    if step.moe is not None or w.compile or (step.fp8_gather and step.t > 1):
        return 0.0
    dtype_scale = 2 if w.dtype == "fp32" else 1
    return 3 * step.k.activation_bytes * dtype_scale * step.rows * step.f / step.t / step.hbm


def _layer_terms(step: _Step) -> tuple[float, float, float, float, tuple[float, float], float]:
    """One layer's GEMMs, attention, elementwise work and FP8 casts, and the output layer's GEMMs
    and loss, on one GPU: worked out once per distinct set of what they read (the cluster's
    rates are the machine's), since layouts that differ only in pipelining, replicas,
    checkpointing or accumulation share them."""
    w = step.w
    key = (
        w.dtype, w.fp8_recipe, w.fp8_casts, w.compile, w.tp_overlap, step.fp8, step.fp8_gather, step.rows, step.s, step.h,
        w.fp8_weights_cached and w.grad_accum_steps, w.logits_materialized, w.mlp_activation, w.moe_permute_fusion,
        step.q, step.kv, step.f, step.vocab, step.t, step.c, step.shard, step.cp_attention,
        None if step.moe is None else (step.moe.num_experts, step.moe.top_k, step.moe.expert_ffn_hidden_size,
                                       step.moe.shared_experts, step.ep),
    )  # fmt: skip
    known = step.machine.layer_terms
    found = known.get(key)
    if found is None:
        block_gemm_s, head_s = matmul_time(step)
        found = known[key] = (
            block_gemm_s,
            head_s,
            attention_time(step),
            elementwise_time(step),
            fp8_cast_time(step),
            loss_time(step),
        )
    return found


def matmul_time(step: _Step) -> tuple[float, float]:
    """(one block's GEMMs, the output layer's GEMMs in the loss), forward and backward."""
    k, w, gen, rows = step.k, step.w, step.gen, step.rows
    h, kv, f, t = step.h, step.kv, step.f, step.t
    bf16_peak = step.bf16_peak
    block_precision, block_peak, block_eff = _block_precision(step)
    head_precision = "fp32" if w.dtype == "fp32" else "bf16"
    head_peak = bf16_peak * (k.fp32_peak_factor if w.dtype == "fp32" else 1.0)
    head_eff = k.matmul_efficiency[f"{gen}:bf16"]

    block_half = k.gemm_half_dim[block_precision]
    if _overlapped_tp(step):
        block_gemm_s = sum(sum(roles) for roles in _tp_gemm_roles(step))
    else:  # 6 FLOPs per weight and row: forward, input gradient and weight gradient
        shaped = _shaped_block_params(h, step.q, kv, f, t, block_half) / (block_peak * block_eff)
        block_gemm_s = 6 * rows * shaped / _dim_eff(rows, block_half)
    if step.moe is not None:
        block_gemm_s += expert_gemm_time(step, head_peak, head_eff, k.gemm_half_dim[head_precision])
    # The fused linear + cross-entropy loss (entrypoints/model/loss.py) works through the tokens in
    # chunks (the contract's chunk_tokens: about rows * h / V_local, at least 1024), and recomputes
    # each chunk's logits in backward: 8, not 6, FLOPs per output weight and token, in GEMMs whose M
    # is the chunk. Systems that keep the whole micro-batch's logits (Workload.logits_materialized)
    # run 6, with M all the rows.
    vocab_local = step.vocab // t
    if w.logits_materialized:
        flops_per_weight, head_rows = 6, rows
    else:
        flops_per_weight, head_rows = 8, chunk_tokens(rows, h, vocab_local)
    head_half = k.gemm_half_dim[head_precision]
    head_rate = head_peak * head_eff * _dim_eff(head_rows, head_half) * _dim_eff(h, head_half)
    head_s = flops_per_weight * rows * h * vocab_local / (head_rate * _dim_eff(vocab_local, head_half))
    return block_gemm_s, head_s


def _block_precision(step: _Step) -> tuple[str, float, float]:
    """(precision, peak FLOP/s, matmul efficiency) of the blocks' GEMMs."""
    k, w, gen = step.k, step.w, step.gen
    if w.dtype == "fp32":
        return "fp32", step.bf16_peak * k.fp32_peak_factor, k.matmul_efficiency[f"{gen}:bf16"]
    if step.fp8:
        rowwise = k.fp8_rowwise_factor if w.fp8_recipe == "rowwise" else 1.0
        return "fp8", step.accelerator.peak_fp8_tflops * 1e12, k.matmul_efficiency[f"{gen}:fp8"] * rowwise
    return "bf16", step.bf16_peak, k.matmul_efficiency[f"{gen}:bf16"]


TP_OVERLAP_MODES = ("none", "async", "userbuffers")
"""Workload.tp_overlap: none (the entrypoints' DTensor sequence parallel), async (torch's async TP
under torch.compile, as torchtitan runs it) or userbuffers (Transformer Engine's, as Megatron's
tp_comm_overlap runs it). Planner-only: the entrypoints run neither."""

_CHUNKED_ROLES = {
    # (forward, input gradient) of wq/wk/wv, wo, w1/w3, w2: True where the GEMM runs as t pieces.
    # async TP: torch's micro-pipeline TP pass fuses every all-gather + matmul and matmul +
    # reduce-scatter pair, forward and backward (torch/_inductor/fx_passes/micro_pipeline_tp.py).
    "async": ((True, True),) * 4,
    # userbuffers: ring-exchange for every forward GEMM and for wo's and w2's input gradients;
    # bulk overlap (the GEMM whole, the collective beside it on a few SMs) for wq/wk/wv's and
    # w1/w3's: Megatron-Bridge's userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192
    # (src/megatron/bridge/training/comm_overlap.py, v0.2.0 7af9601c).
    "userbuffers": ((True, False), (True, True), (True, False), (True, True)),
}


def _overlapped_tp(step: _Step) -> bool:
    """Dense blocks under TP with their collectives overlapped (Workload.tp_overlap)."""
    return step.w.tp_overlap != "none" and step.t > 1 and step.moe is None


def _tp_gemm_roles(step: _Step) -> list[tuple[float, float, float]]:
    """(forward, input gradient, weight gradient) seconds of wq/wk/wv, wo, w1/w3 and w2 under
    overlapped TP: 2 FLOPs per weight and row each, a chunked GEMM on rows / t at a time."""
    precision, peak, efficiency = _block_precision(step)
    half = step.k.gemm_half_dim[precision]
    whole, piece = (2 * step.rows / (peak * efficiency * _dim_eff(m, half)) for m in (step.rows, step.rows / step.t))
    groups = _shaped_linear_groups(step.h, step.q, step.kv, step.f, step.t, half)
    return [
        (params * (piece if forward else whole), params * (piece if grad else whole), params * whole)
        for params, (forward, grad) in zip(groups, _CHUNKED_ROLES[step.w.tp_overlap], strict=True)
    ]


def expert_gemm_time(step: _Step, peak: float, efficiency: float, half: int) -> float:
    """A mixture-of-experts layer's GEMMs, forward and backward: the router and shared experts at
    the compute dtype's rate (a small share of the layer), the experts in the compute dtype or,
    under FP8, as torchao's rowwise FP8 grouped GEMMs (entrypoints/model/fp8_experts.py) on
    their padded rows.

    Each tp rank routes its own N = b x s / (c x t) tokens (tensor.py). The
    router is N x h x E; each of the N x k copies goes through one expert's three h x f GEMMs,
    which the grouped GEMM runs as E / ep problems of about N x k x ep / E rows each (balanced
    routing), so few rows per expert lower the rate; the shared experts are a dense N x h SwiGLU."""
    moe, rows, h = step.moe, step.moe_rows, step.h
    f = moe.expert_ffn_hidden_size
    rate = peak * efficiency * _dim_eff(h, half)
    router = 6 * rows * h * moe.num_experts / (rate * _dim_eff(rows, half) * _dim_eff(moe.num_experts, half))
    rows_per_expert = step.expert_rows * step.ep / moe.num_experts
    expert_rate, expert_half = rate, half
    if step.fp8_experts:
        k = step.k
        expert_half = k.gemm_half_dim["fp8"]
        fp8_efficiency = k.matmul_efficiency[f"{step.gen}:fp8"] * k.fp8_rowwise_factor
        expert_rate = step.accelerator.peak_fp8_tflops * 1e12 * fp8_efficiency * _dim_eff(h, expert_half)
    expert_flops = 6 * step.expert_rows * 3 * h * f
    experts = expert_flops / (expert_rate * _dim_eff(f, expert_half) * _dim_eff(rows_per_expert, expert_half))
    shared_f = moe.shared_experts * f
    shared = 6 * rows * 3 * h * shared_f / (rate * _dim_eff(shared_f, half) * _dim_eff(rows, half)) if shared_f else 0.0
    return router + experts + shared


def expert_parallel_time(step: _Step) -> float:
    """The token all-to-alls of one micro-batch under expert parallelism (model/dispatch.py):
    there and back in forward, both again in backward and in a recomputed forward, and the
    router weights' beside them, over the EP group, ep consecutive ranks of dp_shard x cp x tp
    (tp innermost: parallel/expert.py). They sit between the router and the experts, so nothing
    overlaps them."""
    if step.moe is None or step.ep == 1:
        return 0.0
    k = step.k
    all_to_all = step.exchange_time(1, step.ep, *expert_exchange_bytes(step, k.activation_bytes * step.h))
    # The copies' router weights go with the rows (one scalar each, its gradient back in backward):
    # latency, all but free of bytes.
    weights = step.exchange_time(1, step.ep, *expert_exchange_bytes(step, k.activation_bytes))
    per_layer = (4 + 2 * step.recompute) * all_to_all + (2 + step.recompute) * weights
    if step.w.moe_a2a_overlap:
        per_layer -= _a2a_hidden(step, per_layer)
    return step.layers * per_layer


def _a2a_hidden(step: _Step, a2a: float) -> float:
    """What Megatron-Core's overlap_moe_expert_parallel_comm hides of one layer's all-to-alls
    (Workload.moe_a2a_overlap, planner-only). Its combined 1F1B schedule runs each layer's forward
    of one micro-batch beside the same layer's backward of another, every all-to-all on the
    communication stream beside a compute piece of the other micro-batch: the backward's combine
    beside the forward's attention, the forward's dispatch beside the backward's MLP, the
    backward's dispatch beside the forward's MLP, the forward's combine beside the backward's
    attention (`schedule_layer_1f1b`, megatron/core/models/common/model_chunk_schedule_plan.py,
    NVIDIA/Megatron-LM d13e93ff). So a layer's all-to-alls hide behind its own forward and backward
    compute, paying `tp_overlap_interference` of what they hide (the copies and the kernels beside
    them share SMs and HBM), on the micro-batch chunks that pair: all but the warmup forwards,
    which run alone (`_paired_share`)."""
    gemm_s, _, attention_s, forward_ew_s, (cast_forward_s, cast_backward_s), _ = _layer_terms(step)
    compute = gemm_s + attention_s + 3 * forward_ew_s + cast_forward_s + cast_backward_s
    return min(a2a, compute) * (1 - step.k.tp_overlap_interference) * _paired_share(step)


def _paired_share(step: _Step) -> float:
    """The share of a rank's forward chunks that run paired with a backward in Megatron's combined
    1F1B: all but its warmup forwards, (p - rank - 1) x 2 + (v - 1) x p of them under the
    interleaved schedule with micro-batch groups of p, p - rank - 1 under 1F1B, and one more under
    the overlap (`get_pp_rank_microbatches`, megatron/core/pipeline_parallel/schedules.py); the first
    pipeline rank's, which has the most. Without pipelining each micro-batch's forward pairs with
    the previous one's backward (combined_1f1b_schedule_for_no_pipelining)."""
    m, p, v = step.w.grad_accum_steps, step.p, step.v
    warmup = 2 * (p - 1) + (v - 1) * p if v > 1 else p - 1
    chunks = m * v
    return max(0.0, chunks - warmup - 1) / chunks


def expert_exchange_bytes(step: _Step, per_copy: float) -> tuple[float, float]:
    """(bytes to the EP group's ranks on this rank's node, bytes to its ranks on other nodes) of
    one dispatch, `per_copy` bytes for each of the rank's N x k token copies (balanced routing:
    each of the ep ranks, this one included, gets 1/ep of them).

    The entrypoints' all_to_all_single sends every copy to its expert's rank. A dispatcher that
    sends a token once to each node that holds any of its experts and fans it out there over
    NVLink (Workload.ep_dispatch_per_node) sends fewer bytes across nodes: DeepSeek-V3's
    (arXiv 2412.19437, section 3.2.2: each token goes over IB once to the GPU of the same
    in-node index on a target node, then over NVLink to its experts' GPUs) and Hybrid-EP's, which
    keeps one buffer slot per token and remote node (deepseek-ai/DeepEP docs/
    Hybrid-EP_Implementation.md, 4.2: rdma_token_buffer is max_tokens_per_rank x (num_nodes - 1)
    x hidden_dim). Its NVLink side is priced as every copy not for the rank itself crossing
    NVLink once, on this node or after the network."""
    ep, copies = step.ep, step.copies * per_copy
    local = step.ranks_per_node(1, ep)
    if not step.w.ep_dispatch_per_node or local >= ep:
        return step.even_split(1, ep, copies)
    tokens = step.moe_rows * per_copy
    nodes = ceil(ep / local)
    return copies * (ep - 1) / ep, tokens * remote_nodes_per_token(step.moe.num_experts, step.moe.top_k, nodes)


def remote_nodes_per_token(experts: int, top_k: int, nodes: int) -> float:
    """The expected number of other nodes a token's top_k distinct experts fall on, experts spread
    evenly over `nodes` nodes and chosen uniformly (balanced routing): each other node is missed
    only when all top_k picks avoid its experts."""
    per_node = experts // nodes
    missed = math.comb(experts - per_node, top_k) / math.comb(experts, top_k)
    return (nodes - 1) * (1 - missed)


def attention_time(step: _Step) -> float:
    """One block's causal attention, forward and backward: 6 * s * h FLOPs per query token, heads
    split over TP, queries over CP, at the rate of the kernel that runs it (`attention_kernel`).
    Short sequences leave the flash kernel's tiles underused; the CP kernels run at their own
    fraction of plain attention (`cp_attention_factor`)."""
    k, s = step.k, step.s
    attention_flops = 6 * s * (step.q / step.t) * step.rows
    attention_rate = (
        step.bf16_peak
        * k.attention_efficiency[step.gen]
        * k.attention_kernel_factor[k.attention_kernel]
        * _dim_eff(s, k.attention_half_seq)
    )
    if step.c > 1:
        attention_rate *= cp_attention_rate(k, step.cp_attention, s / step.c)
    return attention_flops / attention_rate


def cp_attention_rate(k: Constants, path: str, tokens_per_rank: float) -> float:
    """`cp_attention_factor` of a CP path whose ranks each hold `tokens_per_rank` queries: where it
    was measured per length, the value at the longest measured length not above it (below the
    shortest, the shortest's: an extrapolation)."""
    factor = k.cp_attention_factor[path]
    if not isinstance(factor, dict):
        return factor
    measured = sorted(factor)
    return factor[max((n for n in measured if n <= tokens_per_rank), default=measured[0])]


def elementwise_time(step: _Step) -> float:
    """One block's forward HBM traffic outside the matmuls (backward moves about twice as much).
    Sequence parallel runs the norms on s/(c t) tokens; RoPE and SwiGLU see 1/t of the heads/FFN."""
    k, w = step.k, step.w
    dtype_scale = 2 if w.dtype == "fp32" else 1
    fused = k.compiled_elementwise_factor if w.compile else 1.0
    if w.mlp_activation == "squared_relu_unfused":
        # Eager whatever `compile` says, on the two-matrix FFN of the same parameters: 3/2 of the
        # gated width f; a third of the forward-and-backward bytes counts as the forward's.
        ffn_bytes = k.unfused_squared_relu_bytes / 3 * 1.5 * step.f
    else:
        ffn_bytes = fused * k.elementwise_bytes_per_ffn * step.f
    forward_bytes = (fused * k.elementwise_bytes_per_hidden * step.h + ffn_bytes) * dtype_scale
    dense = forward_bytes * step.rows / step.t
    if step.moe is None:
        return dense / step.hbm
    return (dense + moe_forward_bytes(step)) / step.hbm


def moe_forward_bytes(step: _Step) -> float:
    """The forward HBM traffic of one MoE layer's work outside its GEMMs: the experts' SwiGLU on
    every copy, and the copies gathered by expert and back in token order (two permutes; under EP
    regrouped by local expert and back, two more), each at `moe_permute_bytes` per element, or at
    one read and one write where fused kernels run them (Workload.moe_permute_fusion)."""
    k, w = step.k, step.w
    dtype_scale = 2 if w.dtype == "fp32" else 1
    fused = k.compiled_elementwise_factor if w.compile else 1.0
    swiglu = k.elementwise_bytes_per_ffn * step.moe.expert_ffn_hidden_size * step.copies * dtype_scale
    per_element = 2 * k.activation_bytes if w.moe_permute_fusion else k.moe_permute_bytes
    permutes = (2 if step.ep == 1 else 4) * per_element * dtype_scale * step.h * step.copies
    if step.fp8_experts:  # the rows into their 16-row padded groups and back (fp8_experts.py)
        permutes += 2 * k.activation_bytes * dtype_scale * step.h * (step.expert_rows + step.copies)
    return fused * swiglu + permutes


def moe_layer_seconds(workload: Workload, hardware: Hardware, k: Constants = CONSTANTS) -> float:
    """One MoE layer's forward and backward on the first GPU of `workload`, as the model prices it:
    the router's and the experts' GEMMs and three forwards' worth of `moe_forward_bytes` (what
    scripts/gpu_moe_check.py times of the entrypoints' layer, to which `moe_permute_bytes` is fitted)."""
    step = _Machine(hardware, k).steps_for(workload)[0]
    precision, peak, efficiency = _block_precision(step)
    gemms = expert_gemm_time(step, peak, efficiency, step.k.gemm_half_dim[precision])
    return gemms + 3 * moe_forward_bytes(step) / step.hbm


class _Casts(NamedTuple):
    """Elements of one block's float8 casts on one GPU, per micro-batch, by where they sit: what
    torchao's and Transformer Engine's casts are each priced on (fp8_cast_time)."""

    block_inputs: float  # the attention's and a dense MLP's inputs, h each on the gathered rows;
    # wo's and w2's output gradients are as large
    local_inputs: float  # wo's and w2's inputs (q/t, f/t)
    column_grads: float  # wq/wk/wv's and w1/w3's output gradients (q + 2 kv + 2f over t)
    weights: float  # this rank's weights, as often as a micro-batch casts them


def fp8_cast_elements(step: _Step) -> _Casts:
    """An MoE block's MLP is its experts (_expert_cast_elements): only the attention's linears
    here. Weights: the local shard under float8 all-gather, once a step where cached
    (Workload.fp8_weights_cached)."""
    h, q, kv, f, t, rows = step.h, step.q, step.kv, step.f, step.t, step.rows
    weights = (2 * h * q + 2 * h * kv + 3 * h * f) / t
    if step.w.fp8_weights_cached:
        # Transformer Engine casts the whole local weight on a step's first micro-batch only
        # (Linear.forward's is_first_microbatch, NVIDIA/TransformerEngine 3ec87875,
        # transformer_engine/pytorch/module/linear.py), which Megatron-Core sets once per step
        # (NVIDIA/Megatron-LM 00611e6e, megatron/core/pipeline_parallel/schedules.py forward_step).
        weights /= step.w.grad_accum_steps
    elif step.fp8_gather:
        weights /= step.shard
    block_inputs = (2 if step.moe is None else 1) * h * rows
    return _Casts(block_inputs, rows * (q + f) / t, rows * (q + 2 * kv + 2 * f) / t, weights)


def fp8_cast_time(step: _Step) -> tuple[float, float]:
    """One block's float8 casts, (forward, backward) seconds: a recomputed forward casts again.

    Workload.fp8_casts "torchao" (the entrypoints, torchtitan): inputs and weights in the forward
    graph, output gradients in the backward's, at `torchao_cast_bytes` when compiled and
    `fp8_eager_cast_factor` times that when not. Transformer Engine (te_delayed, te_current): its
    fused casts as `_te_cast_bytes` counts them. The FP8 experts' casts are their own."""
    if not step.fp8:
        return 0.0, 0.0
    k, casts = step.k, fp8_cast_elements(step)
    experts = _expert_cast_elements(step) * k.fp8_cast_bytes_per_element / step.hbm
    if step.w.fp8_casts == "torchao":
        forward, backward = (b / step.hbm for b in _torchao_cast_bytes(step, casts))
    else:
        forward, backward = (b / step.hbm for b in _te_cast_bytes(step, casts))
    return forward + experts, backward + experts


def _torchao_cast_bytes(step: _Step, casts: _Casts) -> tuple[float, float]:
    """(forward, backward) bytes of torchao's float8 casts in one block. Under float8 all-gather
    the block inputs are cast on this rank's s/t rows before the gather (torchao 0.18's
    PrepareFloat8ModuleInput and Float8ColwiseParallel), and so are wo's and w2's output gradients
    before backward gathers them (Float8RowwiseParallel._prepare_output_fn's
    NoopFwToFloat8BwDynamic, torchao/float8/float8_tensor_parallel.py at 6243040)."""
    k = step.k
    price = k.torchao_cast_bytes[step.w.fp8_recipe]
    factor = 1.0 if step.w.compile else k.fp8_eager_cast_factor
    cast_rows = casts.block_inputs / step.t if step.fp8_gather else casts.block_inputs
    forward = price["input"] * (cast_rows + casts.local_inputs) + price["weight"] * casts.weights
    backward = price["grad_output"] * (cast_rows + casts.column_grads)
    return factor * forward, factor * backward


def _te_cast_bytes(step: _Step, casts: _Casts) -> tuple[float, float]:
    """(forward, backward) bytes of Transformer Engine's float8 casts in one block, as
    TransformerEngine v1.8 runs them (module/layernorm_linear.py, linear.py, base.py
    grad_output_preprocess), each at `te_cast_bytes` for a cast-transpose from bf16, one byte less
    without the transposed copy, 2 bytes (read and write) to transpose a float8 tensor:

    - the norm-fed block inputs: delayed scaling casts inside the norm kernel
      (layernorm_fwd_fp8), nothing extra; current scaling takes the norm's bf16 output with its
      amax and casts it (csrc/extensions/normalization.cpp FUSED_NORM_AMAX_FP8). Backward
      transposes the (gathered) float8 input for the weight gradient (fp8_transpose).
    - wo's and w2's inputs, wq/wk/wv's and w1/w3's output gradients: a cast-transpose each.
    - wo's and w2's output gradients: under sequence parallel cast on this rank's s/t rows, gathered
      in float8, and the gathered copy transposed; without, a cast-transpose.
    - the weights, a cast-transpose each."""
    t = step.t
    cast_transpose = step.k.te_cast_bytes[step.w.fp8_casts]
    cast, transpose = cast_transpose - 1, 2.0
    # Current scaling: the amax comes with the norm, so the cast only reads and writes (3 bytes).
    norm_cast = 0.0 if step.w.fp8_casts == "te_delayed" else cast - 2
    row_grads = (cast / t + transpose if t > 1 else cast_transpose) * casts.block_inputs
    forward = norm_cast * casts.block_inputs / t + cast_transpose * (casts.local_inputs + casts.weights)
    backward = transpose * casts.block_inputs + cast_transpose * casts.column_grads + row_grads
    return forward, backward


def _expert_cast_elements(step: _Step) -> float:
    """The FP8 experts' casts per layer, as the forward's share (the caller's convention), in
    torchao's fused Triton cast kernels, compiled or not (torchao/prototype/moe_training/
    kernels/, called by entrypoints/model/fp8_experts.py). Forward: the P padded rows per row for
    w1 and w3 together and per group column for backward (h each), w2's input the same two ways
    (f each), and the local experts' three weights; backward: the gradients per row and per group
    column (2 x (h + 2f)) and the weights transposed. Half their sum."""
    if not step.fp8_experts:
        return 0.0
    moe, h = step.moe, step.h
    f = moe.expert_ffn_hidden_size
    weights = moe.num_experts // step.ep * 3 * h * f
    if step.w.fp8_weights_cached:  # TE's GroupedLinear takes is_first_microbatch too (fp8_cast_time)
        weights /= step.w.grad_accum_steps
    forward = step.expert_rows * 2 * (h + f) + weights
    backward = step.expert_rows * 2 * (h + 2 * f) + weights
    return (forward + backward) / 2


def loss_time(step: _Step) -> float:
    """The loss's elementwise traffic over the logits, forward and backward: the entrypoints'
    chunked loss, or a loss over kept logits (Workload.logits_materialized)."""
    k = step.k
    per_logit = k.materialized_loss_bytes_per_logit if step.w.logits_materialized else k.loss_bytes_per_logit
    return per_logit * step.rows * step.vocab / step.t / step.hbm


def tensor_parallel_time(step: _Step) -> float:
    """Sequence parallel's collectives of one micro-batch: an all-gather before attention and the
    MLP and a reduce-scatter after each (an MoE runs on the rank's own tokens: the attention's
    alone), in forward, again in backward and in a recomputed forward;
    with float8 TP styles the forward all-gathers move 1-byte activations. Under
    tp_saved_inputs shard a kept block all-gathers both inputs once more in backward, for the
    weight gradients (parallel/regather.py; an MoE block only the attention's). The loss
    all-gathers the sequence once more."""
    t, k = step.t, step.k
    if t == 1:
        return 0.0
    bw, lat = step.link(1, t)
    collective = k.activation_bytes * step.rows * step.h * (t - 1) / t / bw + lat
    gather = collective * (0.5 if step.fp8_gather else 1.0)
    loss = 2 * collective
    regathers = _regathered_inputs(step)
    if _overlapped_tp(step):
        layer = _userbuffers_tp_layer if step.w.tp_overlap == "userbuffers" else _overlapped_tp_layer
        return step.layers * layer(step, gather, collective, regathers) + loss
    # The entrypoints' DTensor sequence parallel: every collective sits between dependent matmuls.
    gathered_inputs = 1 if step.moe is not None else 2
    per_layer = gathered_inputs * ((gather + collective) * (1 + step.recompute) + 2 * collective)
    return step.layers * (per_layer + regathers * _regather_exposed(step, gather)) + loss


def _regather_exposed(step: _Step, gather: float) -> float:
    """One all-gather again in backward (tp_saved_inputs shard), or, where it is issued async
    beside the input-gradient GEMM it precedes (Workload.regather_overlap), what that GEMM leaves
    exposed at `tp_overlap_interference`: Megatron-Core's LinearWithGradAccumulationAndAsyncCommunication
    (async_op=True before the grad-input matmul, megatron/core/tensor_parallel/layers.py) and
    Transformer Engine's LayerNormLinear (layernorm_linear.py: "overlapped with dgrad GEMM")."""
    if not step.w.regather_overlap or step.moe is not None:
        return gather
    precision, peak, efficiency = _block_precision(step)
    half = step.k.gemm_half_dim[precision]
    per_weight = 2 * step.rows / (peak * efficiency * _dim_eff(step.rows, half))
    qkv, _, fc1, _ = _shaped_linear_groups(step.h, step.q, step.kv, step.f, step.t, half)
    dgrad = per_weight * (qkv + fc1) / 2  # wq/wk/wv's and w1/w3's, on average
    return gather - min(dgrad, gather) * (1 - step.k.tp_overlap_interference)


def _regathered_inputs(step: _Step) -> float:
    """All-gathers a block adds in backward under tp_saved_inputs shard, averaged over the blocks
    (checkpointed blocks gather in their recomputation instead)."""
    if step.w.tp_saved_inputs != "shard":
        return 0.0
    return (1 if step.moe is not None else 2) * (1 - step.recompute)


def _overlapped_tp_layer(step: _Step, gather: float, collective: float, regathers: float) -> float:
    """One block's exposed TP collectives under torch's async TP, each cut into t pieces that run
    beside t pieces of the GEMM next to it (`_fused_all_gather_matmul` and
    `_fused_matmul_reduce_scatter`, torch/distributed/_symmetric_memory/__init__.py, which
    torch.compile's micro-pipeline TP pass inserts). One piece waits on no GEMM (the first
    gathered or the last reduced); the other t - 1 hide as long as the GEMM beside them lasts,
    at `tp_overlap_interference` of their time.

    Forward (and a recomputed forward): the all-gathers before wq/wk/wv and w1/w3, the
    reduce-scatters after wo and w2, each beside that forward GEMM. Backward, as large: the
    output gradient's all-gather beside wo's and w2's input-gradient GEMMs, and the input
    gradient's reduce-scatter beside wq/wk/wv's and w1/w3's input-gradient GEMMs. Which GEMMs
    run in pieces, on rows / t at a time, is `_CHUNKED_ROLES`."""
    t = step.t
    (qkv, qkv_grad, _), (wo, wo_grad, _), (fc1, fc1_grad, _), (fc2, fc2_grad, _) = _tp_gemm_roles(step)
    interference = step.k.tp_overlap_interference

    def exposed(comm: float, gemm: float) -> float:
        hidden = min(gemm, comm * (t - 1) / t)
        return comm - hidden * (1 - interference)

    regather = regathers * _regather_exposed(step, gather)
    forward = exposed(gather, qkv) + exposed(collective, wo) + exposed(gather, fc1) + exposed(collective, fc2)
    backward = sum(exposed(collective, gemm) for gemm in (qkv_grad, wo_grad, fc1_grad, fc2_grad))
    return forward * (1 + step.recompute) + backward + regather


def _userbuffers_tp_layer(step: _Step, gather: float, collective: float, regathers: float) -> float:
    """One block's TP collectives under Transformer Engine's userbuffers (Megatron's
    tp_comm_overlap), each priced by the method and SMs of `Workload.userbuffers`'s config
    (launcher/plan/userbuffers.py). Forward (and a recomputed forward): the all-gathers before
    qkv and fc1, the reduce-scatters after proj and fc2, beside those GEMMs run in chunks.
    Backward: the output gradient's all-gathers beside proj's and fc2's input gradient (in
    chunks), the input gradient's reduce-scatters beside qkv's and fc1's weight gradient (bulk),
    and under tp_saved_inputs shard the saved inputs' all-gathers beside qkv's and fc1's input
    gradient (bulk: TE's layernorm_linear.py, "overlapped with dgrad GEMM")."""
    ub, t = userbuffers_config(step.w.userbuffers), step.t
    (qkv, qkv_dgrad, qkv_wgrad), (proj, proj_dgrad, _), (fc1, fc1_dgrad, fc1_wgrad), (fc2, fc2_dgrad, _) = (
        _tp_gemm_roles(step)
    )
    forward = (
        ub.qkv_fprop.exposed(gather, qkv, t)
        + ub.proj_fprop.exposed(collective, proj, t)
        + ub.fc1_fprop.exposed(gather, fc1, t)
        + ub.fc2_fprop.exposed(collective, fc2, t)
    )
    backward = (
        ub.proj_dgrad.exposed(gather, proj_dgrad, t)
        + ub.fc2_dgrad.exposed(gather, fc2_dgrad, t)
        + ub.qkv_wgrad.exposed(collective, qkv_wgrad, t)
        + ub.fc1_wgrad.exposed(collective, fc1_wgrad, t)
    )
    # `regathers` counts both inputs' all-gathers (averaged over kept and checkpointed blocks)
    regather = regathers / 2 * (ub.qkv_dgrad.exposed(gather, qkv_dgrad, t) + ub.fc1_dgrad.exposed(gather, fc1_dgrad, t))
    return forward * (1 + step.recompute) + backward + regather


def context_parallel_time(step: _Step) -> float:
    """allgather (and the older zigzag_sdpa): the K/V all-gathers and their gradients'
    reduce-scatter, three per layer: a layer that keeps its activations gathers K/V again in
    backward (parallel/context.py), a checkpointed one in its recomputed forward. Under document
    masking a kept layer saves the gathered K/V instead (two). ulysses: all-to-alls of q, k, v in
    and of the output back, in forward, recomputed forward and backward."""
    c, k = step.c, step.k
    if c == 1:
        return 0.0
    if step.cp_attention == "ulysses":
        # Each rank keeps 1/c of its s/c tokens' heads and sends the rest: (c - 1)/c of its q, k, v
        # and, on the way back, of the attention output (gradients alike in backward).
        local_rows = step.b * step.s / c
        one_way = k.activation_bytes * local_rows * (2 * step.q + 2 * step.kv) / step.t
        # q, k, v there and the output back: both exchanges' bytes in one, and a latency for each
        there_and_back = step.exchange_time(step.t, c, *step.even_split(step.t, c, one_way))
        all_to_all = there_and_back + step.link(step.t, c)[1]
        return step.layers * (2 + step.recompute) * all_to_all * (1 - k.cp_overlap)
    bw, lat = step.link(step.t, c)
    kv_bytes = (
        2 * k.activation_bytes * step.b * step.s * step.kv / step.t
    )  # K and V of the whole sequence, this TP rank's heads
    if step.w.cp_ring:
        return _ring_exposed_time(step, kv_bytes / c / bw + lat)
    collective = kv_bytes * (c - 1) / c / bw + lat
    per_layer = 2 + step.recompute if step.w.document_masking else 3
    return step.layers * per_layer * collective * (1 - k.cp_overlap)


def _ring_exposed_time(step: _Step, kv_step_s: float) -> float:
    """Workload.cp_ring: Transformer Engine's p2p ring (AttnFuncWithCPAndKVP2P in
    transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py, NVIDIA/
    TransformerEngine d0067d0d): attention runs in c steps, each on the K/V chunk received in the
    step before, while the next chunk is sent and received on another stream. Forward sends K/V
    c - 1 times, backward K/V with dK/dV (twice the bytes) c - 1 times. A step's transfer is
    exposed only by as much as it outlasts the step's attention (1/c of the layer's, zigzag
    balancing the causal work); the recomputed forward of checkpointed layers rings again."""
    c = step.c
    attention_s = _layer_terms(step)[2]  # one layer's attention, forward and backward
    forward_step, backward_step = attention_s / 3 / c, 2 * attention_s / 3 / c
    forward = (c - 1) * max(0.0, kv_step_s - forward_step)
    backward = (c - 1) * max(0.0, 2 * kv_step_s - backward_step)
    return step.layers * ((1 + step.recompute) * forward + backward)


class _FsdpTraffic(NamedTuple):
    """One pipeline rank's FSDP collectives, in seconds at full bandwidth."""

    block_gather: float  # all-gather of every block once
    root_gather: float  # the output layer and final norm (not resharded after forward)
    reduce: float  # reduce-scatter of every gradient
    first_block: float  # the first block's all-gather: nothing runs before it to hide it


def fsdp_traffic(step: _Step) -> _FsdpTraffic:
    """Every FSDP unit over dp_shard x cp (tp apart); under expert or tensor parallelism the
    experts of a block are a unit of their own (entrypoints/parallel/fsdp.py) over their
    expert_fsdp group (`_expert_fsdp_spread`), with a collective of its own per block."""
    shard, k, layers = step.shard, step.k, step.layers
    bw, lat = step.link(step.t, shard)
    spread = (shard - 1) / shard / bw / step.t
    expert_spread, expert_lat = _expert_fsdp_spread(step, spread)
    experts, param_bytes = step.expert_block_params, 1 if step.fp8_gather else k.fsdp_param_bytes
    blocks = (step.block_params - experts) * spread + experts * expert_spread
    block_gather = param_bytes * blocks + layers * (lat + expert_lat)
    root_gather = k.fsdp_param_bytes * (step.stage_params - step.block_params) * spread + lat
    stage = (step.stage_params - experts) * spread + experts * expert_spread
    reduce = step.grad_bytes * stage + layers * (lat + expert_lat)
    return _FsdpTraffic(block_gather, root_gather, reduce, block_gather / layers if layers else 0.0)


def _expert_fsdp_spread(step: _Step, spread: float) -> tuple[float, float]:
    """(seconds per parameter, latency) of the experts' FSDP collectives. Without expert or
    tensor parallelism they are part of their block's unit (`spread`, no latency of their own).
    Under either the group is expert_fsdp = dp_shard x cp x tp / ep ranks holding the same E/ep
    experts: the expert mesh is (pp, dp_replicate, expert_fsdp, ep) (entrypoints/parallel/
    expert.py), so they sit ep apart, often one per node past a node's worth of EP, and get that
    node's NIC share, not the whole node's."""
    if not step.experts_apart:
        return spread, 0.0
    group = step.shard * step.t // step.ep
    if group == 1:
        return 0.0, 0.0  # every rank holds its experts whole: nothing to gather or reduce-scatter
    bw, lat = step.link(step.ep, group)
    return (group - 1) / group / bw / step.t, lat


def fsdp_time(step: _Step, compute_mb: float) -> tuple[float, float]:
    """(per micro-batch, per step) FSDP all-gathers and reduce-scatters the compute cannot hide.

    What repeats every micro-batch depends on `parallel.grad_accumulation` (without pipelining):
    sync_each gathers every block before forward and again before backward and reduce-scatters
    the gradients; sync_last reduce-scatters only on the last micro-batch; sync_last_gathered also
    gathers once per step. Traffic a micro-batch carries hides behind 85% of that micro-batch's
    compute; the first block's gather of each gathering micro-batch is always exposed."""
    if step.shard == 1:
        return 0.0, 0.0
    traffic, hidden = step.family_terms().fsdp, step.k.fsdp_overlap * compute_mb
    gather = traffic.block_gather + traffic.root_gather
    if step.p > 1:
        if step.accumulation == "sync_each":
            # pipeline.py's _GradientSyncEachMicroBatch: each block is resharded after its backward
            # and gathered again by the next micro-batch's forward (never resharded after forward
            # under PP), and its gradients reduce-scattered: one gather and one reduce-scatter per
            # micro-batch.
            return max(0.0, gather + traffic.reduce - hidden) + traffic.first_block, 0.0
        # torch.distributed.pipelining keeps FSDP blocks unsharded between micro-batches and
        # syncs gradients only on the last: one gather and one reduce-scatter per step, spread
        # over the schedule (and its bubble).
        m = step.w.grad_accum_steps
        return 0.0, max(0.0, gather + traffic.reduce - hidden * m) + traffic.first_block
    if step.accumulation == "sync_last_gathered":
        return 0.0, max(0.0, gather + traffic.reduce - hidden) + traffic.first_block
    gathers = gather + traffic.block_gather  # forward and backward gathers of one micro-batch
    if step.accumulation == "sync_each":
        return max(0.0, gathers + traffic.reduce - hidden) + traffic.first_block, 0.0
    # sync_last: every micro-batch gathers; the last one also reduce-scatters, which its compute
    # hides only as far as the gathers left room.
    exposed_gathers = max(0.0, gathers - hidden)
    exposed_last = max(0.0, gathers + traffic.reduce - hidden)
    return exposed_gathers + traffic.first_block, exposed_last - exposed_gathers


def pipeline_p2p_time(step: _Step) -> float:
    """Each chunk's activations sent to the next stage and its gradients back, per micro-batch."""
    p = step.p
    if p == 1:
        return 0.0
    layout = step.w.layout
    stride = step.t * step.c * layout.data_shard * step.replicas
    bw, lat = step.p2p_link(stride, p)
    message = step.k.activation_bytes * step.rows * step.h / step.t
    one_way = message / bw + lat
    if step.w.p2p_overlap and step.v > 1:
        # Megatron's overlap_p2p_comm (interleaved schedule): each chunk's send and the next
        # chunk's receive run beside a chunk's compute and are waited for only when the data is
        # needed (megatron/core/pipeline_parallel/schedules.py); what a chunk's compute cannot
        # cover stays exposed.
        chunk_compute = compute_time(step).total / step.v
        return 2 * step.v * max(0.0, one_way - chunk_compute)
    return 2 * step.v * one_way


def pipeline_bubble_time(step: _Step, micro_batch_s: float) -> float:
    """The idle slots of the schedule: (p - 1)/v micro-batches' time, of (m*v + p - 1) chunk slots."""
    bubble_slots = (step.p - 1) / step.v
    return micro_batch_s * bubble_slots


def data_replicate_time(step: _Step) -> float:
    """HSDP's gradient all-reduce between replicas, once per step, partly hidden."""
    replicas, k = step.replicas, step.k
    if replicas == 1:
        return 0.0
    shard_params = step.state_params / step.t / step.shard
    bw, lat = step.link(step.t * step.shard, replicas)
    return (2 * step.grad_bytes * shard_params * (replicas - 1) / replicas / bw + lat) * (1 - k.hsdp_overlap)


def optimizer_time(step: _Step) -> float:
    """AdamW over this rank's fp32 shards: HBM-bound."""
    shard_params = step.state_params / step.t / step.shard
    k = step.k
    per_param = (
        k.bf16_moments_bytes_per_param if step.w.optimizer_state_dtype == "bf16" else k.optimizer_bytes_per_param
    )
    return per_param * shard_params / step.hbm


def _throughput(step: _Step, breakdown: dict[str, float], step_s: float) -> Throughput:
    """`step_s`: the sum of `breakdown`."""
    w, layout = step.w, step.w.layout
    world = layout.world_size
    tokens_per_step = w.tokens_per_step
    tokens_per_s_per_gpu = tokens_per_step / step_s / world
    flops_per_token = step.family_terms().model_flops_per_token
    instances = ceil(world / step.gpus_per_node)
    return Throughput(
        tokens_per_s_per_gpu=tokens_per_s_per_gpu,
        mfu=tokens_per_s_per_gpu * flops_per_token / step.bf16_peak,
        step_time_s=step_s,
        tokens_per_step=tokens_per_step,
        world_size=world,
        bubble_fraction=bubble_fraction(step.p, w.grad_accum_steps, step.v),
        model_flops_per_token=flops_per_token,
        breakdown=breakdown,
        instance_count=instances,
        usd_per_hour=step.usd_per_hour * instances,
        steps=w.steps,
    )


def bubble_fraction(pipeline: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a 1F1B (or GPipe) pipeline: (p - 1) / (m·v + p - 1)."""
    return (pipeline - 1) / (microbatches * virtual_stages + pipeline - 1)


def model_flops_per_token(arch: ModelArch, seq_len: int, *, causal: bool = True) -> float:
    """Model FLOPs per token for MFU: 6·N + 6·L·h·s (causal), or 6·N + 12·L·h·s as published.

    N counts the matmul weights of the blocks and the output layer (not the embedding lookup or the
    norms); no recomputation. `causal=True` is what the entrypoints log; torchtitan and NeMo count
    attention with a full mask (`causal=False`), so their model TFLOP/s convert with that.
    """
    h, layers = arch.hidden_size, arch.num_layers
    q, kv, f, vocab = arch.q_dim, arch.kv_dim, arch.ffn_hidden_size, arch.vocab_size
    if arch.moe is not None:  # the parameters a token goes through: router, top-k and shared experts
        f = arch.moe.active_ffn_width()
    return _model_flops(h, q, kv, f, layers, vocab, seq_len, 6 if causal else 12)


@cache
def _model_flops(
    h: int, q: int, kv: int, f: int, layers: int, vocab: int, seq_len: int, attention_factor: int
) -> float:
    """q: the query width (num_heads x head_dim), which attention's FLOPs scale with."""
    dense = 6 * (layers * (2 * h * q + 2 * h * kv + 3 * h * f) + h * vocab)
    return dense + attention_factor * layers * q * seq_len


def _dim_eff(dim: int | float, half: int) -> float:
    return dim / (dim + half)


@cache
def _shaped_block_params(h: int, q: int, kv: int, f: int, t: int, half: int) -> float:
    """A block's matmul weights on one TP rank, each divided by its K and N shape efficiency."""
    return sum(_shaped_linear_groups(h, q, kv, f, t, half))


@cache
def _shaped_linear_groups(h: int, q: int, kv: int, f: int, t: int, half: int) -> tuple[float, float, float, float]:
    """`_shaped_block_params` of the GEMMs that share one TP collective: wq/wk/wv, wo, w1/w3, w2."""
    groups = (
        ((h, q // t), (h, kv // t), (h, kv // t)),  # wq, wk, wv
        ((q // t, h),),  # wo
        ((h, f // t), (h, f // t)),  # w1, w3
        ((f // t, h),),  # w2
    )
    return tuple(sum(k * n / (_dim_eff(k, half) * _dim_eff(n, half)) for k, n in group if k and n) for group in groups)
