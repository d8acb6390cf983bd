"""What each engine can do and the limits it sets, as data (engines.yaml, each with its source).

The recipe rules and the estimator sit below the backends and may not import them; they ask
`capabilities(cluster.backend)` instead of comparing names, and `launcher.backends.base` gives
each backend class the same entry, so one fact about an engine lives in one place.
"""

from __future__ import annotations

from functools import cache

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt

from launcher.catalog.packaged_yaml import load_packaged

DEFAULT_STOP_GRACE_S = 120
"""A job's seconds from SIGTERM to SIGKILL where neither its engine nor a prediction says more:
SageMaker's, for which the entrypoints' final-save budget was first set."""
STOP_EXIT_S = 20
"""Of the grace, what torchrun and entrypoints/bootstrap.py keep to exit after the workers have:
torchrun's --shutdown-timeout and the trainer's save budget are the grace less this."""


class Capabilities(BaseModel):
    """One engine's entry. The defaults describe an engine that can do little: each entry says
    what its engine adds."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    title: str
    """How messages name the engine ("SageMaker")."""
    multi_node: bool = False
    efa: bool = False
    """Can attach EFA devices, so a multi-node job on an EFA instance gets its bandwidth."""
    s3_data: bool = False
    cpu: bool = True
    cpu_core_per_rank: bool = False
    """A CPU job's allocation gives each rank one core (Slurm's --cpus-per-task), which the
    host-CPU step model then shares out (launcher.plan.host_cpu)."""
    pipeline_parallel: bool = True
    submits: bool = True
    """False for render-only targets (the accelerate config)."""
    time_limit: bool = False
    """The engine stops a job at spec.max_run_s (SageMaker's MaxRuntimeInSeconds)."""
    max_run_s: PositiveInt | None = None
    """The longest cluster.max_run the engine accepts; None: no limit of its own."""
    reads_local_paths: bool = True
    """The job can read a path of the machine that submits it (data.source, prepared raw text)."""
    provisions_instances: bool = False
    """The engine starts machines of a catalog instance type, so `instance_type: local` names none."""
    runs_here: bool = False
    """The job runs on this one machine as it is: one node, `instance_type: local`."""
    uploads_checkpoints: bool = False
    """The engine copies the checkpoint directory to S3 as the job writes it."""
    restores_whole_checkpoint_prefix: bool = False
    """At each start the engine copies every checkpoint it holds to every host, not a host's own files."""
    per_host_checkpoints_above_gb: PositiveFloat | None = None
    """Past this copy per host at each start, each host copies its own files instead; None: never."""

    def per_host_checkpoints(self, checkpoint_bytes: int, keep: int, choice: str = "by_size") -> bool:
        """Whether a job whose checkpoints are this big copies each host's own files to S3 and
        back itself, rather than the engine copying all `keep` of them to every host. `choice`
        is the recipe's sagemaker.checkpoint_copy."""
        limit = self.per_host_checkpoints_above_gb
        if not self.restores_whole_checkpoint_prefix or choice == "checkpoint_config":
            return False
        return choice == "per_host" or (limit is not None and checkpoint_bytes * keep > limit * 1e9)

    stop_grace_s: PositiveFloat | None = None
    """Seconds between the engine's SIGTERM and its SIGKILL, when it sets them; None: not known."""
    job_sets_stop_grace: bool = False
    """The job chooses that time itself (docker --stop-timeout, terminationGracePeriodSeconds,
    Slurm's --signal lead): cluster.stop_grace, by default from the predicted step and save."""

    def stop_grace(self, chosen: int | None) -> int:
        """The job's seconds from SIGTERM to SIGKILL: `chosen` (cluster.stop_grace) where the job
        sets them, else the engine's own, else DEFAULT_STOP_GRACE_S."""
        if self.job_sets_stop_grace and chosen:
            return int(chosen)
        return int(self.stop_grace_s or DEFAULT_STOP_GRACE_S)

    def says_stop_grace(self) -> bool:
        """Whether a job here has a known grace: the engine's own, or one the job sets."""
        return self.job_sets_stop_grace or self.stop_grace_s is not None

    runs_as_role: bool = False
    """The job runs as an IAM execution role of the caller's account (sagemaker.role_arn)."""
    exports_checkpoints: bool = False
    """The job's checkpoints and code bundle stay in its directory here, for `launcher export`."""


@cache
def engines() -> dict[str, Capabilities]:
    data = load_packaged(__package__, "engines.yaml")
    return {name: Capabilities(**entry) for name, entry in data.items()}


def capabilities(backend: str) -> Capabilities:
    """The entry of `backend`, a name the recipe schema has already checked."""
    return engines()[backend]
