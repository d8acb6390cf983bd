"""The job registry under $LAUNCHER_HOME (default ~/.launcher): where jobs live and what is kept.

Every submitted job, on any backend, gets `jobs/<name>/` with `job.json` (its `JobRef`: which
backend and region to ask), `spec.json` and `resolved.json`; the local backend also keeps its
logs, status and metrics there. This module sits below the backends, which write and read it;
the `Job` handle above them (`launcher.jobs`) finds jobs through it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from launcher.errors import UsageError
from launcher.spec import JobSpec, Placement

RECORD = "job.json"


@dataclass(frozen=True, kw_only=True)
class JobRef:
    """Enough to find a job again: what `launcher status NAME` reads from the job registry."""

    name: str
    backend: str
    region: str | None = None
    native_id: str | None = None
    """The engine's own id where it differs from the name (a Slurm job id)."""
    created: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def launcher_home() -> Path:
    return Path(os.environ.get("LAUNCHER_HOME") or "~/.launcher").expanduser()


def job_dir(name: str) -> Path:
    return launcher_home() / "jobs" / name


def checkpoint_home(recipe, lineage: str, root: Path | None = None) -> Path:
    """The recipe's checkpoint.dir, or `<root>/checkpoints/<recipe>/<lineage>`: one directory per
    lineage, so a `--resume` finds the earlier job's checkpoints and two fresh runs never mix."""
    if recipe.checkpoint.dir:
        return Path(recipe.checkpoint.dir)
    return (root or launcher_home()) / "checkpoints" / recipe.name / lineage


def job_dir_placement(recipe, name: str, lineage: str | None = None) -> Placement:
    """Outputs in the job directory, checkpoints per lineage: for backends whose processes see
    this machine's files (local)."""
    checkpoints = checkpoint_home(recipe, lineage or name)
    return Placement(checkpoint_dir=str(checkpoints), output_dir=str(job_dir(name)))


def write_json(path: Path, data: Any) -> None:
    """Write so that readers never see half a file: to a temporary name, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=2) + "\n")
    temporary.replace(path)


def save(ref: JobRef, spec: JobSpec) -> Path:
    directory = job_dir(ref.name)
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / "spec.json", spec.to_dict())
    (directory / "resolved.json").write_text(spec.resolved_json)
    write_json(directory / RECORD, ref.to_dict())
    return directory


def forget(name: str) -> None:
    """Remove a job's record (what `save` wrote); the directory goes too if nothing else is in it."""
    directory = job_dir(name)
    for file in (RECORD, "spec.json", "resolved.json"):
        (directory / file).unlink(missing_ok=True)
    try:
        directory.rmdir()
    except OSError:
        pass  # the backend's own files (a local job's code) stay where it put them


def load(name: str) -> JobRef | None:
    path = job_dir(name) / RECORD
    if not path.is_file():
        return None
    return JobRef(**json.loads(path.read_text()))


def lineage_of(name: str, recipe_name: str) -> str:
    """The checkpoint lineage that a `--resume NAME` of recipe `recipe_name` continues."""
    path = job_dir(name) / "spec.json"
    if not path.is_file():
        raise UsageError(
            f"--resume: no job {name} under {launcher_home() / 'jobs'}; name a job submitted from here (launcher list)"
        )
    spec = json.loads(path.read_text())
    if spec["recipe_name"] != recipe_name:
        raise UsageError(
            f"--resume: {name} ran recipe {spec['recipe_name']}, not {recipe_name}; resume a job of the same recipe"
        )
    return spec.get("lineage") or spec["name"]


def records() -> list[JobRef]:
    root = launcher_home() / "jobs"
    refs = [ref for path in root.glob(f"*/{RECORD}") if (ref := load(path.parent.name)) is not None]
    return sorted(refs, key=lambda r: r.created or "", reverse=True)
