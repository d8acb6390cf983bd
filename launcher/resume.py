"""What `submit --resume NAME` continues: the earlier job's checkpoints, where they are.

A job of a lineage resumes from the newest complete checkpoint in its own checkpoint location.
`--resume NAME` gives the new job NAME's lineage, and so NAME's default location; a recipe whose
checkpoint.dir differs from the one NAME had, or another engine, puts the new job's elsewhere, and
it would start from step 0 without a word. So the two locations must be the same
(`Backend.checkpoint_location`). Where the engine can look (`Backend.resume_point`: this
machine's directory, SageMaker's S3 prefix), submit also says which checkpoint the job starts
from, and refuses one that leaves nothing to train before any instance starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.backends import Backend, get_backend
from launcher.display.text import shown
from launcher.errors import LauncherError, UsageError
from launcher.jobs import NEVER_SUBMITTED, record_status
from launcher.registry import DamagedRecord, lineage_of
from launcher.registry import load as load_record
from launcher.spec import JobSpec


@dataclass(frozen=True)
class Resumed:
    """An earlier job whose checkpoints a new one continues."""

    name: str
    lineage: str
    backend: str
    location: str
    """Where its checkpoints are (Backend.checkpoint_location)."""


def resumed_job(name: str, recipe_name: str) -> Resumed:
    """The job `--resume NAME` names, as its saved spec and record say (both read back: checked)."""
    lineage = lineage_of(name, recipe_name)
    ref = load_record(name)
    if ref is None:
        raise UsageError(f"--resume: no job {name} was submitted from here; `launcher list` shows the jobs")
    engine = get_backend(ref.backend)
    spec = engine.saved_spec(name)
    if spec is None:
        raise DamagedRecord(f"--resume: job {name} has a record but no saved spec; resume another job of the lineage")
    return Resumed(name=name, lineage=lineage, backend=engine.name, location=engine.checkpoint_location(spec))


def resume_problem(resumed: Resumed, spec: JobSpec, target: Backend) -> str | None:
    """Why the new job would not read the earlier job's checkpoints; None when it would."""
    here = target.checkpoint_location(spec)
    if here == resumed.location:
        return None
    if target.name == resumed.backend and target.checkpoint_setting == "checkpoint.dir":
        remedy = f"set checkpoint.dir: {shown(resumed.location)}, as {resumed.name} had it"
    elif target.name == resumed.backend:
        remedy = f"set {target.checkpoint_setting} as {resumed.name} had it"
    else:
        remedy = f"submit it to the {resumed.backend} backend, which {resumed.name} ran on"
    return (
        f"--resume {resumed.name}: its checkpoints are in {shown(resumed.location)}, but this job's would be in "
        f"{shown(here)}, where it would start from step 0; {remedy}"
    )


def running_problem(resumed: Resumed) -> str | None:
    """Why the new job must wait: the earlier one has not ended, and still writes the checkpoints
    the new one would read and write (two SageMaker jobs of a lineage share one S3 prefix, with
    no lease between them). Asks the earlier job's engine."""
    status = record_status(load_record(resumed.name))
    if status.terminal or status.state == NEVER_SUBMITTED:
        return None
    return (
        f"--resume {resumed.name}: {resumed.name} is {shown(status.state)} and still writes the checkpoints this job would "
        f"continue; wait for it to end, or stop it (launcher stop {resumed.name})"
    )


@dataclass(frozen=True)
class ResumeStart:
    """What submit tells about the checkpoint a job starts from."""

    lines: tuple[str, ...] = ()
    problem: str | None = None
    """Why the job must not start: nothing is left to train."""
    step: int = 0
    """The step it resumes after, where known (0: from the start, or not known)."""


def resume_start(spec: JobSpec, target: Backend, resumed: Resumed | None) -> ResumeStart:
    """The checkpoint the job starts from, and why it must not start: a checkpoint at or past
    training.steps leaves nothing to train (the ranks would refuse it, after the engine started
    them, on SageMaker after the instances were paid for). The engine looks only where it is
    cheap: on this machine always, elsewhere for a `--resume`."""
    if resumed is None and not target.capabilities.runs_here:
        return ResumeStart()
    try:
        point = target.resume_point(spec)
    except LauncherError as error:
        return ResumeStart(lines=(f"warning: which checkpoint the job resumes from is not known: {error}",))
    if point is None or (point.step is None and resumed is None):
        return ResumeStart()
    if point.step is None:
        where = shown(point.where)
        return ResumeStart(
            lines=(f"warning: --resume {resumed.name}: no complete checkpoint in {where}; the job starts from step 0",)
        )
    steps = spec.resolved["training"]["steps"]
    if point.step >= steps:
        return ResumeStart(
            problem=f"checkpoint: the newest complete checkpoint in {shown(point.where)} is at step {point.step}, and "
            f"training.steps is {steps}: nothing is left to train; raise training.steps, or set checkpoint.resume: "
            "never to start over"
        )
    line = f"resumes from {shown(point.path)}, the newest complete checkpoint (step {point.step}; an older one if it is damaged)"
    return ResumeStart(lines=(line,), step=point.step)
