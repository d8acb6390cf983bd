"""The Slurm backend: an sbatch script that runs torchrun on every node through srun.

One srun task per node starts torchrun; torchrun's c10d rendezvous on the first node of the
allocation assigns ranks. The job's files live on a file system every node mounts
(`slurm.shared_dir`, default $LAUNCHER_HOME): `<shared>/jobs/<name>/` holds the code bundle,
the script, the log and the exit code; checkpoints go to `<shared>/checkpoints/<recipe>/<lineage>`
and staged s3:// data to `<shared>/data/<digest>`.

What the script does, in order (docs/slurm.md tells it for users):
1. checks that every node sees the job's code under the shared directory (one line naming the
   directory if not);
2. runs torchrun through srun in the background and waits, so that signals reach its traps
   at once;
3. on USR1, which Slurm sends `slurm.signal_before_end` before the time limit, it sends SIGTERM
   to the training step: the workers save a checkpoint and exit; then, with `slurm.requeue`,
   it requeues the job, which resumes from that checkpoint;
4. after `launcher stop`, which first sends SIGTERM to the training step only and waits up to the
   job's stop grace, it cancels the job itself once training has saved and ended (never
   requeueing it); `stop` cancels a job still running after that grace with a plain scancel;
5. writes its exit code to `<job dir>/exit_code`, because many small clusters keep no
   accounting database: `status` asks `scontrol show job` first and falls back to that file.

Each node's task runs `python3 entrypoints/bootstrap.py --exec torchrun ...`: the bootstrap
checks the image's torch and installs the job's pinned wheels (torchao for FP8) offline from
`<shared>/wheelhouse/<key>/`, which submit fills, into a directory of its own, then execs
torchrun, which keeps the c10d rendezvous and gets Slurm's signals as before. USR1 comes at least
the job's stop grace (`JobSpec.stop_grace_s`, the predicted step plus one save) before the time
limit, and torchrun's --shutdown-timeout is that grace less its exit, so the save after USR1
lands before Slurm's own SIGTERM and SIGKILL at the limit.

The script is built line by line with every value quoted by shlex, and nothing from a recipe
reaches it except checked names and paths: the recipe travels in resolved.json inside the bundle.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.backends.base import (
    TERMINAL_STATES,
    Backend,
    JobRef,
    JobStatus,
    Rendering,
    utc_now,
)
from launcher.backends.history import MetricsHistory
from launcher.backends.staging import staging_dir
from launcher.backends.tail import file_tail, follow_file, last_metrics, log_summary
from launcher.backends.tools import ToolFailed, run_tool
from launcher.backends.wheelhouse import bootstrap_environment, fill, job_wheels, wheelhouse_key
from launcher.bundle import Bundle
from launcher.contract.metrics import METRICS_FILE
from launcher.display.text import shown
from launcher.errors import LauncherError, UsageError
from launcher.registry import checkpoint_home, job_dir, launcher_home, records
from launcher.spec import CONFIG_FILE, RDZV_PORT, EngineSettings, JobSpec, Placement

if TYPE_CHECKING:
    from launcher.recipe import Recipe

SCRIPT = "job.sbatch"
CODE_DIR = "code"
EXIT_FILE = "exit_code"
"""Written by the script's EXIT trap: the batch script's exit status (not after a requeue)."""
STOP_FILE = "stop_requested"
"""Written by `launcher stop` before scancel, so a cancelled job reads as Stopped, not Failed."""
MAX_SIGNAL_S = 65535  # sbatch --signal's @time is 16 bits
IMAGES_DIR = "images"
"""<shared>/images/: slurm.container_image imported once, as squashfs files (`image_file`)."""

# `scontrol show job` JobState values of a job that is not over yet (a requeued job goes
# REQUEUED -> PENDING -> RUNNING under the same id).
ACTIVE = {
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
    "RESIZING", "SUSPENDED", "STOPPED", "STAGE_OUT", "SIGNALING", "SPECIAL_EXIT", "RESV_DEL_HOLD",
}  # fmt: skip
UNKNOWN_JOB = "Invalid job id specified"


@dataclass(frozen=True, kw_only=True)
class SlurmSettings(EngineSettings):
    """What only the Slurm backend reads (the recipe's slurm: section). The defaults are the
    section's own, so a spec saved before it had this part reads as the recipe's defaults."""

    partition: str | None = None
    account: str | None = None
    shared_dir: str | None = None
    container_image: str | None = None
    venv: str | None = None
    signal_before_end_s: int = 600
    requeue: bool = True
    gpu_request: str = "gpus-per-node"
    """slurm.gpu_request: how a GPU job asks for its GPUs (`GPU_REQUESTS`)."""

    @classmethod
    def of(cls, recipe: Recipe) -> SlurmSettings:
        settings = recipe.slurm.model_dump()
        settings["signal_before_end_s"] = settings.pop("signal_before_end")
        return cls(**settings)


def slurm_settings(spec: JobSpec) -> SlurmSettings:
    """The spec's Slurm part; a spec built for another backend has none."""
    if not isinstance(spec.engine, SlurmSettings):
        raise UsageError(f"{spec.name} is a {spec.backend} spec with no Slurm settings; build it with backend='slurm'")
    return spec.engine


def shared_root(settings: SlurmSettings | None) -> Path:
    """The directory every node mounts: slurm.shared_dir, else $LAUNCHER_HOME."""
    return Path(settings.shared_dir) if settings and settings.shared_dir else launcher_home()


def slurm_job_dir(settings: SlurmSettings | None, name: str) -> Path:
    return shared_root(settings) / "jobs" / name


# --- the script --------------------------------------------------------------------------------


def time_limit(seconds: int) -> str:
    """sbatch --time as D-HH:MM:SS."""
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    return f"{days}-{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"


# slurm.gpu_request -> the directives that ask for N GPUs per node (sbatch man page,
# SchedMD/slurm doc/man/man1/sbatch.1):
# - --gpus-per-node=N: "the number of GPUs required for the job on each node"; Slurm counts GPUs
#   as GRES, so a cluster without gres.conf answers "Invalid generic resource (gres)
#   specification" (ESLURM_INVALID_GRES, src/common/slurm_errno.c);
# - --gres=gpu:N: "generic consumable resources requested per node", "name[[:type]:count]";
#   "mutually exclusive with --gpus-per-node";
# - none: --exclusive alone, as AWS's distributed-training samples do: the job "is allocated all
#   CPUs and GRES on all nodes in the allocation", and on a cluster without GRES the GPUs come
#   with the node.
GPU_REQUESTS = {
    "gpus-per-node": lambda n: [f"--gpus-per-node={n}"],
    "gres": lambda n: [f"--gres=gpu:{n}"],
    "none": lambda n: [],
}


def gpu_directives(request: str, gpus_per_node: int) -> list[str]:
    """Whole nodes for a GPU job: --exclusive, --mem=0 and slurm.gpu_request's GPU directive.
    sbatch man page, --exclusive: the job "is only allocated as much memory as it requested ...
    To request all the memory on a node, use --mem=0"; --mem: "A memory size specification of
    zero is treated as a special case and grants the job access to all of the memory on each node"."""
    if request not in GPU_REQUESTS:  # a saved spec read back from disk is untrusted
        raise UsageError(f"slurm.gpu_request: {request!r} is not one of {', '.join(GPU_REQUESTS)}")
    return ["--exclusive", "--mem=0", *GPU_REQUESTS[request](gpus_per_node)]


def directives(spec: JobSpec) -> list[str]:
    r, settings = spec.resources, slurm_settings(spec)
    lines = [
        f"--job-name={spec.name}",
        f"--nodes={r.instance_count}",
        "--ntasks-per-node=1",
    ]
    if r.device == "cuda":
        lines += gpu_directives(settings.gpu_request, r.procs_per_node)
    else:
        # A CPU job shares its nodes: ask for one core per torchrun worker.
        lines.append(f"--cpus-per-task={r.procs_per_node}")
    lines.append(f"--time={time_limit(spec.max_run_s)}")
    if settings.partition:
        lines.append(f"--partition={settings.partition}")
    if settings.account:
        lines.append(f"--account={settings.account}")
    lines += [
        f"--signal=B:USR1@{signal_lead_s(spec)}",
        "--requeue" if settings.requeue else "--no-requeue",
        "--open-mode=append",  # a requeued run appends to the same log
    ]
    return [f"#SBATCH {line}" for line in lines]


def signal_lead_s(spec: JobSpec) -> int:
    """USR1's lead before the time limit (sbatch --signal=B:USR1@<lead>): slurm.signal_before_end,
    and never less than the job's stop grace, which the step in progress and the save need."""
    return min(max(slurm_settings(spec).signal_before_end_s, spec.stop_grace_s), MAX_SIGNAL_S)


def wheelhouse_dir(spec: JobSpec) -> Path:
    """The job's wheels on the shared file system, by content: jobs with the same pins share it."""
    return shared_root(slurm_settings(spec)) / "wheelhouse" / wheelhouse_key(job_wheels(spec.resolved))


def wheel_exports(spec: JobSpec) -> list[str]:
    """What entrypoints/bootstrap.py reads to install the job's wheels offline (none: nothing)."""
    wheels = job_wheels(spec.resolved)
    if not wheels:
        return []
    values = bootstrap_environment(wheels, str(wheelhouse_dir(spec)))
    return [
        "# The job's pinned wheels, installed offline on every node by entrypoints/bootstrap.py.",
        *(f"export {key}={shlex.quote(value)}" for key, value in values.items()),
    ]


def sbatch_argv(directory: Path) -> list[str]:
    """sbatch's command line. The paths go here, not into #SBATCH lines, which cannot hold every
    character a path may (a newline)."""
    return [
        "sbatch",
        "--parsable",
        f"--output={directory / 'slurm-%j.out'}",
        f"--chdir={directory}",
        str(directory / SCRIPT),
    ]


def shared_dir_check(code_dir: Path, shared: Path) -> list[str]:
    """Every node must see the job's files at the same path before torchrun starts."""
    message = (
        'echo "launcher: node $SLURMD_NODENAME ($(hostname)) cannot read $1;'
        ' slurm.shared_dir ($2) must be mounted at the same path on every node" >&2'
    )
    check = f'test -r "$1" || {{ {message}; exit 1; }}'
    srun = [
        "srun",
        "--ntasks-per-node=1",
        "bash",
        "-c",
        check,
        "shared-dir-check",
        str(code_dir / CONFIG_FILE),
        str(shared),
    ]
    return [
        "# Every node must see the job's code, checkpoints and data at the same path.",
        f"{shlex.join(srun)} || exit 1",
    ]


def rendezvous_lines(instance_count: int) -> list[str]:
    if instance_count == 1:
        return []
    return [
        "# torchrun's c10d rendezvous store runs on the allocation's first node, reached at the",
        "# address Slurm itself uses for it (NodeAddr): node names need not resolve on the nodes.",
        "# (No `| head`: under pipefail, scontrol's broken pipe would fail the job.)",
        'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "rdzv_host=$(scontrol show node \"${nodes[0]}\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p') || true",
        f'export PET_RDZV_ENDPOINT="${{rdzv_host:-${{nodes[0]}}}}:{RDZV_PORT}"',
    ]


