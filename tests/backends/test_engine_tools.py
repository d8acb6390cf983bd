"""Slurm, Kubernetes and docker jobs driven through their command-line tools.

No engine runs here, so stand-in `sbatch`/`sacct`/`scancel`/`kubectl`/`docker` executables on
PATH record the argv they get and answer what the real tools print.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from .helpers import recipe_path


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """make(name, stdout, exit_code=0): a stand-in tool; calls(name) -> the argv lists it got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    def make(name: str, stdout: str = "", exit_code: int = 0) -> None:
        script = bin_dir / name
        script.write_text(
            "#!/usr/bin/env python3\nimport json, sys\n"
            f"open({str(tmp_path / (name + '.calls'))!r}, 'a').write(json.dumps({{'argv': sys.argv[1:], "
            "'stdin': '' if sys.stdin.isatty() else sys.stdin.read()}) + '\\n')\n"
            f"sys.stdout.write({stdout!r})\nsys.exit({exit_code})\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR)

    def calls(name: str) -> list[dict]:
        path = tmp_path / f"{name}.calls"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    make.calls = calls
    return make


def test_slurm_submit_writes_the_script_and_records_the_job_id(home, fake_bundle, tools, cli):
    tools("sbatch", "4242;cluster-a\n")
    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--json")
    assert result.code == 0, result.err
    name = json.loads(result.out)["name"]
    directory = home / "jobs" / name
    (call,) = tools.calls("sbatch")
    assert call["argv"] == ["--parsable", f"--output={directory / 'slurm-%j.out'}", str(directory / "job.sbatch")]
    assert (directory / "job.sbatch").read_text().startswith("#!/bin/bash\n#SBATCH --job-name=")
    assert (directory / "code" / "resolved.json").is_file()
    assert json.loads((directory / "job.json").read_text())["native_id"] == "4242"


@pytest.mark.parametrize(
    "sacct, state, reason",
    [
        ("RUNNING|0:0|2026-11-09T10:00:00|Unknown\n", "InProgress", None),
        ("COMPLETED|0:0|2026-11-09T10:00:00|2026-11-09T11:00:00\n", "Completed", None),
        ("CANCELLED by 1000|0:15|2026-11-09T10:00:00|2026-11-09T10:05:00\n", "Stopped", None),
        (
            "TIMEOUT|0:0|2026-11-09T10:00:00|2026-11-10T10:00:00\n",
            "Failed",
            "Slurm job 4242 ended TIMEOUT (exit code 0:0)",
        ),
        ("", "InProgress", None),
    ],
)
def test_slurm_status_maps_sacct_states(home, fake_bundle, tools, cli, sacct, state, reason):
    tools("sbatch", "4242\n")
    tools("sacct", sacct)
    name = json.loads(cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--json").out)["name"]
    status = json.loads(cli("status", name, "--json").out)
    assert (status["state"], status["failure_reason"]) == (state, reason)
    assert tools.calls("sacct")[0]["argv"][:2] == ["-j", "4242"]


def test_slurm_logs_read_the_output_file_and_stop_cancels(home, fake_bundle, tools, cli):
    tools("sbatch", "4242\n")
    tools("sacct", "COMPLETED|0:0|a|b\n")
    tools("scancel")
    name = json.loads(cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--json").out)["name"]
    (home / "jobs" / name / "slurm-4242.out").write_text("metrics step=1 loss=2\nsummary steps=1")
    assert cli("logs", name, "--follow").out.splitlines() == ["metrics step=1 loss=2", "summary steps=1"]
    cli("stop", name)
    assert tools.calls("scancel")[0]["argv"] == ["4242"]


def test_k8s_submit_applies_exactly_the_dry_run_manifest(home, fake_bundle, fixed_names, tools, cli):
    tools("kubectl", "pytorchjob.kubeflow.org/x created\n")
    dry = cli("submit", recipe_path("tiny-cpu"), "--backend", "k8s", "--dry-run")
    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "k8s")
    assert result.code == 0, result.err
    (call,) = tools.calls("kubectl")
    assert call["argv"] == ["apply", "-f", "-"]
    assert call["stdin"] == dry.out


def test_k8s_status_reads_the_pytorchjob_conditions(home, fake_bundle, tools, cli):
    job = {
        "metadata": {"name": "tiny-cpu-x", "creationTimestamp": "2026-11-09T10:00:00Z"},
        "status": {
            "conditions": [
                {"type": "Created", "status": "True", "lastTransitionTime": "2026-11-09T10:00:00Z"},
                {"type": "Running", "status": "False", "lastTransitionTime": "2026-11-09T10:01:00Z"},
                {"type": "Failed", "status": "True", "message": "master-0 exited with code 1"},
            ]
        },
    }
    tools("kubectl", json.dumps(job))
    status = json.loads(cli("status", "tiny-cpu-x", "--backend", "k8s", "--json").out)
    assert (status["state"], status["failure_reason"]) == ("Failed", "master-0 exited with code 1")
    assert [t["status"] for t in status["transitions"]] == ["Created", "Running", "Failed"]


def test_docker_submit_runs_the_rendered_command(home, fake_bundle, tools, cli):
    tools("docker", "27.0.1\n")
    result = cli("submit", recipe_path("tiny-cpu"), "--backend", "docker", "--json")
    assert result.code == 0, result.err
    # version, then the name and image checks (this stand-in's answer means: no such container, image present)
    version, *_, run = tools.calls("docker")
    assert version["argv"][0] == "version"
    spec = json.loads(result.out)["spec"]
    assert run["argv"][:4] == ["run", "--detach", "--name", spec["name"]]
    assert run["argv"][-len(spec["command"]) :] == spec["command"]
    assert Path(home / "jobs" / spec["name"] / "code" / "resolved.json").is_file()


def test_docker_status_reads_the_container_state(home, tools, cli):
    tools("docker", json.dumps({"Status": "exited", "ExitCode": 137, "StartedAt": "a", "FinishedAt": "b"}))
    status = json.loads(cli("status", "c1", "--backend", "docker", "--json").out)
    assert (status["state"], status["exit_code"]) == ("Stopped", 137)
