"""One planned layout: what to set in the recipe, its memory and its predicted speed and cost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.contract.layout import Layout
from launcher.estimate import MemoryEstimate
from launcher.estimate.throughput import Throughput


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutPlan:
    layout: Layout
    micro_batch_size: int
    grad_accum_steps: int
    pipeline_schedule: str
    activation_checkpointing: str
    fp8: bool
    instance_type: str
    instance_count: int
    nproc_per_node: int
    memory: MemoryEstimate
    throughput: Throughput

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.throughput.tokens_per_s_per_gpu

    def describe(self) -> str:
        """'tensor 2 x context 8 x data_shard 2, micro batch 1, full AC'."""
        layout = self.layout
        parts = [f"{name} {getattr(layout, name)}" for name in _DEGREES if getattr(layout, name) > 1]
        if layout.virtual_stages > 1:
            parts[parts.index(f"pipeline {layout.pipeline}")] += f" (v{layout.virtual_stages})"
        parts = parts or ["data_shard 1"]
        extras = [f"micro batch {self.micro_batch_size}", f"{self.activation_checkpointing} AC"]
        if self.fp8:
            extras.append("fp8")
        return " x ".join(parts) + ", " + ", ".join(extras)

    def settings(self) -> dict[str, Any]:
        """The recipe values this plan sets, as dotted keys (`Recipe.with_changes` takes them)."""
        return _settings(
            self.layout,
            pipeline_schedule=self.pipeline_schedule,
            activation_checkpointing=self.activation_checkpointing,
            micro_batch_size=self.micro_batch_size,
            fp8=self.fp8,
            instance_type=self.instance_type,
            instance_count=self.instance_count,
            nproc_per_node=self.nproc_per_node,
        )

    def changes(self, recipe) -> dict[str, tuple[Any, Any]]:
        """{dotted key: (recipe's value, planned value)} for what differs from the recipe."""
        current = _current(recipe)
        changed = {key: (current[key], new) for key, new in self.settings().items() if current[key] != new}
        if "cluster.instance_type" in changed:
            # A catalog instance type fixes the GPU model and the processes per node.
            for key in ("cluster.accelerator", "cluster.nproc_per_node"):
                value = _lookup(recipe, key)
                if value is not None and self.instance_type != "local":
                    changed[key] = (value, None)
        return changed

    def overrides(self, recipe) -> dict[str, Any]:
        """What `Recipe.with_changes` needs to turn `recipe` into this plan."""
        return {key: new for key, (_, new) in self.changes(recipe).items()}

    def to_json(self) -> dict[str, Any]:
        layout = self.layout
        return {
            "tensor": layout.tensor,
            "context": layout.context,
            "pipeline": layout.pipeline,
            "virtual_stages": layout.virtual_stages,
            "pipeline_schedule": self.pipeline_schedule,
            "data_shard": layout.data_shard,
            "data_replicate": layout.data_replicate,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "activation_checkpointing": self.activation_checkpointing,
            "fp8": self.fp8,
            "instance_type": self.instance_type,
            "instance_count": self.instance_count,
            "memory_utilization": round(self.memory.utilization, 4),
            "per_gpu_peak_bytes": self.memory.per_gpu_peak_bytes,
            **self.throughput.to_json(),
        }


_DEGREES = ("tensor", "context", "pipeline", "data_replicate", "data_shard")


def _current(recipe) -> dict[str, Any]:
    return _settings(
        recipe.layout,
        pipeline_schedule=recipe.parallel.pipeline_schedule,
        activation_checkpointing=recipe.parallel.activation_checkpointing,
        micro_batch_size=recipe.training.micro_batch_size,
        fp8=recipe.precision.fp8,
        instance_type=recipe.cluster.instance_type,
        instance_count=recipe.cluster.instance_count,
        nproc_per_node=recipe.hardware.procs_per_node,
    )


def _settings(layout: Layout, *, pipeline_schedule, activation_checkpointing, micro_batch_size, fp8, instance_type,
              instance_count, nproc_per_node) -> dict[str, Any]:  # fmt: skip
    values = {f"parallel.{name}": value for name, value in layout.as_dict().items()}
    values |= {
        "parallel.pipeline_schedule": pipeline_schedule,
        "parallel.activation_checkpointing": activation_checkpointing,
        "training.micro_batch_size": micro_batch_size,
        "precision.fp8": fp8,
        "cluster.instance_type": instance_type,
        "cluster.instance_count": instance_count,
    }
    if instance_type == "local":
        values["cluster.nproc_per_node"] = nproc_per_node
    return values


def _lookup(recipe, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(recipe, section), name)
