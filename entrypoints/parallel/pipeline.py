"""Pipeline parallelism with `torch.distributed.pipelining`: 1F1B, interleaved 1F1B, GPipe.

    ids = rank_stages(pp_rank, cfg.parallel)                        # this rank's stages, in order
    parts = [split_model(model, i, cfg.parallel) for i in ids]      # meta stage models
    ...parallelize and materialise each part...
    pipeline = Pipeline(parts, ids, mesh["pp"], cfg.parallel, device)
    loss = pipeline.step(tokens, targets)                           # None on ranks without the last stage
    val_loss = pipeline.evaluate(tokens, targets)                   # forward only (validation)

The layers are split into pp x virtual_stages contiguous stages, balanced with the embedding and
the output layer counted as a layer each unless the config lists `pipeline_layers` (Llama 3.1
405B on 8 stages: 15 | 16 x 6 | 15), and rank r holds stages r, r + pp, r + 2·pp, ... (the
"loop" order interleaved 1F1B expects): `launcher.contract.layout`'s `stage_layers` and
`rank_stages`, which the memory estimator and the planner read too. Each stage is a `Transformer` with
the layers it does not hold removed; the first keeps the embedding, the last the final norm
and the output weight, and layer names stay global so checkpoints reshard across layouts.

Receive buffers are allocated when a receive is posted and dropped once their micro-batch's
forward (or backward) has run (`_OnDemandReceiveStage`), and the interleaved schedule posts each
receive just before the chunk that consumes it (`defer_pp_recv`), so a rank holds at most one
receive buffer beyond its in-flight activations. torch's PipelineStage instead allocates one
buffer per micro-batch for every stage input and output gradient up front and keeps them all
for the whole run: with 64 micro-batches that was 18 GiB on Llama 3 70B's stage 0 at 8K, TP 4,
PP 8 x 5 (docs/estimator.md). Under the interleaved schedule the stages also issue their own
sends and let each go once complete (`_SendsInFlight`), where torch's runtime would keep every
sent activation and gradient alive until the step ends.

The loss is computed inside the last stage's forward (targets go to every stage as a keyword
argument), so the fused vocab-parallel loss runs under the stage's FSDP/TP hooks like any other
layer; the schedule's loss_fn just passes it on. Micro-batches per step are grad_accum_steps;
the schedule averages gradients over them (scale_grads), the same as the non-pipelined loop.
Under `parallel.grad_accumulation: sync_each` every micro-batch's backward reduce-scatters its
gradients into their shards (_GradientSyncEachMicroBatch); otherwise torch accumulates them
unsharded until the step's REDUCE_GRAD.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

try:  # torch 2.13's internals that _OnDemandReceiveStage builds on
    from torch.distributed.pipelining._utils import _make_tensor_from_meta
    from torch.distributed.pipelining.stage import _RecvInfo
except ImportError:  # pragma: no cover - another torch: PipelineStage as it is (_stage_class)
    _make_tensor_from_meta = _RecvInfo = None
try:  # and the backward _GradientSyncEachMicroBatch runs
    from torch.distributed.pipelining._backward import stage_backward
except ImportError:  # pragma: no cover - another torch: torch's own accumulation, with a warning
    stage_backward = None

from launcher.contract.config import ParallelConfig
from launcher.contract.layout import Layout, stage_layers

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B}


def split_model(model, stage_index: int, layout: Layout):
    """A copy of the (meta) model holding only stage `stage_index` of the layout's stages."""
    num_stages = layout.num_stages
    keep = {str(i) for i in stage_layers(len(model.layers), layout, stage_index)}
    part = copy.deepcopy(model)
    for key in list(part.layers):
        if key not in keep:
            del part.layers[key]
    if stage_index != 0:
        part.tok_embeddings = None
    if stage_index != num_stages - 1:
        part.norm = None
        part.output = None
    return part


log = logging.getLogger(__name__)


class _SendsInFlight:
    """One rank's pipeline sends under the interleaved schedule, each let go as soon as it is safe.

    torch's runtime (_PipelineScheduleRuntime._step_microbatches, torch 2.13) keeps the Work of
    every send until the step ends ("there isn't an obvious time when to wait for them"), and a
    Work holds its tensor until it is dropped (tests/entrypoints/test_pipeline_memory.py measures
    it on gloo): every output and input gradient a rank sent would stay alive to the end of the
    step. The runtime sends them as batches of sends alone, which `_batch_p2p` issues as plain
    isends; the stages issue the same isends at the same moment here and return no ops, so the
    schedule is otherwise unchanged. A send is let go:
    - once `is_completed()` says so, checked at every send (NCCL's query of the kernel's event;
      gloo's send reports completion only once waited for);
    - for a forward send, when its micro-batch's backward starts on the sending stage: that
      backward waited for the gradient the receiver sent after consuming the activation, so the
      wait returns at once and cannot block on a peer.
    The rest are waited for at the end of the step, as the runtime does."""

    def __init__(self) -> None:
        self.works: dict[tuple[str, int, int], list] = {}

    def issue(self, kind: str, stage: int, microbatch: int, ops) -> None:
        works = self.works.setdefault((kind, stage, microbatch), [])
        for op in ops:
            works.append(torch.distributed.isend(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer))

    def prune(self) -> None:
        for key in [k for k, works in self.works.items() if all(w.is_completed() for w in works)]:
            del self.works[key]

    def release_forward(self, stage: int, microbatch: int) -> None:
        for work in self.works.pop(("forward", stage, microbatch), []):
            work.wait()

    def finish(self) -> None:
        """At the end of a step, as the runtime does with its own."""
        for works in self.works.values():
            for work in works:
                work.wait()
        self.works = {}


