"""Checkpoint size, save time and interruption warnings, against numbers computed by hand.

Llama 3.1 70B (h 8192, 80 layers, GQA 64/8 heads, ffn 28672, vocab 128256, untied):
  block      = 2*8192^2 + 2*8192*1024 + 3*8192*28672 + 2*8192 = 855,654,400
  parameters = 2*128256*8192 + 80*855,654,400 + 8192     = 70,553,706,496
  checkpoint = 12 B/param (fp32 weights, exp_avg, exp_avg_sq)  = 846,644,477,952 B (847 GB)
On 4 x ml.p5e.48xlarge: 211,661,119,488 B per host; 52.9 s at 4 GB/s to NVMe, 84.7 s at 2.5 GB/s
to S3: 137.6 s until durable, beyond SageMaker's 120 s stop grace.

checkpoint.every_minutes: auto (Young 1974, Daly 2006): sqrt(2 x save x MTBF). Per host 0.00379
failures a day (Llama 3: 419 in 54 days on 2,048 hosts), 4 hosts: MTBF 86400 / (0.00379 x 4) =
5,699,208 s (1583.1 h); sqrt(2 x 137.58 x 5,699,208) = 39,600.4 s = 660.007 min -> 661 min.
With spot (+0.00657 a host-day): MTBF 2,084,942 s; sqrt(2 x 137.58 x 2,084,942) / 60 = 399.2 -> 400.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.catalog import instance_types
from launcher.estimate.checkpoint import (
    auto_every_minutes,
    checkpoint_bytes,
    estimate_checkpoint,
    estimate_recipe_checkpoint,
    job_mtbf_s,
    young_daly_interval_s,
)
from launcher.recipe import Recipe
from launcher.resolve import resolve
from tests.backends.helpers import MY_ROLE

REPO = Path(__file__).resolve().parents[2]
PARAMS_70B = 70_553_706_496
P5E = instance_types()["ml.p5e.48xlarge"]


def p5e_70b(**changes):
    settings = {"every_steps": 200, "every_minutes": 0, "step_time_s": 402.0}
    return estimate_checkpoint(params=PARAMS_70B, instance_count=4, instance=P5E, **{**settings, **changes})


def test_a_70b_checkpoint_holds_12_bytes_per_parameter():
    assert checkpoint_bytes(PARAMS_70B) == 846_644_477_952


def test_bf16_moments_make_the_recipes_checkpoint_8_bytes_per_parameter():
    # training.optimizer.state_dtype bf16: fp32 weights, bf16 exp_avg and exp_avg_sq.
    recipe = Recipe.load(REPO / "recipes" / "llama70b-128k.yaml", {"training.optimizer.state_dtype": "bf16"})
    assert recipe.checkpoint_bytes == 8 * PARAMS_70B == 564_429_651_968
    est = estimate_recipe_checkpoint(recipe, step_time_s=402.0)
    assert est.size_bytes == recipe.checkpoint_bytes
    assert est.line().startswith("checkpoint 564 GB (8 B/param), 141 GB per host:")
    # A smaller save is durable sooner, so the auto interval shortens (sqrt of the save time).
    assert (
        auto_every_minutes(recipe).minutes
        < auto_every_minutes(Recipe.load(REPO / "recipes" / "llama70b-128k.yaml")).minutes
    )


def test_70b_on_four_p5e_writes_a_quarter_per_host_then_uploads_it():
    est = p5e_70b()
    assert est.bytes_per_host == 211_661_119_488
    assert est.write_s == pytest.approx(52.915, abs=1e-3)
    assert est.upload_s == pytest.approx(84.664, abs=1e-3)
    assert est.durable_s == pytest.approx(137.579, abs=1e-3)
    assert est.line() == (
        "checkpoint 847 GB (12 B/param), 212 GB per host: ~53 s to write, ~85 s to S3; every 200 steps (22.3 h)"
    )


def test_200_steps_of_402_s_warns_that_an_interruption_can_lose_22_hours():
    est = p5e_70b()
    assert est.interval_s == 80_400
    assert est.worst_loss_s == pytest.approx(80_537.58, abs=0.01)
    assert est.warnings[0] == (
        "an interruption can lose up to 22.4 h of training (every 200 steps (22.3 h) + 138 s to save); "
        "set checkpoint.every_minutes, e.g. auto"
    )


def test_a_save_that_cannot_finish_in_the_stop_grace_is_said_once_and_not_warned_about():
    est = p5e_70b(every_steps=0, every_minutes=661)
    assert not any("grace" in w for w in est.warnings)
    assert est.stop_text == (
        "a stop or interruption loses at most 11.1 h (every 661 min (11.1 h) + 138 s to save): the step in "
        "progress (~6.7 min) and a save (~138 s) do not fit in the 120 s between SIGTERM and SIGKILL, so the "
        "last periodic checkpoint counts"
    )
    # On 8 hosts a host's share is durable in 68.8 s, but a 402 s step still cannot end in the grace.
    eight = estimate_checkpoint(
        params=PARAMS_70B, instance_count=8, instance=P5E, every_steps=0, every_minutes=30, step_time_s=402.0
    )
    assert eight.durable_s == pytest.approx(68.790, abs=1e-3)
    assert "do not fit in the 120 s between SIGTERM and SIGKILL" in eight.stop_text
    # A 40 s step and that save fit: a stop saves first.
    quick = estimate_checkpoint(
        params=PARAMS_70B, instance_count=8, instance=P5E, every_steps=0, every_minutes=30, step_time_s=40.0
    )
    assert (
        quick.stop_text
        == "a stop saves first: the step in progress (~40 s) and a save (~69 s) fit in the 120 s stop grace"
    )


def test_auto_interval_is_young_daly_from_the_save_time_and_the_hosts_failure_rate():
    recipe = Recipe.load(REPO / "recipes" / "llama70b-128k.yaml")
    assert recipe.checkpoint.every_minutes == "auto" and "checkpoint.every_minutes" in recipe.unsettled
    assert job_mtbf_s(P5E, 4, spot=False) == pytest.approx(5_699_208.4, abs=0.1)
    assert young_daly_interval_s(137.5797, 5_699_208.4) == pytest.approx(39_600.4, abs=0.1)
    auto = auto_every_minutes(recipe)
    assert auto.minutes == 661
    assert auto.line() == (
        "checkpoint.every_minutes auto: 661 = sqrt(2 x 138 s to save x 1583.1 h between interruptions) "
        "(Young 1974, Daly 2006; rates in launcher/catalog/instances.yaml)"
    )
    assert resolve(recipe).settled["checkpoint.every_minutes"] == 661
    assert resolve(recipe).concrete.resolved().checkpoint.every_minutes == 661


def test_spot_adds_its_reclaim_rate_and_shortens_the_auto_interval():
    recipe = Recipe.load(REPO / "recipes" / "llama70b-128k.yaml", {"sagemaker.spot": True, "sagemaker.max_wait": "7d"})
    assert job_mtbf_s(P5E, 4, spot=True) == pytest.approx(2_084_942.1, abs=0.1)
    assert auto_every_minutes(recipe).minutes == 400


@pytest.mark.parametrize(
    ("name", "restore_bytes", "line"),
    [
        # 8B on one p5: 3 x 96,368,037,888 B copied by CheckpointConfig, at 2.5 GB/s: 116 s.
        (
            "llama3-8b-8k",
            3 * 8_030_261_248 * 12,
            "each start, retry or spot restart first copies at least 289 GB to every host "
            "(3 x 96 GB: CheckpointConfig restores the whole prefix, ~1.9 min)",
        ),
        # 70B: CheckpointConfig would copy 3 x 847 GB = 2,540 GB, past the 500 GB of engines.yaml, so
        # each host reads back its own quarter, 211,661,119,488 B, at 2.5 GB/s: 85 s.
        (
            "llama70b-128k",
            211_661_119_488,
            "each start, retry or spot restart reads back 212 GB to each host: its own files of the newest "
            "checkpoint, ~1.4 min (CheckpointConfig would copy 3 x 847 GB to every host)",
        ),
        # 405B: 405,853,388,800 x 12 B / 16 hosts = 304,390,041,600 B, at 2.5 GB/s: 122 s.
        (
            "llama405b-128k",
            304_390_041_600,
            "each start, retry or spot restart reads back 304 GB to each host: its own files of the newest "
            "checkpoint, ~2.0 min (CheckpointConfig would copy 2 x 4870 GB to every host)",
        ),
    ],
)
def test_each_start_copies_what_the_checkpoint_path_copies_to_each_host(name, restore_bytes, line):
    est = estimate_recipe_checkpoint(Recipe.load(REPO / "recipes" / f"{name}.yaml"), step_time_s=300.0)
    assert est.restore_bytes_per_host == restore_bytes
    assert est.restore_line() == line


def test_auto_without_a_modelled_save_time_is_hourly():
    recipe = Recipe.load(REPO / "recipes" / "tiny-cpu.yaml", {"checkpoint.every_minutes": "auto"})
    auto = auto_every_minutes(recipe)
    assert auto.minutes == 60 and auto.save_s is None
    assert resolve(recipe).concrete.checkpoint.every_minutes == 60


@pytest.mark.parametrize(
    ("name", "path", "per_host", "interval"),
    [
        ("llama70b-128k", "s3://my-training-bucket/checkpoints/llama70b-128k/", "212 GB per host", "every 661 min"),
        ("llama405b-128k", "s3://my-training-bucket/checkpoints/llama405b-128k/", "304 GB per host", "every 396 min"),
    ],
)
def test_the_flagship_dry_runs_print_path_bytes_per_host_and_interval_without_a_grace_warning(
    home, name, path, per_host, interval
):
    from launcher import api

    told = []
    mine = [MY_ROLE]  # the shipped role is the documentation's, which dry-run warns about
    api.submit(
        REPO / "recipes" / f"{name}.yaml", set_options=mine, dry_run=True, report=lambda _, line: told.append(line)
    )
    text = "\n".join(told)
    assert f"checkpoints: {path}{name}-" in text
    assert per_host in text and interval in text
    assert "checkpoint.every_minutes auto: " in text
    assert sum("a stop or interruption loses at most" in line for line in told) == 1
    assert sum(line.startswith("each start, retry or spot restart reads back") for line in told) == 1
    assert any(line.startswith("checkpoints: s3://") and "copied there by each host" in line for line in told)
    # The one warning left is the quota check's, offline here (no credentials): none of saves or grace.
    warnings = [line for line in told if line.startswith("warning:")]
    assert [line.split(":")[1].strip() for line in warnings] == ["quotas"], warnings
    assert not any("cannot finish" in line for line in told)


def test_every_minutes_rounds_up_to_whole_steps_and_silences_the_loss_warning():
    est = p5e_70b(every_steps=0, every_minutes=30)
    assert est.interval_s == 5 * 402.0  # ceil(1800 / 402) = 5 steps
    assert est.interval_text == "every 30 min (33.5 min)"
    assert not any("can lose" in w for w in est.warnings)


def test_every_minutes_shorter_than_a_step_is_warned_about():
    est = p5e_70b(every_steps=0, every_minutes=5)
    assert est.interval_s == 402.0
    assert "checkpoint.every_minutes 5 is shorter than one step (6.7 min): checkpoints are a step apart" in est.warnings
    # 137.6 s to save every 402 s is fine; every 60 s steps it is not.
    fast = p5e_70b(every_steps=1, step_time_s=60.0)
    assert any("saving takes ~138 s, longer than the 1.0 min between checkpoints" in w for w in fast.warnings)


def test_no_periodic_checkpoints_is_warned_about():
    est = p5e_70b(every_steps=0)
    assert est.interval_s is None and est.interval_text == "only at the end and on SIGTERM"
    assert est.warnings[0].startswith("no periodic checkpoints")


def test_off_sagemaker_nothing_is_uploaded_and_there_is_no_stop_grace():
    est = estimate_checkpoint(
        params=PARAMS_70B,
        instance_count=4,
        instance=P5E,
        every_steps=200,
        every_minutes=0,
        step_time_s=402.0,
        uploads_to_s3=False,
        stop_grace_s=None,
    )
    assert est.upload_s is None and est.durable_s == pytest.approx(52.915, abs=1e-3)
    assert est.stop_text is None and est.restore_line() is None


def test_the_shipped_70b_recipe():
    recipe = Recipe.load(REPO / "recipes" / "llama70b-128k.yaml")
    est = estimate_recipe_checkpoint(recipe, step_time_s=402.0)
    assert est.size_bytes == 846_644_477_952 and est.instance_count == 4
    assert est.upload_s == pytest.approx(84.664, abs=1e-3)


def test_a_local_cpu_job_has_a_size_but_no_modelled_save_time():
    recipe = Recipe.load(REPO / "recipes" / "tiny-cpu.yaml")
    est = estimate_recipe_checkpoint(recipe, step_time_s=None)
    assert est.write_s is None and est.warnings == ()
    assert est.line() == f"checkpoint {est.size_bytes / 1e6:.1f} MB (12 B/param); every 10 steps"


def test_an_engine_the_job_sets_the_grace_of_gets_the_predicted_step_and_save_with_margin(home):
    """70B on 4 p5e under Slurm: a ~276.2 s step and a ~53 s save (nothing uploaded) take
    ceil(1.25 x 329.3) + 20 = 432 s; the trainer and torchrun get 412 s of it."""
    recipe = Recipe.load(REPO / "recipes" / "llama70b-128k.yaml", {"cluster.backend": "slurm"})
    resolved = resolve(recipe)
    assert resolved.settled["cluster.stop_grace"] == 432 == resolved.concrete.stop_grace_s
    assert resolved.concrete.resolved().runtime.stop_budget_s == 412
    est = estimate_recipe_checkpoint(resolved.concrete, 276.2)
    assert est.stop_text.startswith("a stop saves first: the step in progress (~4.6 min) and a save (~53 s) fit")
    # SageMaker's grace is its own: nothing to settle, and the 120 s it gives leave 100 s.
    role = {"sagemaker.role_arn": MY_ROLE.partition("=")[2]}
    on_sagemaker = resolve(Recipe.load(REPO / "recipes" / "llama70b-128k.yaml", role))
    assert "cluster.stop_grace" not in on_sagemaker.settled and on_sagemaker.concrete.stop_grace_s == 120


def test_a_grace_too_short_for_a_step_and_a_save_sets_a_periodic_interval_and_says_what_a_stop_loses(home):
    from launcher import api

    told = []
    short = ["cluster.backend=docker", "cluster.instance_count=1", "parallel.context=8", "data.source=/fsx/tokens"]
    short += ["cluster.stop_grace=30", "checkpoint.every_minutes=0", "checkpoint.every_steps=0"]
    submission = api.submit(
        REPO / "recipes" / "llama3-8b-8k.yaml",
        set_options=short,
        dry_run=True,
        report=lambda _, line: told.append(line),
    )
    minutes = submission.spec.resolved["checkpoint"]["every_minutes"]
    assert minutes > 0, "a stop saves nothing, so the periodic interval must bound the loss"
    stop = [line for line in told if line.startswith("a stop or interruption loses at most")]
    assert len(stop) == 1 and "do not fit in the 30 s between SIGTERM and SIGKILL" in stop[0], told
    assert any(line.startswith(f"checkpoint.every_minutes auto: {minutes:g} ") for line in told), told
    assert not any("no periodic checkpoints" in line for line in told)
