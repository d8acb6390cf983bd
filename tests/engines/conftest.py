"""Fixtures for the engine simulations: the image, the job's data in S3, and `launcher submit`.

The simulation creates network, mount, UTS and PID namespaces, so it needs root, `ip` (iproute2)
and `unshare`/`nsenter` (util-linux), as CI has. Elsewhere these tests fail and say so: a skip
would hide that the proof did not run.
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import sys
from array import array
from pathlib import Path

import pytest

from tests import REPO
from tests.backends.helpers import REGION, ROLE

from .image import build_image
from .sagemaker_sim import Simulation
from .slurm_cluster import SlurmCluster, missing_prerequisites, start_cluster, stop_cluster

RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
DATA_BUCKET = "launcher-sim-data"
VOCAB = 512  # llama-tiny's vocabulary


@pytest.fixture(scope="session")
def namespaces_allowed() -> None:
    missing = [tool for tool in ("ip", "unshare", "mount", "hostname") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        pytest.fail(
            "the SageMaker simulation needs root and iproute2 + util-linux "
            f"(running as uid {os.geteuid()}, missing: {', '.join(missing) or 'nothing'})"
        )


@pytest.fixture(scope="session")
def image(tmp_path_factory, namespaces_allowed) -> Path:
    """This machine's venv without torchao (see image.py), standing in for the training image."""
    return build_image(Path(sys.prefix), tmp_path_factory.mktemp("image") / "venv")


@pytest.fixture
def s3(request):
    import boto3

    request.getfixturevalue("aws")  # moto, freshly reset, with credentials and AWS_ENDPOINT_URL

    return boto3.client("s3", region_name=REGION)


@pytest.fixture
def sim(s3, image, tmp_path) -> Simulation:
    # A shortened spot/stop grace: SageMaker gives about 120 s; the tiny job saves in well under 1.
    return Simulation(s3, image=image, workdir=tmp_path / "hosts", grace_s=30.0, sync_poll_s=0.2)


@pytest.fixture
def train_data(s3) -> str:
    """Token shards in S3 (uint16, llama-tiny's vocabulary): the job's `train` channel.

    A random walk (each token 1 to 4 above the last), so there is something to learn and the
    loss falls within a few steps.
    """
    s3.create_bucket(Bucket=DATA_BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
    generator = random.Random(0)
    for shard in range(2):
        tokens, token = array("H"), generator.randrange(VOCAB)
        for _ in range(40_000):
            token = (token + generator.randint(1, 4)) % VOCAB
            tokens.append(token)
        s3.put_object(Bucket=DATA_BUCKET, Key=f"tokens/shard-{shard}.bin", Body=tokens.tobytes())
    return f"s3://{DATA_BUCKET}/tokens/"


@pytest.fixture
def submit(s3, cli, monkeypatch, tmp_path):
    """`launcher submit tiny-cpu --backend sagemaker --set ...` against moto; returns the request sent.

    The request is read off the launcher's own boto3 client as it calls CreateTrainingJob (moto
    drops Environment on describe), so it is exactly what SageMaker would receive.
    """
    from launcher.backends.sagemaker import aws as aws_clients

    monkeypatch.setenv("LAUNCHER_HOME", str(tmp_path / "launcher-home"))

    def run(*sets: str) -> dict:
        sent: list[dict] = []
        aws_clients.client("sagemaker", REGION).meta.events.register(
            "provide-client-params.sagemaker.CreateTrainingJob",
            lambda params, **_: sent.append(copy.deepcopy(params)),
        )
        options = [arg for item in (*sim_settings(), *sets) for arg in ("--set", item)]
        result = cli("submit", RECIPE, "--backend", "sagemaker", *options)
        assert result.code == 0, f"launcher submit failed:\n{result.err}"
        assert len(sent) == 1, f"expected one CreateTrainingJob call, saw {len(sent)}"
        return sent[0]

    return run


# One rank per host: what the simulation proves is between hosts (rendezvous, interfaces, each
# host's checkpoint files); torchrun maps the ranks within a host, and every rank more costs each
# start ~10 s of CPU (torch's imports and first dispatches) on CI's two cores.
RANKS_PER_HOST = 1


def sim_settings() -> list[str]:
    """tiny-cpu on 2 SageMaker CPU instances x RANKS_PER_HOST processes (FSDP over the hosts),
    checkpointing every 2 of 8 steps."""
    return [
        "cluster.instance_type=ml.c5.2xlarge",
        "cluster.instance_count=2",
        f"cluster.nproc_per_node={RANKS_PER_HOST}",
        "parallel.tensor=1",
        "cluster.device=cpu",
        f"sagemaker.role_arn={ROLE}",
        f"sagemaker.region={REGION}",
        "training.steps=8",
        "training.seq_len=128",
        "checkpoint.every_steps=2",
        "checkpoint.keep=2",
    ]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running two-node Slurm cluster for the session; torn down even when tests fail."""
    reason = missing_prerequisites()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    cluster = None
    try:
        cluster = start_cluster(root)
        yield cluster
    finally:
        if cluster is None:  # start failed half way: stop what did start
            cluster = SlurmCluster(root=root, conf=root / "slurm.conf")
        stop_cluster(cluster)


@pytest.fixture
def slurm(slurm_cluster, monkeypatch) -> SlurmCluster:
    """The cluster, with SLURM_CONF set so the launcher's own Slurm commands reach it; no jobs left over."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    slurm_cluster.cancel_everything()
    return slurm_cluster
