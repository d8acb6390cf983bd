"""The Python API of the launcher, which every CLI verb goes through: load a recipe, estimate its
memory, plan its layout, submit it, then status, logs, stop and list its jobs.

`submit` is one pipeline of named stages: load -> plan -> estimate -> spec -> render -> submit.
`dry_run` stops after render; it has no code path of its own, so what it prints is exactly
what submit would have sent. The memory estimate runs before anything is uploaded or created.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from launcher.backends import JobStatus, Rendering, get_backend
from launcher.backends.base import EngineUnavailable
from launcher.errors import Detached, LauncherError, UsageError
from launcher.estimate import DEFAULT_THRESHOLD, MemoryEstimate, Mode, Workload, estimate_memory, format_bytes
from launcher.estimate.checkpoint import estimate_recipe_checkpoint
from launcher.jobs import Job, list_jobs, outcome_exit_code
from launcher.plan import LayoutPlan, Search, search
from launcher.plan.apply import auto_plan as best_layout
from launcher.plan.forecast import RunForecast, forecast
from launcher.plan.suggest import suggestion
from launcher.plan.throughput import CONSTANTS, Constants, predicted_summary
from launcher.recipe import Recipe, parse_set_options
from launcher.recipe.schema import Cluster
from launcher.registry import JobRef, forget, lineage_of, save
from launcher.spec import JobSpec

RECIPE_BACKENDS = get_args(Cluster.model_fields["backend"].annotation)  # those cluster.backend may name

__all__ = [
    "Job",
    "Stage",
    "Submission",
    "WontFit",
    "estimate",
    "list_jobs",
    "load",
    "logs",
    "plan",
    "plan_search",
    "predicted_summary",
    "status",
    "stop",
    "submit",
]


class Stage(enum.Enum):
    LOAD = "load"
    PLAN = "plan"
    ESTIMATE = "estimate"
    SPEC = "spec"
    RENDER = "render"
    SUBMIT = "submit"


# Above this predicted cost (USD) a submission asks first: on a terminal it asks, elsewhere it needs yes=True.
CONFIRM_ABOVE_USD = 1000.0


class WontFit(UsageError):
    """The memory estimate says the job would run out of GPU memory (or is too close to it)."""


@dataclass(frozen=True)
class Submission:
    """What `submit` did: the checked recipe, its estimate, the spec, the rendering, and the job."""

    recipe: Recipe
    estimate: MemoryEstimate
    spec: JobSpec
    rendering: Rendering
    job: Job | None = None
    final: JobStatus | None = None
    """With wait=True: the job's status when it ended."""

    @property
    def dry_run(self) -> bool:
        return self.job is None

    @property
    def exit_code(self) -> int:
        """After wait=True: 0 when the job completed, 1 when it failed or was stopped."""
        return 0 if self.final is None else outcome_exit_code(self.final)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.spec.name, "backend": self.spec.backend, "dry_run": self.dry_run}
        data["estimate"] = self.estimate.to_json()
        data.update(self.rendering.data if self.dry_run else {"spec": self.spec.to_dict()})
        if self.job is not None:
            data["job"] = self.job.ref.to_dict()
        if self.final is not None:
            data["status"] = self.final.to_dict()
        return data


def load(recipe: Recipe | str | Path, *, backend: str | None = None, set_options: Sequence[str] = ()) -> Recipe:
    """The recipe, with `--set` overrides and `--backend` (which overrides cluster.backend).

    The one loader: every CLI verb that reads a recipe file comes through here.
    """
    overrides = parse_set_options(set_options)
    origin = "--set" if overrides else "--backend"
    if backend in RECIPE_BACKENDS:
        origin = "--set/--backend" if overrides else origin
        overrides["cluster.backend"] = backend
    if isinstance(recipe, Recipe):
        return recipe.with_changes(overrides) if overrides else recipe
    return Recipe.load(recipe, overrides, origin=origin)


def estimate(
    recipe: Recipe | str | Path, *, mode: Mode = "fsdp", threshold: float = DEFAULT_THRESHOLD
) -> MemoryEstimate:
    """Per-GPU peak memory per pipeline stage, the verdict, and a change that fits if it does not.

    `mode` is "fsdp" (what the entrypoints allocate) or "megatron" (Fujii et al. 2024's published
    accounting). The suggestion is the planner's search for the smallest change that fits.
    """
    recipe = load(recipe)
    result = estimate_memory(Workload.from_recipe(recipe), recipe.hardware, mode=mode, threshold=threshold)
    if result.fits:
        return result
    return result.with_suggestion(suggestion(recipe, mode=mode, threshold=threshold))


