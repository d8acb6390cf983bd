"""The backend interface: render, submit, status, logs, stop, list.

Public methods check what a backend supports and then call the backend's private hooks, so
an unsupported request (four nodes on the local machine, pipeline parallelism under accelerate) fails with a reason
before anything is uploaded or created. Backends are found by name here too (`get_backend`),
each module imported only when asked for.
"""

from __future__ import annotations

import datetime
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from launcher.backends import staging
from launcher.backends.history import MetricsHistory
from launcher.backends.tail import metrics_file_rows
from launcher.catalog import choices
from launcher.catalog.engines import Capabilities, capabilities
from launcher.contract.checkpoint_dirs import complete_checkpoints, step_dir_name
from launcher.display import html
from launcher.display.text import metric_cell, shown
from launcher.errors import EngineError, UsageError
from launcher.registry import SPEC, DamagedRecord, JobRef, job_dir, read_json
from launcher.spec import MAX_JOB_NAME, EngineSettings, JobSpec, Placement, job_name

if TYPE_CHECKING:
    from launcher.recipe import Recipe

TERMINAL_STATES = ("Completed", "Failed", "Stopped")
STATES = ("InProgress", "Stopping", *TERMINAL_STATES)


@dataclass(frozen=True, kw_only=True)
class Transition:
    status: str
    start: str | None
    end: str | None = None
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    """One job's state, the same shape for every backend (SageMaker's vocabulary)."""

    name: str
    backend: str
    state: str
    secondary: str | None = None
    transitions: tuple[Transition, ...] = ()
    failure_reason: str | None = None
    exit_code: int | None = None
    created: str | None = None
    ended: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["terminal"] = self.terminal
        return data

    @property
    def links(self) -> list[tuple[str, str]]:
        """(title, url) of the pages that show this job (`Backend.links`)."""
        ref = JobRef(name=self.name, backend=self.backend, region=self.details.get("region"))
        return backend_class(self.backend)().links(ref) if self.backend in _BACKENDS else []

    def _repr_html_(self) -> str:
        state = self.state + (f" ({self.secondary})" if self.secondary and self.secondary != self.state else "")
        rows = [("job", self.name), ("backend", self.backend), ("state", state)]
        rows += [(k, v) for k, v in (("created", self.created), ("ended", self.ended)) if v]
        if self.failure_reason:
            rows.append(("failure", self.failure_reason))
        if self.exit_code is not None:
            rows.append(("exit code", str(self.exit_code)))
        rows += [(key.removeprefix("train:"), metric_cell(value)) for key, value in self.metrics.items()]
        raw = [("links", html.links(self.links))] if self.links else []
        return html.table(rows, title=f"{self.name}: {state}", raw=raw)


@dataclass(frozen=True, kw_only=True)
class Rendering:
    """What a backend would create for a spec: shown by --dry-run, sent unchanged by submit."""

    spec: JobSpec
    data: dict[str, Any]
    """The JSON of `--dry-run --json`."""
    text: str
    """The human form: the request, command, script or manifest."""
    payload: dict[str, Any] = field(default_factory=dict, repr=False)
    """Things submit needs that are not printed, such as the bundle bytes."""


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    """The checkpoint a job would start from: the newest complete one in its checkpoint location."""

    where: str
    """The location looked in (a directory, an S3 prefix)."""
    step: int | None
    """None: no complete checkpoint there, so the job starts from step 0."""

    @property
    def path(self) -> str:
        return f"{self.where}/{step_dir_name(self.step)}"


@dataclass(frozen=True, kw_only=True)
class Allowance:
    """What the engine lets one job of a recipe have, by its own limits and its account's quotas."""

    longest_run_s: int | None
    """The longest one job may run; None: as long as cluster.max_run says. A run longer than this
    goes on in a chain of jobs of one lineage (`submit --resume`)."""
    lines: tuple[str, ...] = ()
    """What to tell about the check (e.g. that documented defaults stood in for the account's)."""


