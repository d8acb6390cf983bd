"""What the launcher reads back from $LAUNCHER_HOME is checked, and what it writes survives a bad day.

Damaged records (job.json, status.json, spec.json, metrics.jsonl) are one line naming the file;
a full disk is named with its path and leaves no temporary file; a local job's outcome is read
from its files when its runner is gone; a submit that dies leaves no phantom job; names are
names, so no path built from one leaves its root. Local jobs run the stand-in trainer
(`no_torchrun`), a fraction of a second each; full disks are real tmpfs mounts (root).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.registry import JobRef, records, save, write_json
from tests import REPO
from tests.backends.helpers import FAKE_ENTRYPOINTS, alive, recipe_path, runner_record, submit, wait_for_line
from tests.disks import fill_disk, small_disk

TINY = recipe_path("tiny-cpu")


# --- helpers ------------------------------------------------------------------------------------


def temporary_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.tmp"))


def wait_until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def runner_pid(home: Path, name: str) -> int:
    return runner_record(home, name)["runner_pid"]


def one_line(result) -> str:
    assert len(result.err_lines) == 1, result.err
    assert "Traceback" not in result.err + result.out
    return result.err_lines[0]


# --- damaged records: one parametrised table -----------------------------------------------------


@pytest.fixture(scope="module")
def finished_home(tmp_path_factory):
    """A $LAUNCHER_HOME holding two completed local jobs (stand-in trainer): (home, [older, newer])."""
    import launcher.backends.local.backend as local
    import launcher.bundle

    home = tmp_path_factory.mktemp("pristine") / "home"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAUNCHER_HOME", str(home))
        patch.setattr(launcher.bundle, "find_entrypoints", lambda: FAKE_ENTRYPOINTS)
        patch.setattr(
            local, "torchrun_argv", lambda command: [sys.executable, *command[command.index("entrypoints/train.py") :]]
        )
        names = [submit(wait=True, poll_s=0.05).spec.name for _ in range(2)]
    return home, names


@pytest.fixture
def damaged_home(finished_home, tmp_path, monkeypatch, fake_bundle):
    """A private copy of `finished_home`, which each case damages: (home, damaged job, other job)."""
    pristine, (other, damaged) = finished_home
    home = tmp_path / "home"
    shutil.copytree(pristine, home, symlinks=True)
    monkeypatch.setenv("LAUNCHER_HOME", str(home))
    return home, damaged, other


def _edited(change):
    def edit(raw: bytes) -> bytes:
        data = json.loads(raw)
        change(data)
        return json.dumps(data).encode()

    return edit


def _edited_rows(row: str):
    return lambda raw: raw + row.encode() + b"\n"


# For each file: what to drop for "missing a key", what to set for "a wrong type".
MISSING = {
    "job.json": _edited(lambda d: d.pop("backend")),
    "status.json": _edited(lambda d: d.pop("state")),
    "spec.json": _edited(lambda d: d.pop("recipe_name")),
    "metrics.jsonl": _edited_rows('{"loss": 1.0}'),
}
WRONG_TYPE = {
    "job.json": _edited(lambda d: d.update(name=42)),
    "status.json": _edited(lambda d: d.update(transitions="Completed")),
    "spec.json": _edited(lambda d: d.update(lineage=7)),
    "metrics.jsonl": _edited_rows('{"step": NaN, "loss": "high"}'),
}
CORRUPTIONS = {
    "truncated": lambda file: lambda raw: raw[: len(raw) // 2],
    "not JSON": lambda file: lambda raw: b"this is not JSON\n",
    "a list": lambda file: lambda raw: b"[1, 2, 3]\n",
    "a string": lambda file: lambda raw: b'"job"\n',
    "missing a key": MISSING.get,
    "a wrong type": WRONG_TYPE.get,
    "binary garbage": lambda file: lambda raw: b"\x89PNG\r\n\x1a\n\x00\xff\xfe\x80" * 16,
    "a directory": lambda file: "directory",
    "a FIFO": lambda file: "fifo",
}


def damage(path: Path, corruption: str) -> None:
    how = CORRUPTIONS[corruption](path.name)
    raw = path.read_bytes()
    path.unlink()
    if how == "directory":
        path.mkdir()
    elif how == "fifo":
        os.mkfifo(path)  # a reader that opened it plainly would block forever
    else:
        path.write_bytes(how(raw))


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
@pytest.mark.parametrize("file", ["job.json", "status.json", "spec.json", "metrics.jsonl"])
def test_a_damaged_state_file_is_one_line_naming_it_and_list_shows_the_other_jobs(damaged_home, cli, file, corruption):
    home, name, other = damaged_home
    path = home / "jobs" / name / file
    damage(path, corruption)
    if file == "metrics.jsonl":
        # Metrics are the trainer's stream: damaged rows are skipped, the job's state stands.
        status = cli("status", name)
        assert status.code == 0 and "Completed" in status.out and "Traceback" not in status.err, status.err
        metrics = cli("metrics", name)
        assert metrics.code == 0 and metrics.out.split()[0] == "STEP", metrics.err
        return
    if file == "spec.json":  # read by --resume
        line = one_line(result := cli("-q", "submit", TINY, "--backend", "local", "--resume", name, "--dry-run"))
        assert result.code == 2 and line.startswith(f"{path}: ") and ("job spec" in line), line
        assert cli("status", name).code == 0
        return
    what = "job record" if file == "job.json" else "job status"
    status = cli("status", name)
    line = one_line(status)
    assert status.code == 2 and line.startswith(f"{path}: ") and what in line, line
    listed = cli("list")
    assert listed.code == 2 and one_line(listed) == line
    rows = listed.out.splitlines()
    assert len(rows) == 2 and rows[1].split()[:3] == [other, "local", "Completed"], listed.out


LOG_IN_ITS_PLACE = {
    "a FIFO": lambda path: os.mkfifo(path),  # a reader that opened it plainly would block forever
    "a device": lambda path: path.symlink_to("/dev/zero"),  # a reader that read to its end would never stop
    "a directory": lambda path: path.mkdir(),
}


def _capped_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2**31, 2**31))  # reading /dev/zero whole fails here, not the host


@pytest.mark.parametrize("kind", list(LOG_IN_ITS_PLACE))
def test_a_job_log_that_is_not_a_file_is_one_line_naming_it_not_a_hang(damaged_home, kind):
    """`launcher logs` in its own process (a hang or an endless read must fail the test, not hold it)."""
    home, name, _ = damaged_home
    path = home / "jobs" / name / "output.log"
    path.unlink()
    LOG_IN_ITS_PLACE[kind](path)
    env = {**os.environ, "LAUNCHER_HOME": str(home), "PYTHONPATH": str(REPO)}
    follow = ["--follow"] if kind == "a FIFO" else []  # both read through follow_file's one open
    logs = subprocess.run(
        [sys.executable, "-m", "launcher", "logs", name, *follow],
        env=env, capture_output=True, text=True, timeout=60, preexec_fn=_capped_memory,
    )  # fmt: skip
    line = f"{path}: damaged job log: it is {kind}, not a file; move it away"
    assert (logs.returncode, logs.stderr.splitlines(), logs.stdout) == (2, [line], ""), logs.stderr[-2000:]


def test_a_job_whose_runner_is_gone_is_read_without_blocking_on_fifos_in_its_files(damaged_home):
    """status.json still says InProgress, its runner is gone and its log and the runner's are
    FIFOs: `status` (in its own process) reads the outcome from what is left, never blocking on a
    FIFO as a plain open would."""
    home, name, _ = damaged_home
    directory = home / "jobs" / name
    status = json.loads((directory / "status.json").read_text())
    write_json(directory / "status.json", {**status, "state": "InProgress", "exit_code": None})
    (directory / "exit.json").unlink()  # no exit code: the log's summary line, then runner.log's tail
    for file in ("output.log", "runner.log"):
        (directory / file).unlink(missing_ok=True)
        os.mkfifo(directory / file)
    env = {**os.environ, "LAUNCHER_HOME": str(home), "PYTHONPATH": str(REPO)}
    shown = subprocess.run(
        [sys.executable, "-m", "launcher", "status", name, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert json.loads(shown.stdout)["state"] == "Failed"
    assert "the launcher's runner process died" in json.loads(shown.stdout)["failure_reason"]


# --- writes: atomic, and a full disk named with its path -------------------------------------------


def test_a_full_disk_is_named_with_the_path_and_leaves_no_temporary_file(tmp_path):
    from launcher.registry import DiskError

    with small_disk(tmp_path / "disk", "64k") as disk:
        write_json(disk / "status.json", {"state": "InProgress"})
        fill_disk(disk)
        with pytest.raises(DiskError) as raised:
            write_json(disk / "status.json", {"state": "Completed", "padding": "x" * 8192})
        assert str(raised.value) == f"disk full writing {disk}/status.json (ENOSPC)"
        assert temporary_files(disk) == []
        assert json.loads((disk / "status.json").read_text()) == {"state": "InProgress"}  # the old one stands


def test_a_writer_killed_mid_write_leaves_no_temporary_file_behind_the_next_write(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now no process's
    orphan = tmp_path / f".status.json.{dead.pid}.x1y2.tmp"
    orphan.write_text('{"state": "Trai')
    living = tmp_path / f".status.json.{os.getppid()}.z3w4.tmp"  # a writer that is still running
    living.write_text("{")
    write_json(tmp_path / "status.json", {"state": "Completed"})
    assert temporary_files(tmp_path) == [living.name]
    assert json.loads((tmp_path / "status.json").read_text()) == {"state": "Completed"}


def test_a_full_disk_at_submit_is_one_line_and_leaves_no_job(no_torchrun, cli, fixed_names):
    """Room for the job's record, none for its code: the bundle's extraction hits ENOSPC."""
    from launcher.registry import forget

    home = no_torchrun
    with small_disk(home):
        spec = submit(backend="local", dry_run=True).spec
        before = os.statvfs(home).f_bavail
        save(JobRef(name=spec.name, backend="local", submitting={"pid": 1, "start": 1, "host": "x"}), spec)
        record_blocks = before - os.statvfs(home).f_bavail
        forget(spec.name)
        fill_disk(home, leave_blocks=record_blocks)
        result = cli("-q", "submit", TINY, "--backend", "local")
        line = one_line(result)
        assert result.code == 1 and line.startswith("disk full writing ") and f"{home}/jobs/{spec.name}/code" in line
        assert line.endswith("(ENOSPC); nothing was submitted"), line
        assert records() == [] and cli("list").out.strip() == "no jobs"
        assert temporary_files(home) == []
        assert not (home / "jobs" / spec.name).exists()  # no half-extracted code/ either


@pytest.mark.parametrize(
    ("free_blocks", "reason", "runner_line"),
    [
        # No room even for exit.json: the runner's own last line says why, and status shows it.
        (0, "the launcher's runner failed: disk full writing {d}/exit.json (ENOSPC); see runner.log", "exit.json"),
        # exit.json fits, status.json does not: the outcome is read from exit.json.
        (1, "torchrun exited with code 3: RuntimeError: fake failure in step 4", "status.json"),
    ],
)
def test_a_full_disk_in_the_runner_is_named_and_the_outcome_survives_in_the_exit_file(
    no_torchrun, monkeypatch, free_blocks, reason, runner_line
):
    monkeypatch.setenv("FAKE_TRAIN", "fail")
    monkeypatch.setenv("FAKE_TRAIN_HOLD", "1")
    home = no_torchrun
    with small_disk(home):
        job = submit().job
        directory = home / "jobs" / job.name
        wait_for_line(job, "holding")
        runner = runner_pid(home, job.name)
        fill_disk(home, leave_blocks=free_blocks)
        (directory / "release").touch()
        wait_until(lambda: not alive(runner), "the runner to end")
        status = job.status()
        assert (status.state, status.failure_reason) == ("Failed", reason.format(d=directory))
        assert f"disk full writing {directory}/{runner_line} (ENOSPC)" in (directory / "runner.log").read_text()
        assert temporary_files(home) == []


# --- status from what is on disk ---------------------------------------------------------------------


def test_a_job_that_finished_after_its_runner_was_killed_is_completed(no_torchrun, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN_HOLD", "1")
    job = submit().job
    directory = no_torchrun / "jobs" / job.name
    wait_for_line(job, "holding")
    runner, trainer = runner_pid(no_torchrun, job.name), int((directory / "fake.pid").read_text())
    os.kill(runner, signal.SIGKILL)
    wait_until(lambda: not alive(runner), "the runner to die")
    (directory / "release").touch()
    wait_until(lambda: not alive(trainer), "the trainer to finish")
    status = job.status()
    assert (status.state, status.exit_code, status.failure_reason) == ("Completed", 0, None)
    assert (
        status.transitions[-1].message == "the runner died; outcome read from the job's files: the log's summary line"
    )


# --- submit leaves no phantom job ----------------------------------------------------------------------

KILLED_SUBMIT = """
import os, signal, sys
from pathlib import Path
import launcher.bundle
import launcher.backends.local.backend as local
launcher.bundle.find_entrypoints = lambda: Path(sys.argv[1])
# The submit is killed at the last moment before the backend takes the job.
local.LocalBackend._submit = lambda self, rendering: os.kill(os.getpid(), signal.SIGKILL)
from launcher import api
api.submit(sys.argv[2])
"""


def test_a_submit_killed_before_the_engine_is_never_submitted_and_list_clean_removes_it(home, cli):
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_SUBMIT, str(FAKE_ENTRYPOINTS), str(TINY)],
        env={**os.environ, "LAUNCHER_HOME": str(home), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (name,) = [ref.name for ref in records()]
    pid = json.loads((home / "jobs" / name / "job.json").read_text())["submitting"]["pid"]
    detail = f"never submitted: its submit (pid {pid}) ended before local took the job"
    listed = cli("list")
    assert listed.code == 0 and listed.out.splitlines()[1].split()[:3] == [name, "local", "NeverSubmitted"]
    assert f"{detail}; `launcher list --clean` removes the record" in listed.out
    status = cli("status", name)
    assert status.code == 0 and status.out.startswith(f"{name}  [local]  NeverSubmitted ({detail}")
    cleaned = cli("list", "--clean")
    assert cleaned.code == 0 and cleaned.err_lines == [f"removed {name}: {detail}"]
    assert cleaned.out.strip() == "no jobs" and not (home / "jobs" / name).exists()


def test_a_sagemaker_record_whose_submit_died_before_create_training_job_is_never_submitted(aws, home, cli):
    """The engine's own answer decides it: DescribeTrainingJob of a job it never got fails with
    ResourceNotFound (botocore's sagemaker model lists it for that operation; moto answers with
    ValidationException "not found")."""
    from launcher.api import submit as api_submit

    spec = api_submit(recipe_path("llama3-8b-8k"), dry_run=True).spec
    dead = subprocess.Popen(["true"])
    dead.wait()
    save(
        JobRef(
            name=spec.name,
            backend="sagemaker",
            region="us-west-2",
            submitting={"pid": dead.pid, "start": 1, "host": os.uname().nodename},
        ),
        spec,
    )
    listed = cli("list")
    assert listed.code == 0 and listed.out.splitlines()[1].split()[:3] == [spec.name, "sagemaker", "NeverSubmitted"]
    cleaned = cli("list", "--clean")
    assert cleaned.err_lines == [
        f"removed {spec.name}: never submitted: its submit (pid {dead.pid}) ended before sagemaker took the job"
    ]
    assert records() == []


def test_a_submit_still_under_way_is_shown_and_list_clean_keeps_it(home, cli, fake_bundle):
    from launcher.backends.processes import process_start_time

    spec = submit(backend="local", dry_run=True).spec
    me = {"pid": os.getpid(), "start": process_start_time(os.getpid()), "host": os.uname().nodename}
    save(JobRef(name=spec.name, backend="local", submitting=me), spec)
    cleaned = cli("list", "--clean")
    assert cleaned.code == 0 and cleaned.err_lines == []
    assert cleaned.out.splitlines()[1].split()[:3] == [spec.name, "local", "Submitting"]
    assert [ref.name for ref in records()] == [spec.name]


def test_a_submit_that_fails_with_any_exception_takes_its_record_back(no_torchrun, monkeypatch):
    import launcher.backends.local.backend as local

    def broken(self, rendering):
        raise RuntimeError("a bug in a backend")

    monkeypatch.setattr(local.LocalBackend, "_submit", broken)
    with pytest.raises(RuntimeError, match="a bug in a backend"):
        submit()
    assert records() == [] and not list((no_torchrun / "jobs").glob("*/job.json"))


# --- names are names ------------------------------------------------------------------------------

INVALID = "is not a job name: a name is 1 to 63 letters, digits and hyphens, starting and ending with a letter or digit"


@pytest.fixture
def outside(home):
    """A job record outside $LAUNCHER_HOME/jobs, where `../../outside` leads from a job name."""
    directory = home.parent / "outside"
    directory.mkdir(parents=True)
    return directory


@pytest.mark.parametrize(
    ("args", "what", "value"),
    [
        (("status", "../../outside"), "job name", "../../outside"),
        (("logs", ".."), "job name", ".."),
        (("stop", "a/b"), "job name", "a/b"),
        (("status", "x" * 64), "job name", "x" * 64),
        (
            ("-q", "submit", TINY, "--backend", "local", "--resume", "../../outside", "--dry-run"),
            "--resume",
            "../../outside",
        ),
    ],
)
def test_a_name_that_is_not_a_name_is_refused_in_one_line(home, outside, fake_bundle, cli, args, what, value):
    (home / "jobs").mkdir(parents=True)
    spec = submit(backend="local", dry_run=True).spec
    write_json(outside / "job.json", {"name": "../../outside", "backend": "local"})
    write_json(outside / "spec.json", spec.to_dict())  # what the escape would read
    result = cli(*args)
    assert result.code == 2 and one_line(result) == f"{what} {value!r} {INVALID}"


def test_a_lineage_read_from_a_spec_is_a_name_too(home, fake_bundle, cli):
    spec = submit(backend="local", dry_run=True).spec
    directory = save(JobRef(name=spec.name, backend="local"), spec)
    write_json(directory / "spec.json", {**spec.to_dict(), "lineage": "../../../escape"})
    result = cli("-q", "submit", TINY, "--backend", "local", "--resume", spec.name, "--dry-run")
    assert result.code == 2 and one_line(result) == f"{directory}/spec.json: lineage '../../../escape' {INVALID}"


def test_a_job_directory_that_links_outside_the_registry_is_refused(home, outside, cli):
    write_json(outside / "job.json", {"name": "evil", "backend": "local"})
    (home / "jobs").mkdir(parents=True)
    (home / "jobs" / "evil").symlink_to(outside)
    result = cli("status", "evil")
    line = one_line(result)
    assert (
        result.code == 2
        and line
        == f"job name evil: {home}/jobs/evil leads outside {home}/jobs (a link); move it back under {home}/jobs"
    )
