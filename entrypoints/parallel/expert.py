"""Expert parallelism: each MoE layer's experts split over `parallel.expert` ranks of dp_shard x cp.

    expert_mesh = build_expert_mesh(cfg.parallel, "cpu")    # dims pp, dp_replicate, expert_fsdp, ep, tp
    apply_expert_parallel(model, expert_mesh, cp_mesh)       # experts -> Shard(0) DTensors on "ep"
    ...apply_fsdp(model, ..., expert_mesh=expert_mesh)       # experts' FSDP over expert_fsdp

The layout rule (EP divides the expert count and dp_shard x cp) is launcher.contract.layout's
`expert_problems`. The mesh follows torchtitan's `ParallelDims.build_mesh`
(torchtitan/distributed/parallel_dims.py), which unflattens the world into a second mesh whose
expert dims borrow dp_shard and cp: here dp_shard x cp, flattened as in the main mesh's
"dp_shard_cp", is cut into (dp_shard x cp / ep, ep), so an EP group is ep consecutive ranks of
dp_shard_cp. Both meshes number the ranks in the same row-major order, so each rank's place in
pp, dp_replicate and tp is the same in both.

As torchtitan's `ExpertParallel` (torchtitan/distributed/expert_parallel.py) the expert weights
[E, ...] become DTensors sharded on dim 0 over "ep", and FSDP then shards each rank's experts
over the remaining data ranks, "expert_fsdp" (torchtitan/models/llama4/infra/parallelize.py,
`apply_fsdp`: `fully_shard(transformer_block.moe.experts, mesh=dp_mod_ep_mesh)`). The router
and shared experts stay with the rest of the block on the main mesh. Experts are never split
over tp: under tensor parallelism every tp rank of a group runs the same tokens (tensor.py).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from entrypoints.model.moe import MoE
from launcher.contract.layout import Layout

EXPERT_MESH_DIMS = ("pp", "dp_replicate", "expert_fsdp", "ep", "tp")


def build_expert_mesh(parallel: Layout, device_type: str) -> DeviceMesh:
    """The expert region's mesh over the same world as `build_mesh`'s, in the same rank order."""
    shape = (parallel.pipeline, parallel.data_replicate, parallel.expert_fsdp, parallel.expert, parallel.tensor)
    return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_DIMS)


def expert_fsdp_mesh(expert_mesh: DeviceMesh) -> DeviceMesh:
    """The experts' FSDP mesh: expert_fsdp, with dp_replicate in front for HSDP."""
    if expert_mesh["dp_replicate"].size() > 1:
        return expert_mesh[("dp_replicate", "expert_fsdp")]
    return expert_mesh["expert_fsdp"]


def moe_layers(model: nn.Module) -> list[MoE]:
    return [block.feed_forward for block in model.layers.values() if isinstance(block.feed_forward, MoE)]


def apply_expert_parallel(model: nn.Module, expert_mesh: DeviceMesh, cp_mesh: DeviceMesh | None) -> None:
    """Shard every MoE layer's experts over "ep" and route their tokens there (model/dispatch.py)."""
    ep_mesh = expert_mesh["ep"]
    for moe in moe_layers(model):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.grad_scale = 1.0 / ep_mesh.size()
        moe.expert_group = ep_mesh.get_group()
        moe.routing_group = cp_mesh.get_group() if cp_mesh is not None else None


def apply_routing_group(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Without expert parallelism: context-parallel ranks still pool their routing statistics."""
    for moe in moe_layers(model):
        moe.routing_group = cp_mesh.get_group()