class Backend(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    max_name_length: ClassVar[int] = MAX_JOB_NAME
    settings_type: ClassVar[type[EngineSettings]] = EngineSettings
    """The class of this engine's part of a JobSpec (`JobSpec.engine`)."""
    checkpoint_setting: ClassVar[str] = "checkpoint.dir"
    """The recipe key that moves the job's checkpoint location (`checkpoint_location`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.capabilities = capabilities(cls.name)  # launcher/catalog/engines.yaml, read by the recipe rules too

    # --- what the job sees -------------------------------------------------------------------

    @abstractmethod
    def placement(self, recipe: Recipe, name: str, lineage: str | None = None) -> Placement:
        """Where checkpoints, outputs and the rendezvous are for a job of this name; checkpoints are
        kept per `lineage` (default: the job's own name)."""

    def settings(self, recipe: Recipe) -> EngineSettings:
        """What only this engine reads, from the recipe's section for it (retries, spot, tags...)."""
        return self.settings_type.of(recipe)

    def spec(self, recipe: Recipe, *, lineage: str | None = None) -> JobSpec:
        """A new job of `recipe`; `lineage` names the earlier job whose checkpoints it continues."""
        name = job_name(recipe.name, max_len=self.max_name_length)
        placement = self.placement(recipe, name, lineage or name)
        return JobSpec.create(
            recipe, backend=self.name, placement=placement, engine=self.settings(recipe), name=name, lineage=lineage
        )

    def checkpoint_location(self, spec: JobSpec) -> str:
        """Where the job's checkpoints persist, as one text two jobs' can be compared by (a
        `--resume` continues the earlier job's only where they are the same): the directory the
        job writes, or the directory of this machine bound there; engines that keep them
        elsewhere (S3, a volume claim) say so."""
        bound = [mount.source for mount in spec.mounts if mount.target == spec.checkpoint_dir]
        return bound[0] if bound else spec.checkpoint_dir

    def resume_point(self, spec: JobSpec) -> ResumePoint | None:
        """Where a job of `spec` would resume (`checkpoint.resume: auto`), as far as this launcher
        can look: the newest checkpoint every host completed in its checkpoint location. None
        where it cannot look; the default looks only on this machine (capability runs_here)."""
        if not self.capabilities.runs_here or spec.resolved["checkpoint"]["resume"] != "auto":
            return None
        directory = Path(spec.resolved["checkpoint"]["dir"])
        complete = complete_checkpoints(directory)
        return ResumePoint(where=str(directory), step=complete[-1][0] if complete else None)

    def load_spec(self, data: dict[str, Any]) -> JobSpec:
        """A saved spec (`JobSpec.to_dict`, today's format or an older one) with this engine's part."""
        return JobSpec.from_dict(data, engine=self.settings_type.from_dict)

    def saved_spec(self, name: str) -> JobSpec | None:
        """The spec that submit saved for job `name`; None if it was not submitted from here."""
        path = job_dir(name) / SPEC
        data = read_json(path, "job spec")
        if data is None:
            return None
        try:
            return self.load_spec(data)
        except ValueError as error:  # a format this launcher does not read: what to do instead
            raise DamagedRecord(f"{path}: {error}") from None
        except (KeyError, TypeError, AttributeError) as error:
            raise DamagedRecord(f"{path}: damaged job spec: {type(error).__name__} {error}; move it away") from None

    # --- checks ------------------------------------------------------------------------------

    def problems(self, spec: JobSpec) -> list[str]:
        """Why this backend cannot run the spec, one line each; empty when it can."""
        caps, r = self.capabilities, spec.resources
        problems = []

        def others(capability: str) -> str:
            names = [n for n in backends_with(capability) if n != self.name and backend_class(n).capabilities.submits]
            return choices(names) if names else "another backend"

        if r.instance_count > 1 and not caps.multi_node:
            problems.append(
                f"the {self.name} backend runs one node, not cluster.instance_count {r.instance_count}; use {others('multi_node')}"
            )
        elif r.instance_count > 1 and r.has_efa and not caps.efa:
            problems.append(
                f"the {self.name} backend cannot attach the EFA devices {r.instance_type} needs between nodes; use {others('efa')}"
            )
        for data in spec.inputs:
            if data.name == "model" and data.container_path.startswith("s3://"):
                problems.append(
                    f"model.init_from: the {self.name} backend does not fetch s3:// weights; copy them to the nodes "
                    "and give the path, or use the local or sagemaker backend"
                )
            elif data.source.startswith("s3://") and not caps.s3_data:
                problems.append(
                    f"data.source: the {self.name} backend cannot read {data.source}; copy it to the nodes and use a path, or use {others('s3_data')}"
                )
        if r.device == "cpu" and not caps.cpu:
            problems.append(f"cluster.device: the {self.name} backend runs GPU jobs only; use device: cuda")
        if spec.resolved["parallel"]["pipeline"] > 1 and not caps.pipeline_parallel:
            problems.append(f"parallel.pipeline: the {self.name} backend has no pipeline parallelism; use pipeline: 1")
        if caps.runs_here:
            problems += _paths_here_problems(spec)
        return problems

    def check(self, spec: JobSpec) -> None:
        problems = self.problems(spec)
        if problems:
            raise UsageError("\n".join(problems))

    def allowance(self, recipe: Recipe) -> Allowance:
        """Refuse a job over the engine account's quotas, before anything is built, uploaded or
        created; the default: only the engine's own time limit."""
        return Allowance(longest_run_s=self.capabilities.max_run_s)

    # --- the interface -----------------------------------------------------------------------

    def render(self, spec: JobSpec) -> Rendering:
        self.check(spec)
        rendering = self._render(spec)
        notes = [staging.describe(i.source, i.staged_at, i.container_path) for i in spec.inputs if i.staged_at]
        if notes:
            rendering.data["notes"] = [*rendering.data.get("notes", ()), *notes]
        return rendering

    def submit(self, rendering: Rendering) -> JobRef:
        if not self.capabilities.submits:
            raise UsageError(f"the {self.name} backend only renders a config; use --dry-run to print it")
        self.check(rendering.spec)
        for data in rendering.spec.inputs:
            if data.staged_at:
                staging.stage(data.source, data.staged_at)
        return self._submit(rendering)

    def pending_ref(self, spec: JobSpec) -> JobRef:
        """The record of a job about to be submitted: enough to ask the engine about it."""
        return JobRef(name=spec.name, backend=self.name, created=utc_now())

    def status(self, ref: JobRef) -> JobStatus:
        return self._status(ref)

    def logs(self, ref: JobRef, *, follow: bool = False, poll_s: float = 5.0) -> Iterator[str]:
        return self._logs(ref, follow=follow, poll_s=poll_s)

    def stop(self, ref: JobRef, *, grace_s: float = 30.0) -> JobStatus:
        return self._stop(ref, grace_s=grace_s)

    def list(self, *, region: str | None = None, limit: int = 50) -> list[JobStatus]:
        return self._list(region=region, limit=limit)

    def metrics(self, ref: JobRef) -> MetricsHistory:
        """Every step the job has logged so far."""
        return self._metrics(ref)

    def links(self, ref: JobRef) -> list[tuple[str, str]]:
        """(title, url) of the pages that show this job, for engines that have them (a console)."""
        return []

    @abstractmethod
    def _render(self, spec: JobSpec) -> Rendering: ...

    def _submit(self, rendering: Rendering) -> JobRef:
        raise UsageError(f"the {self.name} backend cannot submit jobs")

    def _status(self, ref: JobRef) -> JobStatus:
        raise UsageError(f"the {self.name} backend has no jobs to show")

    def _logs(self, ref: JobRef, *, follow: bool, poll_s: float) -> Iterator[str]:
        raise UsageError(f"the {self.name} backend has no job logs")

    def _stop(self, ref: JobRef, *, grace_s: float) -> JobStatus:
        raise UsageError(f"the {self.name} backend has no jobs to stop")

    def _list(self, *, region: str | None, limit: int) -> list[JobStatus]:
        return []

    def _metrics(self, ref: JobRef) -> MetricsHistory:
        # What every engine keeps: the job's log, where rank 0 prints one line per step.
        return MetricsHistory.from_lines(ref.name, self._logs(ref, follow=False, poll_s=1.0))

    def _file_or_log_metrics(self, ref: JobRef, metrics_file: Path | None) -> MetricsHistory:
        """The job's metrics.jsonl where this machine can read it, else its log lines."""
        rows = metrics_file_rows(metrics_file) if metrics_file is not None else []
        return MetricsHistory.from_rows(ref.name, rows) if rows else Backend._metrics(self, ref)


# name -> "module:class"; a backend's module is imported only when that backend is asked for.
_BACKENDS = {
    "sagemaker": "launcher.backends.sagemaker.backend:SageMakerBackend",
    "local": "launcher.backends.local.backend:LocalBackend",
    "docker": "launcher.backends.docker:DockerBackend",
    "slurm": "launcher.backends.slurm:SlurmBackend",
    "k8s": "launcher.backends.k8s.backend:KubernetesBackend",
    "accelerate": "launcher.backends.accelerate:AccelerateBackend",
}
NAMES = tuple(_BACKENDS)


def _paths_here_problems(spec: JobSpec) -> list[str]:
    """A job that runs on this machine reads its data and writes its checkpoints at these very
    paths: what cannot work is said before anything starts, not by a rank's traceback."""
    problems = []
    for data in spec.inputs:
        if data.name == "train" and data.staged_at is None and not Path(data.source).exists():
            problems.append(f"data.source: {shown(data.source)} does not exist on this machine, where the job runs")
    directory = Path(spec.resolved["checkpoint"]["dir"])
    existing = next((path for path in (directory, *directory.parents) if path.exists()), None)
    if existing is not None and not existing.is_dir():
        problems.append(f"checkpoint.dir: {shown(existing)} is a file; give a directory (new or one of checkpoints)")
    export = spec.resolved["checkpoint"]["export_hf"]
    if export and Path(export).is_absolute() and Path(export).exists() and not Path(export).is_dir():
        problems.append(f"checkpoint.export_hf: {shown(export)} is a file; give a directory")
    return problems


def backend_class(name: str) -> type[Backend]:
    if name not in _BACKENDS:
        raise UsageError(f"'{name}' is not a backend; use {choices(_BACKENDS)}")
    module, _, attribute = _BACKENDS[name].partition(":")
    return getattr(import_module(module), attribute)


def get_backend(name: str) -> Backend:
    return backend_class(name)()


def backends_with(capability: str) -> list[str]:
    return [name for name in _BACKENDS if getattr(backend_class(name).capabilities, capability)]


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


class EngineUnavailable(EngineError):
    """The engine a backend drives (Docker, Slurm, kubectl) is not reachable from here."""
