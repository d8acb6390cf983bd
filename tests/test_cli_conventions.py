"""The CLI's conventions, each with the problem it fixed: version, completion, quiet,
JSON errors, exit codes, the AWS CLI's region order, whole `show`, quiet broken pipes, MiB
figures, run time and cost in the plan, and Ctrl-C that detaches from a job that goes on."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

from launcher import api
from launcher.jobs import Job
from tests import REPO
from tests.backends.helpers import alive, recipe_path

LAUNCHER = [sys.executable, "-m", "launcher"]


def run_shell(command: str, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], cwd=REPO, env=environment, capture_output=True, text=True, timeout=60
    )


@contextlib.contextmanager
def ctrl_c_when_a_log_says(text: str, home):
    """Send this process SIGINT (Ctrl-C) once a job's log holds `text`, as a user would."""
    done = threading.Event()

    def watch():
        deadline = time.monotonic() + 30
        while not done.is_set() and time.monotonic() < deadline:
            if any(text in log.read_text(errors="replace") for log in home.glob("jobs/*/output.log")):
                time.sleep(1.0)  # inside the follow loop by now
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    # A shell starts a background job with SIGINT ignored (POSIX), and Python then installs no
    # KeyboardInterrupt handler: a terminal's Ctrl-C reaches a foreground CLI, so give it one here.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGINT, previous)


def test_version_and_help_show_flags_without_a_bool_type(cli):
    from launcher import __version__

    assert cli("--version").out.strip() == f"launcher {__version__}"
    for args in (("--help",), ("submit", "--help"), ("plan", "--help")):
        result = cli(*args)
        assert result.code == 0 and "--json" in result.out or "--quiet" in result.out
        assert "<bool>" not in result.out, args


def test_shell_completion_script_is_printed_offline():
    # typer (with shellingham) reads the shell from the parent processes, not from the argument:
    # the pipe keeps bash the parent (a lone `bash -c CMD` execs CMD), wherever pytest was started.
    done = run_shell(f"{sys.executable} -m launcher --show-completion bash | cat")
    assert done.returncode == 0, done.stderr
    assert "_launcher_completion" in done.stdout and "complete " in done.stdout


def test_a_closed_pipe_ends_quietly_with_exit_0():
    for command in (
        f"{sys.executable} -m launcher schema | head -1",
        f"{sys.executable} -m launcher plan recipes/llama3-8b-8k.yaml | head -1",
    ):
        done = run_shell(command)
        assert (done.returncode, done.stderr) == (0, ""), command
        assert done.stdout.strip()


def test_json_errors_are_json_on_stdout_with_the_problems(cli):
    result = cli("estimate", recipe_path("llama3-8b-8k"), "--set", "parallel.tensor=3", "--json")
    report = json.loads(result.out)
    assert result.code == report["exit_code"] == 2 and result.err == ""
    problem = next(p for p in report["problems"] if p["path"] == "parallel.tensor")
    assert problem["source"] == "--set" and "3" in problem["message"]
    assert f"--set parallel.tensor: {problem['message']}" in report["error"].splitlines()

    usage = cli("plan", recipe_path("tiny-cpu"), "--bogus", "--json")
    assert usage.code == 2
    error = json.loads(usage.out)["error"]
    assert error.startswith("launcher plan: No such option: --bogus") and error.endswith("(see `launcher plan --help`)")


def test_exit_codes_bad_input_2_wont_fit_2_engine_3(cli, monkeypatch, tmp_path):
    assert cli("estimate", tmp_path / "missing.yaml").code == 2
    oom = cli("estimate", recipe_path("llama3-8b-8k"), "--set", "training.micro_batch_size=4")
    assert oom.code == 2 and "\noom: " in oom.out, oom.out
    assert cli("estimate", recipe_path("llama3-8b-8k")).code == 0

    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here: the engine is missing
    monkeypatch.setenv("LAUNCHER_HOME", str(tmp_path / "home"))
    engine = cli("status", "12345", "--backend", "slurm")
    assert engine.code == 3, (engine.code, engine.err)


def test_quiet_submit_prints_only_the_job_name(no_torchrun, cli):  # noqa: F811
    result = cli("--quiet", "submit", recipe_path("tiny-cpu"), "--wait")
    assert result.code == 0 and result.err == ""
    name = result.out.strip()
    assert "\n" not in name and Job.find(name).status().state == "Completed"


