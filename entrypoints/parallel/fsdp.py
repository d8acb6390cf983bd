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
- the experts' [E, ., .] weights are sharded on dim 1 wherever their (local) expert count is
  not a multiple of the shard degree (`expert_placement`): FSDP2 splits dim 0 in torch.chunk's
  pieces, so 1 local expert over 2 ranks would leave one rank the whole expert and the other
  none (as torchtitan, torchtitan/models/llama4/infra/parallelize.py `apply_fsdp`, whose
  shard_placement_fn shards on dim 1 when dp_mod_ep x ep exceeds the experts);
- Float8 all-gather (torchao, tensorwise) is switched on in fp8.py only where the backend has
  float8 collectives (nccl).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from entrypoints.model.moe import GroupedExperts, MoE


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

    def shard(module: torch.nn.Module, on: DeviceMesh, block: torch.nn.Module | None = None) -> None:
        placement = expert_placement(block, on) if block is not None else None
        fully_shard(
            module, mesh=on, mp_policy=policy, reshard_after_forward=reshard_after_forward, shard_placement_fn=placement
        )

    units = []  # per block in forward order: (block, its experts' unit or None)
    for block in model.layers.values():
        experts = None
        if expert_mesh is not None and isinstance(block.feed_forward, MoE):
            experts = block.feed_forward.experts
            shard(experts, expert_mesh, block)
        shard(block, mesh, block)
        units.append((block, experts))
    shard(model, mesh)
    if pipelined:
        chunk_backward_prefetch(units)


def expert_placement(block: torch.nn.Module, mesh: DeviceMesh):
    """FSDP's placement for `block`'s grouped expert weights on `mesh` (its last dim shards):
    Shard(1) where the local experts (dim 0 of the local tensor) do not divide evenly over the
    shard degree, else FSDP's default Shard(0); None for a block without experts."""
    feed_forward = getattr(block, "feed_forward", None)
    if not isinstance(feed_forward, MoE) or not isinstance(feed_forward.experts, GroupedExperts):
        return None
    shards = mesh.size(mesh.ndim - 1)
    experts = set(feed_forward.experts.parameters())

    def placement(param: torch.nn.Parameter) -> Shard | None:
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(1) if param in experts and local.shape[0] % shards else None

    return placement


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
