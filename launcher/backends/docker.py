"""The docker backend: the training image on this machine, as a detached, labelled container.

The command is an argv list; `--dry-run` prints it quoted with shlex. Mounts use `--mount`
with CSV quoting, so paths holding commas, colons or quotes bind exactly what they name. The
launcher calls plain `docker`; any engine with Docker's CLI works (podman through podman-docker
is tested: tests/engines/test_docker_real.py).

Inside the container entrypoints/bootstrap.py runs torchrun, as on SageMaker: it checks the
image's torch, installs the job's pinned wheels (torchao for FP8) offline from the wheelhouse
bound at /opt/launcher/wheels, passes `docker stop`'s SIGTERM on to the workers (they save a
last checkpoint and the container exits 143) and writes the first failing rank's error to the
output directory, where `status` reads it.

The bootstrap is the container's PID 1 (`--entrypoint python3`), not the image's entrypoint.
The PyTorch DLC's is `bash -m start_with_right_hostname.sh` (aws/deep-learning-containers,
docker/pytorch/Dockerfile.cuda, the sagemaker stage), and that script ends in `eval "$@"`
without exec (scripts/pytorch/start_with_right_hostname.sh): bash stays PID 1, and the kernel
delivers to PID 1 only the signals it handles, which bash does not for SIGTERM while it waits
for a command. `docker stop` would then SIGKILL the job after its grace without a final save.
The script's other work (telemetry, CUDA compat libraries on old drivers, the hostname preload
for SageMaker's `train`) the job does not need: the bootstrap names the rendezvous itself.

`--stop-timeout` is the job's stop grace (`JobSpec.stop_grace_s`: the predicted step plus one
save, with margin), so a `docker stop` without `--time` waits that long, and `launcher stop`
never waits less.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import io
import json
import shlex
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

from launcher.backends.base import Backend, EngineUnavailable, JobRef, JobStatus, Rendering, utc_now
from launcher.backends.history import MetricsHistory
from launcher.backends.images import EcrRegistry, ecr_registry, training_image
from launcher.backends.staging import staging_dir
from launcher.backends.tail import last_metrics
from launcher.backends.tools import ToolFailed, run_tool, stream_tool
from launcher.backends.wheelhouse import bootstrap_environment, fill, job_wheels
from launcher.bundle import Bundle
from launcher.contract.metrics import METRICS_FILE
from launcher.errors import LauncherError, UsageError
from launcher.registry import checkpoint_home, job_dir, launcher_home, write_json
from launcher.spec import JobSpec, Mount, Placement

ROOT = "/opt/launcher"
DATA_DIR = f"{ROOT}/data/train"
LABEL = "launcher.job"
# entrypoints/bootstrap.py reads the job's hosts from this file (one host: a standalone
# rendezvous) and writes the failure file where these variables say (its ENV_* names).
HOSTS_FILE = f"{ROOT}/config/resourceconfig.json"
FAILURE_FILE = f"{ROOT}/output/failure"
BOOTSTRAP_ENV = (("LAUNCHER_RESOURCE_CONFIG", HOSTS_FILE), ("LAUNCHER_FAILURE_FILE", FAILURE_FILE))
WHEELS_DIR = f"{ROOT}/wheels"
"""Where the job's pinned wheels are bound (read-only) for the bootstrap's offline install."""
# NVIDIA's recommended limits for PyTorch GPU containers: pinned memory without a cap, and the
# deep stacks of compiled graphs. GPU jobs only: pinned memory is a CUDA matter, and an engine
# that may not raise its own hard limits (no CAP_SYS_RESOURCE, as in unprivileged or nested
# containers) refuses every --ulimit, which would stop a CPU job that needs none of them.
ULIMITS = ("memlock=-1", "stack=67108864", "nofile=1048576:1048576")
# A DLC is 5-20 GB: pulling one takes minutes, not the seconds other docker calls get.
PULL_TIMEOUT_S = 3600
# Seconds a follow may take to print its last lines after the container ended.
FLUSH_S = 10
# `docker stop` exits 143 (SIGTERM, entrypoints/bootstrap.py's answer) or 137 (SIGKILL after the grace period).
STOP_EXIT_CODES = (137, 143)


def mount_option(mount: Mount) -> str:
    """`--mount` takes CSV: quote fields so any path survives intact."""
    fields = ["type=bind", f"source={mount.source}", f"target={mount.target}"]
    if mount.read_only:
        fields.append("readonly")
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow(fields)
    return out.getvalue()


def wheels_mount(spec: JobSpec) -> Mount:
    """The job's wheelhouse, filled at submit (wheelhouse.fill), bound where the bootstrap reads it."""
    return Mount(source=str(job_dir(spec.name) / "wheels"), target=WHEELS_DIR, read_only=True)


