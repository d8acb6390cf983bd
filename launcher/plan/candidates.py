"""Every valid parallel layout of a model on a number of GPUs, built from divisors.

The search walks the degrees from the innermost mesh dimension outwards (tensor, context,
pipeline, then the data-parallel split of what is left) and only ever tries divisors of the GPUs
still unassigned, so it never builds a product it then throws away. Branches that a recipe rule
rejects are cut where the rule first applies (head counts for tensor, sequence divisibility for
context, the layer count for pipeline, the batch for data parallelism), and every layout that
survives is checked once more by `launcher.recipe.rules.layout_problems`, the same function that
validates recipes, so a layout the planner proposes is always one a recipe accepts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from launcher.catalog import ModelArch
from launcher.contract.layout import (
    EMBEDDING_WEIGHT,
    OUTPUT_WEIGHT,
    Layout,
    divisors,
    expert_choices,
    min_layers,
    seq_len_divisor,
    tensor_choices,
)
from launcher.estimate import Workload
from launcher.recipe.rules import layout_problems

MAX_VIRTUAL_STAGES = 8
"""Interleaving beyond 8 stages per rank gains little bubble and costs a send/recv per stage."""

MAX_MICRO_BATCH = 64


def _virtual_choices(layers: int, pipeline: int) -> list[int]:
    """Stages per rank to try: powers of two, which give most of interleaving's bubble cut, and
    any other count up to MAX_VIRTUAL_STAGES that splits the layers evenly, by themselves or with
    the embedding and the output layer counted as one each (the Llama 3 paper's split, where the
    end stages hold a layer less). Uneven counts run too (`stage_layer_counts`); leaving them out
    keeps the search small."""
    even = [
        v
        for v in range(1, MAX_VIRTUAL_STAGES + 1)
        if layers % (pipeline * v) == 0 or (layers + EMBEDDING_WEIGHT + OUTPUT_WEIGHT) % (pipeline * v) == 0
    ]
    return sorted({v for v in (1, 2, 4, 8) if v <= MAX_VIRTUAL_STAGES} | set(even))


@dataclass(frozen=True, slots=True)
class Shape:
    """A layout with its micro-batching: everything but activation checkpointing and FP8."""

    layout: Layout
    micro_batch_size: int
    grad_accum_steps: int
    pipeline_schedule: str

    def fields(self, base: Workload) -> dict[str, Any]:
        """The Workload fields this shape sets on `base` (the recipe's workload): its layout (the
        recipe's pipeline_layers where this shape has as many stages, else the balanced split) and
        its micro-batching."""
        layout, given = self.layout, base.layout.pipeline_layers
        if given is not None and len(given) == layout.num_stages:
            layout = replace(layout, pipeline_layers=given)
        return {
            "layout": layout,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "pipeline_schedule": self.pipeline_schedule,
        }


def shapes(
    arch: ModelArch,
    *,
    world_size: int,
    gpus_per_node: int,
    seq_len: int,
    global_batch_size: int,
    schedule: str,
) -> Iterator[Shape]:
    """Each valid (layout, micro batch) for `world_size` GPUs, once."""
    layers = arch.num_layers
    # With one stage per rank the schedule is the recipe's (1f1b or gpipe); interleaving is chosen
    # together with virtual stages.
    plain_schedule = "1f1b" if schedule == "interleaved_1f1b" else schedule
    for t in tensor_choices(arch, gpus_per_node):
        if world_size % t or seq_len % t:
            continue
        for c in divisors(world_size // t):
            if seq_len % seq_len_divisor(c, t):
                continue
            for p in divisors(world_size // (t * c)):
                if min_layers(p) > layers:
                    break  # every stage but the end ones needs a layer; they need not split evenly
                rest = world_size // (t * c * p)  # data_replicate x data_shard
                if global_batch_size % rest:
                    continue
                per_rank = global_batch_size // rest
                virtual = [1] if p == 1 else [v for v in _virtual_choices(layers, p) if min_layers(p * v) <= layers]
                for b in divisors(per_rank):
                    if b > MAX_MICRO_BATCH:
                        break
                    m = per_rank // b
                    if m < p:
                        break  # larger micro-batches leave even fewer per pipeline stage
                    for v in virtual:
                        if v > 1 and m % p:
                            continue
                        for replicate in divisors(rest):
                            dense = Layout(
                                tensor=t,
                                context=c,
                                pipeline=p,
                                virtual_stages=v,
                                data_replicate=replicate,
                                data_shard=rest // replicate,
                            )
                            sched = "interleaved_1f1b" if v > 1 else plain_schedule
                            # A mixture of experts also splits its experts over EP ranks of dp_shard x cp x tp.
                            for ep in expert_choices(arch, dense):
                                layout = replace(dense, expert=ep) if ep > 1 else dense
                                if layout_problems(
                                    layout,
                                    arch,
                                    seq_len=seq_len,
                                    global_batch_size=global_batch_size,
                                    micro_batch_size=b,
                                    gpus_per_node=gpus_per_node,
                                    schedule=sched,
                                ):
                                    continue
                                yield Shape(layout, b, m, sched)
