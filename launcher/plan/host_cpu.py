"""The step time of a job on host CPUs (gloo): counted work times seconds per unit, measured.

A CPU step is not bound by FLOPs the way a GPU step is. The recipe tiny-cpu spends about a tenth
of its step in matrix multiplies; the rest is the host's per-operation cost (Python, autograd,
DTensor and FSDP hooks) and gloo collectives over loopback, and ranks beyond the cores take turns
on them. So a CPU step is priced as the work it counts, each kind at the seconds per unit measured
on a host CPU (`launcher/catalog/host_cpu.yaml`, fitted by scripts/bench_cpu_step.py):

    step = share x (  per step + per layer + PP: per step
                    + FSDP: per MB gathered and reduced + HSDP: per MB all-reduced
                    + slots x ( per layer and micro-batch
                              + matmul GFLOPs x s/GFLOP + attention GFLOPs x s/GFLOP
                              + TP: per layer and micro-batch + per MB gathered and scattered
                                    + per weight replicated over tp, layer and micro-batch
                              + CP: per layer and micro-batch
                              + MoE: per local expert, layer and micro-batch + EP: per MB sent ) )

Every rank runs one thread (the launcher sets OMP_NUM_THREADS=1 for CPU jobs,
`launcher.spec.job_environment`), so `share` = max(1, busy ranks / cores) is how many ranks take
turns on each core. A pipeline runs its m micro-batches of v chunks in m·v + p - 1 slots, so the
micro-batch work stretches by `slots` = (m·v + p - 1) / (m·v), and a rank waits in the bubble
(p - 1) / (m·v + p - 1) of the step, leaving its core to the others: busy ranks = ranks x (1 -
bubble). The counts are those of the entrypoints' program (entrypoints/parallel/):
- FSDP gathers each block's parameters twice and reduces their gradients once (a per-group
  latency was fitted too and came out 0, so the megabytes carry it);
- sequence-parallel TP gathers and scatters each block's [micro-batch, sequence, hidden]
  activations four times forward and four times backward, and all-reduces over tp the gradients
  of the weights it replicates there (Qwen3's q_norm and k_norm, an MoE's router and shared
  experts: `tp_replicated_weights`), each layer and micro-batch;
- context parallelism splits the sequence and regathers K/V per layer;
- an MoE layer runs one matmul per local expert on CPUs (the grouped GEMM's fallback) and, under
  EP, sends each routed token's hidden state to its experts' ranks and back, forward and backward.

Measured: scripts/bench_cpu_step.py, docs/monitoring.md ("How a CPU job is predicted").
"""

from __future__ import annotations

from launcher.catalog import HostCpuRates
from launcher.estimate.workload import Workload
from launcher.plan.modes import AC_RECOMPUTE, FORWARD_SHARE

MB = 1e6
GFLOP = 1e9
TP_COLLECTIVES_PER_LAYER = 8  # sequence-parallel: all-gather + reduce-scatter around attention and the MLP, x2 backward
MOE_TP_COLLECTIVES_PER_LAYER = 4  # an MoE runs on the rank's own tokens: the attention's alone
FSDP_TRANSFERS = 3  # the forward all-gather, backward's all-gather again (reshard after forward), the reduce-scatter
EP_TRANSFERS = 4  # dispatch and combine all-to-alls, forward and backward