def image_file(settings: SlurmSettings) -> Path | None:
    """The squashfs file on the shared directory that the job's image is imported to once; None
    without an image, or where slurm.container_image names a file already (pyxis reads an image
    that starts with '.' or '/' as a squashfs path: NVIDIA/pyxis pyxis_slurmstepd.c)."""
    image = settings.container_image
    if not image or image[0] in "./":
        return None
    return shared_root(settings) / IMAGES_DIR / f"{image_file_name(image)}.sqsh"


def image_file_name(image: str) -> str:
    """A file name for an image: its digest when pinned to one (the same bytes under any name),
    else its name made safe, with a hash of the name so that two names never share a file."""
    digest = re.search(r"@sha256:([0-9a-f]{64})$", image)
    if digest:
        return f"sha256-{digest[1]}"
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", image)[:100].lstrip(".")
    return f"{safe}-{hashlib.sha256(image.encode()).hexdigest()[:12]}"


def enroot_uri(image: str) -> str:
    """The enroot URI pyxis itself imports for an image: docker:// and dockerd:// as given, any
    other name as docker://<image> (NVIDIA/pyxis pyxis_slurmstepd.c, enroot_container_create)."""
    return image if image.startswith(("docker://", "dockerd://")) else f"docker://{image}"


def image_import(settings: SlurmSettings) -> list[str]:
    """The batch script imports the image when its file is missing (NVIDIA/enroot doc/cmd/import.md:
    `enroot import --output FILE docker://[USER@][REGISTRY#]IMAGE[:TAG]`)."""
    path = image_file(settings)
    if path is None:
        return []
    uri = enroot_uri(settings.container_image)
    importing = f"launcher: importing {uri} to {path} once (enroot import); later jobs and requeues reuse it"
    failed = (
        f"launcher: enroot import of {uri} failed (its error is above); a private registry (ECR) needs "
        "its credentials in $ENROOT_CONFIG_PATH/.credentials (by default ~/.config/enroot/.credentials) on the nodes: see docs/slurm.md"
    )
    return [
        "# The image, imported once to a squashfs file on the shared directory: given an image name,",
        "# pyxis imports it again for every step on every node, and after every requeue, into a",
        "# file it deletes at the step's end (NVIDIA/pyxis pyxis_slurmstepd.c). enroot import",
        "# refuses an existing file and writes in place (NVIDIA/enroot src/docker.sh), so it writes",
        "# a name of this run's own that one rename makes the image: a job or a requeue that finds",
        "# the image finds all of it, and two jobs importing at once each rename a whole file.",
        f"image={shlex.quote(str(path))}",
        'if [[ ! -e "$image" ]]; then',
        f"    echo {shlex.quote(importing)}",
        '    mkdir -p -- "${image%/*}"',
        '    partial="$image.$SLURM_JOB_ID.$$.partial"',
        f'    enroot import --output "$partial" {shlex.quote(uri)} ||',
        f'        {{ rm -f -- "$partial"; echo {shlex.quote(failed)} >&2; exit 1; }}',
        '    mv -f -- "$partial" "$image"',
        "fi",
    ]


