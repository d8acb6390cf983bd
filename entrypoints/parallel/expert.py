"""The expert region: each MoE layer's experts split over `parallel.expert` ranks of
dp_shard x cp x tp, and FSDP-sharded over the rest.

    expert_mesh = build_expert_mesh(cfg.parallel, "cpu")    # dims pp, dp_replicate, expert_fsdp, ep
    apply_expert_parallel(model, expert_mesh, routing_mesh)  # experts -> Shard(0) DTensors on "ep"
    ...apply_fsdp(model, ..., expert_mesh=expert_mesh)       # experts' FSDP over expert_fsdp

A MoE layer runs on the rank's own tokens: under tensor parallelism its tp ranks route and
compute different slices of the sequence (tensor.py), so dp_shard x cp x tp ranks all hold
different tokens there. That is Megatron-Core's layout with expert_tensor_parallel_size 1 and
torchtitan's with etp = 1 (torchtitan/distributed/parallel_dims.py: "EP would borrow all cp and
tp and some dp_shard degree"): the layout rule (EP divides the expert count and dp_shard x cp x
tp) is launcher.contract.layout's `expert_problems`. The mesh unflattens the world, as
torchtitan's `ParallelDims.build_mesh` does, into a second mesh whose expert dims take
dp_shard x cp x tp flattened (tp innermost, as in the main mesh) and cut it into
(dp_shard x cp x tp / ep, ep): an EP group is ep consecutive ranks, tp ranks first. Both meshes
number the ranks in the same row-major order, so each rank's place in pp and dp_replicate is
the same in both.

As torchtitan's `ExpertParallel` (torchtitan/distributed/expert_parallel.py) the expert weights
[E, ...] become DTensors sharded on dim 0 over "ep", and FSDP then shards each rank's experts
over the remaining ranks, "expert_fsdp" (torchtitan/models/llama4/infra/parallelize.py,
`apply_fsdp`: `fully_shard(transformer_block.moe.experts, mesh=dp_mod_ep_mesh)`). Under TP
without EP the experts take the same unit, over all dp_shard x cp x tp ranks, since tp ranks
compute them on different tokens and their gradients must be summed. The router and shared
experts stay with the rest of the block on the main mesh, replicated over tp (tensor.py).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from entrypoints.model.moe import MoE
from launcher.contract.layout import Layout

EXPERT_MESH_DIMS = ("pp", "dp_replicate", "expert_fsdp", "ep")


def build_expert_mesh(parallel: Layout, device_type: str) -> DeviceMesh:
    """The expert region's mesh over the same world as `build_mesh`'s, in the same rank order."""
    shape = (parallel.pipeline, parallel.data_replicate, parallel.expert_fsdp, parallel.expert)
    return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_DIMS)


def expert_fsdp_mesh(expert_mesh: DeviceMesh) -> DeviceMesh:
    """The experts' FSDP mesh: expert_fsdp, with dp_replicate in front for HSDP."""
    if expert_mesh["dp_replicate"].size() > 1:
        return expert_mesh[("dp_replicate", "expert_fsdp")]
    return expert_mesh["expert_fsdp"]


def moe_layers(model: nn.Module) -> list[MoE]:
    return [block.feed_forward for block in model.layers.values() if isinstance(block.feed_forward, MoE)]


def apply_expert_parallel(model: nn.Module, expert_mesh: DeviceMesh, tensor: int) -> None:
    """Shard every MoE layer's experts over "ep" and route their tokens there (model/dispatch.py).

    Each rank's expert gradients sum the tokens of its whole EP group, which spans ep / tp data
    ranks (or the tp / ep ranks of one, which FSDP sums), and FSDP divides them by expert_fsdp
    = dp_shard x cp x tp / ep: the scale tp / ep makes that the mean over the dp_shard x cp data
    ranks the rest of the model averages over, as torchtitan's `fsdp_gradient_divide_factor`
    (torchtitan/distributed/parallel_dims.py) does with FSDP's divide factor, whose PREMUL_SUM
    reduction gloo lacks."""
    ep_mesh = expert_mesh["ep"]
    for moe in moe_layers(model):
        experts = moe.experts
        if ep_mesh.size() > 1:
            for name, param in list(experts.named_parameters(recurse=False)):
                sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
                experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            moe.expert_group = ep_mesh.get_group()
        experts.grad_scale = tensor / ep_mesh.size()


def apply_routing_group(model: nn.Module, routing_mesh: DeviceMesh, tensor: int) -> None:
    """The ranks that hold other tokens of this rank's sequences (cp x tp) pool their routing
    statistics for the auxiliary losses (model/moe.py `router_losses`)."""
    for moe in moe_layers(model):
        moe.routing_group = routing_mesh.get_group()
        moe.routing_tensor = tensor
