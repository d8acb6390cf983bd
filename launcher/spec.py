"""`JobSpec`: one backend-neutral, immutable description of a training job.

Everything a backend needs is here, already decided: the unique name, the image, the torchrun
argv, the environment, resources, where data, outputs and checkpoints live, the time limit,
retries, spot capacity and tags. What only one engine reads travels in one `engine` part that the
backend built (`Backend.settings`): this module knows it only as `EngineSettings`, the base every
engine's settings extend, and the backend layer rebuilds it from a saved spec. The resolved
recipe travels with it as JSON text and lands in the code bundle as `resolved.json`; it is never
flattened into hyperparameters (SageMaker caps those at 100 entries of 2,500 characters).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import secrets
import string
import types
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Self

from launcher.catalog.engines import DEFAULT_STOP_GRACE_S, STOP_EXIT_S
from launcher.display import html

if TYPE_CHECKING:
    from launcher.recipe import Recipe

# SageMaker's TrainingJobName pattern (botocore sagemaker service model); also a valid DNS label
# once lowercased, which Kubernetes and Slurm accept.
JOB_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
MAX_JOB_NAME = 63
SUFFIX_LEN = 4
RDZV_PORT = 29500
CONFIG_FILE = "resolved.json"
ENTRYPOINT = "entrypoints/train.py"
BOOTSTRAP = "entrypoints/bootstrap.py"
BOOTSTRAP_EXEC = "--exec"
"""entrypoints/bootstrap.py's option: install the job's wheels, then exec the torchrun argv as it is."""
SPEC_FORMAT = 2
"""The layout of a saved spec (`spec.json`). 2: the engine's settings in one `engine` part.
1 (no `format` key): a part per engine under its name, with retries, spot, tags and the
volume size beside it; `upgraded` still reads it."""


def job_name(recipe_name: str, *, now: datetime.datetime | None = None, max_len: int = MAX_JOB_NAME) -> str:
    """`<recipe>-<YYYYMMDD-HHMMSS-mmm>-<4 random>`: unique even for jobs sent in the same millisecond.

    The recipe part is shortened, never the time or the suffix, so names sort by submission time.
    """
    now = (now or datetime.datetime.now(datetime.UTC)).astimezone(datetime.UTC)
    stamp = f"{now:%Y%m%d-%H%M%S}-{now.microsecond // 1000:03d}"
    suffix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(SUFFIX_LEN))
    room = max_len - len(stamp) - len(suffix) - 2
    prefix = recipe_name.lower()[:room].rstrip("-") or "job"
    name = f"{prefix}-{stamp}-{suffix}"
    assert JOB_NAME_RE.match(name) and len(name) <= max_len, name
    return name


@dataclass(frozen=True, kw_only=True)
class Mount:
    """A directory of the machine that runs the container, bound into it."""

    source: str
    target: str
    read_only: bool = False


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a backend puts the job's files, as the training processes see them."""

    checkpoint_dir: str
    output_dir: str
    model_dir: str | None = None
    """Where a relative checkpoint.export_hf goes: the engine's place for the trained model
    (SageMaker's /opt/ml/model, its model artifact); None: under output_dir."""
    rendezvous_host: str | None = None
    """Host of the c10d rendezvous store for multi-node jobs, when the backend knows it in advance
    (algo-1 on SageMaker). None means the launch script exports PET_RDZV_ENDPOINT itself."""
    s3_data_dir: str | None = None
    """Where the training processes read s3:// data (SageMaker's train channel, a staged copy, a
    mounted bucket); None: the backend cannot provide it."""
    s3_staging_dir: str | None = None
    """A directory that submit fills with the s3:// data before the job starts (on this machine;
    for Slurm on the shared file system); None where the engine fetches the data itself."""
    s3_model_dir: str | None = None
    """Where the training processes read an s3:// model.init_from (SageMaker's model channel, a
    staged copy); None: the backend cannot provide it."""
    s3_model_staging_dir: str | None = None
    """A directory that submit fills with the s3:// model.init_from before the job starts."""
    image: str | None = None
    """The container image; None runs on the machines' own Python environment."""
    mounts: tuple[Mount, ...] = ()
    max_restarts: int = 0
    """torchrun's --max-restarts unless the recipe sets cluster.max_restarts: 0 where the engine
    reruns a failed job itself."""
    bootstrap: bool | str = False
    """Run torchrun through entrypoints/bootstrap.py, which picks the rendezvous from the engine's
    own host list (SageMaker's resourceconfig.json), installs pinned wheels and writes the failure
    file; "exec": it installs the pinned wheels, then execs torchrun with the rendezvous the command
    names (engines that rendezvous and signal torchrun themselves: Slurm, Kubernetes)."""