def test_ctrl_c_while_waiting_detaches_and_the_job_goes_on(no_torchrun, cli, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FAKE_TRAIN", "hang")
    with ctrl_c_when_a_log_says("hanging", no_torchrun):
        result = cli("submit", recipe_path("tiny-cpu"), "--wait")
    assert result.code == 130, result.err
    name = result.err_lines[-1].split()[2].rstrip(";")
    assert result.err_lines[-1] == (
        f"detached from {name}; it is still running. Follow it with `launcher logs {name} --follow`, "
        f"stop it with `launcher stop {name}`"
    )
    job = Job.find(name)
    assert job.status().state == "InProgress"
    pid = int((no_torchrun / "jobs" / name / "fake.pid").read_text())
    assert alive(pid)

    with ctrl_c_when_a_log_says("hanging", no_torchrun):
        follow = cli("logs", name, "--follow")
    assert follow.code == 130 and follow.err_lines[-1].startswith(f"detached from {name}; it is still running")
    assert "hanging" in follow.out

    for grace in ("-1", "nan", "inf"):  # refused before anything is signalled
        refused = cli("stop", name, "--grace", grace)
        assert (refused.code, refused.err_lines) == (2, [f"--grace {grace}: use a number of seconds, 0 or more"])
    assert job.status().state == "InProgress" and alive(pid)
    for limit in ("0", "-1"):
        refused = cli("list", "--limit", limit)
        assert (refused.code, refused.err_lines) == (2, [f"--limit {limit}: use 1 or more"])
    assert [row.name for row in api.list_jobs(limit=1)] == [name]

    stopped = job.stop(grace_s=10)
    assert (stopped.state, stopped.exit_code) == ("Stopped", 143)
    log = (no_torchrun / "jobs" / name / "output.log").read_text()
    assert "Traceback" not in log


def test_region_follows_the_aws_cli_order(cli, monkeypatch, tmp_path):
    shipped = recipe_path("llama3-8b-8k").read_text()
    without_region = tmp_path / "no-region.yaml"
    without_region.write_text("\n".join(line for line in shipped.splitlines() if "region:" not in line))

    def region(*extra: str) -> str:
        result = cli("show", recipe_path("tiny-cpu"), "--json", *extra)
        return json.loads(result.out)["sagemaker"]["region"]

    assert region() == "us-west-2"
    config = tmp_path / "config"
    config.write_text("[default]\nregion = ap-south-1\n[profile work]\nregion = eu-central-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    assert region() == "ap-south-1"
    monkeypatch.setenv("AWS_PROFILE", "work")
    assert region() == "eu-central-1"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert region() == "eu-west-1"
    monkeypatch.setenv("AWS_REGION", "sa-east-1")
    assert region() == "sa-east-1"
    assert region("--set", "sagemaker.region=us-east-2") == "us-east-2"
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    rendered = json.loads(cli("submit", without_region, "--backend", "sagemaker", "--dry-run", "--json").out)
    assert ".eu-west-3." in rendered["request"]["AlgorithmSpecification"]["TrainingImage"]


def test_list_sagemaker_jobs_without_region_uses_the_environments(aws, cli):
    result = cli("list", "--backend", "sagemaker")
    assert (result.code, result.out.strip()) == (0, "no jobs"), result.err


def test_show_prints_every_section_and_tiny_figures_are_mib(cli):
    shown = json.loads(cli("show", recipe_path("tiny-cpu"), "--json").out)
    assert {"model", "training", "parallel", "cluster", "sagemaker", "slurm", "k8s", "derived"} <= set(shown)
    assert shown["cluster"]["backend"] == "local"

    table = cli("estimate", recipe_path("tiny-cpu")).out
    assert "┃ MiB per CPU rank" in table and "┃ GiB per" not in table
    assert "│ parameters       │                    0.85 │" in table  # 0.00 in GiB
    assert "┃ GiB per GPU" in cli("estimate", recipe_path("llama3-8b-8k")).out


def test_the_plan_table_shows_run_time_and_cost(cli):
    out = cli("plan", recipe_path("llama3-8b-8k"), "--top", "2").out
    header = out.splitlines()[2:4]
    assert "run" in header[0] and "time" in header[1] and "cost" in header[1]
    first = out.splitlines()[5].split()
    assert first[-1].startswith("$") and first[-2] in ("h", "min", "days", "s")
