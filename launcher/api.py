"""The Python API of the launcher, which every CLI verb goes through: load a recipe, estimate its
memory, plan its layout, submit it, then status, logs, stop and list its jobs.

`submit` is one pipeline of named stages: load -> data -> resolve -> estimate -> spec -> render
-> submit. RESOLVE (launcher/resolve.py) settles every `auto` of the recipe once, with the planner
first where `auto_plan` asks for its layout; what comes after it reads the concrete recipe.
`dry_run` stops after render; it has no code path of its own, so what it prints is exactly
what submit would have sent. The memory estimate runs before anything is uploaded or created.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from launcher.backends import JobStatus, Rendering, get_backend
from launcher.backends.base import EngineUnavailable
from launcher.backends.history import MetricsHistory
from launcher.backends.processes import process_start_time
from launcher.catalog.engines import engines
from launcher.contract.dataset import MANIFEST
from launcher.contract.hf_checkpoint import export_out_problem
from launcher.data.prepare import DEFAULT_SHARD_TOKENS, Prepared, PrepareSettings, open_inputs, prepare, prepare_opened
from launcher.display import html
from launcher.errors import Detached, UsageError
from launcher.estimate import DEFAULT_THRESHOLD, MemoryEstimate, Mode, Workload, estimate_memory, format_bytes
from launcher.estimate.checkpoint import auto_every_minutes, estimate_recipe_checkpoint, needed_stop_grace
from launcher.estimate.memory import check_options
from launcher.jobs import Job, list_jobs, outcome_exit_code
from launcher.plan import LayoutPlans, Search, SearchOptions, search
from launcher.plan.forecast import RunForecast, forecast
from launcher.plan.suggest import suggestion
from launcher.plan.throughput import predicted_summary
from launcher.recipe import Recipe, parse_set_options
from launcher.recipe.schema import DATA_PREPARE_KEYS, Cluster, Data
from launcher.registry import DiskError, JobRef, forget, job_dir, launcher_home, os_error_line, save
from launcher.registry import load as load_record
from launcher.resolve import Resolved, resolve
from launcher.resume import Resumed, ResumeStart, resume_problem, resume_start, resumed_job, running_problem
from launcher.spec import CONFIG_FILE, JobSpec

RECIPE_BACKENDS = get_args(Cluster.model_fields["backend"].annotation)  # those cluster.backend may name

__all__ = [
    "Job",
    "SearchOptions",
    "Stage",
    "Submission",
    "WontFit",
    "estimate",
    "list_jobs",
    "load",
    "logs",
    "metrics",
    "plan",
    "plan_search",
    "predicted_summary",
    "prepare_data",
    "status",
    "stop",
    "submit",
]


class Stage(enum.Enum):
    """The stages of `submit`, in order. RESOLVE tells nothing of its own: its auto-plan step
    tells PLAN, and what it settles is what `launcher show` prints and ESTIMATE measures."""

    LOAD = "load"
    DATA = "data"
    PLAN = "plan"
    RESOLVE = "resolve"
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

    def _repr_html_(self) -> str:
        memory = self.estimate
        rows = [
            ("job", self.spec.name),
            ("backend", self.spec.backend),
            ("submitted", "no (dry run)" if self.dry_run else "yes"),
            (
                "memory",
                f"{memory.verdict}, {format_bytes(memory.per_gpu_peak_bytes)} per GPU ({memory.utilization:.0%})",
            ),
            (
                "resources",
                f"{self.spec.resources.instance_count} x {self.spec.resources.instance_type}, world {self.spec.resources.world_size}",
            ),
        ]
        if self.final is not None:
            rows.append(("final state", f"{self.final.state}, exit code {self.exit_code}"))
        links = self.job.links if self.job is not None else []
        raw = [("links", html.links(links))] if links else []
        return html.table(rows, title=f"Submission {self.spec.name}", raw=raw)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.spec.name, "backend": self.spec.backend, "dry_run": self.dry_run}
        data["estimate"] = self.estimate.to_dict()
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
    loaded = load(recipe)
    check_options(mode, threshold)
    return estimate_resolved(resolve(loaded, threshold=threshold), mode=mode, threshold=threshold)


def estimate_resolved(
    resolved: Resolved, *, mode: Mode = "fsdp", threshold: float = DEFAULT_THRESHOLD
) -> MemoryEstimate:
    """`estimate` after RESOLVE: the concrete recipe's memory; where it does not fit, the planner's
    smallest change to the recipe as given (the planner weighs its autos per layout itself)."""
    concrete = resolved.concrete
    result = estimate_memory(Workload.from_recipe(concrete), concrete.hardware, mode=mode, threshold=threshold)
    if result.fits:
        return result
    return result.with_suggestion(suggestion(resolved.recipe, mode=mode, threshold=threshold))


def plan_search(recipe: Recipe | str | Path, options: SearchOptions | None = None) -> Search:
    """The planner's search for this recipe or another GPU budget (`SearchOptions`), with the
    numbers behind it: what `launcher plan` prints."""
    return search(load(recipe), options)


def plan(recipe: Recipe | str | Path, options: SearchOptions | None = None, **changes: Any) -> LayoutPlans:
    """The `top` fastest parallel layouts that fit, for this recipe or another GPU budget, best first.

    `options` is a `SearchOptions`; keywords set its fields (`plan(recipe, gpus=64, top=5)`).
    A list (`.best` is the first) that draws itself: `.plot(path)`, and a table in a notebook.
    Apply one with `recipe.with_changes(plan.overrides(recipe))`.
    """
    return plan_search(recipe, dataclasses.replace(options or SearchOptions(), **changes)).ranked


def check_memory(resolved: Resolved, *, force: bool, threshold: float = DEFAULT_THRESHOLD) -> MemoryEstimate:
    """The memory estimate; refuses `oom` always and `risky` unless forced."""
    recipe = resolved.recipe
    found = estimate_resolved(resolved, threshold=threshold)
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


def check_run_time(
    recipe: Recipe, *, time_limited: bool, force: bool, longest_job_s: int | None = None, start_step: int = 0
) -> RunForecast | None:
    """The predicted run time and cost after `start_step`; refuses a run that its engine's time
    limit would cut short, unless no one job may run it all (`longest_job_s`): then it is planned
    as a chain of jobs."""
    limit = recipe.cluster.max_run if time_limited else None
    longest = longest_job_s if time_limited else None
    run = forecast(recipe, time_limit_s=limit, longest_job_s=longest, start_step=start_step)
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
            "pass --yes to submit without asking; nothing was submitted"
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
    loaded = prepare_recipe_data(loaded, dry_run=dry_run, tell=tell)

    resolved = resolve(loaded, threshold=threshold, auto_plan=auto_plan)
    for line in resolved.plan.lines() if resolved.plan else ():
        tell(Stage.PLAN, line)
    loaded = resolved.recipe

    resumed = resumed_job(resume, loaded.name) if resume else None
    spec = target.spec(resolved.concrete, lineage=resumed.lineage if resumed else None)
    start = _resume_start(spec, target, resumed, dry_run=dry_run)
    memory, run = _check_fit(resolved, target, force=force, threshold=threshold, tell=tell, start_step=start.step)
    tell(Stage.SPEC, f"job {spec.name} on {target.name}")
    for line in start.lines:
        tell(Stage.SPEC, line)
    if run is not None and run.jobs > 1:
        tell(Stage.SPEC, _chain_next(spec, resumed=resume))

    rendering = target.render(spec)
    for note in rendering.data.get("notes", ()):
        tell(Stage.RENDER, note)
    for warning in rendering.data.get("warnings", ()):
        tell(Stage.RENDER, f"warning: {warning}")
    if dry_run:
        return Submission(loaded, memory, spec, rendering)

    confirm_cost(run, yes=yes, confirm=confirm)
    ref = _submit_recorded(target, rendering, predicted=_predicted_speed(run))
    job = Job(ref)
    tell(Stage.SUBMIT, f"submitted {spec.name} to {target.name}")
    if not wait:
        return Submission(loaded, memory, spec, rendering, job)
    try:
        final = job.wait(on_line=on_line, on_status=on_status, poll_s=poll_s)
    except KeyboardInterrupt:
        raise Detached(spec.name) from None
    return Submission(loaded, memory, spec, rendering, job, final)


def _resume_start(spec: JobSpec, target, resumed: Resumed | None, *, dry_run: bool) -> ResumeStart:
    """The checkpoint the job starts from; refused where it would not continue `resumed`'s, while
    `resumed` still runs (not asked in a dry run), or where nothing is left to train."""
    problem = resume_problem(resumed, spec, target) if resumed else None
    if resumed and not problem and not dry_run:
        problem = running_problem(resumed)
    start = resume_start(spec, target, resumed) if not problem else ResumeStart()
    if problem or start.problem:
        raise UsageError(problem or start.problem)
    return start


def _check_fit(
    resolved: Resolved,
    target,
    *,
    force: bool,
    threshold: float,
    tell: Callable[[Stage, str], None],
    start_step: int = 0,
) -> tuple[MemoryEstimate, RunForecast | None]:
    """Submit's checks before anything is built: memory, the engine account's quotas, run time
    against the limit (or the chain of jobs it takes), checkpoint cost; each says what it found
    through `tell`. The forecast prices the recipe as given, as the planner does, from the
    checkpoint the job resumes from (`start_step`) where that is known."""
    recipe = resolved.recipe
    memory = check_memory(resolved, force=force, threshold=threshold)
    tell(
        Stage.ESTIMATE,
        f"memory: {memory.verdict}, {format_bytes(memory.per_gpu_peak_bytes)} per {recipe.hardware.accelerator_key} ({memory.utilization:.0%})",
    )
    # What runs differently from the recipe's words (the experts' FP8 is rowwise) and what
    # the estimate assumed (the routing bound), one line each.
    for note in memory.notes:
        if note.startswith(("experts:", "fp8: the experts")):
            tell(Stage.ESTIMATE, note)
    allowance = target.allowance(resolved.concrete)
    time_limited = target.capabilities.time_limit
    run = check_run_time(
        recipe, time_limited=time_limited, force=force, longest_job_s=allowance.longest_run_s, start_step=start_step
    )
    if run is not None:
        tell(Stage.ESTIMATE, run.line())
    checkpoints = estimate_recipe_checkpoint(resolved.concrete, run.speed.step_time_s if run else None)
    auto = [auto_every_minutes(recipe).line()] if "checkpoint.every_minutes" in resolved.settled else []
    if "cluster.stop_grace" in resolved.settled:  # what the engine's grace became (launcher/resolve.py)
        grace = needed_stop_grace(run.speed.step_time_s if run else None, checkpoints.durable_s)
        auto.append(grace.line(target.capabilities.title))
    stop = [checkpoints.stop_text] if checkpoints.stop_text else []
    restore = [checkpoints.restore_line()] if checkpoints.restore_line() else []
    for line in (checkpoints.line(), *auto, *stop, *restore, *checkpoints.warnings) if run else ():
        tell(Stage.ESTIMATE, line)
    for line in (run.chain_line(),) if run is not None and run.jobs > 1 else ():
        tell(Stage.ESTIMATE, line)
    for line in allowance.lines:
        tell(Stage.ESTIMATE, f"warning: {line}")
    return memory, run


def _chain_next(spec: JobSpec, *, resumed: str | None) -> str:
    """How the next job of a chain continues this one, once it ends at its time limit."""
    where = f"continues {resumed}'s lineage; " if resumed else ""
    return (
        f"chain: {where}when {spec.name} ends at its time limit, the same `launcher submit` with "
        f"`--resume {spec.name}` continues it from its last checkpoint"
    )


def prepare_data(
    inputs: Sequence[str],
    *,
    tokenizer: str,
    out: str,
    format: str = "auto",
    field: str = "text",
    delimiter: str | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    eos_token: str | None = None,
    workers: int | None = None,
) -> Prepared:
    """Tokenize text files (local, globs or s3://) into shards, a document index and a manifest
    at `out` (a directory or an s3:// prefix); resumable, and byte-identical whatever `workers`."""
    settings = PrepareSettings(
        inputs=tuple(inputs),
        tokenizer=tokenizer,
        format=format,
        field=field,
        delimiter=delimiter,
        shard_tokens=shard_tokens,
        eos_token=eos_token,
    )
    return prepare(settings, out=out, workers=workers, work_dir=launcher_home() / "datasets" / "uploads")


def prepare_recipe_data(recipe: Recipe, *, dry_run: bool, tell: Callable[[Stage, str], None]) -> Recipe:
    """A recipe naming raw text and a tokenizer, switched to its prepared dataset: prepared now
    (unless dry_run) into $LAUNCHER_HOME/datasets/<key>, where the same inputs, tokenizer and
    settings always land, so a later submit reuses it."""
    data = recipe.data
    if data.tokenizer is None:
        return recipe
    settings = PrepareSettings(
        inputs=(data.source,),
        tokenizer=data.tokenizer,
        format=data.format,
        field=data.field,
        delimiter=data.delimiter,
        eos_token=data.eos_token,
    )
    with tempfile.TemporaryDirectory(prefix="launcher-prepare-") as downloads:
        opened = open_inputs(settings, Path(downloads))
        directory = launcher_home() / "datasets" / opened.key
        if dry_run:
            done_before = (directory / MANIFEST).is_file()
            tell(
                Stage.DATA,
                f"data: {directory}: prepared earlier"
                if done_before
                else f"data: would tokenize {data.source} into {directory}",
            )
        else:
            done = prepare_opened(opened, directory, workers=os.cpu_count() or 1, out=str(directory))
            kept = "already prepared" if not done.written_shards else f"{done.tokens_per_s:,.0f} tokens/s"
            tell(Stage.DATA, f"data: {directory}: {done.manifest['tokens']:,} tokens ({kept})")
    defaults = {f"data.{key}": Data.model_fields[key].default for key in DATA_PREPARE_KEYS}
    return recipe.with_changes({**defaults, "data.source": str(directory), "data.dtype": opened.tokenizer.dtype})


def _predicted_speed(run: RunForecast | None) -> dict[str, float] | None:
    """What the job record keeps of the forecast, for status to compare the live metrics with."""
    if run is None:
        return None
    predicted = {"tokens_per_s_per_gpu": run.speed.tokens_per_s_per_gpu, "mfu": run.speed.mfu}
    return {key: value for key, value in predicted.items() if not math.isnan(value)}  # no MFU on host CPUs


def _submit_recorded(target, rendering: Rendering, *, predicted: dict[str, float] | None = None) -> JobRef:
    """Submit with the job's record written first: if this process dies between the engine's
    create and its answer, `launcher status NAME` still finds the job. Until the backend answers,
    the record names this process (`submitting`), so a record whose submit died is told from one
    under way. A submit that fails, with any exception, takes its record back, so nothing is left
    that names a job that does not exist; a disk error is one line naming the file. The record
    keeps the `predicted` speed (`_predicted_speed`)."""
    spec = rendering.spec
    try:
        save(dataclasses.replace(target.pending_ref(spec), submitting=_this_process(), predicted=predicted), spec)
        ref = dataclasses.replace(target.submit(rendering), predicted=predicted)
    except BaseException as error:
        if isinstance(error, Exception):  # Ctrl-C or SIGTERM mid-create: the record stays, marked
            forget(spec.name)
        if isinstance(error, EngineUnavailable):
            raise EngineUnavailable(f"{error}; `launcher submit --dry-run` prints what would run") from None
        if isinstance(error, OSError):
            raise DiskError(f"{os_error_line(error, 'writing')}; nothing was submitted") from None
        if isinstance(error, DiskError):
            raise DiskError(f"{error}; nothing was submitted") from None
        raise
    try:
        save(ref, spec)
    except DiskError as error:  # the job runs; its record still names this (soon gone) submit
        raise DiskError(f"{error}; {spec.name} was submitted: `launcher status {spec.name}` finds it") from None
    return ref


def _this_process() -> dict[str, Any]:
    """What tells this process apart from any later one with its pid: its start time in /proc."""
    return {"pid": os.getpid(), "start": process_start_time(os.getpid()), "host": socket.gethostname()}


def status(name: str, *, backend: str | None = None, region: str | None = None) -> JobStatus:
    return Job.find(name, backend=backend, region=region).status()


def logs(
    name: str, *, follow: bool = False, backend: str | None = None, region: str | None = None, poll_s: float = 5.0
) -> Iterator[str]:
    return Job.find(name, backend=backend, region=region).logs(follow=follow, poll_s=poll_s)


def metrics(name: str, *, backend: str | None = None, region: str | None = None) -> MetricsHistory:
    """Every step the job has logged so far, from whichever backend runs it."""
    return Job.find(name, backend=backend, region=region).metrics()


def stop(name: str, *, backend: str | None = None, region: str | None = None, grace_s: float = 30.0) -> JobStatus:
    return Job.find(name, backend=backend, region=region).stop(grace_s=grace_s)


EXPORT_SCRIPT = "entrypoints/export_hf.py"


def export(name: str, *, out: str | Path, step: int | None = None) -> Path:
    """Write checkpoint `step` (default: the newest complete one) of local job `name` into `out` as
    a Hugging Face checkpoint, with the job's own code bundle in one process (no GPU needed)."""
    ref = load_record(name)
    if ref is None:
        raise UsageError(f"no job named {name} was submitted from here; `launcher list` shows the jobs")
    code = job_dir(name) / "code"
    engine = engines().get(ref.backend)
    if engine is None or not engine.exports_checkpoints or not (code / EXPORT_SCRIPT).is_file():
        raise UsageError(
            f"launcher export reads the checkpoints of local jobs; for a {ref.backend} job copy its checkpoint "
            f"directory here and run python {EXPORT_SCRIPT} --config resolved.json --checkpoint-dir DIR --out DIR"
        )
    problem = export_out_problem(Path(out))  # also for jobs whose bundle's exporter predates the check
    if problem:
        raise UsageError(problem)
    argv = [sys.executable, EXPORT_SCRIPT, "--config", CONFIG_FILE, "--out", str(Path(out).resolve())]
    argv += ["--step", str(step)] if step is not None else []
    done = subprocess.run(argv, cwd=code, capture_output=True, text=True)
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise UsageError(lines[-1].removeprefix("error: "))
    return Path(out)