def docker_run_argv(spec: JobSpec) -> list[str]:
    argv = ["docker", "run", "--detach", "--name", spec.name, "--label", f"{LABEL}={spec.name}"]
    argv += ["--label", f"launcher.recipe={spec.recipe_name}"]
    argv += ["--stop-timeout", str(spec.stop_grace_s)]
    if spec.resources.device == "cuda":
        argv += ["--gpus", "all"]
        for limit in ULIMITS:
            argv += ["--ulimit", limit]
    # The host's IPC namespace, so /dev/shm (NCCL, gloo and DataLoader workers) is the host's and
    # as large. No --shm-size beside it: that sizes a private /dev/shm, which host IPC has none
    # of; Docker ignores it there and podman refuses the pair.
    argv.append("--ipc=host")
    mounts = list(spec.mounts) + [
        Mount(source=data.staged_at or data.source, target=data.container_path, read_only=True) for data in spec.inputs
    ]
    wheels = job_wheels(spec.resolved)
    environment = [*spec.environment, *BOOTSTRAP_ENV]
    if wheels:
        mounts.append(wheels_mount(spec))
        environment += list(bootstrap_environment(wheels, WHEELS_DIR).items())
    for mount in mounts:
        argv += ["--mount", mount_option(mount)]
    argv += ["--workdir", f"{ROOT}/code"]
    for key, value in environment:
        argv += ["--env", f"{key}={value}"]
    # The image's Python as PID 1, not its entrypoint script (see the module's doc).
    program, *arguments = spec.command
    argv += ["--entrypoint", program, spec.image, *arguments]
    return argv


class DockerBackend(Backend):
    name = "docker"

    def placement(self, recipe, name: str, lineage: str | None = None) -> Placement:
        directory = job_dir(name)
        checkpoints = str(checkpoint_home(recipe, lineage or name))
        staged = recipe.data.source.startswith("s3://")
        return Placement(
            checkpoint_dir=f"{ROOT}/checkpoints",
            output_dir=f"{ROOT}/output",
            image=training_image(recipe),
            bootstrap=True,
            max_restarts=1,  # nothing reruns a failed container: torchrun restarts its workers once
            s3_data_dir=DATA_DIR if staged else None,
            s3_staging_dir=str(staging_dir(recipe.data.source, launcher_home())) if staged else None,
            mounts=(
                Mount(source=str(directory / "code"), target=f"{ROOT}/code", read_only=True),
                Mount(source=str(directory / "config"), target=f"{ROOT}/config", read_only=True),
                Mount(source=checkpoints, target=f"{ROOT}/checkpoints"),
                Mount(source=str(directory / "output"), target=f"{ROOT}/output"),
            ),
        )

    def _render(self, spec: JobSpec) -> Rendering:
        bundle = Bundle.of(spec)
        argv = docker_run_argv(spec)
        data = {"command": argv, "image": spec.image, "job_dir": str(job_dir(spec.name)), "bundle": bundle.describe()}
        login = ecr_registry(spec.image)
        if login is not None:
            data["registry_login"] = login.login_command()
        return Rendering(spec=spec, data=data, text=shlex.join(argv) + "\n", payload={"bundle": bundle, "argv": argv})

    def submit(self, rendering: Rendering) -> JobRef:
        engine_version()  # before the base class stages s3:// data: no download for a job that cannot start
        return super().submit(rendering)

    def _submit(self, rendering: Rendering) -> JobRef:
        spec = rendering.spec
        if container_exists(spec.name):
            raise UsageError(
                f"a container named {spec.name} already exists; remove it (docker rm {spec.name}) or submit again"
            )
        ensure_image(spec.image)
        directory = job_dir(spec.name)
        wheels = job_wheels(spec.resolved)
        if wheels:  # fetched once into the cache (or refused in one line) before anything is created
            fill(wheels, Path(wheels_mount(spec).source))
        rendering.payload["bundle"].extract(directory / "code")
        write_json(directory / "config" / "resourceconfig.json", {"current_host": spec.name, "hosts": [spec.name]})
        for mount in spec.mounts:
            if not mount.read_only:
                Path(mount.source).mkdir(parents=True, exist_ok=True)
        try:
            _docker(rendering.payload["argv"][1:], action=f"starting {spec.name}")
        except LauncherError:
            # A run that fails after creating the container (a refused option, a runtime error)
            # leaves it behind under the job's name; nothing else will ever use that name.
            with contextlib.suppress(LauncherError):  # the run's own error is the one to report
                if container_exists(spec.name):
                    run_tool(["docker", "rm", "--force", spec.name], action=f"removing {spec.name}")
            raise
        return JobRef(name=spec.name, backend=self.name, native_id=spec.name, created=utc_now())

    def _status(self, ref: JobRef) -> JobStatus:
        return container_statuses([ref.name], action=f"reading the status of {ref.name}")[0]

    def _logs(self, ref: JobRef, *, follow: bool, poll_s: float) -> Iterator[str]:
        self._status(ref)  # one line when there is no such container, not the engine's error as a log line
        if follow:
            return follow_logs(ref.name, poll_s=poll_s)
        return stream_tool(["docker", "logs", ref.name], action=f"reading the logs of {ref.name}")

    def _metrics(self, ref: JobRef) -> MetricsHistory:
        # The job's output directory is mounted from here for jobs submitted from this machine.
        return self._file_or_log_metrics(ref, job_dir(ref.name) / "output" / METRICS_FILE)

    def _stop(self, ref: JobRef, *, grace_s: float) -> JobStatus:
        _check_owns(ref.name)
        # docker stop sends SIGTERM and, after the grace period, SIGKILL: never less than the
        # job's own grace (its --stop-timeout), which the final save was sized for.
        spec = self.saved_spec(ref.name)
        grace = max(int(grace_s), spec.stop_grace_s if spec is not None else 0)
        _docker(["stop", "--time", str(grace), ref.name], action=f"stopping {ref.name}", timeout=grace + 60)
        return self._status(ref)

    def _list(self, *, region: str | None, limit: int) -> list[JobStatus]:
        out = _docker(
            ["ps", "--all", "--filter", f"label={LABEL}", "--format", "{{.Names}}"], action="listing containers"
        )
        names = out.split()[:limit]
        return container_statuses(names, action="listing containers") if names else []


