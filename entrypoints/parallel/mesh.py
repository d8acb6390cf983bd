"""The one DeviceMesh of a job, with named dims in the launcher's order.

    mesh = build_mesh(cfg.parallel, "cuda")     # dims pp, dp_replicate, dp_shard, cp, tp
    mesh["tp"], mesh["cp"], mesh["pp"]          # 1-D sub-meshes
    mesh["dp_shard_cp"]                         # FSDP shards parameters over dp_shard x cp
    mesh["dp"]                                  # dp_replicate x dp_shard: ranks that read different data
    mesh["dp_cp"]                               # dp_replicate x dp_shard x cp: ranks that see different tokens
    mesh["cp_tp"]                               # the ranks of one sequence's tokens in an MoE layer

All five dims exist even at size 1 so that code never asks whether a dim is there. TP is
innermost (NVLink), then CP (its K/V all-gather is the next most frequent collective): the
order, the arithmetic and the rules of a layout live in `launcher.contract.layout`.
"""

from __future__ import annotations

import warnings

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from launcher.contract.layout import MESH_DIMS, Layout

FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "cp_tp": ("cp", "tp"),
}


# torch 2.13 warns that slicing a flattened dim from the root mesh "will be deprecated"; it is
# still how a 2-D HSDP mesh (dp_replicate, dp_shard_cp) that shares the TP mesh's root is made.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


def build_mesh(parallel: Layout, device_type: str) -> DeviceMesh:
    """The 5-D mesh for `parallel` on the current default process group."""
    shape = parallel.mesh_shape()
    mesh = init_device_mesh(device_type, tuple(shape[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
    for name, dims in FLATTENED.items():
        mesh[dims]._flatten(name)
    return mesh


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """FSDP's mesh: dp_shard x cp, with dp_replicate in front for HSDP."""
    if mesh["dp_replicate"].size() > 1:
        return mesh[("dp_replicate", "dp_shard_cp")]
    return mesh["dp_shard_cp"]