class _GradientSyncEachMicroBatch:
    """`parallel.grad_accumulation: sync_each` under pipeline parallelism: every micro-batch's
    backward reduce-scatters its gradients into their fp32 shards, as FSDP does without pipelining.

    torch 2.13's stage turns an FSDP stage's gradient sync off for every backward
    (`backward_maybe_with_nosync`, torch/distributed/pipelining/stage.py), so the gradients
    accumulate unsharded in the reduce dtype until the step's REDUCE_GRAD: 4 bytes per parameter
    of the stage beside the fp32 shards (11.8 GiB for Llama 3.1 405B at TP 8, PP 16). The Llama 3
    paper's FSDP shards gradients under PP instead (arXiv 2407.21783, section 3.3.2); here sync
    stays on, and FSDP reshards each block after its backward (its forward keeps it gathered:
    reshard_after_forward is off under PP, parallelize.py), so a block is gathered once and
    reduced once per micro-batch. The step's REDUCE_GRAD then finds nothing left to reduce and
    scales the shards by 1 / micro-batches, as after the unsharded sum. Only the "full" backward
    the 1F1B, interleaved and GPipe schedules run is changed."""

    sync_each: bool = False

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if stage_backward is None or not (
            self.sync_each and backward_type == "full" and isinstance(self.submod, FSDPModule)
        ):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(True)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


class _SyncingStage(_GradientSyncEachMicroBatch, PipelineStage):
    """torch's PipelineStage with per-micro-batch gradient sync (another torch: _stage_class)."""