def training_srun(spec: JobSpec, code_dir: Path, shared: Path) -> str:
    """The srun line that starts torchrun on every node, in the background."""
    argv = ["--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    settings = slurm_settings(spec)
    if settings.container_image:
        # pyxis/enroot: the shared directory is mounted at the same path inside the container.
        argv += [
            f"--container-image={image_file(settings) or settings.container_image}",
            f"--container-mounts={shared}:{shared}",
            f"--container-workdir={code_dir}",
        ]
    # Every CPU the job holds on the node goes to the one torchrun task: a step gets one CPU per
    # task unless told (srun 22.05 ignores the job's --cpus-per-task), and with CPU binding
    # (task/affinity, task/cgroup) its workers and data loaders would share that one core.
    return f'srun --cpus-per-task="$SLURM_CPUS_ON_NODE" {shlex.join([*argv, *spec.command])} &'


def signal_handling(requeue: bool) -> list[str]:
    """Traps for USR1 (time limit near) and TERM (scancel, preemption), and the exit-code record."""
    after = "requeue the job" if requeue else "end (resubmit with --resume to continue)"
    return [
        "# The exit code, for `launcher status` on clusters without accounting (not after a requeue:",
        "# the job is not over).",
        "requeued=''",
        f'record_exit() {{ local code=$?; [[ -n "$requeued" ]] || echo "$code" > "$job_dir"/{EXIT_FILE}; }}',
        "trap record_exit EXIT",
        "# USR1 comes to this shell only (--signal=B:...). SIGTERM goes to the training step's tasks,",
        "# not to srun (which would kill the step): torchrun passes it to the workers, which save a",
        f"# checkpoint and exit. Then {after}.",
        "time_limit_near=''",
        "on_usr1() {",
        '    echo "launcher: USR1 from Slurm: the time limit is near; stopping training so that it saves a checkpoint"',
        "    time_limit_near=1",
        '    scancel --signal=TERM "$SLURM_JOB_ID"',
        "}",
        "trap on_usr1 USR1",
        "# scancel and preemption send SIGTERM to every step and to this shell: keep waiting for srun,",
        "# whose tasks got it too and are saving their checkpoint.",
        "trap 'echo \"launcher: SIGTERM from Slurm: waiting for training to save and stop\"' TERM",
    ]


def wait_and_requeue(requeue: bool) -> list[str]:
    lines = [
        "training=$!",
        "status=0",
        "while true; do",
        '    wait "$training" && { status=0; break; } || status=$?',
        '    kill -0 "$training" 2>/dev/null || break  # else a trap interrupted wait: srun still runs',
        "done",
        *stopped_by_launcher(),
    ]
    if requeue:
        lines += [
            'if [[ -n "$time_limit_near" ]]; then',
            '    echo "launcher: requeueing Slurm job $SLURM_JOB_ID; it resumes from its newest checkpoint"',
            '    scontrol requeue "$SLURM_JOB_ID" && requeued=1 && exit 0',
            '    echo "launcher: scontrol requeue failed; the job ends here"',
            "fi",
        ]
    lines.append('exit "$status"')
    return lines


def signal_training_argv(job_id: str) -> list[str]:
    """`launcher stop`'s first step: SIGTERM to every task of the job's steps, not to the batch
    shell (scancel man page, --batch: "By default, signals other than SIGKILL are not sent to the
    batch step"). The USR1 trap sends the same."""
    return ["scancel", "--signal=TERM", job_id]


def stopped_by_launcher() -> list[str]:
    """After `launcher stop`'s SIGTERM the training has saved and ended: the job ends CANCELLED,
    as a stop reads, and is never requeued, even if USR1 came meanwhile."""
    return [
        f'if [[ -e "$job_dir"/{STOP_FILE} ]]; then',
        '    echo "launcher: training stopped by launcher stop; cancelling Slurm job $SLURM_JOB_ID"',
        "    trap '' TERM  # the cancel's own SIGTERM to this shell: exit with the training's status",
        '    scancel "$SLURM_JOB_ID" || true',
        '    exit "$status"',
        "fi",
    ]


def sbatch_script(spec: JobSpec) -> str:
    settings = slurm_settings(spec)
    shared = shared_root(settings)
    directory = slurm_job_dir(settings, spec.name)
    code_dir = directory / CODE_DIR
    lines = ["#!/bin/bash", *directives(spec), "set -euo pipefail", ""]
    lines += [
        f"job_dir={shlex.quote(str(directory))}",
        f'rm -f -- "$job_dir"/{EXIT_FILE}',
        'echo "launcher: Slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST (run $((${SLURM_RESTART_COUNT:-0} + 1)))"',
        *signal_handling(settings.requeue),
        *shared_dir_check(code_dir, shared),
        "",
    ]
    if settings.venv:
        lines += [
            "# slurm.venv: torch and torchao on every node (srun passes the environment on).",
            "set +u",  # activate scripts may read unset variables
            f"source {shlex.quote(str(Path(settings.venv) / 'bin' / 'activate'))}",
            "set -u",
        ]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in spec.environment]
    lines += wheel_exports(spec)
    lines += image_import(settings)
    lines += rendezvous_lines(spec.resources.instance_count)
    lines.append(f"cd -- {shlex.quote(str(code_dir))}")
    lines.append(training_srun(spec, code_dir, shared))
    lines += wait_and_requeue(settings.requeue)
    return "\n".join(lines) + "\n"


