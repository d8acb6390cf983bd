"""Kubernetes and docker jobs driven through their command-line tools (Slurm's: test_slurm_backend.py).

No engine runs here, so stand-in `kubectl`/`docker` executables on PATH record the argv they
get and answer what the real tools print.
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
    # The command's program is the container's entrypoint (PID 1), its arguments follow the image.
    program, *arguments = spec["command"]
    assert run["argv"][-len(arguments) - 3 :] == ["--entrypoint", program, spec["image"], *arguments]
    assert Path(home / "jobs" / spec["name"] / "code" / "resolved.json").is_file()


def test_docker_status_reads_the_container_state(home, tools, cli):
    tools("docker", json.dumps({"Status": "exited", "ExitCode": 137, "StartedAt": "a", "FinishedAt": "b"}))
    status = json.loads(cli("status", "c1", "--backend", "docker", "--json").out)
    assert (status["state"], status["exit_code"]) == ("Stopped", 137)
