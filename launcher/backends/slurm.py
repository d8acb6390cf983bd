"""The Slurm backend: an sbatch script that runs torchrun on every node through srun.

One srun task per node starts torchrun; torchrun's c10d rendezvous on the first node of the
allocation assigns ranks. The script is built line by line with every value quoted by shlex,
and nothing from a recipe reaches it except the (pattern-checked) job name: the recipe travels
in resolved.json inside the bundle.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

from launcher.backends.base import Backend, Capabilities, JobRef, JobStatus, Rendering, utc_now
from launcher.backends.tail import follow_file
from launcher.backends.tools import run_tool
from launcher.bundle import Bundle
from launcher.errors import UsageError
from launcher.registry import job_dir, job_dir_placement, records
from launcher.spec import RDZV_PORT, JobSpec, Placement

SCRIPT = "job.sbatch"
RUNNING = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "STAGE_OUT"}


def _time_limit(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    return f"{days}-{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"


def sbatch_script(spec: JobSpec, code_dir: str) -> str:
    r = spec.resources
    directives = [
        f"--job-name={spec.name}",
        f"--nodes={r.instance_count}",
        "--ntasks-per-node=1",
        "--exclusive",
        f"--time={_time_limit(spec.max_run_s)}",
    ]
    if r.device == "cuda":
        directives.append(f"--gpus-per-node={r.procs_per_node}")
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "set -euo pipefail", ""]
    lines.append(f"cd -- {shlex.quote(code_dir)}")
    lines += [f"export {key}={shlex.quote(value)}" for key, value in spec.environment]
    if r.instance_count > 1:
        lines += [
            "# torchrun's c10d rendezvous store runs on the allocation's first node. (No `| head`:",
            "# under pipefail, scontrol's broken pipe would fail the job.)",
            'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
            f'export PET_RDZV_ENDPOINT="${{nodes[0]}}:{RDZV_PORT}"',
        ]
    srun = ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", *spec.command]
    lines += [shlex.join(srun), ""]
    return "\n".join(lines)


class SlurmBackend(Backend):
    name = "slurm"
    capabilities = Capabilities(multi_node=True, efa=True)

    def placement(self, recipe, name: str, lineage: str | None = None) -> Placement:
        # $LAUNCHER_HOME must be on a file system every node mounts (home directories usually are).
        return job_dir_placement(recipe, name, lineage)

    def _render(self, spec: JobSpec) -> Rendering:
        bundle = Bundle.build(spec.resolved_json)
        directory = job_dir(spec.name)
        script = sbatch_script(spec, str(directory / "code"))
        argv = ["sbatch", "--parsable", f"--output={directory / 'slurm-%j.out'}", str(directory / SCRIPT)]
        data = {"script": script, "command": argv, "job_dir": str(directory), "bundle": bundle.describe()}
        return Rendering(spec=spec, data=data, text=script, payload={"bundle": bundle, "argv": argv})

    def _submit(self, rendering: Rendering) -> JobRef:
        spec = rendering.spec
        directory = job_dir(spec.name)
        rendering.payload["bundle"].extract(directory / "code")
        (directory / SCRIPT).write_text(rendering.data["script"])
        out = run_tool(rendering.payload["argv"], action=f"submitting {spec.name} with sbatch")
        job_id = out.strip().split(";")[0]
        return JobRef(name=spec.name, backend=self.name, native_id=job_id, created=utc_now())

    def _job_id(self, ref: JobRef) -> str:
        if not ref.native_id:
            raise UsageError(f"{ref.name} has no Slurm job id; it was not submitted from here")
        return ref.native_id

    def _status(self, ref: JobRef) -> JobStatus:
        job_id = self._job_id(ref)
        out = run_tool(
            ["sacct", "-j", job_id, "-X", "--noheader", "--parsable2", "--format=State,ExitCode,Start,End"],
            action=f"asking Slurm about job {job_id}",
        )
        fields = out.strip().splitlines()[0].split("|") if out.strip() else ["PENDING", "", "", ""]
        slurm_state = fields[0].split()[0]
        exit_code = int(fields[1].split(":")[0]) if fields[1][:1].isdigit() else None
        if slurm_state in RUNNING:
            state, reason = "InProgress", None
        elif slurm_state == "COMPLETED":
            state, reason = "Completed", None
        elif slurm_state == "CANCELLED":
            state, reason = "Stopped", None
        else:
            state, reason = "Failed", f"Slurm job {job_id} ended {slurm_state} (exit code {fields[1]})"
        return JobStatus(
            name=ref.name,
            backend=self.name,
            state=state,
            secondary=slurm_state,
            failure_reason=reason,
            exit_code=None if state == "InProgress" else exit_code,
            created=ref.created,
            ended=fields[3] if len(fields) > 3 and fields[3] not in ("", "Unknown") else None,
            details={"slurm_job_id": job_id, "log": str(self._log(ref))},
        )

    def _log(self, ref: JobRef) -> Path:
        return job_dir(ref.name) / f"slurm-{self._job_id(ref)}.out"

    def _logs(self, ref: JobRef, *, follow: bool, poll_s: float) -> Iterator[str]:
        return follow_file(self._log(ref), follow=follow, is_done=lambda: self._status(ref).terminal, poll_s=poll_s)

    def _stop(self, ref: JobRef, *, grace_s: float) -> JobStatus:
        # scancel sends SIGTERM, then SIGKILL after the cluster's KillWait.
        run_tool(["scancel", self._job_id(ref)], action=f"cancelling Slurm job {ref.native_id}")
        return self._status(ref)

    def _list(self, *, region: str | None, limit: int) -> list[JobStatus]:
        return [self._status(ref) for ref in records() if ref.backend == self.name][:limit]
