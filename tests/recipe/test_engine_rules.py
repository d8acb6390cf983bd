"""Rules that depend on the engine read its capabilities (launcher/catalog/engines.yaml), never
its name, and say what they said when they compared names: the same line at the same command."""

from __future__ import annotations

import textwrap
import typing

import pytest

from launcher.backends import NAMES, backend_class
from launcher.catalog.engines import capabilities, engines
from launcher.recipe.schema import SAGEMAKER_MAX_RUN_S, Cluster
from launcher.registry import JobRef, write_json


def test_every_backend_has_one_catalog_entry_and_its_class_reads_it():
    assert list(engines()) == list(NAMES)
    assert typing.get_args(Cluster.model_fields["backend"].annotation) == NAMES
    for name in NAMES:
        assert backend_class(name).capabilities is capabilities(name)


def test_sagemakers_28_day_limit_is_one_number():
    assert capabilities("sagemaker").max_run_s == SAGEMAKER_MAX_RUN_S == 28 * 24 * 3600


TINY = "name: t\nmodel: llama-tiny\ntraining: {seq_len: 64, global_batch_size: 8, steps: 1}\n"
P5 = "name: t\nmodel: llama3-8b\ntraining: {seq_len: 8192, global_batch_size: 16, steps: 10}\n"


@pytest.mark.parametrize(
    "text, line",
    [
        pytest.param(
            P5 + "cluster: {backend: sagemaker, instance_type: ml.p5.48xlarge}\n"
            "data:\n  source: s3://bucket/raw/\n  dtype: uint32\n  tokenizer: meta-llama/Meta-Llama-3-8B\n",
            "recipe.yaml:8 data.tokenizer: submit prepares raw text on this machine, which a SageMaker job cannot "
            "read; run `launcher data prepare SOURCE --tokenizer T --out s3://...` and set data.source to that prefix",
            id="raw-text-for-an-engine-that-cannot-read-this-machine",
        ),
        pytest.param(
            TINY + "cluster:\n  backend: sagemaker\n  device: cpu\n",
            "recipe.yaml:4 cluster.instance_type: the sagemaker backend needs an ml.* instance type; use "
            "ml.p4d.24xlarge, ml.p4de.24xlarge, ml.p5.48xlarge, ml.p5e.48xlarge, ml.p5en.48xlarge or ml.c5.2xlarge",
            id="no-instance-type-for-an-engine-that-provisions-instances",
        ),
        pytest.param(
            TINY + "cluster:\n  backend: local\n  instance_type: ml.p5.48xlarge\n",
            "recipe.yaml:6 cluster.instance_type: the local backend runs on this machine; use instance_type: "
            "local, not ml.p5.48xlarge",
            id="an-instance-type-for-the-engine-that-runs-here",
        ),
    ],
)
def test_an_engine_rule_gives_its_one_line_at_validate(tmp_path, monkeypatch, cli, text, line):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.yaml").write_text(textwrap.dedent(text))
    result = cli("validate", "recipe.yaml")
    assert result.code == 2 and result.err_lines == [line], result.err


def test_export_of_a_job_whose_checkpoints_are_not_here_says_how(tmp_path, monkeypatch, cli):
    monkeypatch.setenv("LAUNCHER_HOME", str(tmp_path))
    name = "t-20261201-120000-000-abcd"
    write_json(tmp_path / "jobs" / name / "job.json", JobRef(name=name, backend="slurm").to_dict())
    result = cli("export", name, "--out", tmp_path / "hf")
    assert result.code == 2 and result.err_lines == [
        "launcher export reads the checkpoints of local jobs; for a slurm job copy its checkpoint directory here "
        "and run python entrypoints/export_hf.py --config resolved.json --checkpoint-dir DIR --out DIR"
    ], result.err