class _OnDemandReceiveStage(_GradientSyncEachMicroBatch, PipelineStage):
    """A PipelineStage whose receive buffers exist only from the posted receive to the end of the
    forward or backward that consumes them.

    torch 2.13's PipelineStage fills `args_recv_info[mb]` and `grad_recv_info[mb]` with a buffer
    per micro-batch in `_prepare_forward_infra` / `_prepare_backward_infra` and keeps them all
    (torch/distributed/pipelining/stage.py). Here those are dropped once prepared, made again in
    `get_fwd_recv_ops` / `get_bwd_recv_ops` (with torch's own `_make_tensor_from_meta`, so
    shape, stride and dtype are the stage's metadata), and dropped after the chunk's
    `forward_one_chunk` / `backward_one_chunk`. A received activation lives on in the stage's
    forward cache, as the autograd input it is, until its backward. With `sends`, the stage
    issues its sends itself (_SendsInFlight)."""

    sends: _SendsInFlight | None = None

    def _prepare_forward_infra(self, *args, **kwargs):
        meta = super()._prepare_forward_infra(*args, **kwargs)
        self._drop(self.args_recv_info.values())
        return meta

    def _prepare_backward_infra(self, *args, **kwargs):
        meta = super()._prepare_backward_infra(*args, **kwargs)
        self._drop(self.grad_recv_info.values())
        return meta

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._make(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        self._make(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if ops and not self.is_last:  # the last stage's output is the loss, never sent
            _release_sent_outputs(self.fwd_cache[fwd_chunk_id][0])
        return self._send("forward", fwd_chunk_id, ops)

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        return self._send("backward", bwd_chunk_id, super().get_bwd_send_ops(bwd_chunk_id))

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._drop([self.args_recv_info[fwd_chunk_id]])
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        if self.sends is not None:
            self.sends.release_forward(self.stage_index, bwd_chunk_id)
        result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._drop([self.grad_recv_info[bwd_chunk_id]])
        return result

    def _send(self, kind: str, microbatch: int, ops):
        if self.sends is None:
            return ops
        self.sends.prune()
        self.sends.issue(kind, self.stage_index, microbatch, ops)
        return []

    def _make(self, infos) -> None:
        for info in infos:
            if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

    @staticmethod
    def _drop(chunks) -> None:
        for infos in chunks:
            for info in infos:
                if not info.is_root_arg:
                    info.buffer = None


def _release_sent_outputs(outputs) -> None:
    """Let a chunk's outputs go once they are being sent; their backward needs only the autograd
    graph behind them and their shape.

    torch's stage keeps each chunk's outputs in its forward cache until the chunk's backward, as
    roots for `torch.autograd.backward` (stage_backward, torch/distributed/pipelining/_backward.py),
    which checks their shape against the received gradients and never reads their values. Each
    output's data is swapped for one element expanded to its shape, as Megatron-Core's
    `deallocate_output_tensor` does (megatron/core/pipeline_parallel/schedules.py) and the Llama 3
    paper's pipeline does for "the input and output tensors of each pipeline stage" (arXiv
    2407.21783, section 3.3.2). The send op holds its own detached alias of the storage
    (get_fwd_send_ops' `to_local_if_dtensor(out, detach=True)`), so the memory is freed when
    the send is done with it, never before; an op that saved the output for its own backward
    keeps its copy too (autograd saves the data, not the tensor whose data is swapped here). A
    block ends in the residual add, which saves nothing, so a rank holds one boundary tensor less
    per micro-batch in flight: 141 x 32 MiB on Llama 3.1 405B's rank 1 at TP 8, PP 16 x 8."""
    for out in outputs:
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) and out.grad_fn is not None:
            out.data = torch.empty((1,), dtype=out.dtype, device=out.device).expand(out.shape)


def _stage_class():
    """`_OnDemandReceiveStage` where torch's stage has the internals it relies on (the entrypoints
    run torch >=2.13,<2.15); otherwise torch's own, with one line saying memory will be higher."""
    needed = ("_prepare_forward_infra", "_prepare_backward_infra", "get_fwd_recv_ops", "get_bwd_recv_ops")
    recv_info_fields = () if _RecvInfo is None else _RecvInfo.__init__.__code__.co_varnames
    if (
        _make_tensor_from_meta is None
        or not all(hasattr(PipelineStage, name) for name in needed)
        or not all(f in recv_info_fields for f in ("buffer", "tensor_meta", "is_root_arg"))
    ):
        log.warning(
            "pipeline: torch %s's PipelineStage differs from 2.13's; receive buffers are kept for every "
            "micro-batch, more than the memory estimate counts",
            torch.__version__,
        )
        return _SyncingStage
    return _OnDemandReceiveStage


def _pass_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage already returns the mean loss of its micro-batch."""
    return output


class Pipeline:
    def __init__(self, parts: list, ids: list[int], pp_mesh, parallel: ParallelConfig, device: torch.device):
        num_stages = parallel.num_stages
        stage_class = _stage_class()
        self.stages = [
            stage_class(part, stage_index, num_stages, device, group=pp_mesh.get_group())
            for part, stage_index in zip(parts, ids, strict=True)
        ]
        for stage in self.stages:
            stage.sync_each = parallel.grad_accumulation == "sync_each"
        if parallel.grad_accumulation == "sync_each" and stage_backward is None:
            log.warning(
                "pipeline: torch %s has no pipelining._backward.stage_backward; gradients accumulate "
                "unsharded until the step's end (sync_last_gathered), more than the memory estimate counts",
                torch.__version__,
            )
        self.has_first = 0 in ids
        self.has_last = num_stages - 1 in ids
        schedule = SCHEDULES[parallel.pipeline_schedule]
        self.sends = None
        if schedule is ScheduleInterleaved1F1B and stage_class is _OnDemandReceiveStage:
            self.sends = _SendsInFlight()
            for stage in self.stages:
                stage.sends = self.sends
        if schedule is ScheduleInterleaved1F1B:
            # Each receive posted just before the chunk that consumes it, not as early as the
            # sender allows (torch's _defer_recv_ops, deadlock-free by rank parity): with
            # on-demand buffers, at most one is then alive beyond the in-flight activations. The
            # 1F1B and GPipe schedules already post each receive just before its chunk.
            self.schedule = schedule(
                self.stages, n_microbatches=parallel.grad_accum_steps, loss_fn=_pass_loss, defer_pp_recv=True
            )
        else:
            self.schedule = schedule(self.stages[0], n_microbatches=parallel.grad_accum_steps, loss_fn=_pass_loss)

    def step(
        self, tokens: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Forward and backward over all micro-batches of one step; the mean loss on the last stage.
        Document ids (document masking) go to every stage, as the targets do."""
        losses: list[torch.Tensor] = []
        inputs = (tokens,) if self.has_first else ()
        extra = {} if documents is None else {"documents": documents}
        self.schedule.step(*inputs, target=targets, losses=losses, return_outputs=False, targets=targets, **extra)
        self._finish_sends()
        return torch.stack(losses).mean().detach() if self.has_last else None

    def evaluate(
        self, tokens: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Forward only over the micro-batches (validation, entrypoints/evaluate.py); the mean loss
        on the last stage. The schedule's own `eval` turns its backward off for this call, and
        re-plans its stages' buffers when training's next `step` turns it back on."""
        losses: list[torch.Tensor] = []
        inputs = (tokens,) if self.has_first else ()
        extra = {} if documents is None else {"documents": documents}
        self.schedule.eval(*inputs, target=targets, losses=losses, return_outputs=False, targets=targets, **extra)
        self._finish_sends()
        return torch.stack(losses).mean() if self.has_last else None

    def _finish_sends(self) -> None:
        if self.sends is not None:
            self.sends.finish()
