"""The README's main job, exactly: `launcher submit recipes/tiny-cpu.yaml --backend local --wait`.

One real torchrun launch: a tiny Llama trained by 4 gloo processes (FSDP 2 x TP 2) through the
installed CLI, the real entrypoints and the local backend's runner.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from launcher.backends import processes
from launcher.backends.sagemaker.backend import METRIC_DEFINITIONS
from launcher.contract.checkpoint_dirs import complete_checkpoints
from launcher.contract.failure import read_error_file
from tests.disks import fill_disk, small_disk
from tests.progress import log_size, wait_while_growing

from .helpers import REPO, alive

pytestmark = [pytest.mark.torchrun, pytest.mark.engines]


def launcher(*args: str, home: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    executable = Path(sys.executable).with_name("launcher")
    env = {**os.environ, "LAUNCHER_HOME": str(home)}
    return subprocess.run([str(executable), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def from_checkout(*args: str, home: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m launcher` from the checkout: the code under test, whichever environment runs it."""
    env = {**os.environ, "LAUNCHER_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def readme_main_job(tmp_path_factory) -> tuple[str, Path]:
    """(stdout, LAUNCHER_HOME) of the README's main job. `.ci/run` has just run it, exactly as the
    README says, in a clean copy of this tree and a venv of its own (README command 1), and names
    that copy in LAUNCHER_CI_README_JOB: the job is checked there rather than trained twice.
    Elsewhere it trains here, once for the module: its tests only read what it left."""
    ran = os.environ.get("LAUNCHER_CI_README_JOB")
    if ran:
        return (Path(ran) / "readme-job.stdout").read_text(), Path(ran) / ".launcher-home"
    home = tmp_path_factory.mktemp("readme-job") / "home"
    result = launcher("submit", "recipes/tiny-cpu.yaml", "--backend", "local", "--wait", home=home)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, home


def test_ci_runs_the_readme_commands_as_the_readme_writes_them():
    """What lets the test below check CI's run of command 1: CI runs the README's commands verbatim."""
    block = (REPO / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    ci = (REPO / ".ci" / "run").read_text()
    first, second = commands
    assert f"    {first} | tee readme-job.stdout\n" in ci
    setup, tests = second.split(" && ")
    assert f"\n{setup}\n" in ci and f'LAUNCHER_CI_README_JOB="$first" {tests} --durations=15' in ci


def test_the_readme_main_job_trains_and_ends_with_loss_and_throughput(readme_main_job):
    stdout, home = readme_main_job
    lines = stdout.splitlines()
    # The host-CPU step model predicts the layout (docs/monitoring.md); a busy machine may run below it.
    ends = r"tiny-cpu-\S+: Completed\. loss [\d.]+, tokens/s/GPU [\d.]+, step 20; ran at (\d+)% of predicted(; warning: .+)?"
    assert re.fullmatch(ends, lines[-1]), lines[-1]
    name = lines[-1].split(":")[0]

    # Every metric line of the run is readable by the SageMaker MetricDefinitions.
    metric_lines = [line for line in lines if line.startswith("metrics ")]
    assert len(metric_lines) == 20
    for definition in METRIC_DEFINITIONS:
        # mfu is nan on the CPU; validation: metrics are on the lines of steps that evaluate (none here)
        if definition["Name"].startswith("train:") and definition["Name"] != "train:mfu":
            assert all(re.search(definition["Regex"], line) for line in metric_lines), definition
    losses = [float(re.search(METRIC_DEFINITIONS[1]["Regex"], line).group(1)) for line in metric_lines]
    assert losses[-1] < losses[0]

    directory = home / "jobs" / name
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    status = json.loads(launcher("status", name, "--json", home=home).stdout)
    assert (status["state"], status["exit_code"]) == ("Completed", 0)
    assert status["details"]["summary"]["steps"] == 20
    predicted = status["details"]["predicted"]["tokens_per_s_per_gpu"]
    share = records[-1]["tokens_per_s_per_gpu"] / predicted
    assert f"\n  speed    ran at {share:.0%} of predicted\n" in launcher("status", name, home=home).stdout


def test_a_resume_says_which_checkpoint_it_starts_from_and_refuses_what_would_start_over(
    readme_main_job, monkeypatch, tmp_path
):
    """`submit --resume` of the README job (its real checkpoints at steps 10 and 20), dry runs."""
    from launcher import api
    from launcher.errors import UsageError

    readme_stdout, home = readme_main_job
    name = readme_stdout.splitlines()[-1].split(":")[0]
    checkpoints = home / "checkpoints" / "tiny-cpu" / name
    monkeypatch.setenv("LAUNCHER_HOME", str(home))
    recipe = REPO / "recipes" / "tiny-cpu.yaml"

    def dry_run(*options: str, backend: str = "local") -> list[str]:
        told = []
        report = lambda stage, message: told.append(message)  # noqa: E731
        api.submit(recipe, backend=backend, resume=name, set_options=options, dry_run=True, report=report)
        return told

    start = f"resumes from {checkpoints}/step-00000020, the newest complete checkpoint (step 20; an older one if it is damaged)"
    told = dry_run("training.steps=30")
    assert start in told
    assert any(re.match(r"time: \S+ s/step x 10 steps after step 20 = ", line) for line in told), told
    with pytest.raises(
        UsageError,
        match=r"^checkpoint: the newest complete checkpoint in .* is at step 20, and training\.steps is 20: nothing is left to train; raise training\.steps",
    ):
        dry_run()
    # Checkpoints elsewhere: the job would start from step 0 in silence; refused, nothing made.
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(UsageError) as refused:
        dry_run(f"checkpoint.dir={elsewhere}", "training.steps=30")
    assert str(refused.value) == (
        f"--resume {name}: its checkpoints are in {checkpoints}, but this job's would be in {elsewhere}, where it "
        f"would start from step 0; set checkpoint.dir: {checkpoints}, as {name} had it"
    )
    assert not elsewhere.exists()
    # docker binds the lineage's directory of this machine into the container: the same checkpoints.
    dry_run("training.steps=30", backend="docker")


def test_a_failed_job_names_the_rank_that_failed_first_not_a_peers_symptom(tmp_path):
    # Rank 0 alone creates the checkpoint directory (for its lease); on a full disk (a real tmpfs)
    # that fails, while rank 1 waits for its resume decision and then fails with gloo's
    # "Connection closed by peer" (the symptom). (A directory under a file is refused at submit.)
    home = tmp_path / "home"
    overrides = ["training.steps=2", "checkpoint.every_steps=1", f"checkpoint.dir={tmp_path / 'full' / 'ckpt'}"]
    overrides += ["cluster.nproc_per_node=2", "parallel.tensor=1"]  # one peer shows the symptom as well as three
    overrides.append("cluster.max_restarts=0")  # the point is the reason, not a second identical failure
    args = [arg for override in overrides for arg in ("--set", override)]
    with small_disk(tmp_path / "full", "64k") as full:
        fill_disk(full)
        result = from_checkout("submit", "recipes/tiny-cpu.yaml", "--backend", "local", "--wait", *args, home=home)
    assert result.returncode != 0
    # The peer fails too: with gloo's symptom, or, where torchrun's agent notices rank 0's exit
    # first (it polls every 0.1 s, monitor_interval in torch/distributed/launcher/api.py) and
    # stops the rest ("Sending process %s closing signal %s", torch/distributed/elastic/
    # multiprocessing/api.py), by its SIGTERM: the race a loaded machine can lose either way.
    peer_failed = "Connection closed by peer" in result.stdout or "closing signal SIGTERM" in result.stdout
    assert peer_failed, result.stdout[-3000:]
    name = result.stdout.splitlines()[-1].split(":")[0]
    status = json.loads(from_checkout("status", name, "--json", home=home, timeout=60).stdout)
    # The reason is rank 0's error, not the peer's.
    assert status["state"] == "Failed"
    assert (
        status["failure_reason"] == "torchrun exited with code 1: rank 0: OSError: [Errno 28] No space left on device"
    )


def test_an_export_that_fails_after_the_last_step_is_the_reason_after_torchruns_restart_too(tmp_path):
    # checkpoint.export_hf on a full disk (a real tmpfs): the writer (rank 0 of FSDP 2) cannot
    # write its file after the last checkpoint, and torchrun restarts the workers (max_restarts 1,
    # the local default). The restarted workers find the job's own checkpoint of the last step and
    # run the export again, instead of refusing with "nothing is left to train": that refusal was
    # the job's failure reason before, and the export's error was lost with the first attempt.
    home = tmp_path / "home"
    export = tmp_path / "full" / "hf"
    overrides = ["training.steps=2", "checkpoint.every_steps=0", f"checkpoint.export_hf={export}"]
    overrides += ["cluster.nproc_per_node=2", "parallel.tensor=1", f"checkpoint.dir={tmp_path / 'checkpoints'}"]
    args = [arg for override in overrides for arg in ("--set", override)]
    with small_disk(tmp_path / "full", "64k") as full:
        fill_disk(full)
        result = from_checkout("submit", "recipes/tiny-cpu.yaml", "--backend", "local", "--wait", *args, home=home)
        left = sorted(path.name for path in export.iterdir())
    assert result.returncode != 0
    name = result.stdout.splitlines()[-1].split(":")[0]
    log = (home / "jobs" / name / "output.log").read_text()
    assert "checkpoint: this job's earlier attempt trained to step 2 and saved it; running what follows" in log
    assert "nothing is left to train" not in log
    assert left == []  # the writer removed its partial file; no index or config.json names it
    status = json.loads(from_checkout("status", name, "--json", home=home, timeout=60).stdout)
    error = (
        f"ExportFailed: checkpoint.export_hf: ENOSPC (No space left on device) writing {export}/"
        f"model-00001-of-00001.safetensors; the complete checkpoint {tmp_path / 'checkpoints'}/step-00000002 holds "
        f"the same weights: `launcher export {name} --out DIR` (or entrypoints/export_hf.py) writes them from it"
    )
    assert status["state"] == "Failed"
    assert re.fullmatch(rf"torchrun exited with code 1: rank [01]: {re.escape(error)}", status["failure_reason"])


def test_a_killed_rank_is_restarted_by_torchrun_and_resumes_from_the_last_checkpoint(tmp_path, mlflow_server):
    """cluster.max_restarts (1 by default on the local backend): torchrun restarts the workers
    after one dies, and they resume from the newest complete checkpoint instead of failing the job.
    The job also feeds TensorBoard and MLflow (tracking.*): the restarted workers continue the
    lineage's MLflow run, and both dashboards hold what metrics.jsonl holds."""
    home = tmp_path / "home"
    overrides = ["training.steps=16", "checkpoint.every_steps=2", "cluster.nproc_per_node=2", "parallel.tensor=1"]
    overrides += ["tracking.tensorboard=true", f"tracking.mlflow.uri={mlflow_server.url}"]
    args = [arg for override in overrides for arg in ("--set", override)]
    submitted = from_checkout("submit", "recipes/tiny-cpu.yaml", "--backend", "local", "--json", *args, home=home)
    assert submitted.returncode == 0, submitted.stderr
    name = json.loads(submitted.stdout)["name"]
    directory = home / "jobs" / name
    assert "--max-restarts=1" in json.loads((directory / "spec.json").read_text())["command"]

    metrics = directory / "metrics.jsonl"
    checkpoints = home / "checkpoints" / "tiny-cpu" / name
    # Kill once a checkpoint is complete on disk: saves are asynchronous, so on a busy machine the
    # step-2 save can still be in flight when step 3 is logged, and then there is nothing to resume.
    wait_while_growing(
        lambda: metrics.exists() and metrics.read_text().count("\n") >= 3 and bool(complete_checkpoints(checkpoints)),
        directory / "output.log",
        "a third step and a complete checkpoint",
    )
    torchrun = json.loads((directory / "status.json").read_text())["pid"]
    workers = [int(p) for p in Path(f"/proc/{torchrun}/task/{torchrun}/children").read_text().split()]
    os.kill(workers[-1], signal.SIGKILL)  # one rank dies, as after a segfault or the OOM killer

    waited = from_checkout("logs", name, "--follow", home=home)
    assert waited.returncode == 0, waited.stdout[-3000:] + waited.stderr[-2000:]
    resumed = [int(m) for m in re.findall(r"resumed_from_step=(\d+)", waited.stdout)]
    assert resumed[0] == 0 and len(resumed) == 2 and resumed[1] >= 2, resumed
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == 16 and sorted(set(steps)) == list(range(1, 17))
    assert "warning: mlflow" not in waited.stdout + waited.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert_tensorboard_holds(directory / "tensorboard", records)
    assert_mlflow_run_holds(mlflow_server.url, name, records, directory / "spec.json")


def test_a_stopped_job_is_stopped_with_no_traceback(tmp_path, doomed_mlflow_server):
    """`launcher stop`: the workers checkpoint, torchrun ends with one line (entrypoints/torchrun.py),
    and the job is Stopped with 143, not a failure ending in torchrun's SignalException traceback.
    Before that its MLflow server is killed (SIGKILL) mid-run: one warning, and training goes on."""
    home = tmp_path / "home"
    overrides = ["training.steps=200", "cluster.nproc_per_node=2", "parallel.tensor=1"]
    overrides.append(f"tracking.mlflow.uri={doomed_mlflow_server.url}")
    args = [arg for override in overrides for arg in ("--set", override)]
    submitted = from_checkout("--quiet", "submit", "recipes/tiny-cpu.yaml", "--backend", "local", *args, home=home)
    assert submitted.returncode == 0, submitted.stderr
    name = submitted.stdout.strip()
    metrics = home / "jobs" / name / "metrics.jsonl"
    log = metrics.with_name("output.log")
    wait_while_growing(lambda: mlflow_steps(doomed_mlflow_server.url, name) >= 1, log, "a step in MLflow")
    doomed_mlflow_server.kill()
    wait_while_growing(lambda: "warning: mlflow" in log.read_text(), log, "the warning")
    after_warning = metrics.read_text().count("\n")
    wait_while_growing(lambda: metrics.read_text().count("\n") >= after_warning + 2, log, "two steps more")
    stopped = json.loads(from_checkout("stop", name, "--json", home=home).stdout)
    assert (stopped["state"], stopped["exit_code"], stopped["failure_reason"]) == ("Stopped", 143, None)
    log = (home / "jobs" / name / "output.log").read_text()
    assert "Traceback" not in log and "SignalException" not in log
    assert log.rstrip().endswith("torchrun: stopped by SIGTERM")
    assert "checkpoint saved" in log
    (warning,) = [line for line in log.splitlines() if "mlflow" in line]
    assert re.fullmatch(
        rf"(\[\S+\]:)?warning: mlflow: POST {doomed_mlflow_server.url}/api/2\.0/mlflow/runs/log-batch: .*"
        "; training goes on without MLflow logging",
        warning,
    ), warning


def last_per_step(pairs) -> dict[int, float]:
    """{step: value}, the later of two values of a step winning (a restarted run logs steps again)."""
    return dict(pairs)


def assert_tensorboard_holds(directory: Path, records: list[dict]) -> None:
    """tensorboard's own reader finds every finite number of metrics.jsonl, at its step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    keys = sorted(k for k in records[0] if k != "step" and records[0][k] is not None)
    assert sorted(events.Tags()["scalars"]) == keys
    for key in keys:
        drawn = last_per_step((e.step, e.value) for e in events.Scalars(key))
        assert drawn == pytest.approx(last_per_step((r["step"], r[key]) for r in records), rel=1e-6), key


def mlflow_runs(url: str, lineage: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(url)
    experiment = client.get_experiment_by_name("tiny-cpu")
    if experiment is None:
        return []
    return client.search_runs([experiment.experiment_id], f"tags.`launcher.lineage` = '{lineage}'")


def mlflow_steps(url: str, lineage: str) -> int:
    runs = mlflow_runs(url, lineage)
    return len(runs[0].data.metrics) if runs else 0


def assert_mlflow_run_holds(url: str, name: str, records: list[dict], spec_file: Path) -> None:
    """One run for the lineage, read back with MLflow's client: its tags, the resolved config as
    params and artifact, and every metric of metrics.jsonl at its step."""
    from mlflow import MlflowClient

    client = MlflowClient(url)
    (run,) = mlflow_runs(url, name)
    resolved = json.loads(spec_file.read_text())["resolved"]
    assert run.info.status == "FINISHED" and run.info.run_name == name
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("launcher.")}
    assert tags == {
        "launcher.job": name,
        "launcher.backend": "local",
        "launcher.lineage": name,
        "launcher.recipe": "tiny-cpu",
    }
    assert run.data.params["training.steps"] == "16"
    assert run.data.params["tracking.mlflow.uri"] == url
    assert json.loads(Path(client.download_artifacts(run.info.run_id, "resolved.json")).read_text()) == resolved
    keys = sorted(k for k in records[0] if k != "step" and records[0][k] is not None)
    assert sorted(run.data.metrics) == keys
    for key in keys:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp)
        logged = last_per_step((m.step, m.value) for m in history)
        assert logged == pytest.approx(last_per_step((r["step"], r[key]) for r in records), rel=1e-12), key


def worker_environments(torchrun: int, job_dir: Path) -> dict[int, tuple[int, dict[str, str]]]:
    """{rank: (pid, environment)} of the torchrun this test started, each worker checked to be
    this job's (the runner's LAUNCHER_JOB_DIR marker in its environment) before it is signalled."""
    workers = {}
    for pid in Path(f"/proc/{torchrun}/task/{torchrun}/children").read_text().split():
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        environment = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
        assert environment.get(processes.JOB_MARKER) == str(job_dir), (pid, environment.get(processes.JOB_MARKER))
        workers[int(environment["RANK"])] = (int(pid), environment)
    return workers


@contextmanager
def held_now_and_then(pid: int, stopped_s: float = 0.45, period_s: float = 0.6):
    """The process stopped (SIGSTOP) for `stopped_s` of every `period_s`: a slow host."""
    done = threading.Event()

    def throttle() -> None:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            done.wait(stopped_s)
            os.kill(pid, signal.SIGCONT)
            done.wait(period_s - stopped_s)

    thread = threading.Thread(target=throttle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        os.kill(pid, signal.SIGCONT)


def test_a_stalled_rank_is_named_the_live_ranks_dump_stacks_and_the_restart_ends_with_the_same_losses(
    tmp_path, readme_main_job
):
    """training.watchdog on the README's job (4 processes, FSDP 2 x TP 2), with real faults: rank 1
    is held for 0.45 s of every 0.6 s until rank 0's straggler line names it, and `status`
    warns that the job runs below its prediction, naming the straggler; then rank 2 is
    stopped for good (SIGSTOP). The other ranks' watchdogs fire: their Python stacks are on
    disk, the failure (the error file torchrun reads) names rank 2 and its host, the job exits
    with 5 and torchrun's restart resumes from the newest checkpoint and ends with the losses
    of the uninterrupted README job, step for step."""
    home = tmp_path / "home"
    overrides = ["checkpoint.every_steps=2", "training.watchdog.straggler_every=2"]
    overrides += ["training.watchdog.min_stall_s=10", "training.watchdog.stall_factor=5"]  # defaults: 60 s and 10
    args = [arg for override in overrides for arg in ("--set", override)]
    submitted = from_checkout("submit", "recipes/tiny-cpu.yaml", "--backend", "local", "--json", *args, home=home)
    assert submitted.returncode == 0, submitted.stderr
    name = json.loads(submitted.stdout)["name"]
    directory = home / "jobs" / name
    metrics, log = directory / "metrics.jsonl", directory / "output.log"
    checkpoints = home / "checkpoints" / "tiny-cpu" / name
    wait_while_growing(
        lambda: metrics.exists() and metrics.read_text().count("\n") >= 3 and bool(complete_checkpoints(checkpoints)),
        log,
        "a third step and a complete checkpoint",
    )

    def added(offset: int) -> str:
        return log.read_bytes()[offset:].decode(errors="replace")

    def ended() -> bool:
        return (directory / "exit.json").exists()

    torchrun = json.loads((directory / "status.json").read_text())["pid"]
    workers = worker_environments(torchrun, directory)
    assert sorted(workers) == [0, 1, 2, 3]

    def newest_names_the_straggler() -> bool:
        rows = metrics.read_text().splitlines()
        return bool(rows) and json.loads(rows[-1]).get("straggler_rank") == 1

    seen = log_size(log)
    with held_now_and_then(workers[1][0]):
        wait_while_growing(lambda: "straggler " in added(seen) or ended(), log, "a straggler line")
        wait_while_growing(lambda: newest_names_the_straggler() or ended(), log, "a metrics record naming rank 1")
        # Still held: status compares the slowed steps with the host-CPU prediction and names the cause.
        status = from_checkout("status", name, home=home, timeout=60).stdout
    assert re.search(
        r"\n  speed    running at \d+% of predicted\n  warning  \d+% of predicted: likely cause: "
        r"a straggler: rank 1's compute time is \d+% above the median",
        status,
    ), status
    lines = [x for x in added(seen).splitlines() if x.startswith("straggler ")]
    assert lines and not ended(), "the job ended before a straggler line"
    line = lines[0]
    assert re.fullmatch(rf"straggler step=\d+ rank=1 host={socket.gethostname()} compute_s=\S+ median_s=\S+ \S+", line)

    os.kill(workers[2][0], signal.SIGSTOP)
    live = [0, 1, 3]
    stacks = [directory / "stacks" / f"rank-{rank}.txt" for rank in live]
    wait_while_growing(
        lambda: all(path.exists() for path in stacks) and not any(alive(workers[r][0]) for r in live),
        log,
        "the live ranks' stacks and exit",
    )
    stuck = f"stuck: rank 2 on {socket.gethostname()}"
    for path in stacks:
        text = path.read_text()
        assert stuck in text and "Thread 0x" in text and 'entrypoints/train.py", line' in text, text[:2000]
    reported = read_error_file(workers[0][1]["TORCHELASTIC_ERROR_FILE"])
    assert reported.message.startswith("WatchdogStall: watchdog: no step completed for ") and stuck in reported.message
    os.kill(
        workers[2][0], signal.SIGKILL
    )  # what torchrun does itself, 30 s later, to a worker that ignores its SIGTERM

    waited = from_checkout("logs", name, "--follow", home=home)
    assert waited.returncode == 0, waited.stdout[-3000:] + waited.stderr[-2000:]
    assert "failed (exitcode: 5)" in waited.stdout + waited.stderr
    resumed = [int(m) for m in re.findall(r"resumed_from_step=(\d+)", waited.stdout)]
    assert resumed[0] == 0 and len(resumed) == 2 and resumed[1] >= 2, resumed
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    # ... and the metrics record it, for `status`'s likely-cause line (launcher.display.text.slow_cause_text).
    assert 1 in {r.get("straggler_rank") for r in records}
    readme_stdout, readme_home = readme_main_job
    readme_job = readme_home / "jobs" / readme_stdout.splitlines()[-1].split(":")[0]
    uninterrupted = [json.loads(x) for x in (readme_job / "metrics.jsonl").read_text().splitlines()]
    losses = last_per_step((r["step"], r["loss"]) for r in records)
    assert losses == pytest.approx(last_per_step((r["step"], r["loss"]) for r in uninterrupted), rel=1e-6)
