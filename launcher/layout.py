"""Parallel layout arithmetic: plain integers, no torch.

A layout splits `world_size` GPUs into a 5-D mesh, outermost first:
pp (pipeline) x dp_replicate (HSDP replicas) x dp_shard (FSDP) x cp (context) x tp (tensor).
TP is innermost so it stays on NVLink inside a node; CP next, because its K/V all-gathers are
the next most frequent collective. The entrypoints build their DeviceMesh in this same order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    tensor: int = 1
    context: int = 1
    pipeline: int = 1
    data_replicate: int = 1
    data_shard: int = 1
    virtual_stages: int = 1

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data_replicate * self.data_shard * self.context * self.tensor

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data: HSDP replicas times FSDP shards."""
        return self.data_replicate * self.data_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks that shard parameters, gradients and optimizer states: dp_shard x cp."""
        return self.data_shard * self.context

    @property
    def num_stages(self) -> int:
        return self.pipeline * self.virtual_stages

    def mesh_shape(self) -> dict[str, int]:
        return dict(
            zip(
                MESH_DIMS,
                (self.pipeline, self.data_replicate, self.data_shard, self.context, self.tensor),
                strict=False,
            )
        )

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __str__(self) -> str:
        parts = [f"{name}{size}" for name, size in self.mesh_shape().items() if size > 1]
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        return "x".join(parts) or "single"


def fill_data_shard(*, world_size: int, tensor: int, context: int, pipeline: int, data_replicate: int) -> int | None:
    """The data_shard that makes the product equal world_size, or None if none does."""
    others = tensor * context * pipeline * data_replicate
    if others > world_size or world_size % others:
        return None
    return world_size // others