# --- status ----------------------------------------------------------------------------------


def container_statuses(names: list[str], *, action: str) -> list[JobStatus]:
    """The job status of each named container, from one `docker inspect`."""
    out = _docker(["inspect", "--format", "{{json .State}}", *names], action=action)
    states = [json.loads(line) for line in out.splitlines() if line.strip()]
    return [_status_from_state(name, state) for name, state in zip(names, states, strict=True)]


def _status_from_state(name: str, state: dict) -> JobStatus:
    status = state.get("Status")
    code = state.get("ExitCode")
    if status in ("created", "configured", "initialized", "running", "restarting", "paused", "stopping"):
        job_state, reason = "InProgress", None
    elif code == 0:
        job_state, reason = "Completed", None
    elif code in STOP_EXIT_CODES:
        job_state, reason = "Stopped", None
    else:
        job_state = "Failed"
        reason = _failure_file(name) or state.get("Error") or f"the container exited with code {code}"
    return JobStatus(
        name=name,
        backend="docker",
        state=job_state,
        secondary=status,
        failure_reason=reason,
        exit_code=None if job_state == "InProgress" else code,
        created=state.get("StartedAt"),
        ended=None if job_state == "InProgress" else state.get("FinishedAt"),
        metrics=last_metrics(job_dir(name) / "output" / METRICS_FILE),
    )


def _failure_file(name: str) -> str | None:
    """What entrypoints/bootstrap.py wrote about the first failing rank (jobs submitted from here)."""
    path = job_dir(name) / "output" / "failure"
    return path.read_text(errors="replace").strip() or None if path.is_file() else None


