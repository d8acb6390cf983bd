"""`launcher estimate`: the table, the JSON contract, and one clean line for bad input."""

from __future__ import annotations

import json

import pytest

from launcher import api
from launcher.estimate import COMPONENTS
from launcher.recipe import Recipe

RECIPE = "recipes/llama3-8b-8k.yaml"
REQUIRED_KEYS = {
    "per_gpu_peak_bytes",
    "gpu_memory_bytes",
    "utilization",
    "verdict",
    "breakdown",
    "stages",
    "suggestion",
}


def test_prints_a_table_per_stage_and_the_verdict(cli):
    result = cli("estimate", RECIPE)
    assert result.code == 0, result.err
    assert "GiB per GPU" in result.out
    for row in ("parameters", "optimizer_states", "activations", "allocated", "cuda_context", "peak"):
        assert row in result.out
    assert "fits:" in result.out and "per GPU" in result.out


def test_pipeline_recipes_get_a_column_per_stage(cli):
    result = cli("estimate", RECIPE, "--set", "parallel.pipeline=2")
    assert result.code == 0, result.err
    assert "stage 0" in result.out and "stage 1" in result.out


def test_json_has_the_contract_keys_and_matches_the_python_api(cli):
    result = cli("estimate", RECIPE, "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert REQUIRED_KEYS <= report.keys()
    assert list(report["breakdown"]) == list(COMPONENTS)
    assert report["utilization"] == pytest.approx(report["per_gpu_peak_bytes"] / report["gpu_memory_bytes"], abs=1e-4)
    assert report["verdict"] in ("fits", "risky", "oom")
    assert {"stage", "layers", "phase", "peak_bytes", "breakdown"} <= report["stages"][0].keys()
    report.pop("predicted", None)  # the throughput model's part of the report
    assert report == api.estimate(Recipe.load(RECIPE)).to_dict()


def test_megatron_mode_and_threshold_reach_the_estimate(cli):
    report = json.loads(cli("estimate", RECIPE, "--mode", "megatron", "--threshold", "0.5", "--json").out)
    assert report["mode"] == "megatron"
    assert report["threshold"] == 0.5
    report.pop("predicted", None)
    assert report == api.estimate(Recipe.load(RECIPE), mode="megatron", threshold=0.5).to_dict()


def test_set_overrides_apply_before_estimating(cli):
    base = json.loads(cli("estimate", RECIPE, "--json").out)
    full = json.loads(cli("estimate", RECIPE, "--set", "parallel.activation_checkpointing=full", "--json").out)
    assert full["breakdown"]["activations"] < base["breakdown"]["activations"]


def test_a_job_over_the_threshold_is_risky_with_a_suggestion(cli):
    report = json.loads(cli("estimate", RECIPE, "--threshold", "0.2", "--json").out)
    assert report["verdict"] == "risky"
    assert report["suggestion"]


@pytest.mark.parametrize(
    "args, message",
    [
        (("recipes/nope.yaml",), "recipes/nope.yaml no such file"),
        ((RECIPE, "--set", "nonsense"), "--set 'nonsense' is not KEY=VALUE"),
        ((RECIPE, "--mode", "deepspeed"), "mode 'deepspeed' is not an accounting mode; use fsdp or megatron"),
        ((RECIPE, "--threshold", "1.5"), "threshold 1.5 is not a fraction of GPU memory"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(cli, args, message):
    result = cli("estimate", *args)
    assert result.code == 2
    assert len(result.err_lines) == 1, result.err
    assert result.err_lines[0].startswith(message)
    assert result.out == ""


def test_the_threshold_option_names_the_estimators_default():
    # The CLI leaves the default to the estimator (None) so `launcher --help` need not import it.
    from launcher import cli
    from launcher.estimate import DEFAULT_THRESHOLD

    assert f"(default {DEFAULT_THRESHOLD})" in cli.ThresholdOpt.__metadata__[0].help
