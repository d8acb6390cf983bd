"""JobSpec: unique SageMaker-valid names, the torchrun argv, EFA environment, serialization."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections import Counter

import pytest

from launcher.backends import get_backend
from launcher.spec import JOB_NAME_RE, EngineSettings, job_name
from tests.backends.helpers import spec_for

NOW = datetime.datetime(2026, 11, 9, 15, 30, 12, 345678, tzinfo=datetime.UTC)


def test_job_names_carry_the_utc_time_to_the_millisecond_and_a_random_suffix():
    name = job_name("llama70b-128k", now=NOW)
    assert name.startswith("llama70b-128k-20261109-153012-345-")
    assert JOB_NAME_RE.match(name) and len(name) <= 63


def test_jobs_in_the_same_millisecond_differ_by_a_suffix_of_four_random_characters():
    """Uniqueness within one millisecond rests on the suffix's entropy (36^4 values from the OS's
    random source), so it is tested by the birthday bound, not by a count that chance can break
    (200 names collided once in a CI run): 2000 names expect 1.19 pairs alike; more than 10 has
    a chance of 6e-8, while a suffix of less entropy (3 characters: 43 pairs) fails."""
    names = [job_name("same", now=NOW) for _ in range(2000)]
    assert {name.rsplit("-", 1)[0] for name in names} == {"same-20261109-153012-345"}
    assert all(re.fullmatch(r"[a-z0-9]{4}", name.rsplit("-", 1)[1]) for name in names)
    alike = sum(count * (count - 1) // 2 for count in Counter(names).values())
    assert alike <= 10, f"{alike} pairs of 2000 names are alike; 4 random characters give about 1.2"


def test_a_long_recipe_name_is_shortened_never_the_time_or_suffix():
    name = job_name("a" * 39 + "-b", now=NOW)
    assert len(name) == 63 and JOB_NAME_RE.match(name)
    assert "-20261109-153012-345-" in name


def test_a_name_cut_at_a_hyphen_stays_valid():
    name = job_name("x" * 36 + "--yy", now=NOW)
    assert JOB_NAME_RE.match(name) and "--2026" not in name


def test_names_respect_a_backends_shorter_limit():
    assert len(job_name("a" * 40, now=NOW, max_len=52)) == 52


def test_single_node_runs_torchrun_standalone_from_the_bundle_root():
    spec = spec_for("llama3-8b-8k", "slurm")
    # The bootstrap installs the job's wheels, then execs torchrun with this rendezvous; torchrun
    # waits the job's stop grace less 20 s for the final save (an 8B step and save need less than 120 s),
    # and restarts the workers once, since Slurm never reruns a job whose script failed (sbatch(1)).
    assert spec.command == (
        "python3",
        "entrypoints/bootstrap.py",
        "--exec",
        "torchrun",
        "--nnodes=1",
        "--nproc-per-node=8",
        "--standalone",
        "--max-restarts=1",
        "--shutdown-timeout=100",
        "entrypoints/train.py",
        "--config",
        "resolved.json",
    )


def test_multi_node_uses_c10d_rendezvous_on_the_first_host():
    spec = spec_for("llama70b-128k", "k8s")
    assert spec.command[:9] == (
        "python3",
        "entrypoints/bootstrap.py",
        "--exec",
        "torchrun",
        "--nnodes=4",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        f"--rdzv-id={spec.name}",
        f"--rdzv-endpoint={spec.name}-master-0:29500",
    )
    assert spec.command[-3:] == ("entrypoints/train.py", "--config", "resolved.json")


def test_on_sagemaker_the_bootstrap_runs_torchrun_and_chooses_the_rendezvous():
    # entrypoints/bootstrap.py adds the c10d rendezvous from resourceconfig.json.
    for recipe in ("llama3-8b-8k", "llama70b-128k"):
        assert spec_for(recipe, "sagemaker").command == (
            "python3",
            "entrypoints/bootstrap.py",
            "torchrun",
            "--nproc-per-node=8",
            "--max-restarts=1",
            "--shutdown-timeout=100",  # SageMaker's 120 s grace less 20 s
            "entrypoints/train.py",
            "--config",
            "resolved.json",
        )


@pytest.mark.parametrize(
    "recipe, instance, efa",
    [
        ("llama3-8b-8k", "ml.p5.48xlarge", True),
        ("llama70b-128k", "ml.p5e.48xlarge", True),
        ("llama405b-128k", "ml.p5en.48xlarge", True),
        ("tiny-cpu", "local", False),
    ],
)
def test_efa_variables_come_from_the_catalog(recipe, instance, efa):
    backend = "local" if instance == "local" else "sagemaker"
    spec = spec_for(recipe, backend)
    assert spec.resources.instance_type == instance
    assert ("FI_PROVIDER" in spec.env) is efa
    if efa:
        assert spec.env["FI_PROVIDER"] == "efa" and spec.env["FI_EFA_USE_DEVICE_RDMA"] == "1"


def test_p4d_gets_efa_settings_too_because_the_catalog_says_it_has_efa():
    spec = spec_for("llama3-8b-8k", "sagemaker", **{"cluster.instance_type": "ml.p4de.24xlarge"})
    assert spec.env["FI_PROVIDER"] == "efa"


def test_s3_data_is_read_through_the_train_channel():
    spec = spec_for("llama70b-128k", "sagemaker")
    (data,) = spec.inputs
    assert (data.name, data.source, data.container_path) == (
        "train",
        "s3://my-training-bucket/tokens/llama3-128k/",
        "/opt/ml/input/data/train",
    )
    assert spec.env["SM_CHANNEL_TRAIN"] == "/opt/ml/input/data/train"


def test_the_resolved_recipe_travels_whole_with_the_backends_paths():
    spec = spec_for("llama70b-128k", "sagemaker")
    resolved = spec.resolved
    assert resolved["format"] == 1 and resolved["name"] == "llama70b-128k"
    assert resolved["checkpoint"]["dir"] == "/opt/ml/checkpoints"
    assert resolved["runtime"]["output_dir"] == "/opt/ml/output/data"
    assert resolved["parallel"]["context"] == 8


def test_spot_without_max_wait_waits_twice_the_run_time():
    spec = spec_for("llama3-8b-8k", "sagemaker", **{"sagemaker.spot": True})
    assert spec.spot and spec.engine.max_wait_s == 2 * spec.max_run_s


def test_json_round_trip_gives_an_equal_spec():
    spec = spec_for("llama70b-128k", "sagemaker", **{"sagemaker.tags": {"team": "x", "cost": "y"}})
    again = get_backend("sagemaker").load_spec(json.loads(spec.to_json()))
    assert again == spec
    assert again.to_json() == spec.to_json()


def test_only_a_sagemaker_spec_carries_sagemaker_settings_and_both_round_trip():
    local = spec_for("tiny-cpu", "local")
    assert type(local.engine) is EngineSettings and local.max_run_s == 86400
    assert get_backend("local").load_spec(json.loads(local.to_json())) == local
    vpc = {"sagemaker.subnets": ["subnet-0a1b"], "sagemaker.security_group_ids": ["sg-0c2d"]}
    sagemaker = spec_for("llama70b-128k", "sagemaker", **vpc)
    assert sagemaker.engine.region == "us-west-2"
    assert sagemaker.engine.networking.subnets == ("subnet-0a1b",)
    assert get_backend("sagemaker").load_spec(json.loads(sagemaker.to_json())) == sagemaker


def test_a_spec_is_frozen():
    spec = spec_for("tiny-cpu", "local")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]


def test_prints_a_summary_and_escapes_html():
    spec = spec_for("tiny-cpu", "local", **{"data.source": "/data/<script>x</script>"})
    assert "1 x local, 4 x cpu each" in str(spec)
    assert repr(spec) == f"JobSpec('{spec.name}', local, 1xlocal, world 4)"
    html = spec._repr_html_()
    assert "<script>" not in html and "&lt;script&gt;" in html