def follow_logs(name: str, *, poll_s: float) -> Iterator[str]:
    """`docker logs --follow NAME`, which ends when the container does, and is ended if it does not.

    Docker's follow returns at the container's exit. podman's waits for the exit to be recorded,
    which its cleanup process can miss (seen with podman 4.3) until another command asks for the
    container's state. So a watcher asks every `poll_s` seconds; once the container has ended,
    the follow gets FLUSH_S seconds to print the last lines and return by itself.
    """
    process = subprocess.Popen(
        ["docker", "logs", "--follow", name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            try:
                ended = container_statuses([name], action=f"following {name}")[0].terminal
            except LauncherError:
                ended = True  # removed meanwhile
            if ended:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=FLUSH_S)
                process.terminate()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            yield line.rstrip("\n")
    finally:
        done.set()
        if process.poll() is None:  # the reader stopped early (Ctrl-C, a closed pipe)
            process.kill()
        process.wait()


# --- the engine and the image -----------------------------------------------------------------


def engine_version() -> str:
    """The engine's version, or EngineUnavailable saying why none answers (submit adds that
    --dry-run prints the command; other verbs need the engine itself)."""
    return _docker(["version", "--format", "{{.Server.Version}}"], action="asking the Docker engine", timeout=15)


def _check_owns(name: str) -> None:
    """Refuse to signal a container that launcher did not start for this job: ours carry the label
    `launcher.job=<name>` (docker_run_argv), whatever else happens to share the name does not."""
    said = _docker(["inspect", "--format", "{{json .Config.Labels}}", name], action=f"stopping {name}")
    try:
        labels = json.loads(said or "null")
    except ValueError:
        labels = None
    owner = labels.get(LABEL) if isinstance(labels, dict) else None
    if owner != name:
        raise LauncherError(
            f"not stopping {name}: container {name} was not started by launcher for this job "
            f"(its {LABEL} label is {owner!r}); nothing was signalled"
        )


def container_exists(name: str) -> bool:
    """Whether a container (running or not) already has this name; job names hold no regex characters."""
    out = _docker(["ps", "--all", "--filter", f"name=^{name}$", "--format", "{{.Names}}"], action=f"looking for {name}")
    return name in out.split()


def ensure_image(image: str) -> None:
    """Make `image` present on this machine: as it is, or pulled (after an ECR login for ECR images)."""
    try:
        _docker(["image", "inspect", "--format", "{{.Id}}", image], action=f"looking for {image}")
        return
    except (UsageError, ToolFailed):
        pass
    registry = ecr_registry(image)
    if registry is not None:
        ecr_login(registry)
    try:
        _docker(["pull", image], action=f"pulling {image}", timeout=PULL_TIMEOUT_S)
    except ToolFailed as failure:
        advice = (
            f"log in with `{registry.login_command()}` if that failed"
            if registry
            else "build or pull it, or set cluster.image to an image this machine has (docker images)"
        )
        raise UsageError(
            f"cluster.image: {image} is not on this machine and pulling it failed ({failure.output}); {advice}"
        ) from None


def ecr_login(registry: EcrRegistry) -> None:
    """`docker login` to a private ECR registry with a token from ecr:GetAuthorizationToken."""
    from launcher.backends.sagemaker import aws

    action = f"logging in to {registry.host}"
    yourself = f"log in yourself: `{registry.login_command()}`"
    try:
        reply = aws.client("ecr", registry.region).get_authorization_token(registryIds=[registry.account])
    except Exception as error:  # botocore's errors: no credentials, denied, unreachable
        raise UsageError(f"{aws.explain(error, action=action, region=registry.region)}; or {yourself}") from None
    token = reply["authorizationData"][0]["authorizationToken"]
    user, _, password = base64.b64decode(token).decode().partition(":")
    try:
        login = ["docker", "login", "--username", user, "--password-stdin", registry.host]
        run_tool(login, action=action, input=password)
    except ToolFailed as failure:
        raise UsageError(f"{action}: docker login failed ({failure.output}); {yourself}") from None


# Phrases of Docker's and podman's CLIs, lowercased.
_NO_ENGINE = (
    "cannot connect to the docker daemon",
    "is the docker daemon running",
    "cannot connect to podman",
    "unable to connect to podman",
)
_NO_SUCH = ("no such object", "no such container", "no container with name or id", "no such image", "image not known")


def _docker(args: list[str], *, action: str, timeout: float = 120) -> str:
    """stdout of `docker ARGS`; one line when the engine is missing, down, or has no such object."""
    if shutil.which("docker") is None:
        raise EngineUnavailable(
            f"{action}: `docker` is not installed here; install Docker (or podman with its docker command)"
        )
    try:
        return run_tool(["docker", *args], action=action, timeout=timeout).strip()
    except ToolFailed as failure:
        said = failure.output.lower()
        if any(phrase in said for phrase in _NO_ENGINE):
            raise EngineUnavailable(
                f"{action}: no container engine answers ({failure.output}); start Docker (or podman), then run this again"
            ) from None
        if any(phrase in said for phrase in _NO_SUCH):
            if args[0] in ("image", "pull"):
                raise UsageError(f"{action}: no image named {args[-1]} here (docker images lists them)") from None
            raise UsageError(f"{action}: no container named {args[-1]} here (docker ps --all lists them)") from None
        raise ToolFailed(f"{action}: docker failed: {last_error(failure.output)}", last_error(failure.output)) from None


def last_error(output: str, limit: int = 300) -> str:
    """The engine's final error out of its output (a pull retries and warns several times first)."""
    start = output.rfind("Error")
    text = output[start:] if start >= 0 else output
    return text if len(text) <= limit else text[: limit - 3] + "..."
