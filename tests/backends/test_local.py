"""The local backend's job lifecycle: submit, status, logs --follow, stop, list, wait.

These run the stand-in trainer (tests/backends/fake_entrypoints) with this Python instead of
torchrun, so each job takes a fraction of a second; test_local_e2e.py runs the real thing.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from launcher.display.text import result_text
from launcher.errors import UsageError
from launcher.jobs import Job
from launcher.registry import scan, write_json

from .helpers import REPO, alive, recipe_path, runner_record, submit, wait_for_line


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
    assert result.code == 1  # the job failed; its own exit code is in its status
    name = json.loads(cli("list", "--json").out)[0]["name"]
    status = json.loads(cli("status", name, "--json").out)
    assert status["state"] == "Failed" and status["exit_code"] == 3
    assert status["failure_reason"] == "torchrun exited with code 3: RuntimeError: fake failure in step 4"
    # --wait's last line says why, as SageMaker's FailureReason (before: "NAME: Failed. " and nothing)
    assert result.out.splitlines()[-1].startswith(
        f"{name}: Failed: torchrun exited with code 3: RuntimeError: fake failure in step 4. loss "
    ), result.out[-500:]
    followed = cli("logs", name, "--follow")
    assert followed.code == 1 and "fake failure in step 4" in followed.out  # the job's outcome, as --wait


@pytest.mark.parametrize(
    ("setting", "line"),
    [
        ("data.source={missing}", "data.source: {missing} does not exist on this machine, where the job runs"),
        ("checkpoint.dir={file}", "checkpoint.dir: {file} is a file; give a directory (new or one of checkpoints)"),
        (
            "checkpoint.dir={file}/below",
            "checkpoint.dir: {file} is a file; give a directory (new or one of checkpoints)",
        ),
        ("checkpoint.export_hf={file}", "checkpoint.export_hf: {file} is a file; give a directory"),
    ],
)
def test_paths_a_local_job_cannot_use_are_one_line_before_anything_starts(home, cli, tmp_path, setting, line):
    """Before, each started the job, whose ranks failed on it: the data and the checkpoint
    directory after their imports, the export after the last step (and then torchrun's restart)."""
    from launcher.display.text import shown

    # A newline in a path must not forge a line of its own.
    paths = {"missing": tmp_path / "no-such\n---\ndata", "file": tmp_path / "a-file"}
    paths["file"].write_text("mine")
    for dry_run in (["--dry-run"], []):
        result = cli("submit", recipe_path("tiny-cpu"), "--set", setting.format(**paths), *dry_run)
        expected = line.format(**{key: shown(path) for key, path in paths.items()})
        assert (result.code, result.err_lines[-1]) == (2, expected), result.err
    assert not home.exists() and paths["file"].read_text() == "mine"  # no job, nothing written


def test_stop_sends_sigterm_to_the_process_group(no_torchrun, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", "hang")
    job = submit().job
    wait_for_line(job, "hanging")
    # A job of its lineage would write the same checkpoints beside it: refused while it runs.
    with pytest.raises(UsageError) as refused:
        submit(resume=job.name)
    assert str(refused.value) == (
        f"--resume {job.name}: {job.name} is InProgress and still writes the checkpoints this job would continue; "
        f"wait for it to end, or stop it (launcher stop {job.name})"
    )
    assert [ref.name for ref in scan().refs] == [job.name]  # no second job, not even its record
    pid = int((no_torchrun / "jobs" / job.name / "fake.pid").read_text())
    stopped = job.stop(grace_s=10)
    assert stopped.state == "Stopped" and stopped.exit_code == 143  # 128 + SIGTERM
    assert not alive(pid)


def test_stop_kills_after_the_grace_period_when_sigterm_is_ignored(no_torchrun, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", "hang")
    monkeypatch.setenv("FAKE_TRAIN_IGNORE_TERM", "1")
    job = submit().job
    wait_for_line(job, "hanging")
    pid = int((no_torchrun / "jobs" / job.name / "fake.pid").read_text())
    stopped = job.stop(grace_s=0.3)
    assert stopped.state == "Stopped" and stopped.exit_code == 137  # 128 + SIGKILL
    assert not alive(pid)


def test_a_stop_before_the_runner_records_the_group_still_stops_the_trainer(no_torchrun, monkeypatch):
    """The trainer runs (and can be asked to stop) before its runner has recorded torchrun's group:
    Popen returns, then runner.run writes runner_pid, pid and pgid. A stop in that window waits
    for the record and signals, whatever its grace; before, it gave up after the grace and the
    trainer went on training."""
    monkeypatch.setenv("FAKE_TRAIN", "hang")
    job = submit().job
    wait_for_line(job, "hanging")
    directory = no_torchrun / "jobs" / job.name
    recorded = runner_record(no_torchrun, job.name)
    trainer = int((directory / "fake.pid").read_text())
    # status.json as it stands inside the window: submit's record, before the runner's write.
    unrecorded = {k: v for k, v in recorded.items() if k not in ("runner_pid", "pid", "pgid", "pgid_start")}
    unrecorded["transitions"] = recorded["transitions"][:1]
    write_json(directory / "status.json", unrecorded)
    runner_writes = threading.Timer(1.0, write_json, (directory / "status.json", recorded))
    runner_writes.start()
    try:
        stopped = job.stop(grace_s=0.3)
        assert (stopped.state, stopped.exit_code) == ("Stopped", 143)
        assert not alive(trainer)
    finally:
        runner_writes.join()
        if alive(trainer) and os.getpgid(trainer) == recorded["pgid"]:  # this test's job's own group
            os.killpg(recorded["pgid"], 9)


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


def hanging_job_without_its_runner(home) -> tuple[Job, dict]:
    """A job whose trainer hangs, after its runner was killed: (job, its last status.json)."""
    job = submit().job
    wait_for_line(job, "hanging")
    status = runner_record(home, job.name)
    os.kill(status["runner_pid"], 9)
    return job, status


def test_a_job_whose_runner_and_processes_died_is_failed(no_torchrun, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", "hang")
    job, status = hanging_job_without_its_runner(no_torchrun)
    os.killpg(status["pgid"], 9)
    deadline = time.monotonic() + 10
    while job.status().state == "InProgress" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.status().state == "Failed"
    assert job.status().failure_reason == "the launcher's runner process died; see runner.log"


def test_a_job_whose_runner_died_keeps_training_and_stop_still_ends_it(no_torchrun, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", "hang")
    job, _ = hanging_job_without_its_runner(no_torchrun)
    trainer = int((no_torchrun / "jobs" / job.name / "fake.pid").read_text())
    time.sleep(0.3)
    now = job.status()
    assert now.state == "InProgress" and "the runner died" in now.secondary  # the trainer still runs
    stopped = job.stop(grace_s=10)
    assert (stopped.state, stopped.exit_code) == ("Stopped", 143)
    assert not alive(trainer)


def test_submit_prints_how_to_follow_the_job(no_torchrun, cli):
    result = cli("submit", recipe_path("tiny-cpu"))
    assert result.code == 0, result.err
    name = result.out.split(":")[0]
    assert result.out.strip() == f"{name}: follow with `launcher logs {name} --follow`"
    assert "memory: fits" in result.err
    assert list(Job.find(name).logs(follow=True, poll_s=0.05))[-1].startswith("summary")


def failure_report(tmp_path, failures: list[tuple[int, str, float | None]], root: int) -> None:
    """An output.log ending in torchrun's failure report, with one error file per failed rank."""

    def entry(rank: int) -> str:
        message, raised_at = next((m, t) for r, m, t in failures if r == rank)
        extra = {"py_callstack": "Traceback ...", "timestamp": "1796016076"}
        if raised_at is not None:
            extra["raised_at"] = f"{raised_at:.6f}"
        path = tmp_path / f"error-{rank}.json"
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))
        return f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : 1 (pid: 1)\n  error_file: {path}\n"

    others = "".join(f"[{i}]:\n{entry(r)}" for i, (r, _, _) in enumerate(failures, 1) if r != root)
    report = f"Failures:\n{others}----\nRoot Cause (first observed failure):\n[0]:\n{entry(root)}====\n"
    (tmp_path / "output.log").write_text(f"metrics step=1 loss=2.0\n{report}")


def test_the_failure_reason_is_the_rank_that_raised_first_not_torchruns_first_exit(tmp_path):
    from launcher.backends.local.runner import root_cause

    closed = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4747"
    failure_report(
        tmp_path,
        [(0, "NotADirectoryError: [Errno 20] Not a directory: '/x'", 100.25), (1, closed, 100.5), (3, closed, 100.3)],
        root=3,
    )
    assert root_cause(tmp_path) == "rank 0: NotADirectoryError: [Errno 20] Not a directory: '/x'"


def test_without_raise_times_the_reason_is_torchruns_root_cause(tmp_path):
    from launcher.backends.local.runner import root_cause

    failure_report(tmp_path, [(0, "ValueError: bad", None), (2, "RuntimeError: symptom", None)], root=2)
    assert root_cause(tmp_path) == "rank 2: RuntimeError: symptom"


def test_stop_waits_for_workers_that_saved_and_are_exiting_rather_than_killing_them(no_torchrun, monkeypatch):
    # `stop --grace 5` on the real trainer: SIGTERM, the step ends, the checkpoint is saved and the
    # stop line printed before the grace ends, but the processes exit after it: that was exit 137.
    monkeypatch.setenv("FAKE_TRAIN", "hang")
    monkeypatch.setenv("FAKE_TRAIN_SLOW_EXIT", "1.5")
    job = submit().job
    wait_for_line(job, "hanging")
    pid = int((no_torchrun / "jobs" / job.name / "fake.pid").read_text())
    stopped = job.stop(grace_s=0.5)
    assert (stopped.state, stopped.exit_code) == ("Stopped", 143)
    assert not alive(pid)
    assert "interrupted by SIGTERM after step 3; checkpoint saved" in list(job.logs())


def test_the_stop_line_the_backend_waits_on_is_the_trainers():
    from launcher.backends.local.backend import STOP_LINE

    assert f'print(f"{STOP_LINE}{{step}}; {{what}}", flush=True)' in (REPO / "entrypoints" / "train.py").read_text()
