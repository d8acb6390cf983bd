"""Checkpoint size, save time and interruption warnings, against numbers computed by hand.

Llama 3.1 70B (h 8192, 80 layers, GQA 64/8 heads, ffn 28672, vocab 128256, untied):
  block      = 2*8192^2 + 2*8192*1024 + 3*8192*28672 + 2*8192 = 855,654,400
  parameters = 2*128256*8192 + 80*855,654,400 + 8192     = 70,553,706,496
  checkpoint = 12 B/param (fp32 weights, exp_avg, exp_avg_sq)  = 846,644,477,952 B (847 GB)
On 4 x ml.p5e.48xlarge: 211,661,119,488 B per host; 52.9 s at 4 GB/s to NVMe, 84.7 s at 2.5 GB/s
to S3: 137.6 s until durable, beyond SageMaker's 120 s stop grace.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.catalog import instance_types
from launcher.estimate.checkpoint import checkpoint_bytes, estimate_checkpoint, estimate_recipe_checkpoint
from launcher.recipe import Recipe

REPO = Path(__file__).resolve().parents[2]
PARAMS_70B = 70_553_706_496
P5E = instance_types()["ml.p5e.48xlarge"]


def p5e_70b(**changes):
    settings = {"every_steps": 200, "every_minutes": 0, "step_time_s": 402.0}
    return estimate_checkpoint(params=PARAMS_70B, instance_count=4, instance=P5E, **{**settings, **changes})


def test_a_70b_checkpoint_holds_12_bytes_per_parameter():
    assert checkpoint_bytes(PARAMS_70B) == 846_644_477_952


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
        "set checkpoint.every_minutes, e.g. 60"
    )


def test_a_save_longer_than_the_120_s_stop_grace_is_warned_about():
    assert any("longer than SageMaker's 120 s stop grace" in w for w in p5e_70b().warnings)
    # On 8 hosts a host's share is durable in 68.8 s: no stop-grace warning.
    eight = estimate_checkpoint(
        params=PARAMS_70B, instance_count=8, instance=P5E, every_steps=0, every_minutes=30, step_time_s=402.0
    )
    assert eight.durable_s == pytest.approx(68.790, abs=1e-3)
    assert not any("stop grace" in w for w in eight.warnings)


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
    assert not any("stop grace" in w for w in est.warnings)


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
