"""The local backend's job lifecycle: submit, status, logs --follow, stop, list, wait.

These run the stand-in trainer (tests/backends/fake_entrypoints) with this Python instead of
torchrun, so each job takes a fraction of a second; test_local_e2e.py runs the real thing.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from launcher import api
from launcher.jobs import Job, result_text

from .helpers import recipe_path


@pytest.fixture
def no_torchrun(monkeypatch, fake_bundle, home):
    import launcher.backends.local as local

    def direct(command):
        return [sys.executable, *command[command.index("entrypoints/train.py") :]]

    monkeypatch.setattr(local, "torchrun_argv", direct)
    return home


def submit(**kwargs):
    return api.submit(recipe_path("tiny-cpu"), **kwargs)


def wait_for_line(job: Job, text: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(text in line for line in job.logs()):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in the logs of {job.name}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_a_job_runs_to_completion_with_its_files_in_the_job_directory(no_torchrun):
    result = submit(wait=True, poll_s=0.05)
    directory = no_torchrun / "jobs" / result.spec.name
    assert result.final.state == "Completed" and result.exit_code == 0
    assert {"spec.json", "resolved.json", "status.json", "output.log", "metrics.jsonl", "job.json"} <= {
        p.name for p in directory.iterdir()
    }
    assert (directory / "code" / "entrypoints" / "train.py").is_file()
    assert json.loads((directory / "resolved.json").read_text())["runtime"]["output_dir"] == str(directory)
    status = result.job.status()
    assert [t.status for t in status.transitions] == ["Starting", "Training", "Completed"]
    assert status.metrics["step"] == 3
    assert result_text(status) == "loss 1.667, tokens/s/GPU 1002, step 3"


def test_logs_follow_ends_when_the_job_ends(no_torchrun):
    job = submit().job
    lines = list(job.logs(follow=True, poll_s=0.05))
    assert lines[-1].startswith("summary steps=3")
    assert sum(line.startswith("metrics step=") for line in lines) == 3
    assert job.status().state == "Completed"


def test_a_failing_job_reports_the_exit_code_and_the_error(no_torchrun, monkeypatch, cli):
    monkeypatch.setenv("FAKE_TRAIN", "fail")
    result = cli("submit", recipe_path("tiny-cpu"), "--wait")
    assert result.code == 3
    name = json.loads(cli("list", "--json").out)[0]["name"]
    status = json.loads(cli("status", name, "--json").out)
    assert status["state"] == "Failed" and status["exit_code"] == 3
    assert status["failure_reason"] == "torchrun exited with code 3: RuntimeError: fake failure in step 4"


def test_stop_sends_sigterm_to_the_process_group(no_torchrun, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", "hang")
    job = submit().job
    wait_for_line(job, "hanging")
    pid = int((no_torchrun / "jobs" / job.name / "fake.pid").read_text())
    stopped = job.stop(grace_s=10)
    assert stopped.state == "Stopped" and stopped.exit_code == -15
    assert not alive(pid)


def test_stop_kills_after_the_grace_period_when_sigterm_is_ignored(no_torchrun, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", "hang")
    monkeypatch.setenv("FAKE_TRAIN_IGNORE_TERM", "1")
    job = submit().job
    wait_for_line(job, "hanging")
    pid = int((no_torchrun / "jobs" / job.name / "fake.pid").read_text())
    stopped = job.stop(grace_s=0.3)
    assert stopped.state == "Stopped" and stopped.exit_code == -9
    assert not alive(pid)


def test_stopping_an_ended_job_changes_nothing(no_torchrun, cli):
    name = submit(wait=True, poll_s=0.05).spec.name
    result = cli("stop", name, "--json")
    assert json.loads(result.out)["state"] == "Completed"


def test_list_shows_local_jobs_newest_first(no_torchrun, cli):
    first = submit(wait=True, poll_s=0.05).spec.name
    second = submit(wait=True, poll_s=0.05).spec.name
    listed = json.loads(cli("list", "--backend", "local", "--json").out)
    assert [(j["name"], j["state"]) for j in listed] == [(second, "Completed"), (first, "Completed")]
    table = cli("list").out.splitlines()
    assert table[0].split() == ["NAME", "BACKEND", "STATE", "DETAIL", "CREATED"]
    assert table[1].split()[:3] == [second, "local", "Completed"]


def test_a_job_whose_runner_died_is_failed(no_torchrun, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", "hang")
    job = submit().job
    wait_for_line(job, "hanging")
    from launcher.backends import local_runner

    directory = no_torchrun / "jobs" / job.name
    status = local_runner.read_status(directory)
    os.kill(status["runner_pid"], 9)
    os.killpg(status["pgid"], 9)
    deadline = time.monotonic() + 10
    while job.status().state == "InProgress" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.status().state == "Failed"
    assert job.status().failure_reason == "the launcher's runner process died; see runner.log"


def test_submit_prints_how_to_follow_the_job(no_torchrun, cli):
    result = cli("submit", recipe_path("tiny-cpu"))
    assert result.code == 0, result.err
    name = result.out.split(":")[0]
    assert result.out.strip() == f"{name}: follow with `launcher logs {name} --follow`"
    assert "memory: fits" in result.err
    assert list(Job.find(name).logs(follow=True, poll_s=0.05))[-1].startswith("summary")
