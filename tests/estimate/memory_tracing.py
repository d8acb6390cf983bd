"""Trace a training program's per-GPU memory on the CPU, without a GPU or real memory.

Everything runs under `FakeTensorMode` (tensors have shapes, dtypes and storages but no data)
with a fake process group, so one process plays one rank of a large job: real Llama 3.1 8B and
70B shapes at 128K tokens cost seconds and a few hundred MB of RAM.

`LiveStorages` is a TorchDispatchMode that counts the bytes of every storage alive at each op,
the way the CUDA caching allocator's `allocated` counter does; its peak is what
`torch.cuda.max_memory_allocated` would report. It handles what torch's MemTracker does not
need to: pipeline stages that run many micro-batches per step.

Two patches from ../shared/KNOWLEDGE.md are required, and without the first the numbers are
silently wrong:
1. DTensor's sharding propagation must not reuse the outer fake mode, or its shadow tensors
   (full-size, not shards) are counted as allocations;
2. every DeviceMesh must be built outside fake mode, or `fully_shard` on TP DTensors fails.
A third one extends the second: DTensor's shard-offset arithmetic
(`compute_local_shape_and_global_offset`, which the vocab-parallel loss calls) builds index
tensors and reads them back as ints, which fake tensors cannot do; it runs outside fake mode.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field
from functools import wraps

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

_PATCHED = False


def apply_tracing_patches() -> None:
    """The patches fake-tensor memory tracing needs in torch 2.13 (idempotent)."""
    global _PATCHED
    import torch.distributed.tensor._utils as dtensor_utils

    if not _PATCHED:
        import torch.distributed.tensor._sharding_prop as sharding_prop
        from torch.distributed.device_mesh import DeviceMesh

        sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
        DeviceMesh.__init__ = _outside_fake_mode(DeviceMesh.__init__)
        mesh_property = DeviceMesh.mesh
        DeviceMesh.mesh = property(_outside_fake_mode(mesh_property.fget))
        dtensor_utils.compute_local_shape_and_global_offset = _outside_fake_mode(
            dtensor_utils.compute_local_shape_and_global_offset
        )
        _PATCHED = True
    # Modules that imported the offset function by name before the patch keep the original.
    patched = dtensor_utils.compute_local_shape_and_global_offset
    for module in list(sys.modules.values()):
        original = getattr(module, "compute_local_shape_and_global_offset", None)
        if original is patched.__wrapped__:
            module.compute_local_shape_and_global_offset = patched


def _outside_fake_mode(function):
    @wraps(function)
    def wrapper(*args, **kwargs):
        with unset_fake_temporarily():
            return function(*args, **kwargs)

    return wrapper


@dataclass
class Peak:
    bytes: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    where: str = ""


class LiveStorages(TorchDispatchMode):
    """Bytes of live tensor storages, by kind, with the peak and where it happened.

    Storages created before entering (parameters, optimizer states) are registered with
    `track`; everything an op returns afterwards is tracked as it appears and released when
    Python frees it. `phase` labels new storages ("forward", "backward", "optimizer", ...),
    so the peak snapshot says what was alive.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.by_kind: Counter[str] = Counter()
        self.peak = Peak()
        self.phase = "setup"
        self._sizes: dict[int, tuple[int, str, weakref.ref]] = {}
        self._labels: dict[int, str] = {}
        self._entry_fake_mode = None
        self._op = ""
        self._modules = None
        # Debugging: when live bytes first reach `dump_at`, `dump` lists what is alive.
        self.dump_at: int | None = None
        self.dump: list[tuple[int, str, str]] = []
        self._original_resize = torch.UntypedStorage.resize_

    # --- bookkeeping ---------------------------------------------------------------------

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def track(self, *tensors_or_modules, kind: str | None = None) -> None:
        for obj in tensors_or_modules:
            if isinstance(obj, torch.nn.Module):
                for tensor in [*obj.parameters(), *obj.buffers()]:
                    self._add_tensor(tensor, kind or "parameters")
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for value in state.values():
                        if isinstance(value, torch.Tensor):
                            self._add_tensor(value, kind or "optimizer_states")
            elif isinstance(obj, torch.Tensor):
                self._add_tensor(obj, kind or self.phase)

    def _add_tensor(self, tensor: torch.Tensor, kind: str) -> None:
        for storage in get_untyped_storages(tensor):
            key = id(storage)
            if key in self._sizes:
                continue
            size = storage.nbytes()
            ref = weakref.ref(storage, lambda _, key=key: self._release(key))
            self._sizes[key] = (size, kind, ref)
            if self.dump_at is not None:
                self._labels[key] = f"{self._op} {str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
            self._change(size, kind)

    def _release(self, key: int) -> None:
        size, kind, _ = self._sizes.pop(key)
        self._labels.pop(key, None)
        self._change(-size, kind)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key not in self._sizes:
            return
        old, kind, ref = self._sizes[key]
        new = storage.nbytes()
        self._sizes[key] = (new, kind, ref)
        self._change(new - old, kind)

    def _change(self, delta: int, kind: str) -> None:
        self.live += delta
        self.by_kind[kind] += delta
        if self.live > self.peak.bytes:
            self.peak = Peak(self.live, {k: v for k, v in self.by_kind.items() if v}, f"{self.phase}: {self._op}")
        if self.dump_at is not None and not self.dump and self.live >= self.dump_at:
            where = sorted(self._modules.parents, key=len)[-1] if self._modules else ""
            self.peak.where += f" in {where}" + (" (backward)" if self._modules and self._modules.is_bw else "")
            self.dump = sorted(
                ((size, kind, self._labels.get(key, "")) for key, (size, kind, _) in self._sizes.items()),
                reverse=True,
            )

    # --- dispatch ------------------------------------------------------------------------

    def __enter__(self):
        self._entry_fake_mode = active_fake_mode()
        if self.dump_at is not None:
            from torch.distributed._tools.mod_tracker import ModTracker

            self._modules = ModTracker()
            self._modules.__enter__()
        tracker = self

        @wraps(self._original_resize)
        def resize_(storage, size):
            result = tracker._original_resize(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._original_resize
        if self._modules is not None:
            self._modules.__exit__(*args)
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        # Let DTensor desugar into local ops first; those are the real allocations.
        if any(t is DTensor for t in types):
            return NotImplemented
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode():
            # The fake kernel of wait_tensor returns a new tensor; eager returns its input.
            result = args[0]
        elif func is torch.ops.aten.index_put.default and len(args) > 3 and args[3]:
            # An indexing op's backward (torch/csrc/autograd/FunctionsManual.cpp `index_backward`)
            # scatters into its fresh zeros in place on plain tensors, but out of place on tensor
            # subclasses, fake tensors among them: one more copy than CUDA makes.
            result = torch.ops.aten.index_put_.default(*args, **(kwargs or {}))
        else:
            result = func(*args, **(kwargs or {}))
        self._op = str(func).removeprefix("aten.")
        # Ops of DTensor's own shape propagation run under a different fake mode; skip them.
        if active_fake_mode() is self._entry_fake_mode:
            tree_map_only(torch.Tensor, lambda t: self._add_tensor(t, self.phase), result)
        return result


# --- making the CPU trace allocate what CUDA allocates ---------------------------------------
#
# A few torch kernels allocate differently on the CPU than on CUDA. The trace runs on the CPU
# but must describe the GPU program, so while tracing these kernels are replaced by stand-ins
# with the CUDA kernel's allocation pattern (under fake tensors no numbers are computed, only
# shapes and storages matter). Each replacement names the CUDA behaviour it copies.


class _FusedRMSNorm(torch.autograd.Function):
    """CUDA's `_fused_rms_norm`: saves its input, the weight and an fp32 rstd per row.

    CPU `F.rms_norm` decomposes into fp32 ops and saves two fp32 copies of the input instead.
    """

    @staticmethod
    def forward(ctx, x, weight):
        rstd = x[..., :1].float()
        ctx.save_for_backward(x, weight, rstd)
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        return grad * 1, weight * 0 if ctx.needs_input_grad[1] else None


def _cuda_rms_norm(x, normalized_shape, weight=None, eps=None):
    return _FusedRMSNorm.apply(x, weight)


class _LowerRightCausal:
    """Stands in for torch.nn.attention.bias.causal_lower_right(q_len, kv_len), a tensor
    subclass that cannot be created under fake tensors."""

    def __init__(self, *sizes):
        self.sizes = sizes


def _sdpa_without_materialised_causal_mask(original):
    """CUDA runs a lower-right causal mask inside the flash kernel as a flag (out and an fp32
    log-sum-exp, nothing [q, kv]-sized); the CPU would materialise a bool [q, kv] mask."""

    @wraps(original)
    def sdpa(query, key, value, attn_mask=None, *args, **kwargs):
        if isinstance(attn_mask, _LowerRightCausal):
            attn_mask = None
        return original(query, key, value, attn_mask, *args, **kwargs)

    return sdpa


def _fused_adamw(original_init):
    """The entrypoints run fused AdamW on CUDA (no parameter-sized temporaries); on the CPU
    they would pick foreach, which holds one fp32 copy of the parameters during `step`."""

    @wraps(original_init)
    def init(self, params, *args, **kwargs):
        kwargs.update(fused=True, foreach=False)
        original_init(self, params, *args, **kwargs)

    return init


class _GroupedMM(torch.autograd.Function):
    """CUDA's `F.grouped_mm` (entrypoints/model/moe.py `grouped_linear`): one [M, N] output;
    saves its input and the [E, N, K] weight; backward makes the input's and the whole weight's
    gradient. The CPU path splits the rows by expert and concatenates the products instead,
    which needs the counts' values (fake tensors have none) and copies every row once more."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x.new_empty((x.shape[0], weight.shape[1]))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight)


def _cuda_grouped_linear(x, weight, counts):
    return _GroupedMM.apply(x, weight)


def _allocating_float8_kernels(emulate: bool):
    """torchao 0.18's FP8 grouped-GEMM kernels as they allocate on CUDA (entrypoints/model/
    fp8_experts.py `torchao_kernels`): each Triton cast makes its float8 copy and fp32 scales and
    nothing else, and `torch._scaled_grouped_mm` its output (the shapes of their registered fakes,
    torchao/prototype/moe_training/kernels/). The CPU emulation casts through fp32 copies instead."""
    from entrypoints.model.fp8_experts import Float8Kernels

    float8, fp32 = torch.float8_e4m3fn, torch.float32

    def rows(t):
        return t.new_empty(t.shape, dtype=float8), t.new_empty((t.shape[0], 1), dtype=fp32)

    def weight_columns(b_t):
        e, _, n = b_t.shape
        return b_t.new_empty(b_t.shape, dtype=float8), b_t.new_empty((e, 1, n), dtype=fp32)

    def weight_rows(b_t):
        e, k, n = b_t.shape
        return b_t.new_empty((e, n, k), dtype=float8), b_t.new_empty((e, k), dtype=fp32)

    def group_columns(t, ends):
        # The dual kernel's discarded second tensor: a 16-column copy and its float8 cast and scales.
        companion = (t.new_empty((t.shape[0], 16)), t.new_empty((t.shape[0], 16), dtype=float8))
        companion += (t.new_empty((ends.numel() * 16,), dtype=fp32),)
        del companion
        return t.new_empty(t.shape, dtype=float8), t.new_empty((ends.numel() * t.shape[1],), dtype=fp32)

    def grouped_mm(a, b, a_inv, b_inv, ends, out_dtype):
        if b.dim() == 3:
            return a.new_empty((a.shape[0], b.shape[-1]), dtype=out_dtype)
        return a.new_empty((ends.numel(), a.shape[0], b.shape[1]), dtype=out_dtype)

    return Float8Kernels(rows, weight_columns, weight_rows, group_columns, grouped_mm)


def _bounded_exchange(counts, group):
    """The routing the estimate prices, for entrypoints/model/dispatch.py `exchange_counts` (the
    real exchange reads the counts' values, which fake tensors do not have): this rank sends an
    equal share of its token copies to each EP rank, and its experts are the popular ones, so it
    receives ROUTING_BOUND times as many (launcher/estimate/moe.py), spread evenly over them."""
    import torch.distributed as dist

    from launcher.estimate.moe import ROUTING_BOUND

    ep, local_experts = dist.get_world_size(group), counts.numel() // dist.get_world_size(group)
    rows, balanced = ROUTED_ROWS
    # Round-robin routing (training.moe_force_load_balance) sends each expert ceil(C / E) at most.
    per_source = -(-rows // (ep * local_experts)) if balanced else int(rows * ROUTING_BOUND) // (ep * local_experts)
    received = torch.full((ep, local_experts), per_source, dtype=counts.dtype)
    return received, [rows // ep] * ep, [per_source * local_experts] * ep


# The token copies each MoE layer of the traced job sends (tokens x top_k per micro-batch), and
# whether it routes round-robin: set by `trace_resolved`.
ROUTED_ROWS = [0, False]


class cuda_kernels:
    """Context manager: swap in the CUDA kernels' allocation patterns while tracing."""

    def __enter__(self):
        import torch.nn.attention.bias as bias
        import torch.nn.functional as F

        from entrypoints.model import dispatch, fp8_experts, moe

        self._saved = (F.rms_norm, F.scaled_dot_product_attention, torch.optim.AdamW.__init__, bias.causal_lower_right)
        self._moe = (moe.grouped_linear, fp8_experts.kernels_for, dispatch.exchange_counts)
        F.rms_norm = _cuda_rms_norm
        F.scaled_dot_product_attention = _sdpa_without_materialised_causal_mask(F.scaled_dot_product_attention)
        torch.optim.AdamW.__init__ = _fused_adamw(torch.optim.AdamW.__init__)
        self._rebind(bias.causal_lower_right, _LowerRightCausal)
        moe.grouped_linear = _cuda_grouped_linear
        fp8_experts.kernels_for = _allocating_float8_kernels
        dispatch.exchange_counts = _bounded_exchange
        return self

    def __exit__(self, *args):
        import torch.nn.functional as F

        from entrypoints.model import dispatch, fp8_experts, moe

        F.rms_norm, F.scaled_dot_product_attention, torch.optim.AdamW.__init__, lower_right = self._saved
        moe.grouped_linear, fp8_experts.kernels_for, dispatch.exchange_counts = self._moe
        self._rebind(_LowerRightCausal, lower_right)

    @staticmethod
    def _rebind(old, new) -> None:
        """Replace a function everywhere it was imported by name (torch and the entrypoints)."""
        for module in list(sys.modules.values()):
            if getattr(module, "causal_lower_right", None) is old:
                module.causal_lower_right = new


# --- tracing the entrypoints -----------------------------------------------------------------


@dataclass(frozen=True)
class Traced:
    """One traced rank: its peak live bytes, what was alive then, and when."""

    peak_bytes: int
    by_kind: dict[str, int]
    phase: str
    rank: int
    seconds: float
    alive_at_peak: list[tuple[int, str, str]] = field(default_factory=list)


def rank_of_stage(parallel, stage: int) -> int:
    """The global rank of the first rank of pipeline stage `stage` (pp is the outermost dim)."""
    return stage * (parallel.world_size // parallel.pipeline)


def trace_resolved(resolved: dict, *, stage: int = 0, dump_at: int | None = None) -> Traced:
    """Trace one optimizer step of one rank of pipeline stage `stage` of a resolved job config.

    The optimizer states are allocated before the traced step (as any step after the first
    finds them), so the peak is that of a long run. With `dump_at` (a known peak), also lists
    every storage alive when live bytes first reach it.
    """
    import time

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from entrypoints.fp8 import fp8_settings
    from entrypoints.optim import Optimizers, clip_grad_norm
    from entrypoints.parallel.accumulate import accumulate
    from entrypoints.parallel.mesh import build_mesh
    from entrypoints.parallel.parallelize import build_model_parts
    from launcher.contract.config import JobConfig

    apply_tracing_patches()
    cfg = JobConfig.from_dict(resolved)
    par, training = cfg.parallel, cfg.training
    rank = rank_of_stage(par, stage)
    if cfg.model.moe is not None:
        ROUTED_ROWS[:] = [
            # Each tp rank routes its own slice of the sequence (entrypoints/parallel/tensor.py).
            training.micro_batch_size * (training.seq_len // par.context // par.tensor) * cfg.model.moe.top_k,
            training.moe_force_load_balance,
        ]
    started = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=par.world_size)
    try:
        mesh = build_mesh(par, "cpu")
        # The GPU program: nccl, so tensorwise FP8 all-gathers float8 weights. The model is
        # built and parallelised on the meta device (as train.py does), outside fake mode:
        # pipeline splitting deep-copies it, which fake tensors do not support.
        fp8 = fp8_settings(cfg, device_type="cpu", backend="nccl")
        parts, ids = build_model_parts(cfg, mesh, fp8=fp8)
        with FakeTensorMode(allow_non_fake_inputs=True), cuda_kernels():
            for part in parts:
                # materialize() is to_empty() plus filling in values; fake tensors hold no
                # values, and filling computes shard offsets from real mesh coordinates.
                part.to_empty(device=torch.device("cpu"))
                part.init_rope()
            optimizers = Optimizers(parts, training.optimizer, total_steps=training.steps)
            _allocate_optimizer_states(parts, optimizers)
            rows = training.micro_batch_size * par.grad_accum_steps
            local_seq = training.seq_len // par.context
            tokens = torch.randint(0, cfg.model.vocab_size, (rows, local_seq))
            targets = torch.randint(0, cfg.model.vocab_size, (rows, local_seq))

            tracker = LiveStorages()
            tracker.dump_at = dump_at
            for part in parts:
                tracker.track(part)
            for optimizer in optimizers.optimizers:
                tracker.track(optimizer)
            tracker.track(tokens, targets, kind="inputs")
            with tracker:
                if par.pipeline > 1:
                    _pipelined_step(parts, ids, cfg, tokens, targets, tracker)
                else:
                    # train.py's own accumulation loop, on this rank's micro-batches.
                    micro = training.micro_batch_size
                    micro_batches = [
                        (tokens[i : i + micro], targets[i : i + micro], None) for i in range(0, rows, micro)
                    ]
                    accumulate(parts[0], micro_batches, par.grad_accumulation, phase=tracker.set_phase)
                tracker.phase = "optimizer"
                clip_grad_norm(parts, training.grad_clip, mesh["pp"])
                optimizers.step()
                optimizers.zero_grad()
        peak = tracker.peak
    finally:
        dist.destroy_process_group()
    return Traced(peak.bytes, peak.by_kind, peak.where, rank, time.perf_counter() - started, tracker.dump)


def _allocate_optimizer_states(parts, optimizers) -> None:
    """One optimizer step on zero gradients: AdamW allocates its states as on the first step."""
    for part in parts:
        for param in part.parameters():
            param.grad = torch.zeros_like(param)
    optimizers.step()
    optimizers.zero_grad()


def _pipelined_step(parts, ids, cfg, tokens, targets, tracker: LiveStorages) -> None:
    """One step of entrypoints/parallel/pipeline.py's schedule, re-enacted on this rank.

    torch.distributed.pipelining's runtime starts each job with a P2P vote and a metadata
    exchange between stages, which a fake process group cannot answer. So the schedule's
    actions are replayed here exactly as torch orders them, on the entrypoints' own stage
    modules, with what the runtime allocates: a receive buffer for a stage input (or its
    gradient) made just before the chunk that consumes it and dropped after it (the
    entrypoints' _OnDemandReceiveStage, with the interleaved schedule's deferred receives:
    tests/estimate/test_pipeline_buffers.py checks the timing against torch's lowering), FSDP
    gradient sync off until the last micro-batch (on throughout under sync_each), and the
    runtime's final reduce-scatter
    (`perform_reduce_grad`). A chunk's output is let go once sent (_release_sent_outputs),
    its storage kept by the latest two sends; an input gradient's send is let go once the next
    action starts, as a completed send is on NCCL (_SendsInFlight); gloo reports an input gradient's send complete
    only when waited for at the end of the step (tests/entrypoints/test_pipeline_memory.py),
    which the estimate of a CPU rank counts and this replay of a GPU rank does not.
    """
    from torch.distributed.fsdp import fully_shard

    par, training = cfg.parallel, cfg.training
    num_stages, micro, m = par.num_stages, training.micro_batch_size, par.grad_accum_steps
    rank = ids[0]
    by_stage = dict(zip(ids, parts, strict=True))
    boundary = (micro, training.seq_len // par.context // par.tensor, cfg.model.hidden_size)
    dtype = torch.bfloat16 if cfg.precision.dtype == "bf16" else torch.float32

    def receive_buffer() -> torch.Tensor:
        return torch.empty(boundary, dtype=dtype)

    # sync_each keeps FSDP's gradient sync on for every backward (pipeline.py's
    # _GradientSyncEachMicroBatch); otherwise torch's stage turns it off until REDUCE_GRAD.
    sync_each = par.grad_accumulation == "sync_each"
    for part in parts:
        part.set_is_last_backward(sync_each)
        part.set_reshard_after_backward(sync_each)
        part.set_requires_gradient_sync(sync_each)
    in_flight, sending, forward_sends = {}, None, []
    for action, stage, mb in pipeline_actions(rank, par.pipeline, par.virtual_stages, m, par.pipeline_schedule):
        sending = None  # the previous action's sends complete before this one starts
        part = by_stage[stage]
        rows = slice(mb * micro, (mb + 1) * micro)
        if action == "F":
            tracker.phase = "forward"
            inputs = tokens[rows] if stage == 0 else receive_buffer().requires_grad_()
            last = stage == num_stages - 1
            output = part(inputs, targets=targets[rows] if last else None)
            if not last:
                # Sent and let go (pipeline.py's _release_sent_outputs): the send's alias of the
                # storage is what keeps it, the latest two sends' at most (_outputs_kept in
                # launcher/estimate/fsdp.py).
                forward_sends = [*forward_sends[-1:], output.detach()]
                output.data = torch.empty((1,), dtype=output.dtype).expand(output.shape)
            in_flight[stage, mb] = (inputs, output)
            del output
        else:
            tracker.phase = "backward"
            inputs, output = in_flight.pop((stage, mb))
            if stage == num_stages - 1:
                output.backward()
            else:
                torch.autograd.backward(output, grad_tensors=receive_buffer())
            if stage > 0:
                # The runtime moves the input gradient to its send cache (stage_backward).
                sending, inputs.grad = inputs.grad, None
            del inputs, output
    del sending, forward_sends
    tracker.phase = "reduce-scatter"
    for part in parts:
        part.set_is_last_backward(True)
        part.set_reshard_after_backward(True)
        part.set_requires_gradient_sync(True)
        state = fully_shard.state(part)
        for module_state in state._state_ctx.all_states:
            for group in module_state._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()


def pipeline_actions(rank: int, p: int, v: int, m: int, schedule: str) -> list[tuple[str, int, int]]:
    """(F or B, stage, micro-batch) in the order torch.distributed.pipelining runs them."""
    if schedule == "gpipe":
        return [("F", rank, mb) for mb in range(m)] + [("B", rank, mb) for mb in range(m)]
    if schedule == "1f1b":
        # Schedule1F1B: min(m, p - rank) forwards, then backward/forward pairs, then backwards.
        warmup = min(m, p - rank)
        actions = [("F", rank, mb) for mb in range(warmup)]
        forward, backward = warmup, 0
        while backward < m:
            actions.append(("B", rank, backward))
            backward += 1
            if forward < m:
                actions.append(("F", rank, forward))
                forward += 1
        return actions
    from torch.distributed.pipelining.schedules import _ComputationType, _get_1f1b_rank_ops, _get_warmup_ops

    # ScheduleInterleaved1F1B._calculate_single_rank_operations, with torch's own helpers.
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = _get_warmup_ops(rank, v, per_round, p, m, multiply_factor=2)
    fwd_bwd = v * m - warmup
    cooldown = v * m - fwd_bwd

    def forward_stage(step):
        return ((step // per_round) % v) * p + rank

    def backward_stage(step):
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    ops = _get_1f1b_rank_ops(v, p, warmup, fwd_bwd, cooldown, rank, forward_stage, backward_stage)
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    return [(kinds[op.computation_type], op.stage_index, op.microbatch_index) for op in ops if op is not None]


def trace_in_subprocess(resolved: dict, *, stage: int = 0, dump_at: int | None = None, timeout: float = 900) -> Traced:
    """`trace_resolved` in a fresh process: torch keeps caches keyed by process groups and
    meshes (DTensor sharding propagation, functional collectives) that go stale once a fake
    process group is destroyed, and the tracing patches stay out of the caller.

    Each trace is a child forked from one tracer process that has imported torch, the
    entrypoints and this module and done nothing else: the state a fresh interpreter reaches
    after its imports, without paying them again (about 6 s of CPU per trace on 2 cores).
    """
    return _tracer().trace(resolved, stage=stage, dump_at=dump_at, timeout=timeout)


# The tracer: reads one request per line on stdin, forks a child per request, and answers one
# line with the child's exit status. The parent only imports: no tensor is made, no thread pool
# is started and no process group exists before a fork, so each child starts as clean as a
# new interpreter. A child writes its result and its stderr to the files the request names,
# and its stdout goes to its stderr file, so nothing it prints reaches the answer pipe.
_TRACER = r"""
import gc, json, os, sys, traceback
# Python's advice for a parent that forks (the gc module's docs, gc.freeze): no collections in the
# parent, and its objects frozen before the forks, so no child's collection walks them (nor copies
# their pages by touching them). The children trace for seconds with the collector off.
gc.disable()
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from dataclasses import asdict
import memory_tracing
import entrypoints.train, torch._dynamo, torch.distributed.pipelining  # what every trace imports
from torch.distributed._tools import fsdp2_mem_tracker  # noqa: F401
try:
    import torchao.float8  # noqa: F401  (the FP8 configs)
    # What convert_to_float8_training imports to patch inductor's codegen (torchao/float8/
    # _inductor_patch.py): 0.4 CPU s and 400 modules (networkx among them) in each FP8 trace.
    import torch._inductor.codegen.triton  # noqa: F401
except ImportError:
    pass
gc.freeze()
sys.stdout.flush()
while line := sys.stdin.readline():
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            log = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            traced = memory_tracing.trace_resolved(request["resolved"], stage=request["stage"], dump_at=request["dump_at"])
            with open(request["result"], "w") as out:
                json.dump(asdict(traced), out)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class _Tracer:
    """The tracer process (started on first use, in a session of its own so that a trace over
    its time limit is killed with its child), and the scratch directory of its requests."""

    def __init__(self) -> None:
        import subprocess
        import tempfile
        from pathlib import Path

        here = Path(__file__).resolve().parent
        self.scratch = Path(tempfile.mkdtemp(prefix="memory-tracing-"))
        self.count = 0
        from tests.background import NICE  # traces run beside the serial tests

        self.process = subprocess.Popen(
            [*NICE, sys.executable, "-c", _TRACER, str(here.parents[1]), str(here)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(self.scratch / "tracer.log").open("w"),
            text=True,
            start_new_session=True,
        )

    def trace(self, resolved: dict, *, stage: int, dump_at: int | None, timeout: float) -> Traced:
        import json
        import select

        self.count += 1
        result, log = self.scratch / f"{self.count}.json", self.scratch / f"{self.count}.log"
        request = {"resolved": resolved, "stage": stage, "dump_at": dump_at, "result": str(result), "stderr": str(log)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        answer = self.process.stdout.readline() if ready else ""
        if not answer:
            self.stop()
            tracer_log = (self.scratch / "tracer.log").read_text()[-3000:]
            why = f"no answer within {timeout} s" if not ready else f"the tracer exited:\n{tracer_log}"
            raise RuntimeError(f"tracing failed ({why}):\n{_tail(log)}")
        code = json.loads(answer)["exit"]
        if code or not result.is_file():
            raise RuntimeError(f"tracing failed (exit {code}):\n{_tail(log)}")
        data = json.loads(result.read_text())
        data["alive_at_peak"] = [tuple(item) for item in data["alive_at_peak"]]
        return Traced(**data)

    def stop(self) -> None:
        """End the tracer and any child of it still tracing (their session is this tracer's)."""
        import os
        import signal

        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _tail(path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.is_file() else ""


_RUNNING: list[_Tracer] = []


def start_tracer() -> None:
    """Start the tracer process now (it inherits this moment's environment), if it is not running."""
    _tracer()


def _tracer() -> _Tracer:
    if not _RUNNING or _RUNNING[0].process.poll() is not None:
        import atexit
        import shutil

        tracer = _Tracer()
        _RUNNING[:] = [tracer]
        atexit.register(shutil.rmtree, tracer.scratch, True)
        atexit.register(tracer.stop)  # atexit runs last-registered first: stop, then remove
    return _RUNNING[0]