def cpu_work(workload: Workload) -> dict[str, float]:
    """What one rank of the slowest pipeline stage does in a step, in the units of HostCpuRates'
    fields: counts, GFLOPs and MB (before cores are shared)."""
    arch, layout = workload.arch, workload.layout
    t, c, p = layout.tensor, layout.context, layout.pipeline
    h, q, kv, vocab = arch.hidden_size, arch.q_dim, arch.kv_dim, arch.vocab_size
    s, mb, micro_batches = workload.seq_len, workload.micro_batch_size, workload.grad_accum_steps
    layers = -(-arch.num_layers // p)  # the stage with the most layers sets the pace
    tokens = s * mb * micro_batches / c  # this rank's: its data-parallel share, 1/c of each sequence
    attention_params = (2 * h * q + 2 * h * kv) / t
    # Each TP rank runs an MoE layer on its own 1/t of the tokens (entrypoints/parallel/tensor.py):
    # the router and the top-k experts a token passes through; a dense MLP's columns are split over TP.
    ffn_params = 3 * h * (arch.moe.active_ffn_width() if arch.moe else arch.ffn_hidden_size) / t
    output = h * vocab / p / t  # the loss stage's output layer, spread as the stage split would
    dense = 6 * tokens * (layers * (attention_params + ffn_params) + output)
    attention = 6 * tokens * layers * q * s / t  # causal: each query sees s/2 keys, forward and backward
    width = 4 if workload.dtype == "fp32" else 2  # bytes per parameter and activation
    slots = 1 / (1 - pipeline_bubble(workload))
    per_micro_batch = slots * layers * micro_batches
    recomputed = AC_RECOMPUTE[workload.activation_checkpointing] * FORWARD_SHARE  # forwards run again
    work = {
        "per_step": 1.0,
        "per_layer": float(layers),
        "per_layer_micro_batch": per_micro_batch,
        "matmul_gflop": slots * dense / GFLOP,
        "attention_gflop": slots * attention / GFLOP,
        "recompute_gflop": slots * recomputed * (dense + attention) / GFLOP,
    }
    work.update(_sharded_parameters(workload, layers, attention_params, width))
    if t > 1:
        activations = mb * s / c * h * width
        # parallel.tp_saved_inputs shard: kept blocks all-gather their inputs once more in backward.
        regathers = 0.0
        if workload.tp_saved_inputs == "shard":
            regathers = (1 if workload.arch.moe else 2) * (1 - AC_RECOMPUTE[workload.activation_checkpointing])
        collectives = (MOE_TP_COLLECTIVES_PER_LAYER if workload.arch.moe else TP_COLLECTIVES_PER_LAYER) + regathers
        work["tp_layer_micro_batch"] = per_micro_batch * collectives / TP_COLLECTIVES_PER_LAYER
        work["tp_mb"] = per_micro_batch * collectives * activations * (t - 1) / t / MB
        work["tp_replicated_layer_micro_batch"] = per_micro_batch * tp_replicated_weights(arch)
    if c > 1:
        work["cp_layer_micro_batch"] = per_micro_batch
    if p > 1:
        work["pp_step"] = 1.0
    if arch.moe:
        ep = layout.expert
        # the CPU fallback of the grouped GEMM runs one matmul per local expert (entrypoints/model/moe.py)
        work["expert_layer_micro_batch"] = per_micro_batch * arch.moe.num_experts / ep
        if ep > 1:  # each routed token goes to its experts' ranks and back, forward and backward
            routed = mb * s / c / t * arch.moe.top_k * h * width
            work["ep_mb"] = per_micro_batch * EP_TRANSFERS * routed * (ep - 1) / ep / MB
    return work


def tp_replicated_weights(arch) -> int:
    """A block's weights that TP replicates over the tp ranks as `SequenceParallel`
    (entrypoints/parallel/tensor.py): Qwen3's q_norm and k_norm, which see only the rank's heads,
    and an MoE's router and shared experts' three linears, which see only the rank's tokens. Each
    one's gradient is a partial sum that DTensor all-reduces over tp in every backward."""
    norms = 2 if arch.qk_norm else 0
    if arch.moe is None:
        return norms
    return norms + 1 + (3 if arch.moe.shared_experts else 0)


def _sharded_parameters(workload: Workload, layers: int, attention_params: float, width: int) -> dict[str, float]:
    """FSDP's megabytes (the dense weights over dp_shard x cp, each layer's local experts over
    dp_shard x cp x tp / ep, `Layout.expert_fsdp`) and HSDP's all-reduce megabytes between replicas."""
    arch, layout = workload.arch, workload.layout
    t, p, shard = layout.tensor, layout.pipeline, layout.fsdp_shard
    dense = layers * attention_params + 2 * arch.hidden_size * arch.vocab_size / p / t
    experts, expert_shard = 0.0, 1
    if arch.moe:
        shared = arch.moe.shared_experts * arch.moe.expert_params(arch.hidden_size)
        dense += layers * (arch.moe.num_experts * arch.hidden_size + shared)  # the router, shared experts
        experts = layers * arch.moe.num_experts / layout.expert * arch.moe.expert_params(arch.hidden_size)
        expert_shard = layout.expert_fsdp
    else:
        dense += layers * 3 * arch.hidden_size * arch.ffn_hidden_size / t
    gathered = dense * (shard - 1) / shard + experts * (expert_shard - 1) / expert_shard
    work = {"fsdp_mb": FSDP_TRANSFERS * gathered * width / MB} if gathered else {}
    replicas = layout.data_replicate
    if replicas > 1:  # HSDP: each rank's gradient shard all-reduced over the replicas (twice its bytes)
        held = dense / shard + experts / expert_shard
        work["replicate_mb"] = 2 * held * width * (replicas - 1) / replicas / MB
    return work


def pipeline_bubble(workload: Workload) -> float:
    """The share of a step a pipeline rank waits: (p - 1) / (m·v + p - 1) (1F1B, interleaved)."""
    layout = workload.layout
    chunks = workload.grad_accum_steps * layout.virtual_stages
    return (layout.pipeline - 1) / (chunks + layout.pipeline - 1)


def core_share(workload: Workload, cores: int) -> float:
    """How many busy ranks take turns on each core: at least 1, one thread per rank."""
    return max(1.0, workload.layout.world_size * (1 - pipeline_bubble(workload)) / cores)


def cpu_step_seconds(workload: Workload, rates: HostCpuRates, *, cores: int) -> dict[str, float]:
    """The step's seconds by kind of work on `cores` cores: `cpu_work` at `rates`, with the ranks
    beyond the cores taking turns."""
    share = core_share(workload, cores)
    per_unit = rates.seconds_per_unit
    # Recomputation is priced at the matmul rate: no measured layout checkpoints activations.
    per_unit = {**per_unit, "recompute_gflop": per_unit["matmul_gflop"]}
    return {kind: share * amount * per_unit.get(kind, 0.0) for kind, amount in cpu_work(workload).items()}