@dataclass(frozen=True, kw_only=True)
class Resources:
    instance_type: str
    instance_count: int
    procs_per_node: int
    device: str
    accelerator: str
    efa_interfaces: int

    @property
    def world_size(self) -> int:
        return self.instance_count * self.procs_per_node

    @property
    def has_efa(self) -> bool:
        return self.efa_interfaces > 0


@dataclass(frozen=True, kw_only=True)
class DataInput:
    name: str
    source: str
    """s3:// URI or a path on the machines that run the job."""
    container_path: str
    """Where the training processes read it."""
    staged_at: str | None = None
    """For s3:// data that submit downloads first: the directory it fills (see launcher.backends.staging)."""


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """What only the job's engine reads, built by its backend from the recipe (`Backend.settings`).

    Each engine with settings of its own extends this class in its backend's module; engines
    without any get this base as it is: no retries, on-demand capacity, no tags."""

    retries: int = 0
    """How many times the engine reruns the job after a failure."""
    spot: bool = False
    """Run on interruptible (spot) capacity."""
    max_wait_s: int | None = None
    """With spot: how long to wait for capacity, run time included (SageMaker's MaxWaitTimeInSeconds)."""
    tags: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, recipe: Recipe) -> Self:
        """The settings from the recipe's section for this engine."""
        return cls()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tags"] = dict(self.tags)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The settings `to_dict` wrote, each value checked against its field's type (a record read
        back from disk is untrusted). A key of another engine's settings is left out, so a format-1
        spec's shared keys (the volume size) reach only the engine that reads them."""
        if not isinstance(data, dict):
            raise TypeError(f"engine: expected a mapping, got {type(data).__name__}")
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        tags = values.get("tags", {})
        if not isinstance(tags, dict) or not all(isinstance(v, str) for pair in tags.items() for v in pair):
            raise TypeError(f"engine.tags: expected a mapping of strings to strings, got {tags!r:.80}")
        values["tags"] = tuple(sorted(tags.items()))
        hints = typing.get_type_hints(cls)
        for name, value in values.items():
            if not _is_of(value, hints[name]):
                raise TypeError(f"engine.{name}: expected {_type_name(hints[name])}, got {value!r:.80}")
        return cls(**values)