INPUT_KEYS = {"train": "data.source", "model": "model.init_from"}


def missing_paths(spec: JobSpec, *, shared: bool) -> list[str]:
    """The job's data and weights paths that do not exist on this machine: one line each.

    Submit writes the job's files under slurm.shared_dir, which every node mounts at the same
    path (the script checks it), so a path under it that is missing here is missing on the
    nodes too (`shared`: those, which refuse the job before it waits in the queue). A path
    elsewhere may be on the nodes only (local scratch): that is a warning (shared=False)."""
    root = Path(os.path.realpath(shared_root(slurm_settings(spec))))
    lines = []
    for data in spec.inputs:
        key = INPUT_KEYS.get(data.name)
        if key is None or data.staged_at or data.source.startswith("s3://") or not Path(data.source).is_absolute():
            continue
        path = Path(data.source)
        if path.exists() or Path(os.path.realpath(path)).is_relative_to(root) != shared:
            continue
        lines.append(
            f"{key}: {shown(path)} does not exist under slurm.shared_dir {shown(root)}, which every node mounts"
            if shared
            else f"{key}: {shown(path)} does not exist on this machine; the nodes must have it"
        )
    return lines


def checkpoint_room_problem(recipe: Recipe, spec: JobSpec) -> str | None:
    """Why a GPU job's checkpoints cannot go where they would: a directory under the submitting
    user's home (by default slurm.shared_dir is $LAUNCHER_HOME, ~/.launcher) is, on ParallelCluster,
    the head node's NFS export, too small for a large model's checkpoints. Such a directory is
    refused unless its file system has room for checkpoint.keep complete checkpoints and the one
    being written (entrypoints/checkpoint.py deletes the oldest only once the newest is complete);
    None when it has, or the directory is not under the home directory, or the job is a CPU job."""
    if recipe.cluster.device != "cuda":
        return None
    settings = slurm_settings(spec)
    home = Path(os.path.realpath(Path.home()))
    directory = Path(os.path.realpath(spec.checkpoint_dir))
    if home == Path("/") or not directory.is_relative_to(home):
        return None
    shared = shared_root(settings)
    key, path = (
        ("slurm.shared_dir", shared)
        if directory.is_relative_to(os.path.realpath(shared))
        else ("checkpoint.dir", directory)
    )
    named = f"{path} (the default, $LAUNCHER_HOME)" if key == "slurm.shared_dir" and not settings.shared_dir else path
    # A checkpoint's size is the contract's, the estimator's too (launcher/estimate/checkpoint.py).
    kept, size = recipe.checkpoint.keep, recipe.checkpoint_bytes
    needed = (kept + 1) * size
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    try:
        stat = os.statvfs(existing)
    except OSError as error:
        return f"{key}: cannot read the free space of {existing} under the home directory {home}: {error.strerror}"
    free = stat.f_bavail * stat.f_frsize
    if free >= needed:
        return None
    return (
        f"{key}: {named} is under the home directory {home}, whose file system has {free:,} bytes "
        f"({_decimal(free)}) free, but this GPU job's checkpoints need {needed:,} bytes ({kept + 1} x "
        f"{_decimal(size)}: checkpoint.keep {kept} and the one being written); "
        f"set {key} to a directory on a file system every node mounts with that room (e.g. FSx for Lustre at /fsx)"
    )


