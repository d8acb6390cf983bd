"""`launcher stop` signals only what /proc proves is the job's, whatever `status.json` says.

A damaged or forged `status.json` names some process group. The target here is a real
`setsid sleep` (its own session and group), and the launcher's own group, and group 1 (whose
killpg is kill(-1): every process the user may signal). `os.killpg` is wrapped by a recorder that
never forwards, so a regression shows as a recorded call, not as a dead machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from launcher.backends import processes
from launcher.backends.processes import JobGroup, process_start_time

from .helpers import alive, runner_record, submit, wait_for_line


@pytest.fixture
def victim():
    """A real `setsid sleep` that nothing of the job's started: it must survive every stop below."""
    process = subprocess.Popen(["setsid", "sleep", "300"])
    try:
        deadline_ok = _wait(lambda: os.getpgid(process.pid) == process.pid)
        assert deadline_ok, "setsid did not make the sleep a group leader"
        yield process.pid
    finally:
        process.kill()
        process.wait()


def _wait(condition, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def hanging(no_torchrun, monkeypatch):
    """A local job whose trainer hangs: (job, its status.json, the record as the runner wrote it).
    Whatever a test leaves in the record, the job is stopped afterwards through the genuine one."""
    monkeypatch.setenv("FAKE_TRAIN", "hang")
    job = submit().job
    wait_for_line(job, "hanging")
    status_file = no_torchrun / "jobs" / job.name / "status.json"
    real = runner_record(no_torchrun, job.name)
    yield job, status_file, real
    status_file.write_text(json.dumps(real))
    job.stop(grace_s=5)


@pytest.fixture
def killpg_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(processes.os, "killpg", lambda pgid, sig: calls.append((pgid, sig)))
    return calls


def forgeries(victim: int, real: dict) -> list[tuple[str, dict, str]]:
    """(what, the fields written into status.json, the reason the error must give)."""
    start = process_start_time(victim)
    return [
        ("group 1", {"pgid": 1}, "process group 1 is not a job's"),
        ("group 0", {"pgid": 0}, "process group 0 is not a job's"),
        ("a negative group", {"pgid": -1}, "process group -1 is not a job's"),
        ("a group id as text", {"pgid": str(victim)}, f"process group '{victim}' is not a job's"),
        ("a boolean", {"pgid": True}, "process group True is not a job's"),
        ("the launcher's own group", {"pgid": os.getpgrp(), "pgid_start": None}, "is the launcher's own"),
        (
            "another process's group with the job's start time (a recycled pid)",
            {"pgid": victim, "pgid_start": real["pgid_start"]},
            f"process group {victim}'s leader started at tick {start}",
        ),
        (
            "another process's group with its own start time",
            {"pgid": victim, "pgid_start": start},
            f"process group {victim} holds process(es) {victim} started without this job's LAUNCHER_JOB_DIR",
        ),
    ]


def test_stop_of_a_forged_record_signals_nothing_and_says_why_in_one_line(hanging, monkeypatch, victim, cli):
    job, status_file, real = hanging
    trainer = int((status_file.parent / "fake.pid").read_text())

    calls = []
    with monkeypatch.context() as patched:
        patched.setattr(processes.os, "killpg", lambda pgid, sig: calls.append((pgid, sig)))
        for what, fields, reason in forgeries(victim, real):
            status_file.write_text(json.dumps({**real, **fields}))
            result = cli("stop", job.name, "--grace", "1")
            assert result.code == 1, what
            lines = result.err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"not stopping {job.name}: {status_file}: "), (what, lines)
            assert reason in lines[0] and lines[0].endswith("; nothing was signalled"), (what, lines)
            assert calls == [], what
            assert alive(victim) and alive(trainer), what
            assert not (status_file.parent / "stop_requested").exists(), what  # nothing created either

    status_file.write_text(json.dumps(real))  # the real killpg and the real record: the job still stops
    assert cli("stop", job.name, "--grace", "10").code == 0
    assert not alive(trainer) and alive(victim)


def test_status_does_not_take_a_foreign_group_for_the_jobs_processes(hanging, victim):
    """With its runner dead, a job is 'still training' only if its recorded group is provably its own."""
    job, status_file, real = hanging
    directory = status_file.parent
    os.kill(real["runner_pid"], signal.SIGKILL)
    assert _wait(lambda: not alive(real["runner_pid"]))
    assert "the runner died" in job.status().secondary  # the genuine group is recognised
    os.killpg(real["pgid"], signal.SIGKILL)  # the job's own group, which this test's submit created
    assert _wait(lambda: not alive(real["pgid"]))
    forged = {**real, "pgid": victim, "pgid_start": process_start_time(victim)}
    (directory / "status.json").write_text(json.dumps(forged))
    status = job.status()
    assert status.state == "Failed" and status.failure_reason == "the launcher's runner process died; see runner.log"
    assert alive(victim)


def test_a_group_whose_leader_exited_is_the_jobs_while_its_members_carry_the_marker(tmp_path, killpg_calls):
    """torchrun (the leader) gone, a worker left: the marker alone proves the group is the job's."""
    marker = str(tmp_path)
    script = "import os, subprocess, sys; p = subprocess.Popen(['sleep', '300']); print(p.pid, flush=True)"
    leader = subprocess.Popen(
        ["python3", "-c", script],
        env={**os.environ, processes.JOB_MARKER: marker},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    worker = int(leader.stdout.readline())
    try:
        leader.wait()
        group = JobGroup(pgid=leader.pid, leader_start=None, job_dir=marker)
        assert [m.pid for m in group.verified_members()] == [worker]
        assert group.signal(signal.SIGTERM) and killpg_calls == [(leader.pid, signal.SIGTERM)]
        assert not JobGroup(pgid=leader.pid, leader_start=None, job_dir=marker + "-other").alive()
    finally:
        os.kill(worker, signal.SIGKILL)