def plan_search(
    recipe: Recipe | str | Path,
    *,
    gpus: int | None = None,
    instances: int | None = None,
    instance_type: str | None = None,
    top: int = 10,
    vary_fp8: bool = False,
    threshold: float = DEFAULT_THRESHOLD,
    constants: Constants = CONSTANTS,
) -> Search:
    """The planner's search for this recipe or another GPU budget, with the numbers behind it."""
    return search(
        load(recipe),
        gpus=gpus,
        instances=instances,
        instance_type=instance_type,
        top=top,
        vary_fp8=vary_fp8,
        threshold=threshold,
        constants=constants,
    )


def plan(
    recipe: Recipe | str | Path,
    *,
    gpus: int | None = None,
    instances: int | None = None,
    instance_type: str | None = None,
    top: int = 10,
    vary_fp8: bool = False,
    threshold: float = DEFAULT_THRESHOLD,
) -> list[LayoutPlan]:
    """The `top` fastest parallel layouts that fit, for this recipe or another GPU budget, best first.

    Apply one with `recipe.with_changes(plan.overrides(recipe))`.
    """
    found = plan_search(
        recipe,
        gpus=gpus,
        instances=instances,
        instance_type=instance_type,
        top=top,
        vary_fp8=vary_fp8,
        threshold=threshold,
    )
    return found.ranked


def check_memory(recipe: Recipe, *, force: bool, threshold: float = DEFAULT_THRESHOLD) -> MemoryEstimate:
    """The memory estimate; refuses `oom` always and `risky` unless forced."""
    found = estimate(recipe, threshold=threshold)
    need = f"{format_bytes(found.per_gpu_peak_bytes)} of the {format_bytes(found.gpu_memory_bytes)}"
    where = f"per {recipe.hardware.accelerator_key} ({found.utilization:.0%})"
    hint = f"; try: {found.suggestion}" if found.suggestion else ""
    if found.verdict == "oom":
        raise WontFit(f"{recipe.name}: would run out of memory: needs {need} {where}{hint}; nothing was submitted")
    if found.verdict == "risky" and not force:
        raise WontFit(
            f"{recipe.name}: risky: needs {need} {where}, above the {threshold:.0%} safety margin{hint}; "
            "pass --force to submit anyway"
        )
    return found


def check_run_time(recipe: Recipe, *, time_limited: bool, force: bool) -> RunForecast | None:
    """The predicted run time and cost; refuses a run that its engine's time limit would cut short."""
    run = forecast(recipe, time_limit_s=recipe.cluster.max_run if time_limited else None)
    problem = run.overrun() if run else None
    if problem and not force:
        raise WontFit(f"{problem}; nothing was submitted (pass --force to submit anyway)")
    return run


def confirm_cost(run: RunForecast | None, *, yes: bool, confirm: Callable[[str], bool] | None) -> None:
    """Ask before a submission predicted to cost more than CONFIRM_ABOVE_USD."""
    if yes or run is None or run.usd <= CONFIRM_ABOVE_USD:
        return
    question = f"{run.recipe_name}: predicted cost about ${run.usd:,.0f} ({run.line().split('; ')[0]}); submit?"
    if confirm is None:
        raise UsageError(
            f"{run.recipe_name}: predicted cost about ${run.usd:,.0f} is above ${CONFIRM_ABOVE_USD:,.0f}; "
            "pass --yes (yes=True) to submit without asking; nothing was submitted"
        )
    if not confirm(question):
        raise UsageError(f"{run.recipe_name}: not confirmed; nothing was submitted")


