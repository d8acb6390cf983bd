"""Checkpoints are kept per job lineage: two runs of one recipe never mix, `--resume` continues one."""

from __future__ import annotations

import pytest

from launcher import api
from launcher.errors import UsageError
from launcher.registry import JobRef, save
from tests import REPO

RECIPE = REPO / "recipes" / "llama3-8b-8k.yaml"
CHECKPOINTS = "s3://my-training-bucket/checkpoints/llama3-8b-8k"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_HOME", str(tmp_path))
    return tmp_path


def checkpoint_uri(submission) -> str:
    return submission.rendering.data["request"]["CheckpointConfig"]["S3Uri"]


def dry_run(**kwargs):
    return api.submit(RECIPE, set_options=[f"sagemaker.checkpoint_uri={CHECKPOINTS}"], dry_run=True, **kwargs)


def test_two_runs_of_one_recipe_get_their_own_checkpoint_prefix():
    first, second = dry_run(), dry_run()
    assert checkpoint_uri(first) == f"{CHECKPOINTS}/{first.spec.name}"
    assert checkpoint_uri(second) == f"{CHECKPOINTS}/{second.spec.name}"
    assert first.spec.lineage == first.spec.name != second.spec.name


def test_resume_continues_the_lineage_of_the_job_it_names_and_of_its_resumptions():
    first = dry_run()
    save(JobRef(name=first.spec.name, backend="sagemaker", region="us-east-1"), first.spec)
    resumed = dry_run(resume=first.spec.name)
    assert resumed.spec.name != first.spec.name
    assert checkpoint_uri(resumed) == checkpoint_uri(first)
    # Resuming the resumption stays in the first job's lineage.
    save(JobRef(name=resumed.spec.name, backend="sagemaker", region="us-east-1"), resumed.spec)
    assert checkpoint_uri(dry_run(resume=resumed.spec.name)) == checkpoint_uri(first)


def test_resume_of_an_unknown_job_or_another_recipe_is_one_clear_error(home):
    with pytest.raises(UsageError, match=rf"--resume: no job nope under {home}/jobs; name a job submitted from here"):
        dry_run(resume="nope")
    other = api.submit(REPO / "recipes" / "mistral7b-32k.yaml", dry_run=True)
    save(JobRef(name=other.spec.name, backend="sagemaker"), other.spec)
    with pytest.raises(UsageError, match="ran recipe mistral7b-32k, not llama3-8b-8k; resume a job of the same recipe"):
        dry_run(resume=other.spec.name)


def test_a_resume_whose_checkpoints_would_be_elsewhere_is_refused_naming_both_places():
    """A new job of the lineage that would look for checkpoints where the earlier job's are not
    would start from step 0 without a word: another sagemaker.checkpoint_uri, another engine."""
    first = dry_run()
    save(JobRef(name=first.spec.name, backend="sagemaker", region="us-east-1"), first.spec)
    moved = "s3://another-bucket/checkpoints"
    with pytest.raises(UsageError) as refused:
        api.submit(RECIPE, set_options=[f"sagemaker.checkpoint_uri={moved}"], dry_run=True, resume=first.spec.name)
    assert str(refused.value) == (
        f"--resume {first.spec.name}: its checkpoints are in {CHECKPOINTS}/{first.spec.name}, but this job's would "
        f"be in {moved}/{first.spec.name}, where it would start from step 0; set sagemaker.checkpoint_uri as "
        f"{first.spec.name} had it"
    )
    with pytest.raises(UsageError) as refused:
        api.submit(RECIPE, backend="slurm", dry_run=True, resume=first.spec.name)
    assert str(refused.value).endswith(
        f"where it would start from step 0; submit it to the sagemaker backend, which {first.spec.name} ran on"
    )
