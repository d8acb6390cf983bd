"""`Hardware`: what a job runs on (an instance type, its GPUs, processes per node, how many
instances, the price), resolved from a recipe's cluster section against the catalogs."""

from __future__ import annotations

from dataclasses import dataclass

from launcher import catalog
from launcher.catalog import Accelerator, InstanceType, choices, suggest
from launcher.catalog.engines import capabilities
from launcher.errors import Problem
from launcher.recipe.schema import Cluster, RecipeSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """What a job runs on: an instance type, its GPUs, processes per node, how many instances, and
    the price of one instance per hour. Every estimate and prediction takes one."""

    instance_key: str
    instance: InstanceType
    accelerator_key: str
    accelerator: Accelerator
    procs_per_node: int
    instance_count: int = 1
    usd_per_hour: float = 0.0
    cpu_cores: int | None = None
    """The cores a CPU job's ranks share on each node (`cpu_cores_for`); None: this machine's."""

    @property
    def world_size(self) -> int:
        return self.procs_per_node * self.instance_count

    def __str__(self) -> str:
        if self.instance_key == "local":
            return f"{self.world_size} x {self.accelerator_key} on this machine"
        return f"{self.instance_count} x {self.instance_key} ({self.world_size} x {self.accelerator_key})"


def find_instance_type(key: str) -> tuple[InstanceType | None, Problem | None]:
    """The catalog's instance type `key`, or the problem (with a close match) if there is none."""
    instances = catalog.instance_types()
    if key not in instances:
        msg = f"'{key}' is not a known instance type{suggest(key, instances)}; use {choices(instances)}"
        return None, Problem("cluster.instance_type", msg)
    return instances[key], None


def cpu_cores_for(backend: str, instance: InstanceType, procs_per_node: int) -> int | None:
    """The cores a CPU job's ranks share on each node: one per rank where the engine allocates
    them so (Slurm), else the instance type's vCPUs, else None (`local`: this machine's, read
    when a step is predicted)."""
    if capabilities(backend).cpu_core_per_rank:
        return procs_per_node
    return instance.vcpus


def hardware_for(
    instance_key: str,
    *,
    accelerator_key: str | None = None,
    procs_per_node: int | None = None,
    instance_count: int = 1,
    usd_per_hour: float | None = None,
    backend: str = "local",
) -> Hardware:
    """The hardware of `instance_count` instances of a catalog instance type.

    An ml.* instance type fixes its GPUs and runs one process per GPU; `local` (this machine)
    takes the accelerator and the process count given. `usd_per_hour` (one instance) defaults to
    the catalog's price; `backend` says how many cores a CPU job gets (`cpu_cores_for`). Names
    must be in the catalogs (`find_instance_type` checks the first).
    """
    instance = catalog.instance_types()[instance_key]
    if instance.gpus_per_node:  # an ml.* GPU type; `local` and CPU types take what they are given
        accelerator_key, procs_per_node = instance.accelerator, instance.gpus_per_node
    assert accelerator_key is not None and procs_per_node is not None, "local hardware needs both"
    return Hardware(
        instance_key=instance_key,
        instance=instance,
        accelerator_key=accelerator_key,
        accelerator=catalog.accelerators()[accelerator_key],
        procs_per_node=procs_per_node,
        instance_count=instance_count,
        usd_per_hour=instance.usd_per_hour if usd_per_hour is None else usd_per_hour,
        cpu_cores=cpu_cores_for(backend, instance, procs_per_node) if accelerator_key == "cpu" else None,
    )


