"""The planner: every valid layout for a GPU budget, ranked by predicted speed, kept if it fits.

Throughput is pure arithmetic and cheap, so every candidate is scored first and sorted. Memory is
then estimated in that order, only until `top` layouts fit: the k-th layout that fits in speed
order is exactly the k-th best fitting layout, without estimating the slow tail. Memory only grows
with the micro batch, shrinks with more recomputation and with a larger FSDP shard (the rest of
the data-parallel ranks being HSDP replicas), grows from sync_each to sync_last to
sync_last_gathered and is less where sequence parallel keeps the shard of its gathered inputs; so
once a layout fails, the same degrees (expert parallelism included) that hold at least as much on
every one of those axes are skipped without another estimate.

The OOM suggestion (`launcher.plan.suggest`) runs this same search in another order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

from launcher.contract.layout import Layout
from launcher.errors import UsageError
from launcher.estimate import MemoryEstimate, Mode, Workload, estimate_if_fits, estimate_memory, format_bytes
from launcher.plan.budget import resolve_budget
from launcher.plan.candidates import Shape, shapes
from launcher.plan.modes import GRAD_ACCUMULATION_MODES, PIPELINED_ACCUMULATION_MODES
from launcher.plan.modes import mode as run_mode
from launcher.plan.options import SearchOptions
from launcher.plan.result import LayoutPlan, LayoutPlans, Search
from launcher.plan.throughput import (
    AC_RECOMPUTE,
    CONSTANTS,
    Constants,
    Throughput,
    host_cpu_note,
    predict,
    predict_many,
)  # fmt: skip
from launcher.recipe import Recipe
from launcher.recipe.hardware import Hardware

AC_MODES = ("none", "selective", "full")
TP_SAVED_INPUTS = ("gathered", "shard")
"""parallel.tp_saved_inputs, least traffic (and most memory) first."""


@dataclass(frozen=True, slots=True)
class Scored:
    """A candidate workload and its predicted speed (None where the hardware has no speed model)."""

    workload: Workload
    throughput: Throughput | None

    def sort_key(self) -> tuple:
        # Fastest first; among equals the simpler layout (less TP and PP, fewer replicas, less
        # recomputation). The full tuple makes the order deterministic.
        w, layout = self.workload, self.workload.layout
        speed = self.throughput.tokens_per_s_per_gpu if self.throughput else 0.0
        return (
            -round(speed, 6),
            layout.tensor,
            layout.pipeline,
            layout.virtual_stages,
            layout.context,
            layout.data_replicate,
            -w.micro_batch_size,
            AC_RECOMPUTE[w.activation_checkpointing],
            w.fp8,
            GRAD_ACCUMULATION_MODES.index(run_mode(w, "grad_accumulation")),
            TP_SAVED_INPUTS.index(w.tp_saved_inputs),
        )


def search(recipe: Recipe, options: SearchOptions | None = None) -> Search:
    """The `options.top` fastest layouts for `recipe` on a GPU budget that fit in `options.threshold`
    of memory, with the numbers behind them (for the CLI's table and its explanation); default
    options: the recipe's own GPUs, top 10."""
    options = options or SearchOptions()
    top, threshold, constants = options.top, options.threshold, options.constants
    if not (isinstance(top, int) and not isinstance(top, bool) and top >= 1):
        raise UsageError(f"--top {top!r}: use a whole number, 1 or more")
    started = time.perf_counter()
    budget = resolve_budget(recipe, gpus=options.gpus, instances=options.instances, instance_type=options.instance_type)
    workloads = candidate_workloads(
        recipe, budget, vary_fp8=options.vary_fp8, vary_accumulation=options.vary_accumulation
    )
    if not workloads:
        training = recipe.training
        raise UsageError(
            f"no parallel layout of {recipe.model_name} is valid on {budget}: training.global_batch_size "
            f"{training.global_batch_size} must be a multiple of the data-parallel size and training.seq_len "
            f"{training.seq_len} of 2 x context x tensor; change them or the GPU count"
        )
    # Held degrees first: only the candidates that keep them are priced.
    scored = score(_held(workloads, options.fixed, budget), budget, constants=constants)
    scored.sort(key=Scored.sort_key)

    found = first_that_fit(scored, budget, top=top, threshold=threshold)
    ranked = [_as_plan(item, estimate, budget) for item, estimate in found.fitting]
    if not ranked:
        closest = smallest_rejected(found.rejected, budget, threshold=threshold)
        assert closest is not None
        raise UsageError(
            f"no layout of {recipe.model_name} at {recipe.training.seq_len} tokens fits in {threshold:.0%} of "
            f"{budget.accelerator_key} memory on {budget}: the smallest needs "
            f"{format_bytes(closest.per_gpu_peak_bytes)} per GPU ({closest.utilization:.0%}); "
            f"use more GPUs, a larger-memory instance type or a shorter training.seq_len"
        )
    return Search(
        budget=budget,
        ranked=LayoutPlans(ranked),
        considered=len(scored),
        estimated=found.estimated,
        faster_but_too_big=found.faster_than_best,
        threshold=threshold,
        elapsed_s=time.perf_counter() - started,
        current=_current(recipe, budget, threshold, constants),
        notes=[note for note in (host_cpu_note(budget),) if note] + _notes(recipe, ranked[0], budget, constants),
    )


def _held(workloads: list[Workload], fixed: tuple[tuple[str, int], ...], budget: Hardware) -> list[Workload]:
    """The candidates whose layout has every degree `fixed` holds."""
    if not fixed:
        return workloads
    degrees = {f.name for f in fields(Layout)}
    for name, _ in fixed:
        if name not in degrees:
            raise UsageError(f"cannot hold {name!r} in a search: valid: {', '.join(sorted(degrees))}")
    held = [w for w in workloads if all(getattr(w.layout, n) == v for n, v in fixed)]
    if not held:
        wanted = ", ".join(f"{n}={v}" for n, v in fixed)
        raise UsageError(f"no valid layout on {budget} has {wanted}")
    return held


def candidate_workloads(
    recipe: Recipe, budget: Hardware, *, vary_fp8: bool = False, vary_accumulation: bool = True
) -> list[Workload]:
    """The recipe's workload with every valid layout x micro batch x checkpointing (x FP8, x
    accumulation mode) on `budget`."""
    base = Workload.from_recipe(recipe)
    fp8_options = [base.fp8]
    if vary_fp8 and budget.accelerator.has_fp8 and base.dtype == "bf16":
        fp8_options = [False, True]
    # Each candidate is the base's fields with its own: built directly, since `dataclasses.replace`
    # (which reads every field of the base again) cost most of the enumeration.
    base_fields = {f.name: getattr(base, f.name) for f in fields(Workload)}
    found = []
    for shape in shapes(
        base.arch,
        world_size=budget.world_size,
        gpus_per_node=budget.procs_per_node,
        seq_len=base.seq_len,
        global_batch_size=recipe.training.global_batch_size,
        schedule=base.pipeline_schedule,
    ):
        shaped = base_fields | shape.fields(base)
        modes = accumulation_modes(shape, vary=vary_accumulation)
        for ac in AC_MODES:
            for saved in tp_saved_inputs_choices(shape.layout, ac):
                for fp8 in fp8_options:
                    for accumulation in modes:
                        changes = {"activation_checkpointing": ac, "fp8": fp8, "tp_saved_inputs": saved}
                        if accumulation is not None:
                            changes["grad_accumulation"] = accumulation
                        found.append(Workload(**(shaped | changes)))
    return found


def tp_saved_inputs_choices(layout: Layout, activation_checkpointing: str) -> tuple[str, ...]:
    """What sequence parallel may keep of its gathered inputs: both where it matters (TP, and
    blocks that keep their activations), else the default."""
    if layout.tensor == 1 or activation_checkpointing == "full":
        return TP_SAVED_INPUTS[:1]
    return TP_SAVED_INPUTS


def accumulation_modes(shape: Shape, *, vary: bool) -> tuple[str | None, ...]:
    """The `parallel.grad_accumulation` modes to try on `shape`, where they differ: FSDP with more
    than one micro-batch per step; under pipelining, which keeps blocks gathered in every mode,
    sync_each and sync_last_gathered. (None,) keeps the recipe's mode."""
    if not vary or shape.grad_accum_steps == 1 or shape.layout.fsdp_shard == 1:
        return (None,)
    if shape.layout.pipeline > 1:
        return PIPELINED_ACCUMULATION_MODES
    return GRAD_ACCUMULATION_MODES


def score(workloads: list[Workload], budget: Hardware, *, constants: Constants = CONSTANTS) -> list[Scored]:
    """Each candidate workload with its predicted speed, unsorted."""
    speeds = predict_many(workloads, budget, constants=constants)
    return [Scored(workload, speed) for workload, speed in zip(workloads, speeds, strict=True)]


@dataclass(frozen=True, slots=True)
class Fitting:
    """What `first_that_fit` found, and what it cost."""

    fitting: list[tuple[Scored, MemoryEstimate]]
    estimated: int  # memory estimates made
    too_big: int  # layouts skipped or estimated that do not fit
    faster_than_best: int  # of those, the ones ranked before the first that fits
    rejected: list[Workload]  # estimated and too big, in the order tried (`smallest_rejected`)


def first_that_fit(
    scored: list[Scored],
    budget: Hardware,
    *,
    top: int,
    threshold: float,
    mode: Mode = "fsdp",
    failures: Failures | None = None,
) -> Fitting:
    """The first `top` of `scored` (in its order) that fit, with their estimates. `failures`: the
    layouts already found too big on this budget at this threshold, which rule out heavier ones
    here too (the OOM suggestion searches one budget in several groups); it gains this search's."""
    fitting: list[tuple[Scored, MemoryEstimate]] = []
    failures = Failures() if failures is None else failures
    estimated = too_big = faster_than_best = 0
    rejected: list[Workload] = []  # estimated and too big
    for item in scored:
        workload = item.workload
        if failures.rule_out(workload):
            too_big += 1
            continue
        estimate = estimate_if_fits(workload, budget, mode=mode, threshold=threshold)
        estimated += 1
        if estimate is None:
            failures.add(workload)
            too_big += 1
            rejected.append(workload)
            continue
        fitting.append((item, estimate))
        if len(fitting) == 1:
            faster_than_best = too_big
        if len(fitting) == top:
            break
    return Fitting(fitting, estimated, too_big, faster_than_best if fitting else too_big, rejected)


class Failures:
    """Layouts that did not fit on one budget: each rules out the workloads of the same degrees
    (`_degrees`) that hold at least as much on every `_Heavier` axis."""

    def __init__(self) -> None:
        self._by_degrees: dict[tuple, list[_Heavier]] = {}

    def rule_out(self, workload: Workload) -> bool:
        heavier = _Heavier.of(workload)
        return any(heavier.at_least(failure) for failure in self._by_degrees.get(_degrees(workload), ()))

    def add(self, workload: Workload) -> None:
        self._by_degrees.setdefault(_degrees(workload), []).append(_Heavier.of(workload))


def lightest_first(item: Scored) -> tuple:
    """Sort key: lightest first on every axis memory only grows along (`_Heavier`)."""
    return _Heavier.of(item.workload).lightest_first()


def _degrees(workload: Workload) -> tuple:
    """What two workloads must share for one to rule out the other (`_Heavier`). The expert degree
    is one of them, not an axis: memory is not monotone in it (qwen3-30b-a3b-64k, selective: 50.2
    GiB at EP 4, 63.1 at EP 8)."""
    layout = workload.layout
    return layout.tensor, layout.context, layout.pipeline, layout.virtual_stages, layout.expert, workload.fp8


class _Heavier(NamedTuple):
    """Where a workload sits on each axis its memory only grows along, the other degrees equal
    (the module's docstring): fewer FSDP shards, a larger micro batch, less recomputation, an
    accumulation mode that keeps more (GRAD_ACCUMULATION_MODES, `auto` as sync_each, the least it
    can pick), and sequence parallel keeping its gathered inputs rather than their shard."""

    shard: int
    micro_batch: int
    recompute: float
    accumulation: int
    saved_inputs: int

    @classmethod
    def of(cls, workload: Workload) -> _Heavier:
        return cls(
            workload.layout.data_shard,
            workload.micro_batch_size,
            AC_RECOMPUTE[workload.activation_checkpointing],
            GRAD_ACCUMULATION_MODES.index(run_mode(workload, "grad_accumulation")),
            TP_SAVED_INPUTS.index(workload.tp_saved_inputs),
        )

    def lightest_first(self) -> tuple:
        """A sort key that puts each workload before those of its degrees that hold at least as
        much: searched in that order, the first that fails rules out the most."""
        return -self.shard, self.micro_batch, -self.recompute, self.accumulation, -self.saved_inputs

    def at_least(self, other: _Heavier) -> bool:
        """Whether this holds at least as much memory as `other` on every axis."""
        return (
            self.shard <= other.shard
            and self.micro_batch >= other.micro_batch
            and self.recompute <= other.recompute
            and self.accumulation >= other.accumulation
            and self.saved_inputs <= other.saved_inputs
        )


def smallest_rejected(
    rejected: list[Workload], budget: Hardware, *, threshold: float, mode: Mode = "fsdp"
) -> MemoryEstimate | None:
    """The whole estimate of the rejected workload that needs the least memory, for the error
    that none fits. A workload that holds at least as much as another of the same degrees on
    every `_Heavier` axis cannot be the least, so only the others are estimated whole (each
    estimate of a large pipelined model costs milliseconds, and a search that fails rejects
    thousands)."""
    by_key: dict[tuple, list[tuple[_Heavier, Workload]]] = {}
    for workload in rejected:
        by_key.setdefault(_degrees(workload), []).append((_Heavier.of(workload), workload))
    lightest = [
        workload
        for group in by_key.values()
        for heavier, workload in group
        if not any(heavier != other and heavier.at_least(other) for other, _ in group)
    ]
    estimates = (estimate_memory(w, budget, mode=mode, threshold=threshold) for w in lightest)
    return min(estimates, key=lambda e: e.per_gpu_peak_bytes, default=None)


def _as_plan(item: Scored, estimate: MemoryEstimate, budget: Hardware) -> LayoutPlan:
    assert item.throughput is not None
    return LayoutPlan(workload=item.workload, hardware=budget, memory=estimate, throughput=item.throughput)


def _current(recipe: Recipe, budget: Hardware, threshold: float, constants: Constants) -> LayoutPlan | None:
    """The recipe's own layout, when the budget is the recipe's own GPUs."""
    if budget.instance_key != recipe.cluster.instance_type or budget.world_size != recipe.world_size:
        return None
    workload = Workload.from_recipe(recipe)
    speed = predict(workload, budget, constants=constants)
    return _as_plan(Scored(workload, speed), estimate_memory(workload, budget, threshold=threshold), budget)


def _notes(recipe: Recipe, best: LayoutPlan, budget: Hardware, constants: Constants) -> list[str]:
    if not best.fp8 or recipe.training.compile:
        return []
    compiled = predict(replace(best.workload, compile=True), budget, constants=constants)
    return [
        f"FP8 without training.compile runs torchao's float8 casts unfused: with training.compile=true the "
        f"best layout predicts {compiled.tokens_per_s_per_gpu:,.0f} tokens/s/GPU "
        f"({compiled.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu - 1:+.0%})"
    ]