def submit(
    recipe: Recipe | str | Path,
    *,
    backend: str | None = None,
    set_options: Sequence[str] = (),
    dry_run: bool = False,
    force: bool = False,
    yes: bool = False,
    confirm: Callable[[str], bool] | None = None,
    resume: str | None = None,
    wait: bool = False,
    auto_plan: bool = False,
    threshold: float = DEFAULT_THRESHOLD,
    report: Callable[[Stage, str], None] | None = None,
    on_line: Callable[[str], None] | None = None,
    on_status: Callable[[JobStatus], None] | None = None,
    poll_s: float = 5.0,
) -> Submission:
    """Check a recipe's memory, build its JobSpec, render it for a backend and (unless dry_run) submit it.

    With `auto_plan`, the recipe first switches to the planner's best layout on its own GPUs.
    `force` submits what the memory estimate calls risky, or what would outrun its time limit.
    `resume` names an earlier job of the same recipe whose checkpoints (its lineage) this one continues.
    Above CONFIRM_ABOVE_USD of predicted cost, `confirm(question)` must say yes, or `yes` be set.

    `report(stage, message)` hears about each stage; while waiting, `on_status` hears the job's
    state as it starts and `on_line` gets its log lines. Ctrl-C while waiting raises Detached: the
    job goes on.
    """

    def tell(stage: Stage, message: str) -> None:
        if report is not None:
            report(stage, message)

    loaded = load(recipe, backend=backend, set_options=set_options)
    for warning in loaded.warnings:
        tell(Stage.LOAD, f"warning: {warning}")
    target = get_backend(backend or loaded.cluster.backend)

    if auto_plan:
        planned = best_layout(loaded, threshold=threshold)
        for line in planned.lines():
            tell(Stage.PLAN, line)
        loaded = planned.recipe

    memory = check_memory(loaded, force=force, threshold=threshold)
    tell(
        Stage.ESTIMATE,
        f"memory: {memory.verdict}, {format_bytes(memory.per_gpu_peak_bytes)} per {loaded.hardware.accelerator_key} ({memory.utilization:.0%})",
    )

    run = check_run_time(loaded, time_limited=target.capabilities.time_limit, force=force)
    if run is not None:
        tell(Stage.ESTIMATE, run.line())
    checkpoints = estimate_recipe_checkpoint(loaded, run.speed.step_time_s if run else None)
    for line in (checkpoints.line(), *checkpoints.warnings) if run else ():
        tell(Stage.ESTIMATE, line)

    spec = target.spec(loaded, lineage=lineage_of(resume, loaded.name) if resume else None)
    tell(Stage.SPEC, f"job {spec.name} on {target.name}")

    rendering = target.render(spec)
    for note in rendering.data.get("notes", ()):
        tell(Stage.RENDER, note)
    for warning in rendering.data.get("warnings", ()):
        tell(Stage.RENDER, f"warning: {warning}")
    if dry_run:
        return Submission(loaded, memory, spec, rendering)

    confirm_cost(run, yes=yes, confirm=confirm)
    ref = _submit_recorded(target, rendering)
    job = Job(ref)
    tell(Stage.SUBMIT, f"submitted {spec.name} to {target.name}")
    if not wait:
        return Submission(loaded, memory, spec, rendering, job)
    try:
        final = job.wait(on_line=on_line, on_status=on_status, poll_s=poll_s)
    except KeyboardInterrupt:
        raise Detached(spec.name) from None
    return Submission(loaded, memory, spec, rendering, job, final)


def _submit_recorded(target, rendering: Rendering) -> JobRef:
    """Submit with the job's record written first: if this process dies between the engine's
    create and its answer, `launcher status NAME` still finds the job. A submit that fails takes
    its record back, so nothing is left that names a job that does not exist."""
    spec = rendering.spec
    save(target.pending_ref(spec), spec)
    try:
        ref = target.submit(rendering)
    except EngineUnavailable as unavailable:
        forget(spec.name)
        raise EngineUnavailable(f"{unavailable}; `launcher submit --dry-run` prints what would run") from None
    except LauncherError:
        forget(spec.name)
        raise
    save(ref, spec)
    return ref


def status(name: str, *, backend: str | None = None, region: str | None = None) -> JobStatus:
    return Job.find(name, backend=backend, region=region).status()


def logs(
    name: str, *, follow: bool = False, backend: str | None = None, region: str | None = None, poll_s: float = 5.0
) -> Iterator[str]:
    return Job.find(name, backend=backend, region=region).logs(follow=follow, poll_s=poll_s)


def stop(name: str, *, backend: str | None = None, region: str | None = None, grace_s: float = 30.0) -> JobStatus:
    return Job.find(name, backend=backend, region=region).stop(grace_s=grace_s)
