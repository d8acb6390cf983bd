"""An s3:// model.init_from reaches the job as the `model` input: SageMaker's channel, or a copy staged at submit."""

from __future__ import annotations

import pytest

from launcher.backends import get_backend
from launcher.backends.sagemaker.aws_model import validate
from launcher.errors import UsageError

from .helpers import spec_for

WEIGHTS = "s3://my-models/llama-3.1-70b/"


def test_sagemaker_gets_a_model_channel_the_service_model_accepts(fake_bundle, home):
    spec = spec_for("llama70b-128k", "sagemaker", model={"base": "llama3.1-70b", "init_from": WEIGHTS})
    request = get_backend("sagemaker").render(spec).data["request"]
    assert validate("sagemaker", "CreateTrainingJob", request) == []
    channels = {c["ChannelName"]: c for c in request["InputDataConfig"]}
    assert channels["model"]["DataSource"]["S3DataSource"]["S3Uri"] == WEIGHTS
    assert request["Environment"]["SM_CHANNEL_MODEL"] == "/opt/ml/input/data/model"
    assert spec.resolved["model"]["init_from"] == WEIGHTS


def test_local_stages_the_weights_at_submit_and_points_the_job_at_the_copy(home):
    spec = spec_for("tiny-cpu", "local", model={"base": "llama3.1-tiny", "init_from": WEIGHTS})
    (model,) = [i for i in spec.inputs if i.name == "model"]
    assert model.source == WEIGHTS and model.staged_at == model.container_path
    assert model.staged_at.startswith(str(home / "data"))
    assert dict(spec.environment)["SM_CHANNEL_MODEL"] == model.container_path


def test_a_backend_that_cannot_fetch_the_weights_says_so_at_render(fake_bundle, home):
    spec = spec_for("tiny-cpu", "docker", model={"base": "llama3.1-tiny", "init_from": WEIGHTS})
    with pytest.raises(UsageError, match="model.init_from: the docker backend does not fetch s3:// weights"):
        get_backend("docker").render(spec)


def test_a_local_checkpoint_is_read_where_it_is(home, tmp_path):
    import json

    from launcher.contract.hf_checkpoint import hf_config_json

    tiny = spec_for("tiny-cpu", "local", model="llama3.1-tiny").resolved["model"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config_json(tiny, dtype="fp32")))
    spec = spec_for("tiny-cpu", "local", model={"base": "llama3.1-tiny", "init_from": str(tmp_path)})
    assert [i.name for i in spec.inputs] == []
    assert spec.resolved["model"]["init_from"] == str(tmp_path)
