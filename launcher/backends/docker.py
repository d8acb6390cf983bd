"""The docker backend: the training image on this machine, as a detached, labelled container.

The command is an argv list; `--dry-run` prints it quoted with shlex. Mounts use `--mount`
with CSV quoting, so paths holding commas, colons or quotes bind exactly what they name.
"""

from __future__ import annotations

import csv
import io
import json
import shlex
from collections.abc import Iterator
from pathlib import Path

from launcher.backends.base import Backend, Capabilities, EngineUnavailable, JobRef, JobStatus, Rendering, utc_now
from launcher.backends.images import training_image
from launcher.backends.tools import ToolFailed, run_tool, stream_tool
from launcher.bundle import Bundle
from launcher.errors import UsageError
from launcher.registry import checkpoint_home, job_dir
from launcher.spec import JobSpec, Mount, Placement

ROOT = "/opt/launcher"
LABEL = "launcher.job"
SHM_SIZE = "64g"
# NVIDIA's recommended limits for PyTorch containers: pinned memory without a cap, and the
# deep stacks of compiled graphs.
ULIMITS = ("memlock=-1", "stack=67108864", "nofile=1048576:1048576")


def mount_option(mount: Mount) -> str:
    """`--mount` takes CSV: quote fields so any path survives intact."""
    fields = ["type=bind", f"source={mount.source}", f"target={mount.target}"]
    if mount.read_only:
        fields.append("readonly")
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow(fields)
    return out.getvalue()


def docker_run_argv(spec: JobSpec) -> list[str]:
    argv = ["docker", "run", "--detach", "--name", spec.name, "--label", f"{LABEL}={spec.name}"]
    argv += ["--label", f"launcher.recipe={spec.recipe_name}"]
    if spec.resources.device == "cuda":
        argv += ["--gpus", "all"]
    argv += ["--ipc=host", f"--shm-size={SHM_SIZE}"]
    for limit in ULIMITS:
        argv += ["--ulimit", limit]
    mounts = list(spec.mounts) + [
        Mount(source=data.source, target=data.container_path, read_only=True) for data in spec.inputs
    ]
    for mount in mounts:
        argv += ["--mount", mount_option(mount)]
    argv += ["--workdir", f"{ROOT}/code"]
    for key, value in spec.environment:
        argv += ["--env", f"{key}={value}"]
    argv.append(spec.image)
    argv += spec.command
    return argv


class DockerBackend(Backend):
    name = "docker"
    capabilities = Capabilities()

    def placement(self, recipe, name: str, lineage: str | None = None) -> Placement:
        directory = job_dir(name)
        checkpoints = str(checkpoint_home(recipe, lineage or name))
        return Placement(
            checkpoint_dir=f"{ROOT}/checkpoints",
            output_dir=f"{ROOT}/output",
            image=training_image(recipe),
            mounts=(
                Mount(source=str(directory / "code"), target=f"{ROOT}/code", read_only=True),
                Mount(source=checkpoints, target=f"{ROOT}/checkpoints"),
                Mount(source=str(directory / "output"), target=f"{ROOT}/output"),
            ),
        )

    def _render(self, spec: JobSpec) -> Rendering:
        bundle = Bundle.build(spec.resolved_json)
        argv = docker_run_argv(spec)
        data = {"command": argv, "job_dir": str(job_dir(spec.name)), "bundle": bundle.describe()}
        return Rendering(spec=spec, data=data, text=shlex.join(argv) + "\n", payload={"bundle": bundle, "argv": argv})

    def _submit(self, rendering: Rendering) -> JobRef:
        engine_version()
        spec = rendering.spec
        directory = job_dir(spec.name)
        rendering.payload["bundle"].extract(directory / "code")
        for mount in spec.mounts:
            if not mount.read_only:
                Path(mount.source).mkdir(parents=True, exist_ok=True)
        _docker(rendering.payload["argv"][1:], action=f"starting {spec.name}")
        return JobRef(name=spec.name, backend=self.name, native_id=spec.name, created=utc_now())

    def _status(self, ref: JobRef) -> JobStatus:
        out = _docker(["inspect", "--format", "{{json .State}}", ref.name], action=f"inspecting {ref.name}")
        state = json.loads(out)
        return _status_from_state(ref.name, state)

    def _logs(self, ref: JobRef, *, follow: bool, poll_s: float) -> Iterator[str]:
        # `docker logs --follow` returns when the container exits, so following ends with the job.
        argv = ["docker", "logs", *(["--follow"] if follow else []), ref.name]
        return stream_tool(argv, action=f"reading the logs of {ref.name}")

    def _stop(self, ref: JobRef, *, grace_s: float) -> JobStatus:
        # docker stop sends SIGTERM and, after the grace period, SIGKILL.
        _docker(["stop", "--time", str(int(grace_s)), ref.name], action=f"stopping {ref.name}")
        return self._status(ref)

    def _list(self, *, region: str | None, limit: int) -> list[JobStatus]:
        out = _docker(
            ["ps", "--all", "--filter", f"label={LABEL}", "--format", "{{.Names}}"], action="listing containers"
        )
        return [self._status(JobRef(name=name, backend=self.name)) for name in out.split()[:limit]]


def _status_from_state(name: str, state: dict) -> JobStatus:
    status = state.get("Status")
    code = state.get("ExitCode")
    if status in ("created", "running", "restarting", "paused"):
        job_state, reason = "InProgress", None
    elif code == 0:
        job_state, reason = "Completed", None
    elif code in (137, 143):  # SIGKILL / SIGTERM: docker stop
        job_state, reason = "Stopped", None
    else:
        job_state, reason = "Failed", state.get("Error") or f"the container exited with code {code}"
    return JobStatus(
        name=name,
        backend="docker",
        state=job_state,
        secondary=status,
        failure_reason=reason,
        exit_code=None if job_state == "InProgress" else code,
        created=state.get("StartedAt"),
        ended=None if job_state == "InProgress" else state.get("FinishedAt"),
    )


def engine_version() -> str:
    """The Docker engine's version, or EngineUnavailable saying why none answers."""
    return _docker(["version", "--format", "{{.Server.Version}}"], action="asking the Docker engine", timeout=15)


def _docker(args: list[str], *, action: str, timeout: float = 120) -> str:
    try:
        return run_tool(["docker", *args], action=action, timeout=timeout).strip()
    except ToolFailed as failure:
        if "Cannot connect to the Docker daemon" in failure.output or "docker daemon" in failure.output.lower():
            raise EngineUnavailable(
                f"{action}: no Docker engine answers ({failure.output}); start Docker, or use --dry-run to print the command"
            ) from None
        if "No such object" in failure.output or "No such container" in failure.output:
            raise UsageError(f"{action}: no container named {args[-1]}") from None
        raise
