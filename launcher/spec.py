"""`JobSpec`: one backend-neutral, immutable description of a training job.

Everything a backend needs is here, already decided: the unique name, the image, the torchrun
argv, the environment, resources, where data, outputs and checkpoints live, the time limit,
retries, spot capacity and tags. What only one engine reads travels in that engine's typed part
(`JobSpec.sagemaker`: region, role, S3 locations, KMS, spot wait, VPC), set only for that
backend. The resolved recipe travels with it as JSON text and lands in the code bundle as
`resolved.json`; it is never flattened into hyperparameters (SageMaker caps those at 100
entries of 2,500 characters).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import secrets
import string
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from launcher.display import html
from launcher.recipe.schema import SAGEMAKER_MAX_RUN_S

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
    bootstrap: bool = False
    """Run torchrun through entrypoints/bootstrap.py, which picks the rendezvous from the engine's
    own host list (SageMaker's resourceconfig.json), installs pinned wheels and writes the failure file."""


@dataclass(frozen=True, kw_only=True)
class Resources:
    instance_type: str
    instance_count: int
    procs_per_node: int
    device: str
    accelerator: str
    efa_interfaces: int
    volume_size_gb: int

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
class Networking:
    subnets: tuple[str, ...] = ()
    security_group_ids: tuple[str, ...] = ()
    isolation: bool = False
    encrypt_inter_node: bool = False


@dataclass(frozen=True, kw_only=True)
class SageMakerSettings:
    """What only a SageMaker training job reads: where it runs, as whom, where its files go."""

    region: str
    role_arn: str | None
    output_uri: str | None
    checkpoint_uri: str | None
    kms_key_id: str | None
    max_wait_s: int | None
    """With spot: how long to wait for capacity, run time included (MaxWaitTimeInSeconds)."""
    networking: Networking
    training_plan_arn: str | None = None
    """A SageMaker training plan's ARN: the job runs on that plan's reserved capacity."""

    @classmethod
    def of(cls, recipe: Recipe) -> SageMakerSettings:
        sm = recipe.sagemaker
        max_wait = None
        if sm.spot:
            max_run = recipe.cluster.max_run
            max_wait = sm.max_wait or max(max_run, min(2 * max_run, SAGEMAKER_MAX_RUN_S))
        return cls(
            region=sm.region,
            role_arn=sm.role_arn,
            output_uri=sm.output_uri,
            checkpoint_uri=sm.checkpoint_uri,
            kms_key_id=sm.kms_key_id,
            max_wait_s=max_wait,
            training_plan_arn=sm.training_plan_arn,
            networking=Networking(
                subnets=tuple(sm.subnets),
                security_group_ids=tuple(sm.security_group_ids),
                isolation=sm.network_isolation,
                encrypt_inter_node=sm.encrypt_inter_container_traffic,
            ),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SageMakerSettings:
        networking = Networking(**{k: _tuple(v) for k, v in data["networking"].items()})
        return cls(**{**data, "networking": networking})


@dataclass(frozen=True, kw_only=True)
class SlurmSettings:
    """What only the Slurm backend reads (the recipe's slurm: section)."""

    partition: str | None
    account: str | None
    shared_dir: str | None
    container_image: str | None
    venv: str | None
    signal_before_end_s: int
    requeue: bool

    @classmethod
    def of(cls, recipe: Recipe) -> SlurmSettings:
        settings = recipe.slurm.model_dump()
        settings["signal_before_end_s"] = settings.pop("signal_before_end")
        return cls(**settings)


@dataclass(frozen=True, kw_only=True)
class KubernetesSettings:
    """What only the Kubernetes backend reads (the recipe's k8s: section)."""

    namespace: str | None
    checkpoint_claim: str | None
    storage_class: str | None
    storage_size: str

    @classmethod
    def of(cls, recipe: Recipe) -> KubernetesSettings:
        return cls(**recipe.k8s.model_dump())


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What to run and where, for any backend. Frozen; `to_json`/`from_json` round-trip."""

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
    retries: int
    """How many times the engine reruns the job after a failure."""
    spot: bool
    """Run on interruptible (spot) capacity; backends without it refuse the spec."""
    tags: tuple[tuple[str, str], ...]
    sagemaker: SageMakerSettings | None
    """The SageMaker-only settings; None for every other backend."""
    slurm: SlurmSettings | None = None
    """The Slurm-only settings; None for every other backend."""
    k8s: KubernetesSettings | None = None
    """The Kubernetes-only settings; None for every other backend."""
    bundle_allow_secrets: tuple[str, ...] = ()
    """The recipe's bundle.allow_secrets_in: bundle files packed although they look like secrets."""
    lineage: str = ""
    """The job whose checkpoints this one continues: its own name for a fresh run, the first job's
    name for a `--resume` of it. Checkpoints are kept per lineage, so two runs of one recipe never mix."""
    resolved_json: str = field(repr=False)
    """The resolved recipe (`Recipe.resolved`) as canonical JSON: the entrypoints' only input."""

    @classmethod
    def create(
        cls, recipe: Recipe, *, backend: str, placement: Placement, name: str | None = None, lineage: str | None = None
    ) -> JobSpec:
        hardware, sm = recipe.hardware, recipe.sagemaker
        on_sagemaker = backend == "sagemaker"
        resources = Resources(
            instance_type=hardware.instance_key,
            instance_count=recipe.cluster.instance_count,
            procs_per_node=hardware.procs_per_node,
            device=recipe.cluster.device,
            accelerator=hardware.accelerator_key,
            efa_interfaces=hardware.instance.efa_interfaces,
            volume_size_gb=sm.volume_size_gb,
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
        # The recipe is concrete (launcher/resolve.py settled its autos): no estimator here.
        resolved = recipe.resolved(checkpoint_dir=placement.checkpoint_dir, output_dir=placement.output_dir).to_dict()
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
            ),
            environment=tuple(sorted(job_environment(name, resources, inputs).items())),
            resources=resources,
            inputs=inputs,
            checkpoint_dir=placement.checkpoint_dir,
            output_dir=placement.output_dir,
            mounts=placement.mounts,
            max_run_s=recipe.cluster.max_run,
            # Only a SageMaker job reads the sagemaker: section; elsewhere it is inert, so one
            # recipe renders on every backend.
            retries=sm.retries if on_sagemaker else 0,
            spot=sm.spot and on_sagemaker,
            tags=tuple(sorted(sm.tags.items())) if on_sagemaker else (),
            sagemaker=SageMakerSettings.of(recipe) if on_sagemaker else None,
            slurm=SlurmSettings.of(recipe) if backend == "slurm" else None,
            k8s=KubernetesSettings.of(recipe) if backend == "k8s" else None,
            bundle_allow_secrets=recipe.bundle.allow_secrets_in,
            resolved_json=canonical_json(resolved),
        )

    # --- views -----------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        return dict(self.environment)

    @property
    def resolved(self) -> dict[str, Any]:
        return json.loads(self.resolved_json)

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)

    # --- serialization -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["command"] = list(self.command)
        data["environment"] = dict(self.environment)
        data["tags"] = dict(self.tags)
        data["resolved"] = json.loads(data.pop("resolved_json"))
        return data

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        data = dict(data)
        data["resources"] = Resources(**{f.name: data["resources"][f.name] for f in fields(Resources)})
        if data["sagemaker"] is not None:
            data["sagemaker"] = SageMakerSettings.from_dict(data["sagemaker"])
        for key, settings in (("slurm", SlurmSettings), ("k8s", KubernetesSettings)):
            if data.get(key) is not None:
                data[key] = settings(**data[key])
        data["inputs"] = tuple(DataInput(**item) for item in data["inputs"])
        data["mounts"] = tuple(Mount(**item) for item in data["mounts"])
        data["command"] = tuple(data["command"])
        data["environment"] = tuple(sorted(data["environment"].items()))
        data["tags"] = tuple(sorted(data["tags"].items()))
        data["bundle_allow_secrets"] = tuple(data.get("bundle_allow_secrets", ()))
        data.setdefault("lineage", data["name"])  # specs saved before lineages existed
        data["resolved_json"] = canonical_json(data.pop("resolved"))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return cls.from_dict(json.loads(text))

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
        wait = self.sagemaker.max_wait_s if self.sagemaker else None
        return f" (wait up to {wait} s)" if self.spot and wait else ""

    def __repr__(self) -> str:
        r = self.resources
        return f"JobSpec({self.name!r}, {self.backend}, {r.instance_count}x{r.instance_type}, world {r.world_size})"

    def __str__(self) -> str:
        width = max(len(key) for key, _ in self.summary_rows())
        return "\n".join(f"{key:<{width}}  {value}" for key, value in self.summary_rows())

    def _repr_html_(self) -> str:
        return html.table(self.summary_rows(), title=f"JobSpec {self.name}")


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def canonical_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _pick(value: int | None, default: int) -> int:
    return default if value is None else value


def torchrun_command(
    resources: Resources, *, name: str, rendezvous_host: str | None, bootstrap: bool = False, max_restarts: int = 0
) -> tuple[str, ...]:
    """The torchrun argv of contract 1, run from the bundle root.

    With `bootstrap`, entrypoints/bootstrap.py runs it and adds the node count and rendezvous itself."""
    tail = [f"--max-restarts={max_restarts}", ENTRYPOINT, "--config", CONFIG_FILE]
    if bootstrap:
        return ("python3", BOOTSTRAP, "torchrun", f"--nproc-per-node={resources.procs_per_node}", *tail)
    argv = ["torchrun", f"--nnodes={resources.instance_count}", f"--nproc-per-node={resources.procs_per_node}"]
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
