"""data.validation: one line naming the key for each bad recipe, and what a good one resolves to."""

from __future__ import annotations

import re

import pytest

from launcher.contract.config import ConfigError, JobConfig
from launcher.recipe import Recipe
from launcher.resolve import resolve

from .test_bad_recipes import BASE

LOCAL = BASE.replace("sagemaker\n", "local\n").replace("ml.p5.48xlarge", "local\n  device: cpu")


def validate(tmp_path, monkeypatch, cli, text: str):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text(text)
    return cli("validate", "r.yaml")


def only_line(result) -> str:
    assert result.code == 2, result.err
    assert len(result.err_lines) == 1, result.err_lines
    return result.err_lines[0]


def test_allows_a_synthetic_validation_stream_and_resolves_it_into_the_job_config(tmp_path):
    (tmp_path / "r.yaml").write_text(BASE + "data:\n  validation: {source: synthetic, every_steps: 5, batches: 2}\n")
    cfg = resolve(Recipe.load(tmp_path / "r.yaml")).concrete.resolved()
    validation = cfg.data.validation
    assert (validation.source, validation.fraction, validation.every_steps, validation.batches) == (
        "synthetic",
        None,
        5,
        2,
    )
    assert JobConfig.from_dict(cfg.to_dict()) == cfg
    assert [validation.due(step, 10) for step in range(1, 11)] == [False] * 4 + [True] + [False] * 4 + [True]


def test_a_recipe_without_validation_resolves_to_none(tmp_path):
    (tmp_path / "r.yaml").write_text(BASE)
    assert resolve(Recipe.load(tmp_path / "r.yaml")).concrete.resolved().data.validation is None


def test_rejects_both_a_source_and_a_fraction(tmp_path, monkeypatch, cli):
    text = LOCAL + "data:\n  source: /data/tokens\n  dtype: uint32\n  validation: {source: /data/val, fraction: 0.01}\n"
    assert only_line(validate(tmp_path, monkeypatch, cli, text)).endswith(
        "data.validation: both of source and fraction given; give one: source (held-out token files) or "
        "fraction (a share of data.source's documents, e.g. 0.01)"
    )


def test_rejects_every_steps_with_nothing_to_evaluate(tmp_path, monkeypatch, cli):
    line = only_line(validate(tmp_path, monkeypatch, cli, BASE + "data:\n  validation: {every_steps: 100}\n"))
    assert line.endswith("data.validation: neither of source and fraction given; give one: source (held-out "
                         "token files) or fraction (a share of data.source's documents, e.g. 0.01)")  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("fraction: 1.5", "data.validation.fraction: expected less than 1.0, got 1.5"),
        ("fraction: 0", "data.validation.fraction: expected a positive number, got 0"),
        ("{source: synthetic, batches: 0}", "data.validation.batches: expected a positive number, got 0"),
        ("{source: synthetic, every_steps: -1}", "data.validation.every_steps: expected at least 0, got -1"),
        ("{source: synthetic, every: 5}", "data.validation.every"),
    ],
)
def test_rejects_out_of_range_values_in_one_line(tmp_path, monkeypatch, cli, setting, message):
    if setting.startswith("fraction"):
        setting = "{" + setting + "}"
    line = only_line(validate(tmp_path, monkeypatch, cli, BASE + f"data:\n  validation: {setting}\n"))
    assert message in line, line


def test_rejects_a_fraction_of_synthetic_data(tmp_path, monkeypatch, cli):
    line = only_line(validate(tmp_path, monkeypatch, cli, BASE + "data:\n  validation: {fraction: 0.01}\n"))
    assert line.endswith(
        "data.validation.fraction: holds out whole documents of a prepared dataset, but data.source is "
        "synthetic; use data.validation.source: synthetic"
    ), line


def test_rejects_a_fraction_of_token_files_that_are_not_a_prepared_dataset(tmp_path, monkeypatch, cli):
    (tmp_path / "tokens").mkdir()
    (tmp_path / "tokens" / "a.bin").write_bytes(b"\x00\x00" * 100)
    text = LOCAL + "data:\n  source: tokens\n  dtype: uint32\n  validation: {fraction: 0.01}\n"
    assert only_line(validate(tmp_path, monkeypatch, cli, text)).endswith(
        f"data.validation.fraction: {tmp_path / 'tokens'} is not a prepared dataset (no manifest.json), so it has no documents "
        "to hold out; prepare it with `launcher data prepare`, or give data.validation.source"
    )


def test_rejects_local_validation_files_on_sagemaker_and_remote_ones_everywhere(tmp_path, monkeypatch, cli):
    line = only_line(validate(tmp_path, monkeypatch, cli, BASE + "data:\n  validation: {source: /data/val}\n"))
    assert line.endswith(
        "data.validation.source: a local path (/data/val) cannot reach a SageMaker job; hold out a share of "
        "data.source with data.validation.fraction"
    ), line
    line = only_line(validate(tmp_path, monkeypatch, cli, LOCAL + "data:\n  validation: {source: s3://b/val}\n"))
    assert "data.validation.source: s3://b/val: remote validation data is not staged to the job" in line


def test_allows_a_fraction_of_an_s3_prepared_dataset_the_job_splits(tmp_path, monkeypatch, cli):
    text = BASE + "data:\n  source: s3://bucket/prepared\n  dtype: uint32\n  validation: {fraction: 0.01}\n"
    result = validate(tmp_path, monkeypatch, cli, text)
    assert result.code == 0, result.err


def test_the_entrypoints_refuse_a_hand_edited_config_in_one_line(tmp_path):
    (tmp_path / "r.yaml").write_text(BASE)
    data = resolve(Recipe.load(tmp_path / "r.yaml")).concrete.resolved().to_dict()
    for validation, message in (
        ({"source": "synthetic", "fraction": 0.1}, "data.validation: give exactly one of source"),
        ({"fraction": 2.0}, "data.validation.fraction: 2.0 is not between 0 and 1 (exclusive)"),
        ({"source": "synthetic", "batches": 0}, "data.validation.batches: 0 is not a positive number of batches"),
        ({"source": "synthetic", "every_steps": "5"}, 'data.validation.every_steps: expected an integer, got "5"'),
    ):
        data["data"]["validation"] = validation
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
            JobConfig.from_dict(data)


def test_a_relative_validation_source_is_relative_to_the_recipe_file(tmp_path):
    (tmp_path / "held-out").mkdir()
    (tmp_path / "held-out" / "a.bin").write_bytes(b"\x01\x00" * 600)
    (tmp_path / "r.yaml").write_text(LOCAL + "data:\n  dtype: uint32\n  validation: {source: held-out}\n")
    recipe = Recipe.load(tmp_path / "r.yaml")
    assert recipe.data.validation.source == str(tmp_path / "held-out")
