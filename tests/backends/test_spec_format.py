"""Saved specs (spec.json) carry a format version; a record written before the engine part
existed (format 1, tests/backends/specs_format1/, written by the launcher of that time) still
loads, as the same spec and the same request, and a format this launcher does not know is one
line that says what to do."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launcher.backends import get_backend
from launcher.errors import LauncherError
from launcher.registry import job_dir, write_json
from launcher.spec import SPEC_FORMAT

from .helpers import HERE, PLACEHOLDER_ROLE, spec_for

# The recipe and --set options each format-1 record was written with.
FORMAT1_RECORDS = {
    "sagemaker": (
        "llama3-8b-8k",
        {
            "sagemaker.spot": True,
            "sagemaker.retries": 2,
            "sagemaker.tags": {"team": "ml", "cost": "r1"},
            "sagemaker.role_arn": PLACEHOLDER_ROLE,
            "sagemaker.volume_size_gb": 200,
            "sagemaker.subnets": ["subnet-0a1b"],
            "sagemaker.security_group_ids": ["sg-0c2d"],
        },
    ),
    # The sagemaker: section is inert on the other engines: no retries, spot or tags there.
    "slurm": (
        "llama3-8b-8k",
        {
            "slurm.partition": "gpu",
            "slurm.account": "ml",
            "slurm.shared_dir": "/shared",
            "sagemaker.retries": 3,
            "sagemaker.spot": True,
        },
    ),
    # Written when the 70B recipe still said max_run: 6d (now 4d, within SageMaker's default quota).
    "k8s": (
        "llama70b-128k",
        {
            "k8s.namespace": "train",
            "k8s.storage_class": "fsx",
            "sagemaker.tags": {"team": "ml"},
            "cluster.max_run": "6d",
        },
    ),
    "local": ("tiny-cpu", {}),
}
# Where $LAUNCHER_HOME was when the local record was written (its paths lie under it); never created.
FORMAT1_HOME = "/var/empty/launcher-home"


def format1(backend: str) -> dict:
    return json.loads((HERE / "specs_format1" / f"{backend}.json").read_text())


@pytest.mark.parametrize("backend", list(FORMAT1_RECORDS))
def test_a_format1_record_loads_as_the_spec_and_request_that_submit_builds_today(monkeypatch, backend):
    monkeypatch.setenv("LAUNCHER_HOME", FORMAT1_HOME)
    recipe, overrides = FORMAT1_RECORDS[backend]
    target = get_backend(backend)
    old = format1(backend)
    assert "format" not in old and "engine" not in old  # written before either existed
    loaded, today = target.load_spec(old), spec_for(recipe, backend, **overrides)
    # The resolved config is RESOLVE's, which may grow keys; the command (and the stop grace it
    # carries) is what that job was started with; everything the engine part holds must match.
    assert loaded.stop_grace_s == 120  # a spec from before the stop grace: SageMaker's, as it ran
    loaded = loaded.replace(command=today.command, stop_grace_s=today.stop_grace_s)
    if backend == "k8s":
        # Written before the k8s part carried the region: none, so Mountpoint finds it as it did then.
        assert loaded.engine.region is None
        loaded = loaded.replace(engine=dataclasses.replace(loaded.engine, region=today.engine.region))
    assert loaded.replace(resolved_json=today.resolved_json) == today
    assert type(loaded.engine) is target.settings_type
    assert (loaded.retries, loaded.spot, loaded.tags) == (
        old["retries"],
        old["spot"],
        tuple(sorted(old["tags"].items())),
    )
    if backend == "sagemaker":
        request = target.render(loaded.replace(resolved_json=today.resolved_json)).data["request"]
        assert request == target.render(today).data["request"]
        assert request["ResourceConfig"]["VolumeSizeInGB"] == 200
        assert request["RetryStrategy"] == {"MaximumRetryAttempts": 2}
        assert request["StoppingCondition"]["MaxWaitTimeInSeconds"] == old["sagemaker"]["max_wait_s"]


@pytest.mark.parametrize("backend", list(FORMAT1_RECORDS))
def test_a_saved_spec_carries_its_format_and_reads_back_equal(home, backend):
    recipe, overrides = FORMAT1_RECORDS[backend]
    spec = spec_for(recipe, backend, **overrides)
    write_json(job_dir(spec.name) / "spec.json", spec.to_dict())
    saved = json.loads((job_dir(spec.name) / "spec.json").read_text())
    assert saved["format"] == SPEC_FORMAT == 2
    assert get_backend(backend).saved_spec(spec.name) == spec


def test_a_spec_of_an_unknown_format_is_one_line_saying_what_to_do(home):
    spec = spec_for("tiny-cpu", "slurm")
    path = job_dir(spec.name) / "spec.json"
    write_json(path, {**spec.to_dict(), "format": 9})
    with pytest.raises(LauncherError) as raised:
        get_backend("slurm").saved_spec(spec.name)
    assert str(raised.value) == (
        f"{path}: job spec format 9 is not one this launcher reads (1 or 2); "
        "use the launcher version that submitted the job"
    )


def test_a_spec_missing_its_engine_part_is_one_line_naming_the_file(home):
    spec = spec_for("tiny-cpu", "slurm")
    path = job_dir(spec.name) / "spec.json"
    data = spec.to_dict()
    del data["engine"]
    write_json(path, data)
    with pytest.raises(LauncherError) as raised:
        get_backend("slurm").saved_spec(spec.name)
    assert str(raised.value) == f"{path}: damaged job spec: KeyError 'engine'; move it away"


# backend -> (engine key, a value of the wrong type, the type the reader names)
WRONG_ENGINE_VALUES = [
    ("slurm", "retries", "3", "int"),
    ("slurm", "retries", True, "int"),
    ("slurm", "spot", "yes", "bool"),
    ("slurm", "signal_before_end_s", 1.5, "int"),
    ("slurm", "partition", ["gpu"], "str | None"),
    ("k8s", "storage_size", None, "str"),
    ("sagemaker", "volume_size_gb", "200", "int"),
    ("sagemaker", "max_wait_s", "1d", "int | None"),
]


@pytest.mark.parametrize(("backend", "key", "value", "expected"), WRONG_ENGINE_VALUES)
def test_an_engine_value_of_the_wrong_type_is_one_line_naming_the_key(home, backend, key, value, expected):
    # A saved spec is read back from disk: a value of the wrong type must not reach the engine's
    # request or an sbatch line (a retries of "3" would render as RetryStrategy "3").
    spec = spec_for("tiny-cpu" if backend != "sagemaker" else "llama3-8b-8k", backend)
    path = job_dir(spec.name) / "spec.json"
    data = spec.to_dict()
    data["engine"][key] = value
    write_json(path, data)
    with pytest.raises(LauncherError) as raised:
        get_backend(backend).saved_spec(spec.name)
    assert str(raised.value) == (
        f"{path}: damaged job spec: TypeError engine.{key}: expected {expected}, got {value!r}; move it away"
    )


@pytest.mark.parametrize(
    ("tags", "networking"),
    [({"team": 1}, None), (["team", "ml"], None), (None, {"isolation": "no"}), (None, {"subnets": [7]})],
)
def test_damaged_sagemaker_tags_or_networking_are_one_line(home, tags, networking):
    spec = spec_for("llama3-8b-8k", "sagemaker")
    path = job_dir(spec.name) / "spec.json"
    data = spec.to_dict()
    if tags is not None:
        data["engine"]["tags"] = tags
    if networking is not None:
        data["engine"]["networking"].update(networking)
    write_json(path, data)
    with pytest.raises(LauncherError) as raised:
        get_backend("sagemaker").saved_spec(spec.name)
    line = str(raised.value)
    assert "\n" not in line and line.startswith(f"{path}: damaged job spec: TypeError engine."), line
    assert line.endswith("; move it away") and ("engine.tags" in line) == (tags is not None), line
