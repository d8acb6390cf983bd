"""Run time and cost before money is spent: submit states them, refuses a run its time limit would
cut short (unless forced), and asks before an expensive one."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import api
from launcher.display.text import duration
from launcher.errors import UsageError
from launcher.plan.forecast import forecast

REPO = Path(__file__).resolve().parents[2]
FLAGSHIP = REPO / "recipes" / "llama70b-128k.yaml"
# The flagship as it shipped before the forecast existed: 2000 steps in a 5-day limit.
TOO_LONG = ["training.steps=2000", "cluster.max_run=5d"]
# A run one job within SageMaker's 5-day run-time quota could finish, cut short by max_run alone
# (a run longer than the quota is no overrun: it goes on in a chain of jobs, test_sagemaker_quotas.py).
CUT_SHORT = ["cluster.max_run=2d"]


def test_the_forecast_is_steps_times_the_predicted_step_at_the_clusters_price():
    recipe = api.load(FLAGSHIP)
    run = forecast(recipe, time_limit_s=recipe.cluster.max_run)
    speed = run.speed
    assert run.run_s == pytest.approx(recipe.training.steps * speed.step_time_s)
    # 4 x ml.p5e.48xlarge at the catalog's hourly price, for the predicted hours.
    hourly = 4 * recipe.hardware.instance.usd_per_hour
    assert run.speed.usd_per_hour == pytest.approx(hourly)
    assert run.usd == pytest.approx(hourly * run.run_s / 3600)
    assert run.line() == (
        f"time: {speed.step_time_s:.1f} s/step x 1000 steps = {duration(run.run_s)}; "
        f"cost about ${run.usd:,.0f} (4 x ml.p5e.48xlarge at ${hourly:,.2f}/h)"
    )
    assert run.overrun() is None


def test_a_run_longer_than_max_run_says_which_max_run_or_steps_would_fit():
    recipe = api.load(FLAGSHIP, set_options=TOO_LONG)
    run = forecast(recipe, time_limit_s=recipe.cluster.max_run)
    fitting_steps = math.floor(5 * 86400 / run.speed.step_time_s)
    needed_days = math.ceil(run.run_s * 1.15 / 86400)
    assert run.overrun() == (
        f"llama70b-128k: the predicted run time {duration(run.run_s)} (2000 steps x {run.speed.step_time_s:.1f} s) "
        f"exceeds cluster.max_run 5.0 days, so the job would be stopped before its last step; "
        f"set cluster.max_run: {needed_days}d or training.steps: {fitting_steps}"
    )
    # Either fix really fits.
    for fix in (f"cluster.max_run={needed_days}d", f"training.steps={fitting_steps}"):
        fixed = api.load(FLAGSHIP, set_options=[*TOO_LONG, fix])
        assert forecast(fixed, time_limit_s=fixed.cluster.max_run).overrun() is None


def test_a_resumed_run_is_priced_from_its_checkpoint_and_its_fix_counts_the_steps_before():
    """A job that resumes after step 1200 of 2000 runs 800 steps: that fits a 5-day limit the
    whole run does not, and where it does not fit, the training.steps that would count from 0."""
    recipe = api.load(FLAGSHIP, set_options=TOO_LONG)
    whole = forecast(recipe, time_limit_s=recipe.cluster.max_run)
    resumed = forecast(recipe, time_limit_s=recipe.cluster.max_run, start_step=1200)
    assert resumed.steps == 800 and resumed.run_s == pytest.approx(whole.run_s * 800 / 2000)
    assert resumed.usd == pytest.approx(whole.usd * 800 / 2000)
    assert resumed.line().startswith(f"time: {whole.speed.step_time_s:.1f} s/step x 800 steps after step 1200 = ")
    assert resumed.overrun() is None and whole.overrun() is not None
    short = forecast(recipe, time_limit_s=2 * 86400, start_step=1200)
    fitting_steps = math.floor(2 * 86400 / short.speed.step_time_s)
    assert short.overrun().endswith(f" or training.steps: {1200 + fitting_steps}")
    assert "(800 steps after step 1200 x " in short.overrun()


def test_submit_refuses_a_run_that_would_outlast_max_run_and_force_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_HOME", str(tmp_path))
    with pytest.raises(api.WontFit, match=r"exceeds cluster.max_run 2.0 days.*nothing was submitted \(pass --force"):
        api.submit(FLAGSHIP, set_options=CUT_SHORT, dry_run=True)
    told = []
    forced = api.submit(FLAGSHIP, set_options=CUT_SHORT, dry_run=True, force=True, report=lambda s, m: told.append(m))
    assert forced.dry_run and any(m.startswith("time: ") and "1000 steps" in m for m in told)


def test_the_time_limit_applies_only_where_the_engine_enforces_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_HOME", str(tmp_path))
    # Slurm requeues a job at its time limit and the job resumes, so cluster.max_run bounds one
    # allocation, not the run: the same too-long run renders (it states the time all the same).
    told = []
    done = api.submit(
        FLAGSHIP,
        set_options=TOO_LONG,
        backend="slurm",
        dry_run=True,
        report=lambda s, m: told.append(m),
    )
    assert done.dry_run and any(m.startswith("time: ") for m in told)
    # A PyTorchJob's activeDeadlineSeconds does stop it.
    with pytest.raises(api.WontFit, match=r"exceeds cluster.max_run 5.0 days"):
        api.submit(FLAGSHIP, set_options=TOO_LONG, backend="k8s", dry_run=True)


def test_dry_run_states_time_cost_and_checkpoint_cost_of_every_recipe(tmp_path, monkeypatch):
    """The CPU recipe too: its step is priced by the host-CPU rates (launcher.plan.host_cpu)."""
    monkeypatch.setenv("LAUNCHER_HOME", str(tmp_path))
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        told = []
        api.submit(path, dry_run=True, report=lambda stage, message, told=told: told.append(message))
        assert any(m.startswith("time: ") and "cost about $" in m for m in told), path.name
        assert any(m.startswith("checkpoint ") for m in told), path.name


def test_an_expensive_submission_needs_a_yes_and_nothing_is_sent_without_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_HOME", str(tmp_path))
    # No terminal and no yes: refused before anything is uploaded or created (no AWS call is made:
    # this test has no credentials and no endpoint).
    with pytest.raises(UsageError, match=r"predicted cost about \$[\d,]+ is above \$1,000; pass --yes"):
        api.submit(FLAGSHIP)
    asked = []
    with pytest.raises(UsageError, match="not confirmed; nothing was submitted"):
        api.submit(FLAGSHIP, confirm=lambda question: asked.append(question) or False)
    assert len(asked) == 1 and asked[0].startswith("llama70b-128k: predicted cost about $")
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())


def test_cli_prints_one_line_and_exits_2_for_a_run_that_would_not_fit(tmp_path):
    env = {"LAUNCHER_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    sets = [arg for s in CUT_SHORT for arg in ("--set", s)]
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "submit", str(FLAGSHIP), *sets, "--dry-run"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "exceeds cluster.max_run" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr
