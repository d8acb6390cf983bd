"""Live against predicted (issue 25, part 4): submit keeps the planner's speed for the job's layout
in its record, and `status`, the `submit --wait` line and the Job repr compare the newest step's
tokens/s per GPU with it. Nothing is said where nothing was predicted (a record from before
predictions, or a GPU without datasheet peaks)."""

from __future__ import annotations

import json

import pytest

from launcher.jobs import Job
from launcher.registry import load, write_json
from tests.backends.helpers import recipe_path

NONE = "(no straggler named, data wait under 20% of the step, saves are outside the step)"
# tiny-cpu as if on one H100: the planner predicts a speed and an MFU for it (no MFU on host CPUs).
ON_A_GPU = ["cluster.device=cuda", "cluster.accelerator=h100-80gb"]


def newest_row(path):
    return json.loads(path.read_text().splitlines()[-1])


def test_submit_keeps_the_prediction_and_wait_status_and_repr_compare_the_newest_step_with_it(no_torchrun, cli):
    from launcher import api
    from launcher.display.text import wait_text
    from launcher.plan.forecast import forecast

    done = api.submit(recipe_path("tiny-cpu"), set_options=ON_A_GPU, wait=True, poll_s=0.05)
    name, directory = done.spec.name, no_torchrun / "jobs" / done.spec.name
    speed = forecast(done.recipe, time_limit_s=None).speed
    predicted = {"tokens_per_s_per_gpu": speed.tokens_per_s_per_gpu, "mfu": speed.mfu}
    assert json.loads((directory / "job.json").read_text())["predicted"] == predicted
    # The stand-in trainer's newest step (its MFU is NaN: no MFU is said); the CLI prints wait_text.
    live = newest_row(directory / "metrics.jsonl")["tokens_per_s_per_gpu"]
    wait_line = wait_text(done.final)
    assert wait_line.startswith(f"{name}: Completed. loss ")
    share = live / speed.tokens_per_s_per_gpu
    # Far below the prediction, and the stand-in trainer records no cause (display.text.slow_cause_text).
    assert f"; ran at {share:.0%} of predicted" in wait_line and share < 0.8
    assert wait_line.endswith(f"; warning: {share:.0%} of predicted: likely cause: none in the metrics {NONE}")

    # A newest step at 62% of the prediction, at 31% MFU, as the trainer would write it.
    row = {"step": 4, "loss": 1.5, "tokens_per_s_per_gpu": 0.62 * speed.tokens_per_s_per_gpu, "mfu": 0.31}
    with (directory / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps(row) + "\n")
    status = cli("status", name)
    assert status.code == 0 and "\n  speed    ran at 62% of predicted (MFU 31%)\n" in status.out + "\n"
    assert repr(Job(load(name))) == f"Job({name!r}, backend='local'): ran at 62% of predicted (MFU 31%)"


def write_running_job(home, name: str, record: dict) -> None:
    """A local job's record and status file as submit and the runner write them, just started
    (a runner is not asked after until a start long ago)."""
    from launcher.backends.local import runner

    directory = home / "jobs" / name
    write_json(directory / "job.json", {"name": name, "backend": "local", **record})
    write_json(directory / "status.json", {"state": "InProgress", "created": runner.now()})
    row = {"step": 7, "loss": 2.0, "tokens_per_s_per_gpu": 1234.5, "mfu": float("nan")}
    (directory / "metrics.jsonl").write_text(json.dumps(row) + "\n")


def test_a_running_job_says_running_at_and_a_job_with_no_prediction_says_nothing(home, cli):
    write_running_job(home, "predicted-job", {"predicted": {"tokens_per_s_per_gpu": 2469.0, "mfu": 0.4}})
    write_running_job(home, "cpu-job", {})  # a record with nothing predicted
    running = cli("status", "predicted-job")
    assert running.code == 0 and "  speed    running at 50% of predicted\n" in running.out
    assert repr(Job(load("predicted-job"))) == "Job('predicted-job', backend='local'): running at 50% of predicted"
    cpu = cli("status", "cpu-job")
    assert cpu.code == 0 and "speed" not in cpu.out and "predicted" not in cpu.out
    assert repr(Job(load("cpu-job"))) == "Job('cpu-job', backend='local')"


@pytest.mark.parametrize(
    ("predicted", "found"),
    [
        ("fast", "predicted is a string, not an object or null"),
        (
            {"tokens_per_s_per_gpu": "fast", "mfu": 0.4},
            "predicted.tokens_per_s_per_gpu is a string, not a positive number",
        ),
        ({"tokens_per_s_per_gpu": 2469.0, "mfu": "high"}, "predicted.mfu is a string, not a positive number"),
        ({"mfu": 0.4}, "predicted.tokens_per_s_per_gpu is missing, not a positive number"),
        ({"tokens_per_s_per_gpu": -1.0, "mfu": 0.4}, "predicted.tokens_per_s_per_gpu is -1.0, not a positive number"),
        (
            {"tokens_per_s_per_gpu": True, "mfu": 0.4},
            "predicted.tokens_per_s_per_gpu is true/false, not a positive number",
        ),
    ],
)
def test_a_damaged_prediction_in_the_record_is_one_line_naming_it(home, cli, predicted, found):
    write_running_job(home, "damaged-job", {"predicted": predicted})
    status = cli("status", "damaged-job")
    path = home / "jobs" / "damaged-job" / "job.json"
    assert status.code == 2 and status.err.strip().splitlines() == [f"{path}: damaged job record: {found}"]


@pytest.mark.parametrize(
    ("causes", "warning"),
    [
        (
            {"straggler_rank": 3, "straggler_above_median": 0.87},
            "50% of predicted: likely cause: a straggler: rank 3's compute time is 87% above the median "
            "(its log names the host)",
        ),
        (
            {"data_wait_s": 0.3, "step_time_s": 1.0},
            "50% of predicted: likely cause: data wait: 30% of the step waits for its batch",
        ),
        (
            {"data_wait_s": 0.1, "step_time_s": 1.0},
            f"50% of predicted: likely cause: none in the metrics {NONE}",
        ),
    ],
    ids=["straggler", "data-wait", "none"],
)
def test_a_job_below_80_percent_of_predicted_gets_a_warning_naming_the_likely_cause(home, cli, causes, warning):
    """The cause comes from what the newest metrics record holds (entrypoints/watchdog.speed_causes)."""
    write_running_job(home, "slow-job", {"predicted": {"tokens_per_s_per_gpu": 2469.0, "mfu": 0.4}})
    metrics = home / "jobs" / "slow-job" / "metrics.jsonl"
    metrics.write_text(json.dumps({**json.loads(metrics.read_text()), **causes}) + "\n")
    status = cli("status", "slow-job")
    assert status.code == 0 and f"  speed    running at 50% of predicted\n  warning  {warning}\n" in status.out


def test_a_job_at_80_percent_of_predicted_or_more_gets_no_warning(home, cli):
    write_running_job(home, "fine-job", {"predicted": {"tokens_per_s_per_gpu": 1234.5 / 0.8, "mfu": 0.4}})
    status = cli("status", "fine-job")
    assert status.code == 0 and "running at 80% of predicted" in status.out and "warning" not in status.out
