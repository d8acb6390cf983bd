"""What the planner returns: one `LayoutPlan` per layout (what to set in the recipe, its memory,
its predicted speed and cost) and the `Search` that ranked them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from launcher.contract.layout import Layout
from launcher.display import html
from launcher.errors import UsageError
from launcher.estimate import MemoryEstimate, Workload, format_bytes
from launcher.plan.modes import mode
from launcher.plan.throughput import Throughput
from launcher.recipe import Recipe
from launcher.recipe.hardware import Hardware


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutPlan:
    """A workload (the recipe's, with another layout, micro-batch, checkpointing or FP8) on a budget."""

    workload: Workload
    hardware: Hardware
    memory: MemoryEstimate
    throughput: Throughput

    @property
    def layout(self) -> Layout:
        return self.workload.layout

    @property
    def micro_batch_size(self) -> int:
        return self.workload.micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.workload.grad_accum_steps

    @property
    def pipeline_schedule(self) -> str:
        return self.workload.pipeline_schedule

    @property
    def activation_checkpointing(self) -> str:
        return self.workload.activation_checkpointing

    @property
    def fp8(self) -> bool:
        return self.workload.fp8

    @property
    def grad_accumulation(self) -> str:
        return mode(self.workload, "grad_accumulation")

    @property
    def instance_type(self) -> str:
        return self.hardware.instance_key

    @property
    def instance_count(self) -> int:
        return self.hardware.instance_count

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
        # Expert parallelism splits the experts over data_shard x context ranks: not a factor of the product.
        experts = [f"expert {layout.expert}"] if layout.expert > 1 else []
        extras = [*experts, f"micro batch {self.micro_batch_size}", f"{self.activation_checkpointing} AC"]
        if self.fp8:
            extras.append("fp8")
        if self.grad_accumulation != "sync_each":
            extras.append(self.grad_accumulation)
        if self.workload.tp_saved_inputs == "shard":
            extras.append("TP saves shard")
        return " x ".join(parts) + ", " + ", ".join(extras)

    def settings(self) -> dict[str, Any]:
        """The recipe values this plan sets, as dotted keys (`Recipe.with_changes` takes them)."""
        return recipe_settings(self.workload, self.hardware)

    def changes(self, recipe: Recipe) -> dict[str, tuple[Any, Any]]:
        """{dotted key: (recipe's value, planned value)} for what differs from the recipe."""
        current = recipe_settings(Workload.from_recipe(recipe), recipe.hardware)
        changed = {key: (current[key], new) for key, new in self.settings().items() if current[key] != new}
        if "cluster.instance_type" in changed:
            # A catalog instance type fixes the GPU model and the processes per node.
            for key in ("cluster.accelerator", "cluster.nproc_per_node"):
                value = _lookup(recipe, key)
                if value is not None and self.instance_type != "local":
                    changed[key] = (value, None)
        return changed

    def overrides(self, recipe: Recipe) -> dict[str, Any]:
        """What `Recipe.with_changes` needs to turn `recipe` into this plan."""
        return {key: new for key, (_, new) in self.changes(recipe).items()}

    def _repr_html_(self) -> str:
        speed = self.throughput
        unit = "tokens/s/GPU" if self.memory.device == "GPU" else f"tokens/s per {self.memory.device}"
        rows = [
            ("layout", self.describe()),
            ("on", f"{self.instance_count} x {self.instance_type}"),
            (unit, f"{speed.tokens_per_s_per_gpu:,.0f}"),
            ("MFU", speed.mfu_text(1)),
            ("step (s)", f"{speed.step_time_s:.3g}"),
            ("peak memory", f"{format_bytes(self.memory.per_gpu_peak_bytes)} ({self.memory.utilization:.0%})"),
            ("$/h", f"{speed.usd_per_hour:,.2f}"),
        ]
        rows += [] if speed.usd_per_run is None else [("$/run", f"{speed.usd_per_run:,.0f}")]
        return html.table(rows, title="one layout: what the plan predicts")

    def to_dict(self) -> dict[str, Any]:
        layout = self.layout
        return {
            "tensor": layout.tensor,
            "context": layout.context,
            "pipeline": layout.pipeline,
            "virtual_stages": layout.virtual_stages,
            "pipeline_schedule": self.pipeline_schedule,
            "data_shard": layout.data_shard,
            "data_replicate": layout.data_replicate,
            "expert": layout.expert,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "grad_accumulation": self.grad_accumulation,
            "activation_checkpointing": self.activation_checkpointing,
            "tp_saved_inputs": self.workload.tp_saved_inputs,
            "fp8": self.fp8,
            "instance_type": self.instance_type,
            "instance_count": self.instance_count,
            "memory_utilization": round(self.memory.utilization, 4),
            "per_gpu_peak_bytes": self.memory.per_gpu_peak_bytes,
            **self.throughput.to_dict(),
        }


class LayoutPlans(list):
    """The layouts that fit, best first: a list of LayoutPlan that also draws itself."""

    @property
    def best(self) -> LayoutPlan:
        if not self:
            raise UsageError("no layout fits this budget; `launcher plan` and `launcher estimate` say what to change")
        return self[0]

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Predicted tokens/s/GPU against peak memory for every layout, the best marked (the `plot` extra)."""
        from launcher.display.plots import plot_plans

        points = [(p.describe(), p.memory.per_gpu_peak_bytes, p.tokens_per_s_per_gpu) for p in self]
        memory = self.best.memory if self else None
        return plot_plans(
            path,
            points,
            best=0,
            capacity_bytes=memory.gpu_memory_bytes if memory else 0,
            threshold=memory.threshold if memory else 1.0,
            title=title or f"{len(self)} layouts that fit; best: {points[0][0] if points else 'none'}",
        )

    def _repr_html_(self) -> str:
        header = ("#", "layout", "tokens/s/GPU", "MFU", "step (s)", "peak memory", "$/h", "$/run")
        rows = [
            (
                str(rank),
                plan.describe(),
                f"{plan.tokens_per_s_per_gpu:,.0f}",
                plan.throughput.mfu_text(1),
                f"{plan.throughput.step_time_s:.3g}",
                f"{format_bytes(plan.memory.per_gpu_peak_bytes)} ({plan.memory.utilization:.0%})",
                f"{plan.throughput.usd_per_hour:,.2f}",
                "" if plan.throughput.usd_per_run is None else f"{plan.throughput.usd_per_run:,.0f}",
            )
            for rank, plan in enumerate(self, start=1)
        ]
        title = f"{len(self)} layouts that fit, best first" if self else "no layout fits"
        return html.grid(header, rows, title=title, marked=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Search:
    """What `search` found: the ranked layouts and how it got there."""

    budget: Hardware
    ranked: LayoutPlans
    considered: int  # valid layouts scored (layout x micro batch x AC x fp8)
    estimated: int  # memory estimates made
    faster_but_too_big: int  # layouts faster than the best that do not fit (whatever --top is)
    threshold: float
    elapsed_s: float
    current: LayoutPlan | None = None  # the recipe's own layout, when it is in this budget
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> LayoutPlan:
        return self.ranked[0]


_DEGREES = ("tensor", "context", "pipeline", "data_replicate", "data_shard")
_LAYOUT_FIELDS = tuple(f.name for f in fields(Layout))


def recipe_settings(workload: Workload, hardware: Hardware) -> dict[str, Any]:
    """The recipe keys a workload on a budget sets."""
    layout = workload.layout
    values = {f"parallel.{name}": getattr(layout, name) for name in _LAYOUT_FIELDS}
    values |= {
        "parallel.pipeline_schedule": workload.pipeline_schedule,
        "parallel.activation_checkpointing": workload.activation_checkpointing,
        "parallel.tp_saved_inputs": workload.tp_saved_inputs,
        "training.micro_batch_size": workload.micro_batch_size,
        "precision.fp8": workload.fp8,
        "cluster.instance_type": hardware.instance_key,
        "cluster.instance_count": hardware.instance_count,
    }
    # As the workload holds it: "auto" stays auto (the estimator's choice by memory), so a plan
    # that searched a concrete mode says so, and its recipe estimates what the plan did.
    values["parallel.grad_accumulation"] = workload.grad_accumulation
    if workload.fp8_experts:  # it needs precision.fp8, which --vary-fp8 may turn off
        values["precision.fp8_experts"] = workload.fp8
    if hardware.instance_key == "local":
        values["cluster.nproc_per_node"] = hardware.procs_per_node
    return values


def _lookup(recipe: Recipe, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(recipe, section), name)
