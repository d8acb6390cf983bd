"""FSDP2: `fully_shard` per transformer block and once at the root, with mixed precision.

    apply_fsdp(model, fsdp_mesh(mesh), param_dtype=torch.bfloat16, reshard_after_forward=True)

Parameters, gradients and optimizer states are sharded over dp_shard x cp (and replicated over
dp_replicate: HSDP on a 2-D mesh). Master weights stay fp32 in the shards; `MixedPrecisionPolicy`
all-gathers them in `param_dtype` (bf16) for compute and reduce-scatters gradients in
`reduce_dtype` (fp32 unless `parallel.reduce_dtype: bf16`).
FSDP is applied even at shard degree 1 because it also carries the mixed-precision policy.

What is gathered when (the estimator models this):
- each block is one unit: all-gathered before its forward and again before its backward;
  freed after forward when `reshard_after_forward` (not under pipeline parallelism or
  `grad_accumulation: sync_last_gathered`, where every micro-batch would gather it again, as
  in torchtitan); accumulate.py sets gradient sync and resharding after backward per micro-batch;
- the root unit holds the embedding, the final norm and the output weight. FSDP2 never
  reshards the root after forward, so these stay gathered from the start of forward to the
  end of backward.
- under expert parallelism each MoE layer's experts are a unit of their own on the expert mesh
  (expert.py), sharded over expert_fsdp (FSDP divides their gradients by that mesh's size; the
  experts scale them by 1/ep first, see `GroupedExperts.grad_scale`);
- Float8 all-gather (torchao, tensorwise) is switched on in fp8.py only where the backend has
  float8 collectives (nccl).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from entrypoints.model.moe import MoE


def apply_fsdp(
    model,
    mesh,
    *,
    param_dtype: torch.dtype,
    reshard_after_forward: bool,
    reduce_dtype: torch.dtype = torch.float32,
    expert_mesh: DeviceMesh | None = None,
    pipelined: bool = False,
) -> None:
    """`expert_mesh`: the experts' FSDP mesh under expert parallelism, else None (the experts are
    then part of their block's unit). `pipelined`: `model` is one pipeline chunk
    (`chunk_backward_prefetch`)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    units = []  # per block in forward order: (block, its experts' unit or None)
    for block in model.layers.values():
        experts = None
        if expert_mesh is not None and isinstance(block.feed_forward, MoE):
            experts = block.feed_forward.experts
            fully_shard(experts, mesh=expert_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        units.append((block, experts))
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if pipelined:
        chunk_backward_prefetch(units)


def chunk_backward_prefetch(units: list) -> None:
    """Under pipeline parallelism, each block's backward prefetches its own experts and the block
    before it in its chunk, and nothing else.

    FSDP's own backward prefetch (FSDPParamGroup._backward_prefetch, torch/distributed/fsdp/
    _fully_shard/_fsdp_param_group.py) all-gathers the unit whose forward finished just before
    the latest forward of the unit entering backward. A pipeline schedule runs other micro-batches'
    and chunks' forwards in between, so that unit can be any block of the rank, one of them the
    block just resharded after its backward under sync_each (pipeline.py): it was gathered again,
    and held, for nothing (traced: 70B 4K, PP 2 x 2, FP8, sync_each: one block's float8 weights,
    0.8 GiB, beside the second block's backward). The list FSDP takes instead
    (`set_modules_to_backward_prefetch`) may not be empty, which means the default: a unit with
    nothing to prefetch names itself, already gathered by its own pre-backward, a no-op (unshard
    returns at once for an unsharded group)."""
    for index, (block, experts) in enumerate(units):
        targets = [unit for unit in (experts, units[index - 1][0] if index else None) if unit is not None]
        block.set_modules_to_backward_prefetch(targets or [block])
        if experts is not None:
            experts.set_modules_to_backward_prefetch([experts])
