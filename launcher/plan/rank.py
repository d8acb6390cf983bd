"""The planner: every valid layout for a GPU budget, ranked by predicted speed, kept if it fits.

Throughput is pure arithmetic and cheap, so every candidate is scored first and sorted. Memory is
then estimated in that order, only until `top` layouts fit: the k-th layout that fits in speed
order is exactly the k-th best fitting layout, without estimating the slow tail. Memory only grows
with the micro batch, shrinks with more recomputation and with a larger FSDP shard (the rest of
the data-parallel ranks being HSDP replicas), so once a layout fails, the same degrees with a
larger micro batch, less recomputation or fewer shards are skipped without another estimate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from launcher.errors import UsageError
from launcher.estimate import DEFAULT_THRESHOLD, MemoryEstimate, estimate_memory, format_bytes
from launcher.estimate.throughput import AC_RECOMPUTE, CONSTANTS, Constants, Throughput, predict
from launcher.plan.budget import Budget, resolve_budget
from launcher.plan.candidates import Shape, shapes
from launcher.plan.result import LayoutPlan

AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True, slots=True)
class _Scored:
    shape: Shape
    activation_checkpointing: str
    fp8: bool
    throughput: Throughput

    def sort_key(self) -> tuple:
        # Fastest first; among equals the simpler layout (less TP and PP, fewer replicas, less
        # recomputation). The full tuple makes the order deterministic.
        layout = self.shape.layout
        return (
            -round(self.throughput.tokens_per_s_per_gpu, 6),
            layout.tensor,
            layout.pipeline,
            layout.virtual_stages,
            layout.context,
            layout.data_replicate,
            -self.shape.micro_batch_size,
            AC_RECOMPUTE[self.activation_checkpointing],
            self.fp8,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Search:
    """What `search` found: the ranked layouts and how it got there."""

    budget: Budget
    ranked: list[LayoutPlan]
    considered: int  # valid layouts scored (layout x micro batch x AC x fp8)
    estimated: int  # memory estimates made
    faster_but_too_big: int  # layouts faster than the last shown that do not fit
    threshold: float
    elapsed_s: float
    current: LayoutPlan | None = None  # the recipe's own layout, when it is in this budget
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> LayoutPlan:
        return self.ranked[0]

    def why(self) -> str:
        from launcher.plan.explain import why

        return why(self)


def plan(
    recipe,
    *,
    gpus: int | None = None,
    instances: int | None = None,
    instance_type: str | None = None,
    top: int = 10,
    vary_fp8: bool = False,
    threshold: float = DEFAULT_THRESHOLD,
    constants: Constants = CONSTANTS,
) -> list[LayoutPlan]:
    """The `top` fastest layouts for `recipe` on a GPU budget that fit in `threshold` of memory."""
    return search(
        recipe,
        gpus=gpus,
        instances=instances,
        instance_type=instance_type,
        top=top,
        vary_fp8=vary_fp8,
        threshold=threshold,
        constants=constants,
    ).ranked


def search(
    recipe,
    *,
    gpus: int | None = None,
    instances: int | None = None,
    instance_type: str | None = None,
    top: int = 10,
    vary_fp8: bool = False,
    threshold: float = DEFAULT_THRESHOLD,
    constants: Constants = CONSTANTS,
) -> Search:
    """`plan`, with the numbers behind it (for the CLI's table and its explanation).

    `constants` replaces the throughput model's constants, to ask what-if questions (what if
    context-parallel attention ran as fast as plain attention?).
    """
    if top < 1:
        raise UsageError(f"--top {top}: use 1 or more")
    started = time.perf_counter()
    budget = resolve_budget(recipe, gpus=gpus, instances=instances, instance_type=instance_type)
    arch, training, precision = recipe.arch, recipe.training, recipe.precision
    accelerator = budget.accelerator
    fp8_options = [precision.fp8]
    if vary_fp8 and accelerator.has_fp8 and precision.dtype == "bf16":
        fp8_options = [False, True]

    def score(shape: Shape, ac: str, fp8: bool, compile: bool = training.compile) -> Throughput:
        return predict(
            arch,
            shape.layout,
            seq_len=training.seq_len,
            micro_batch_size=shape.micro_batch_size,
            grad_accum_steps=shape.grad_accum_steps,
            accelerator=accelerator,
            gpus_per_node=budget.gpus_per_node,
            network_gbps=budget.instance.efa_gbps,
            dtype=precision.dtype,
            fp8=fp8,
            fp8_recipe=precision.fp8_recipe,
            activation_checkpointing=ac,
            pipeline_schedule=shape.pipeline_schedule,
            compile=compile,
            usd_per_hour=budget.usd_per_hour,
            steps=training.steps,
            constants=constants,
        )

    def memory(shape: Shape, ac: str, fp8: bool) -> MemoryEstimate:
        return estimate_memory(
            arch,
            shape.layout,
            seq_len=training.seq_len,
            micro_batch_size=shape.micro_batch_size,
            grad_accum_steps=shape.grad_accum_steps,
            dtype=precision.dtype,
            fp8=fp8,
            fp8_recipe=precision.fp8_recipe,
            activation_checkpointing=ac,
            pipeline_schedule=shape.pipeline_schedule,
            accelerator=accelerator,
            threshold=threshold,
        )

    def as_plan(item: _Scored, estimate: MemoryEstimate) -> LayoutPlan:
        return LayoutPlan(
            layout=item.shape.layout,
            micro_batch_size=item.shape.micro_batch_size,
            grad_accum_steps=item.shape.grad_accum_steps,
            pipeline_schedule=item.shape.pipeline_schedule,
            activation_checkpointing=item.activation_checkpointing,
            fp8=item.fp8,
            instance_type=budget.instance_type,
            instance_count=budget.instance_count,
            nproc_per_node=budget.gpus_per_node,
            memory=estimate,
            throughput=item.throughput,
        )

    scored = [
        _Scored(shape, ac, fp8, score(shape, ac, fp8))
        for shape in shapes(
            arch,
            world_size=budget.world_size,
            gpus_per_node=budget.gpus_per_node,
            seq_len=training.seq_len,
            global_batch_size=training.global_batch_size,
            schedule=recipe.parallel.pipeline_schedule,
        )
        for ac in AC_MODES
        for fp8 in fp8_options
    ]
    if not scored:
        raise UsageError(
            f"no parallel layout of {recipe.model_name} is valid on {budget}: training.global_batch_size "
            f"{training.global_batch_size} must be a multiple of the data-parallel size and training.seq_len "
            f"{training.seq_len} of 2 x context x tensor; change them or the GPU count"
        )
    scored.sort(key=_Scored.sort_key)

    fitting, estimated, too_big, closest = _first_that_fit(scored, memory, top)
    ranked = [as_plan(item, estimate) for item, estimate in fitting]
    if not ranked:
        assert closest is not None
        raise UsageError(
            f"no layout of {recipe.model_name} at {training.seq_len} tokens fits in {threshold:.0%} of "
            f"{budget.accelerator_key} memory on {budget}: the smallest needs "
            f"{format_bytes(closest.per_gpu_peak_bytes)} per GPU ({closest.utilization:.0%}); "
            f"use more GPUs, a larger-memory instance type or a shorter training.seq_len"
        )

    notes = []
    best = ranked[0]
    if best.fp8 and not training.compile:
        shape = Shape(best.layout, best.micro_batch_size, best.grad_accum_steps, best.pipeline_schedule)
        compiled = score(shape, best.activation_checkpointing, True, compile=True)
        notes.append(
            f"FP8 without training.compile runs torchao's float8 casts unfused: with training.compile=true the "
            f"best layout predicts {compiled.tokens_per_s_per_gpu:,.0f} tokens/s/GPU "
            f"({compiled.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu - 1:+.0%})"
        )

    current = None
    if budget.instance_type == recipe.cluster.instance_type and budget.world_size == recipe.world_size:
        shape = Shape(
            recipe.layout, training.micro_batch_size, recipe.grad_accum_steps, recipe.parallel.pipeline_schedule
        )
        ac, fp8 = recipe.parallel.activation_checkpointing, precision.fp8
        current = as_plan(_Scored(shape, ac, fp8, score(shape, ac, fp8)), memory(shape, ac, fp8))
    return Search(
        budget=budget,
        ranked=ranked,
        considered=len(scored),
        estimated=estimated,
        faster_but_too_big=too_big,
        threshold=threshold,
        elapsed_s=time.perf_counter() - started,
        current=current,
        notes=notes,
    )


def _first_that_fit(scored: list[_Scored], memory, top: int):
    """The first `top` of `scored` (fastest first) that fit, with their estimates.

    Returns (fitting, estimates made, layouts skipped or failed, the smallest failed estimate).
    """
    fitting: list[tuple[_Scored, MemoryEstimate]] = []
    failed: dict[tuple, list[tuple[int, int, float]]] = {}
    estimated = too_big = 0
    closest: MemoryEstimate | None = None
    for item in scored:
        layout = item.shape.layout
        key = (layout.tensor, layout.context, layout.pipeline, layout.virtual_stages, item.fp8)
        shard, b = layout.data_shard, item.shape.micro_batch_size
        recompute = AC_RECOMPUTE[item.activation_checkpointing]
        if any(shard <= s0 and b >= b0 and recompute <= r0 for s0, b0, r0 in failed.get(key, ())):
            too_big += 1
            continue
        estimate = memory(item.shape, item.activation_checkpointing, item.fp8)
        estimated += 1
        if estimate.verdict != "fits":
            failed.setdefault(key, []).append((shard, b, recompute))
            too_big += 1
            if closest is None or estimate.per_gpu_peak_bytes < closest.per_gpu_peak_bytes:
                closest = estimate
            continue
        fitting.append((item, estimate))
        if len(fitting) == top:
            break
    return fitting, estimated, too_big, closest
