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

The loss is computed inside the last stage's forward (targets go to every stage as a keyword
argument), so the fused vocab-parallel loss runs under the stage's FSDP/TP hooks like any other
layer; the schedule's loss_fn just passes it on. Micro-batches per step are grad_accum_steps;
the schedule averages gradients over them (scale_grads), the same as the non-pipelined loop.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

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


def _pass_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage already returns the mean loss of its micro-batch."""
    return output


class Pipeline:
    def __init__(self, parts: list, ids: list[int], pp_mesh, parallel: ParallelConfig, device: torch.device):
        num_stages = parallel.num_stages
        self.stages = [
            PipelineStage(part, stage_index, num_stages, device, group=pp_mesh.get_group())
            for part, stage_index in zip(parts, ids, strict=True)
        ]
        self.has_first = 0 in ids
        self.has_last = num_stages - 1 in ids
        schedule = SCHEDULES[parallel.pipeline_schedule]
        stages = self.stages if schedule is ScheduleInterleaved1F1B else self.stages[0]
        self.schedule = schedule(stages, n_microbatches=parallel.grad_accum_steps, loss_fn=_pass_loss)

    def step(
        self, tokens: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Forward and backward over all micro-batches of one step; the mean loss on the last stage.
        Document ids (document masking) go to every stage, as the targets do."""
        losses: list[torch.Tensor] = []
        inputs = (tokens,) if self.has_first else ()
        extra = {} if documents is None else {"documents": documents}
        self.schedule.step(*inputs, target=targets, losses=losses, return_outputs=False, targets=targets, **extra)
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
        return torch.stack(losses).mean() if self.has_last else None
