"""`job.metrics()` and `launcher metrics NAME`: every logged step, from each backend's own files or logs.

The local job runs the stand-in trainer (three steps, metrics.jsonl and log lines) through the
real runner; SageMaker reads moto's CloudWatch Logs; Slurm, docker and k8s read what their
stand-in tools and the job's files hold.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import boto3
import pytest

from launcher import api
from launcher.backends.history import MetricsHistory
from launcher.contract.metrics import METRIC_KEYS, metric_rows, metrics_line
from launcher.jobs import Job
from launcher.registry import JobRef

from . import test_docker, test_engine_tools, test_k8s_submit
from .helpers import REGION, ROLE, recipe_path

# The stand-ins of the engines' own tests: Slurm's tools, docker, kubectl, and the local runner
# running the stand-in trainer without torchrun (no_torchrun, from conftest.py).
tools = test_engine_tools.tools
fake_docker = test_docker.fake_docker
cluster = test_k8s_submit.cluster

STEP_KEYS = set(METRIC_KEYS)  # every field the entrypoints log per step


def line(step: int, loss: float) -> str:
    values = dict.fromkeys(STEP_KEYS, 0.5) | {"step": step, "loss": loss, "mfu": math.nan}
    return metrics_line(values)


# --- reading the lines ---------------------------------------------------------------------------


def test_metric_lines_are_read_behind_a_host_label_and_other_lines_are_skipped():
    lines = [
        "[algo-1] " + line(2, 2.5),
        "checkpoint step=2 written_s=1",
        line(1, 3.0),
        "summary steps=2 final_loss=2.5",
    ]
    rows = metric_rows(lines)
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 3.0), (2, 2.5)]
    assert set(rows[0]) == STEP_KEYS and math.isnan(rows[0]["mfu"])


HOSTILE_STEPS = ("inf", "nan", "-inf", "1e400", "1e300", "2.5", "-3", "1000000001")


def test_a_line_or_record_naming_no_step_a_job_could_log_is_skipped():
    """Logs and metrics files are the job's: `metrics step=inf` in them was an OverflowError that
    ended `launcher metrics` and the `submit --wait` that follows the log."""
    lines = [line(1, 3.0), *(f"metrics step={step} loss=9" for step in HOSTILE_STEPS), line(2, 2.0)]
    assert [(r["step"], r["loss"]) for r in metric_rows(lines)] == [(1, 3.0), (2, 2.0)]
    records = [{"step": 1, "loss": 3.0}, {"step": 10**32}, {"step": 1e308}, {"step": True}, {"step": "2"}]
    records += [{"step": -1}, {"step": 2.0, "loss": 2.0}, ["step", 3]]
    assert [(r["step"], r["loss"]) for r in MetricsHistory.from_rows("job", records)] == [(1, 3.0), (2, 2.0)]


def test_the_live_line_of_submit_wait_skips_a_line_naming_no_step():
    import io

    from rich.console import Console

    from launcher.display.live import LiveProgress

    screen, lines = io.StringIO(), io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120, color_system=None)
    with LiveProgress(total_steps=20, console=console, lines_to=lines) as progress:
        for text in [line(1, 3.0), *(f"metrics step={step} loss=9" for step in HOSTILE_STEPS), line(2, 2.0)]:
            progress.line(text)
        assert progress.first_step[0] == 1
    shown = screen.getvalue()
    assert "step 2/20  loss 2.0000  ETA " in shown and "loss 9" not in shown
    assert lines.getvalue().count("metrics step=") == 2 + len(HOSTILE_STEPS)  # every log line is still passed on


def test_a_step_logged_again_after_a_restart_keeps_its_latest_values():
    history = MetricsHistory.from_lines("job", [line(1, 3.0), line(2, 2.9), line(2, 2.7), line(3, 2.5)])
    assert [r["loss"] for r in history.to_rows()] == [3.0, 2.7, 2.5]
    assert history.last["step"] == 3 and len(history) == 3
    assert history.column("loss") == [3.0, 2.7, 2.5]


def test_json_has_null_where_a_value_was_not_measured():
    data = MetricsHistory.from_lines("job", [line(1, 3.0)]).to_dict()
    assert data["steps"] == 1 and data["rows"][0]["mfu"] is None
    json.dumps(data, allow_nan=False)  # strict JSON


def test_an_empty_history_has_no_last_step_and_says_so_when_plotted(tmp_path):
    from launcher.errors import UsageError

    empty = MetricsHistory("job-x")
    assert (len(empty), empty.last, empty.to_rows()) == (0, {}, [])
    with pytest.raises(UsageError, match="job-x: no steps logged yet"):
        empty.plot(tmp_path / "x.png")


# --- each backend --------------------------------------------------------------------------------


def test_a_local_job_returns_every_step_of_its_metrics_file_and_the_cli_prints_them(no_torchrun, cli, tmp_path):
    job = api.submit(recipe_path("tiny-cpu"), wait=True, poll_s=0.05).job
    history = job.metrics()
    assert [r["step"] for r in history] == [1, 2, 3]
    assert [round(r["loss"], 4) for r in history] == [5.0, 2.5, 1.6667]
    assert history.last["tokens_per_s_per_gpu"] == 1003.0

    table = cli("metrics", job.name)
    assert table.code == 0, table.err
    header, *rows = table.out.splitlines()
    assert header.split() == ["STEP", "LOSS", "TOKENS/S/GPU", "MFU", "STEP_S", "MEM_GIB"]
    assert [row.split()[:3] for row in rows] == [["1", "5", "1001"], ["2", "2.5", "1002"], ["3", "1.667", "1003"]]

    as_json = json.loads(cli("metrics", job.name, "--json").out)
    assert [r["step"] for r in as_json["rows"]] == [1, 2, 3] and as_json["rows"][0]["mfu"] is None

    plotted = cli("metrics", job.name, "--plot", tmp_path / "m.png")
    assert plotted.code == 0, plotted.err
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert job.plot_metrics(tmp_path / "n.png").stat().st_size > 10_000


def test_a_sagemaker_job_reads_the_metric_lines_of_its_cloudwatch_logs(aws, home, cli):
    name = "tiny-sm-job"
    boto3.client("sagemaker", region_name=REGION).create_training_job(
        TrainingJobName=name,
        AlgorithmSpecification={"TrainingImage": "image:1", "TrainingInputMode": "File"},
        RoleArn=ROLE,
        OutputDataConfig={"S3OutputPath": "s3://bucket/out"},
        ResourceConfig={"InstanceType": "ml.p5e.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 100},
        StoppingCondition={"MaxRuntimeInSeconds": 3600},
    )
    logs = boto3.client("logs", region_name=REGION)
    group = "/aws/sagemaker/TrainingJobs"
    logs.create_log_group(logGroupName=group)
    now = int(time.time() * 1000)
    events = {"algo-1": [line(1, 3.0), "checkpoint step=1", line(2, 2.0)], "algo-2": ["ready", "metrics step=inf"]}
    for host, messages in events.items():
        stream = f"{name}/{host}-1700000000"
        logs.create_log_stream(logGroupName=group, logStreamName=stream)
        logs.put_log_events(
            logGroupName=group,
            logStreamName=stream,
            logEvents=[{"timestamp": now + i, "message": m} for i, m in enumerate(messages)],
        )
    history = Job.find(name, backend="sagemaker", region=REGION).metrics()
    assert [(r["step"], r["loss"]) for r in history] == [(1, 3.0), (2, 2.0)]  # read behind the [algo-1] labels
    from_cli = json.loads(cli("metrics", name, "--backend", "sagemaker", "--region", REGION, "--json").out)
    assert from_cli["steps"] == 2


def test_a_slurm_job_reads_its_metrics_file_on_the_shared_dir_else_its_log(home, fake_bundle, tools, cli):
    tools("sbatch", "4242\n")
    tools("scontrol", (Path(__file__).parent / "slurm_outputs" / "scontrol-show-job-running.txt").read_text())
    name = json.loads(cli("submit", recipe_path("tiny-cpu"), "--backend", "slurm", "--json").out)["name"]
    directory = home / "jobs" / name
    (directory / "slurm-4242.out").write_text("\n".join([line(1, 4.0), line(2, 3.0)]) + "\n")
    assert [r["loss"] for r in Job.find(name).metrics()] == [4.0, 3.0]  # no metrics.jsonl yet: the log
    rows = [{"step": s, "loss": 9.0 - s} for s in (1, 2, 3)]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["loss"] for r in Job.find(name).metrics()] == [8.0, 7.0, 6.0]


def test_a_docker_job_reads_its_mounted_output_else_the_containers_log(fake_docker, home):
    fake_docker.answer(["logs"], out="\n".join([line(1, 4.0), "noise", line(2, 3.5)]) + "\n")
    job = Job(JobRef(name="tiny-docker-job", backend="docker"))
    assert [r["loss"] for r in job.metrics()] == [4.0, 3.5]
    assert fake_docker.calls()[-1]["argv"] == ["logs", "tiny-docker-job"]
    output = home / "jobs" / job.name / "output"
    output.mkdir(parents=True)
    (output / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.25}) + "\n")
    assert job.metrics().to_rows() == [{"step": 1, "loss": 1.25}]


def test_a_k8s_job_reads_the_metric_lines_of_its_master_pod(cluster, monkeypatch):
    cluster.add("PyTorchJob", "team-a", "tiny-k8s-job", {})
    monkeypatch.setenv("FAKE_KUBECTL_LOGS", "\n".join([line(1, 4.0), line(2, 3.25)]))
    job = Job(JobRef(name="tiny-k8s-job", backend="k8s", native_id="team-a/tiny-k8s-job"))
    assert [r["loss"] for r in job.metrics()] == [4.0, 3.25]
    logs_call = cluster.calls()[-1]["argv"]
    assert logs_call[:3] == ["--namespace", "team-a", "logs"] and "tiny-k8s-job-master-0" in logs_call