def resolve_hardware(spec: RecipeSpec) -> tuple[Hardware | None, list[Problem]]:
    """The recipe's hardware, and every way its cluster section contradicts itself or the catalogs."""
    cluster = spec.cluster
    key = cluster.instance_type
    instance, unknown = find_instance_type(key)
    if unknown is not None:
        return None, [unknown]
    if key == "local":
        accelerator_key, problems = _local_accelerator(cluster)
        if accelerator_key is None:
            return None, problems
    elif instance.accelerator == "cpu":
        # A CPU instance type: cluster.nproc_per_node gloo processes, no GPU to size.
        accelerator_key, problems = "cpu", []
        if cluster.device != "cpu":
            problems.append(Problem("cluster.device", f"{key} has no GPUs; use device: cpu"))
    else:
        accelerator_key, problems = instance.accelerator, _instance_problems(cluster, instance)
    problems += _backend_problems(cluster)
    hardware = hardware_for(
        key,
        accelerator_key=accelerator_key,
        procs_per_node=cluster.nproc_per_node or 1,
        instance_count=cluster.instance_count,
        usd_per_hour=cluster.usd_per_hour,
        backend=cluster.backend,
    )
    return hardware, problems


def _local_accelerator(cluster: Cluster) -> tuple[str | None, list[Problem]]:
    """This machine's accelerator: the CPU, or the GPU `cluster.accelerator` names (None if unusable)."""
    accelerators = catalog.accelerators()
    if capabilities(cluster.backend).provisions_instances:
        instances = catalog.instance_types()
        problems = [
            Problem(
                "cluster.instance_type",
                f"the {cluster.backend} backend needs an ml.* instance type; use {choices(k for k in instances if k != 'local')}",
            )
        ]
    else:
        problems = []
    if cluster.device == "cpu":
        if cluster.accelerator not in (None, "cpu"):
            problems.append(
                Problem(
                    "cluster.accelerator",
                    f"'{cluster.accelerator}' is a GPU but cluster.device is cpu; remove it or set device: cuda",
                )
            )
        return "cpu", problems
    gpus = [k for k in accelerators if k != "cpu"]
    if cluster.accelerator is None:
        problems.append(
            Problem(
                "cluster.accelerator",
                f"required for a local cuda machine so memory can be checked; use {choices(gpus)}",
            )
        )
        return None, problems
    if cluster.accelerator not in gpus:
        problems.append(
            Problem(
                "cluster.accelerator",
                f"'{cluster.accelerator}' is not a known GPU{suggest(cluster.accelerator, gpus)}; use {choices(gpus)}",
            )
        )
        return None, problems
    return cluster.accelerator, problems


def _instance_problems(cluster: Cluster, instance: InstanceType) -> list[Problem]:
    """An ml.* instance type fixes the device, the GPU model and the processes per node."""
    key, accelerator_key = cluster.instance_type, instance.accelerator
    problems = []
    if cluster.device == "cpu":
        problems.append(
            Problem(
                "cluster.device",
                f"{key} has {instance.gpus_per_node} GPUs; use device: cuda (cpu is for the local backend)",
            )
        )
    if cluster.accelerator not in (None, accelerator_key):
        problems.append(
            Problem(
                "cluster.accelerator",
                f"{key} has {accelerator_key} GPUs, not {cluster.accelerator}; remove the key",
            )
        )
    if cluster.nproc_per_node not in (None, instance.gpus_per_node):
        problems.append(
            Problem(
                "cluster.nproc_per_node",
                f"{key} has {instance.gpus_per_node} GPUs, one process each; use {instance.gpus_per_node} or remove the key",
            )
        )
    return problems


def _backend_problems(cluster: Cluster) -> list[Problem]:
    problems = []
    runs_here = capabilities(cluster.backend).runs_here
    if runs_here and cluster.instance_count != 1:
        problems.append(
            Problem(
                "cluster.instance_count",
                f"the {cluster.backend} backend runs on this one machine; use 1, not {cluster.instance_count}",
            )
        )
    if runs_here and cluster.instance_type != "local":
        problems.append(
            Problem(
                "cluster.instance_type",
                f"the {cluster.backend} backend runs on this machine; use instance_type: local, not {cluster.instance_type}",
            )
        )
    return problems
