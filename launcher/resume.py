"""What `submit --resume NAME` continues: the earlier job's checkpoints, where they are.

A job of a lineage resumes from the newest complete checkpoint in its own checkpoint location.
`--resume NAME` gives the new job NAME's lineage, and so NAME's default location; a recipe whose
checkpoint.dir differs from the one NAME had, or another engine, puts the new job's elsewhere, and
it would start from step 0 without a word. So the two locations must be the same
(`Backend.checkpoint_location`); on this machine (capability runs_here) submit also says which
checkpoint the job starts from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launcher.backends import Backend, get_backend
from launcher.backends.base import newest_checkpoint_to_resume
from launcher.display.text import shown
from launcher.errors import UsageError
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
        remedy = f"set checkpoint.dir: {resumed.location}, as {resumed.name} had it"
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
        f"--resume {resumed.name}: {resumed.name} is {status.state} and still writes the checkpoints this job would "
        f"continue; wait for it to end, or stop it (launcher stop {resumed.name})"
    )


def resume_note(spec: JobSpec, target: Backend, resumed: Resumed | None) -> str | None:
    """On this machine: the checkpoint the job starts from, or that `--resume` finds none."""
    if not target.capabilities.runs_here:
        return None
    newest = newest_checkpoint_to_resume(spec)
    if newest is not None and newest[0] >= spec.resolved["training"]["steps"]:
        return None  # nothing is left to train: the backend's check refuses the job
    if newest is not None:
        step, path = newest
        return (
            f"resumes from {shown(path)}, the newest complete checkpoint (step {step}; an older one if it is damaged)"
        )
    if resumed is not None and spec.resolved["checkpoint"]["resume"] == "auto":
        where = shown(Path(spec.resolved["checkpoint"]["dir"]))
        return f"warning: --resume {resumed.name}: no complete checkpoint in {where}; the job starts from step 0"
    return None