def _is_of(value: Any, hint: Any) -> bool:
    """Whether `value` is of the type `hint` names: the plain types, unions with None, homogeneous
    and fixed tuples, and nested settings (dataclasses, already rebuilt by the engine's reader)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_of(value, option) for option in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_is_of(item, args[0]) for item in value)
        return len(value) == len(args) and all(_is_of(item, arg) for item, arg in zip(value, args, strict=True))
    if hint is type(None):
        return value is None
    if hint is int:  # bool is an int to Python, not to a reader of retries or a volume size
        return isinstance(value, int) and not isinstance(value, bool)
    if dataclasses.is_dataclass(hint):
        nested = typing.get_type_hints(hint)
        return isinstance(value, hint) and all(_is_of(getattr(value, f.name), nested[f.name]) for f in fields(hint))
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("NoneType", "None") if typing.get_args(hint) else hint.__name__


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What to run and where, for any backend. Frozen; `to_json` and `Backend.load_spec` round-trip."""

    name: str
    recipe_name: str
    backend: str
    image: str | None
    command: tuple[str, ...]
    """torchrun argv, run from the bundle root (the directory holding entrypoints/)."""
    environment: tuple[tuple[str, str], ...]
    resources: Resources
    inputs: tuple[DataInput, ...]
    checkpoint_dir: str
    output_dir: str
    mounts: tuple[Mount, ...]
    max_run_s: int
    """The time limit: the job is stopped after this many seconds of running."""
    engine: EngineSettings
    """What only this backend's engine reads, built by the backend (`Backend.settings`)."""
    bundle_allow_secrets: tuple[str, ...] = ()
    """The recipe's bundle.allow_secrets_in: bundle files packed although they look like secrets."""
    lineage: str = ""
    """The job whose checkpoints this one continues: its own name for a fresh run, the first job's
    name for a `--resume` of it. Checkpoints are kept per lineage, so two runs of one recipe never mix."""
    stop_grace_s: int = DEFAULT_STOP_GRACE_S
    """Seconds from the engine's SIGTERM to its SIGKILL (`Recipe.stop_grace_s`): what docker's
    --stop-timeout, a pod's terminationGracePeriodSeconds and Slurm's --signal lead are set to."""
    resolved_json: str = field(repr=False)
    """The resolved recipe (`Recipe.resolved`) as canonical JSON: the entrypoints' only input."""

    @classmethod
    def create(
        cls,
        recipe: Recipe,
        *,
        backend: str,
        placement: Placement,
        engine: EngineSettings,
        name: str | None = None,
        lineage: str | None = None,
    ) -> JobSpec:
        hardware = recipe.hardware
        resources = Resources(
            instance_type=hardware.instance_key,
            instance_count=recipe.cluster.instance_count,
            procs_per_node=hardware.procs_per_node,
            device=recipe.cluster.device,
            accelerator=hardware.accelerator_key,
            efa_interfaces=hardware.instance.efa_interfaces,
        )
        name = name or job_name(recipe.name)
        inputs = ()
        if recipe.data.source != "synthetic":
            # Local paths are mounted at the same path, so the resolved recipe needs no rewrite.
            is_s3 = recipe.data.source.startswith("s3://")
            container = (placement.s3_data_dir or recipe.data.source) if is_s3 else recipe.data.source
            staged_at = placement.s3_staging_dir if is_s3 else None
            inputs = (
                DataInput(name="train", source=recipe.data.source, container_path=container, staged_at=staged_at),
            )
        inputs += _model_input(recipe, placement)
        from launcher.recipe.recipe import JobIdentity  # the recipe layer, below this one

        # The recipe is concrete (launcher/resolve.py settled its autos): no estimator here.
        resolved = recipe.resolved(
            checkpoint_dir=placement.checkpoint_dir,
            output_dir=placement.output_dir,
            model_dir=placement.model_dir,
            job=JobIdentity(name, backend, lineage or name),
        ).to_dict()
        return cls(
            name=name,
            lineage=lineage or name,
            recipe_name=recipe.name,
            backend=backend,
            image=placement.image,
            command=torchrun_command(
                resources,
                name=name,
                rendezvous_host=placement.rendezvous_host,
                bootstrap=placement.bootstrap,
                max_restarts=_pick(recipe.cluster.max_restarts, placement.max_restarts),
                shutdown_timeout_s=recipe.stop_grace_s - STOP_EXIT_S,
            ),
            environment=tuple(sorted(job_environment(name, resources, inputs).items())),
            resources=resources,
            inputs=inputs,
            checkpoint_dir=placement.checkpoint_dir,
            output_dir=placement.output_dir,
            mounts=placement.mounts,
            max_run_s=recipe.cluster.max_run,
            # Only the backend's own section of the recipe reaches the engine part; the others
            # are inert, so one recipe renders on every backend.
            engine=engine,
            bundle_allow_secrets=recipe.bundle.allow_secrets_in,
            stop_grace_s=recipe.stop_grace_s,
            resolved_json=canonical_json(resolved),
        )

    # --- views -----------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        return dict(self.environment)

    @property
    def retries(self) -> int:
        """How many times the engine reruns the job after a failure."""
        return self.engine.retries

    @property
    def spot(self) -> bool:
        """Run on interruptible (spot) capacity; backends without it refuse the spec."""
        return self.engine.spot

    @property
    def tags(self) -> tuple[tuple[str, str], ...]:
        return self.engine.tags

    @property
    def resolved(self) -> dict[str, Any]:
        return json.loads(self.resolved_json)

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)

    # --- serialization -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = {"format": SPEC_FORMAT, **asdict(self)}
        data["command"] = list(self.command)
        data["environment"] = dict(self.environment)
        data["engine"] = self.engine.to_dict()
        data["resolved"] = json.loads(data.pop("resolved_json"))
        return data

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, engine: Callable[[dict[str, Any]], EngineSettings]) -> JobSpec:
        """The spec `to_dict` wrote (or a format-1 one). `engine` rebuilds the engine part: only the
        backend layer knows its type (`Backend.load_spec`)."""
        data = upgraded(data)
        del data["format"]
        data["resources"] = Resources(**{f.name: data["resources"][f.name] for f in fields(Resources)})
        data["engine"] = engine(data["engine"])
        data["inputs"] = tuple(DataInput(**item) for item in data["inputs"])
        data["mounts"] = tuple(Mount(**item) for item in data["mounts"])
        data["command"] = tuple(data["command"])
        data["environment"] = tuple(sorted(data["environment"].items()))
        data["bundle_allow_secrets"] = tuple(data.get("bundle_allow_secrets", ()))
        data.setdefault("lineage", data["name"])  # specs saved before lineages existed
        data["resolved_json"] = canonical_json(data.pop("resolved"))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str, *, engine: Callable[[dict[str, Any]], EngineSettings]) -> JobSpec:
        return cls.from_dict(json.loads(text), engine=engine)

    # --- notebooks ---------------------------------------------------------------------------------

    def summary_rows(self) -> list[tuple[str, str]]:
        r = self.resources
        rows = [
            ("name", self.name),
            ("backend", self.backend),
            ("resources", f"{r.instance_count} x {r.instance_type}, {r.procs_per_node} x {r.accelerator} each"),
            ("image", self.image or "(this machine's Python)"),
            ("command", " ".join(self.command)),
            ("checkpoints", self.checkpoint_dir),
            ("output", self.output_dir),
            ("max run", f"{self.max_run_s} s" + (", spot" if self.spot else "") + self._spot_wait()),
        ]
        rows += [(f"input {i.name}", f"{i.source} -> {i.container_path}") for i in self.inputs]
        rows += [("mount", f"{m.source} -> {m.target}{' (read-only)' if m.read_only else ''}") for m in self.mounts]
        if r.has_efa:
            rows.append(("efa", f"{r.efa_interfaces} interfaces per node"))
        return rows

    def _spot_wait(self) -> str:
        wait = self.engine.max_wait_s
        return f" (wait up to {wait} s)" if self.spot and wait else ""

    def __repr__(self) -> str:
        r = self.resources
        return f"JobSpec({self.name!r}, {self.backend}, {r.instance_count}x{r.instance_type}, world {r.world_size})"

    def __str__(self) -> str:
        width = max(len(key) for key, _ in self.summary_rows())
        return "\n".join(f"{key:<{width}}  {value}" for key, value in self.summary_rows())

    def _repr_html_(self) -> str:
        return html.table(self.summary_rows(), title=f"JobSpec {self.name}")


def upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of a saved spec in today's format. Format 1 kept each engine's part under its own
    name (`sagemaker`, `slurm`, `k8s`; None or absent for the others) and retries, spot, tags and
    the volume size outside it: all of them join the `engine` part the backend rebuilds."""
    data = dict(data)
    version = data.get("format", 1)
    if version == SPEC_FORMAT:
        return data
    if version != 1:
        raise ValueError(
            f"job spec format {version!r} is not one this launcher reads (1 or {SPEC_FORMAT}); "
            "use the launcher version that submitted the job"
        )
    parts = {key: data.pop(key) for key in ("sagemaker", "slurm", "k8s") if key in data}
    engine = dict(parts.get(data["backend"]) or {})
    resources = dict(data["resources"])
    engine.update(retries=data.pop("retries"), spot=data.pop("spot"), tags=data.pop("tags"))
    engine["volume_size_gb"] = resources.pop("volume_size_gb")
    return {**data, "format": SPEC_FORMAT, "resources": resources, "engine": engine}


def canonical_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _pick(value: int | None, default: int) -> int:
    return default if value is None else value


def torchrun_command(
    resources: Resources,
    *,
    name: str,
    rendezvous_host: str | None,
    bootstrap: bool | str = False,
    max_restarts: int = 0,
    shutdown_timeout_s: int = DEFAULT_STOP_GRACE_S - STOP_EXIT_S,
) -> tuple[str, ...]:
    """The torchrun argv the entrypoints are started with, run from the bundle root.

    With `bootstrap`, entrypoints/bootstrap.py runs it and adds the node count and rendezvous
    itself; with bootstrap="exec" it installs the job's wheels and execs this argv, rendezvous
    included. `shutdown_timeout_s`: how long torchrun waits for the workers' final save after
    SIGTERM before it SIGKILLs them (torch/distributed/run.py: 30 s unless told)."""
    tail = [f"--max-restarts={max_restarts}", f"--shutdown-timeout={shutdown_timeout_s}"]
    tail += [ENTRYPOINT, "--config", CONFIG_FILE]
    if bootstrap is True:
        return ("python3", BOOTSTRAP, "torchrun", f"--nproc-per-node={resources.procs_per_node}", *tail)
    front = ("python3", BOOTSTRAP, BOOTSTRAP_EXEC) if bootstrap == "exec" else ()
    argv = [*front, "torchrun", f"--nnodes={resources.instance_count}", f"--nproc-per-node={resources.procs_per_node}"]
    if resources.instance_count == 1:
        argv.append("--standalone")
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-id={name}"]
        if rendezvous_host is not None:
            argv.append(f"--rdzv-endpoint={rendezvous_host}:{RDZV_PORT}")
    return (*argv, *tail)


# libfabric and NCCL settings for EFA. Set from the catalog's efa_interfaces, so every EFA
# instance gets them (the SageMaker SDK sets FI_PROVIDER only for the p5 types it knows).
EFA_ENVIRONMENT = {
    "FI_PROVIDER": "efa",  # make libfabric (and so aws-ofi-nccl) use EFA, not TCP sockets
    "FI_EFA_USE_DEVICE_RDMA": "1",  # GPUDirect RDMA between GPU memory and the EFA devices
    "FI_EFA_FORK_SAFE": "1",  # data-loader workers fork after libfabric registered memory
}


def _model_input(recipe: Recipe, placement: Placement) -> tuple[DataInput, ...]:
    """An s3:// model.init_from as the `model` input (SageMaker's channel, or a staged copy); a
    local path is read where it is. Without a place for it the input keeps the URI, which the
    backend refuses (Backend.problems)."""
    init_from = getattr(recipe.model, "init_from", None)
    if not init_from or not init_from.startswith("s3://"):
        return ()
    return (
        DataInput(
            name="model",
            source=init_from,
            container_path=placement.s3_model_dir or init_from,
            staged_at=placement.s3_model_staging_dir,
        ),
    )


def job_environment(name: str, resources: Resources, inputs: tuple[DataInput, ...]) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}  # metric lines reach the logs as they are printed
    env["LAUNCHER_JOB_NAME"] = name  # the checkpoint lease's owner (entrypoints/checkpoint_files.py)
    if resources.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # gloo ranks share the host's cores
    else:
        # Long-context activations vary in size; expandable segments keep fragmentation down.
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        env["NCCL_DEBUG"] = "WARN"
    if resources.has_efa:
        env.update(EFA_ENVIRONMENT)
    for data in inputs:
        if data.source.startswith("s3://"):
            env[f"SM_CHANNEL_{data.name.upper()}"] = data.container_path
    return env
