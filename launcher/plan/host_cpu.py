"""The step time of a job on host CPUs (gloo): counted work times seconds per unit, measured.

A CPU step is not bound by FLOPs the way a GPU step is. The recipe tiny-cpu spends about a tenth
of its step in matrix multiplies; the rest is the host's per-operation cost (Python, autograd,
DTensor and FSDP hooks) and gloo collectives over loopback, and ranks beyond the cores take turns
on them. So a CPU step is priced as the work it counts, each kind at the seconds per unit measured
on a host CPU (`launcher/catalog/host_cpu.yaml`, fitted by scripts/bench_cpu_step.py):

    step = share x (  per step + per layer + FSDP: per MB gathered and reduced
                    + PP: per step
                    + slots x ( per layer and micro-batch
                              + matmul GFLOPs x s/GFLOP + attention GFLOPs x s/GFLOP
                              + TP: per layer and micro-batch + per MB gathered and scattered
                              + CP: per layer and micro-batch ) )

Every rank runs one thread (the launcher sets OMP_NUM_THREADS=1 for CPU jobs,
`launcher.spec.job_environment`), so `share` = max(1, busy ranks / cores) is how many ranks take
turns on each core. A pipeline runs its m micro-batches of v chunks in m·v + p - 1 slots, so the
micro-batch work stretches by `slots` = (m·v + p - 1) / (m·v), and a rank waits in the bubble
(p - 1) / (m·v + p - 1) of the step, leaving its core to the others: busy ranks = ranks x (1 -
bubble). The counts are those of the entrypoints' program (entrypoints/parallel/): FSDP gathers
each block's parameters twice and reduces their gradients once (a per-group latency was fitted
too and came out 0, so the megabytes carry it); sequence-parallel TP gathers and scatters each block's [micro-batch, sequence, hidden]
activations four times forward and four times backward; context parallelism splits the
sequence and regathers K/V per layer.

Measured: scripts/bench_cpu_step.py, docs/monitoring.md ("How a CPU job is predicted").
"""

from __future__ import annotations

from launcher.catalog import HostCpuRates
from launcher.errors import UsageError
from launcher.estimate.workload import Workload

MB = 1e6
GFLOP = 1e9
TP_COLLECTIVES_PER_LAYER = 8  # sequence-parallel: all-gather + reduce-scatter around attention and the MLP, x2 backward
FSDP_TRANSFERS = 3  # the forward all-gather, backward's all-gather again (reshard after forward), the reduce-scatter
RECOMPUTE = {"none": 0.0, "selective": 0.5, "full": 1.0}
"""Blocks whose forward runs again in backward (launcher.plan.throughput.AC_RECOMPUTE's fractions);
a forward is a third of a block's forward and backward."""


class CpuStepUnknown(UsageError):
    """A CPU layout the measured rates do not cover."""


def cpu_work(workload: Workload) -> dict[str, float]:
    """What one rank of the slowest pipeline stage does in a step, in the units of HostCpuRates'
    fields: counts, GFLOPs and MB (before cores are shared)."""
    arch, layout = workload.arch, workload.layout
    if arch.moe is not None or layout.expert > 1:
        raise CpuStepUnknown(
            "model: no speed is predicted for an MoE model on host CPUs (launcher/catalog/host_cpu.yaml's rates "
            "were measured on dense models only); plan it on GPUs, e.g. --instance-type ml.p5.48xlarge"
        )
    t, c, p = layout.tensor, layout.context, layout.pipeline
    h, q, kv, f, vocab = arch.hidden_size, arch.q_dim, arch.kv_dim, arch.ffn_hidden_size, arch.vocab_size
    s, mb, micro_batches = workload.seq_len, workload.micro_batch_size, workload.grad_accum_steps
    layers = -(-arch.num_layers // p)  # the stage with the most layers sets the pace
    tokens = s * mb * micro_batches / c  # this rank's: its data-parallel share, 1/c of each sequence
    block = 2 * h * q + 2 * h * kv + 3 * h * f
    output = h * vocab / p  # the loss stage's output layer, spread as the stage split would
    dense = 6 * tokens * (layers * block + output) / t
    attention = 6 * tokens * layers * q * s / t  # causal: each query sees s/2 keys, forward and backward
    width = 4 if workload.dtype == "fp32" else 2  # bytes per parameter and activation
    slots = 1 / (1 - pipeline_bubble(workload))
    work = {
        "per_step": 1.0,
        "per_layer": float(layers),
        "per_layer_micro_batch": slots * layers * micro_batches,
        "matmul_gflop": slots * dense / GFLOP,
        "attention_gflop": slots * attention / GFLOP,
        "recompute_gflop": slots * RECOMPUTE[workload.activation_checkpointing] * (dense + attention) / 3 / GFLOP,
    }
    shard = layout.fsdp_shard
    if shard > 1:
        params = (layers * block + 2 * h * vocab / p) / t
        work["fsdp_mb"] = FSDP_TRANSFERS * params * width * (shard - 1) / shard / MB
    if t > 1:
        activations = mb * s / c * h * width
        work["tp_layer_micro_batch"] = slots * layers * micro_batches
        work["tp_mb"] = slots * layers * micro_batches * TP_COLLECTIVES_PER_LAYER * activations * (t - 1) / t / MB
    if c > 1:
        work["cp_layer_micro_batch"] = slots * layers * micro_batches
    if p > 1:
        work["pp_step"] = 1.0
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
    # recomputed FLOPs run at the matmul and attention rates in proportion; the matmul rate bounds them
    per_unit = {**per_unit, "recompute_gflop": per_unit["matmul_gflop"]}
    return {kind: share * amount * per_unit.get(kind, 0.0) for kind, amount in cpu_work(workload).items()}