# --- reading Slurm's answers ---------------------------------------------------------------------


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol --oneliner show job` as a dict; a value with spaces (a path) keeps them."""
    fields: dict[str, str] = {}
    key = None
    for token in text.split():
        name, sep, value = token.partition("=")
        if sep and name and (name[0].isalpha()):
            key, fields[name] = name, value
        elif key is not None:
            fields[key] += " " + token
    return fields


def exit_code_of(value: str) -> int | None:
    """Slurm's `code:signal`: the code, or -signal when a signal ended the script."""
    code, _, sig = value.partition(":")
    if not code.isdigit():
        return None
    return -int(sig) if sig.isdigit() and int(sig) else int(code)


def state_of(slurm_state: str, *, stop_requested: bool) -> str:
    """The launcher's state (SageMaker's words) for a Slurm JobState."""
    if slurm_state in ACTIVE:
        return "Stopping" if stop_requested else "InProgress"
    if slurm_state == "COMPLETED":
        return "Completed"
    if slurm_state == "CANCELLED" or stop_requested:
        return "Stopped"
    return "Failed"


def status_from_exit_file(code: int | None, *, stop_requested: bool) -> tuple[str, str]:
    """(launcher state, Slurm-like state) of a job Slurm has forgotten, from what the script left."""
    if code == 0:
        return "Completed", "COMPLETED"
    if stop_requested:
        return "Stopped", "CANCELLED"
    return "Failed", "FAILED" if code is not None else "UNKNOWN"


def failure_reason(job_id: str, slurm_state: str, fields: dict[str, str], log: Path | None) -> str:
    where = f"; see {log}" if log else ""
    if slurm_state == "UNKNOWN":
        return (
            f"Slurm no longer knows job {job_id} and the job left no exit code (killed before its "
            f"script could record one: time limit, node failure or scancel){where}"
        )
    if slurm_state == "TIMEOUT":
        return f"Slurm job {job_id} ran past its time limit (cluster.max_run){where}"
    reason = fields.get("Reason")
    because = f", {reason}" if reason and reason != "None" else ""
    return f"Slurm job {job_id} ended {slurm_state} (exit code {fields.get('ExitCode', '?')}{because}){where}"


# --- the backend ---------------------------------------------------------------------------------


class SlurmBackend(Backend):
    name = "slurm"
    settings_type = SlurmSettings

    def placement(self, recipe, name: str, lineage: str | None = None) -> Placement:
        settings = SlurmSettings.of(recipe)
        shared = shared_root(settings)
        # s3:// data is staged once, at submit, onto the shared file system the nodes read.
        staged = str(staging_dir(recipe.data.source, shared)) if recipe.data.source.startswith("s3://") else None
        return Placement(
            checkpoint_dir=str(checkpoint_home(recipe, lineage or name, root=shared)),
            output_dir=str(slurm_job_dir(settings, name)),
            s3_data_dir=staged,
            s3_staging_dir=staged,
            bootstrap="exec",  # installs the wheels; torchrun keeps the c10d rendezvous and Slurm's signals
            # Slurm reruns a job only "after node failure, or upon preemption" or when asked (sbatch(1),
            # --requeue), never after its script fails: a crashed or stalled rank (the watchdog's
            # exit 5) is restarted by torchrun inside the allocation, from the newest checkpoint.
            max_restarts=1,
        )

    def problems(self, spec: JobSpec) -> list[str]:
        problems = super().problems(spec) + missing_paths(spec, shared=True)
        settings = slurm_settings(spec)
        if settings.signal_before_end_s > MAX_SIGNAL_S:
            problems.append(
                f"slurm.signal_before_end: Slurm can signal at most {MAX_SIGNAL_S} s before the time limit, "
                f"not {settings.signal_before_end_s} s; use a shorter one"
            )
        return problems

    def spec(self, recipe: Recipe, *, lineage: str | None = None) -> JobSpec:
        """The job, once its checkpoints have room where the settings put them (`checkpoint_room_problem`)."""
        spec = super().spec(recipe, lineage=lineage)
        problem = checkpoint_room_problem(recipe, spec)
        if problem:
            raise UsageError(problem)
        return spec

    def _render(self, spec: JobSpec) -> Rendering:
        bundle = Bundle.of(spec)
        settings = slurm_settings(spec)
        directory = slurm_job_dir(settings, spec.name)
        script = sbatch_script(spec)
        argv = sbatch_argv(directory)
        data = {"script": script, "command": argv, "job_dir": str(directory), "bundle": bundle.describe()}
        warnings, lead = [], signal_lead_s(spec)
        if lead >= spec.max_run_s:
            warnings.append(
                f"slurm.signal_before_end ({lead} s) is not shorter than "
                f"cluster.max_run ({spec.max_run_s} s): Slurm sends USR1 as soon as the job starts"
            )
        warnings += missing_paths(spec, shared=False)
        if warnings:
            data["warnings"] = warnings
        if lead > settings.signal_before_end_s:
            data["notes"] = [
                f"slurm.signal_before_end: USR1 comes {lead} s before the time limit, not "
                f"{settings.signal_before_end_s} s: the job's stop grace (cluster.stop_grace) needs that long"
            ]
        return Rendering(spec=spec, data=data, text=script, payload={"bundle": bundle, "argv": argv})

    def _submit(self, rendering: Rendering) -> JobRef:
        spec = rendering.spec
        directory = slurm_job_dir(slurm_settings(spec), spec.name)
        wheels = job_wheels(spec.resolved)
        if wheels:  # fetched once into the cache (or refused in one line) before anything is written
            fill(wheels, wheelhouse_dir(spec))
        rendering.payload["bundle"].extract(directory / CODE_DIR)
        (directory / SCRIPT).write_text(rendering.data["script"])
        out = run_tool(rendering.payload["argv"], action=f"submitting {spec.name} with sbatch")
        job_id = out.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
        return JobRef(name=spec.name, backend=self.name, native_id=job_id, created=utc_now())

    # --- what Slurm and the job directory say ------------------------------------------------

    def _job_id(self, ref: JobRef) -> str:
        if ref.native_id:
            return ref.native_id
        if ref.name.isdigit():  # `launcher status 1234 --backend slurm`: a Slurm job id
            return ref.name
        raise UsageError(
            f"{ref.name} was not submitted from here, so its Slurm job id is unknown; "
            "pass the job id instead (launcher status JOBID --backend slurm)"
        )

    def _check_owns(self, ref: JobRef, job_id: str) -> None:
        """Refuse to cancel a Slurm job that is not the one the record names: a job id read from a
        damaged or forged job.json could be any of the user's jobs (or an option for scancel)."""
        if not job_id.isdigit():
            raise LauncherError(
                f"not stopping {ref.name}: its Slurm job id {job_id!r} is not a number; nothing was cancelled"
            )
        if ref.name == job_id:
            return  # `launcher stop JOBID --backend slurm`: the user named the Slurm job itself
        name = (self._scontrol(job_id) or {}).get("JobName")
        if name != ref.name:
            raise LauncherError(
                f"not stopping {ref.name}: Slurm job {job_id} is named {name!r}, not {ref.name!r} (the record in "
                f"{job_dir(ref.name)} is stale or damaged); nothing was cancelled"
            )

    def _directory(self, ref: JobRef) -> Path | None:
        """The job's directory on the shared file system (its spec's output_dir), if submitted from here."""
        spec = self.saved_spec(ref.name)
        return None if spec is None else Path(spec.output_dir)

    def _scontrol(self, job_id: str) -> dict[str, str] | None:
        """`scontrol show job`'s fields; None once Slurm has forgotten the job (after MinJobAge)."""
        try:
            out = run_tool(["scontrol", "--oneliner", "show", "job", job_id], action=f"asking Slurm about job {job_id}")
        except ToolFailed as failed:
            if UNKNOWN_JOB in failed.output:
                return None
            raise
        return parse_scontrol(out)

    def _status(self, ref: JobRef) -> JobStatus:
        job_id = self._job_id(ref)
        directory = self._directory(ref)
        fields = self._scontrol(job_id)
        stop_requested = bool(directory and (directory / STOP_FILE).exists())
        if fields is not None:
            slurm_state = fields.get("JobState", "UNKNOWN")
            state = state_of(slurm_state, stop_requested=stop_requested)
            exit_code = exit_code_of(fields.get("ExitCode", ""))
        elif directory is not None:
            code = _read_exit_file(directory / EXIT_FILE)
            state, slurm_state = status_from_exit_file(code, stop_requested=stop_requested)
            exit_code, fields = code, {}
        else:
            raise UsageError(
                f"Slurm does not know job {job_id} (it never existed, or it ended over MinJobAge ago); "
                "check the id with squeue or sacct"
            )
        log = self._log_path(ref, fields, directory)
        return JobStatus(
            name=ref.name,
            backend=self.name,
            state=state,
            secondary=slurm_state,
            failure_reason=failure_reason(job_id, slurm_state, fields, log) if state == "Failed" else None,
            exit_code=exit_code if state in TERMINAL_STATES else None,
            created=ref.created or fields.get("SubmitTime"),
            ended=fields.get("EndTime") if state in TERMINAL_STATES and fields.get("EndTime") != "Unknown" else None,
            metrics=last_metrics(directory / METRICS_FILE) if directory else {},
            details=_details(job_id, fields, directory, log, over=state in TERMINAL_STATES),
        )

    def _log_path(self, ref: JobRef, fields: dict[str, str], directory: Path | None) -> Path | None:
        if directory is not None:
            return directory / f"slurm-{self._job_id(ref)}.out"
        return Path(fields["StdOut"]) if fields.get("StdOut") else None

    def _logs(self, ref: JobRef, *, follow: bool, poll_s: float) -> Iterator[str]:
        job_id = self._job_id(ref)
        directory = self._directory(ref)
        log = self._log_path(ref, self._scontrol(job_id) or {}, directory)
        if log is None:
            raise UsageError(f"Slurm job {job_id}: no log file known; Slurm has forgotten the job")
        return follow_file(log, follow=follow, is_done=lambda: self._status(ref).terminal, poll_s=min(poll_s, 1.0))

    def _metrics(self, ref: JobRef) -> MetricsHistory:
        directory = self._directory(ref)
        return self._file_or_log_metrics(ref, directory / METRICS_FILE if directory else None)

    def _stop(self, ref: JobRef, *, grace_s: float) -> JobStatus:
        """SIGTERM to the training first, then, if the job is still there after its stop grace,
        scancel: a plain scancel alone SIGKILLs after the cluster's KillWait (slurm.conf, 30 s
        by default), too soon for a large model's step and final save."""
        job_id = self._job_id(ref)
        status = self._status(ref)
        if status.terminal:
            return status
        self._check_owns(ref, job_id)
        directory = self._directory(ref)
        if directory is not None:
            (directory / STOP_FILE).touch()  # before any signal: the script then does not requeue
        spec = self.saved_spec(ref.name)
        if status.secondary == "RUNNING":  # a pending job has no steps to signal: it is cancelled at once
            status = self._signal_training(ref, job_id, grace_s=max(grace_s, spec.stop_grace_s if spec else 0))
            if status.terminal:
                return status
        # SIGTERM to every step and the script, SIGKILL after the cluster's KillWait.
        run_tool(["scancel", job_id], action=f"cancelling Slurm job {job_id}")
        return self._wait_until_over(ref, grace_s)

    def _signal_training(self, ref: JobRef, job_id: str, *, grace_s: float) -> JobStatus:
        """SIGTERM to the tasks of the job's steps, as the USR1 trap sends it, and the job's status
        once it has ended or `grace_s` has passed. scancel man page, --batch: "By default, signals
        other than SIGKILL are not sent to the batch step (the shell script)", so neither the
        script nor its srun is signalled (see `signal_handling`). torchrun passes SIGTERM to the
        workers, which save and exit; the script then sees stop_requested and cancels the job
        itself (`stopped_by_launcher`)."""
        try:
            run_tool(signal_training_argv(job_id), action=f"signalling Slurm job {job_id}")
        except ToolFailed:
            status = self._status(ref)
            if status.terminal:  # it ended between our look and the signal
                return status
            raise
        return self._wait_until_over(ref, grace_s)

    def _wait_until_over(self, ref: JobRef, seconds: float) -> JobStatus:
        deadline = time.monotonic() + seconds
        while not (status := self._status(ref)).terminal and time.monotonic() < deadline:
            time.sleep(0.5)
        return status

    def _list(self, *, region: str | None, limit: int) -> list[JobStatus]:
        # Ask Slurm once first: without its tools, or with its controller down, say so, even
        # when no job was submitted from here.
        run_tool(["squeue", "--noheader", "--format=%i"], action="listing Slurm jobs")
        return [self._status(ref) for ref in [r for r in records() if r.backend == self.name][:limit]]


def _decimal(size_bytes: int) -> str:
    """Bytes as disks are sold and as the checkpoint estimate prints them: 847.0 GB, 10.4 MB."""
    return f"{size_bytes / 1e9:.1f} GB" if size_bytes >= 1e9 else f"{size_bytes / 1e6:.1f} MB"


def _read_exit_file(path: Path) -> int | None:
    try:
        return int(file_tail(path, 64).strip())  # the job's own file: a FIFO there must not block status
    except ValueError:
        return None


def _details(job_id: str, fields: dict[str, str], directory: Path | None, log: Path | None, *, over: bool) -> dict:
    details: dict = {"slurm_job_id": job_id, "log": str(log) if log else None}
    if fields.get("NodeList") not in (None, "", "(null)"):  # empty while pending
        details["nodes"] = fields["NodeList"]
    if fields.get("Restarts", "0") != "0":
        details["restarts"] = int(fields["Restarts"])
    if fields.get("JobState") == "PENDING" and fields.get("Reason") not in (None, "None"):
        details["waiting"] = fields["Reason"]
    if directory is not None:
        details["job_dir"] = str(directory)
    if over and log is not None:
        # Only at the end: while a requeued job runs again, the log's last summary is the first run's.
        details["summary"] = log_summary(log)
    return details
