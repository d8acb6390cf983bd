"""`launcher submit --backend docker` through a real container engine (podman as `docker`).

The launcher renders and runs its own `docker run ...`; only the image is local (container.py),
and every command is the CLI run as users run it. The image is as unkind as the PyTorch DLC: its
Python has no torchao, and its entrypoint is bash as PID 1 running the command through `eval`.
tiny-cpu runs in FP8 as 2 CPU processes (tensor parallel 2) with short sequences, on token
shards in S3 (a moto server over HTTP), which submit stages on this machine and the container
reads through a read-only bind; the bootstrap installs torchao from the wheelhouse submit binds.
Two jobs keep this quick: the first trains to the end; the second resumes from the first one's
checkpoints and is stopped while it trains, and its final save must land.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from array import array
from pathlib import Path

import pytest

from launcher.backends.staging import staging_dir
from launcher.contract.checkpoint_dirs import complete_checkpoints
from tests import REPO
from tests.backends.helpers import REGION

from . import container

RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
SMALL = [
    "precision.fp8=true",  # ~1.3 s a step at this size on CPU
    "cluster.nproc_per_node=2",
    "training.seq_len=64",
    "training.global_batch_size=2",
    "training.micro_batch_size=2",
    "checkpoint.every_steps=2",
]
FIRST_STEPS = 4
JOB_TIMEOUT_S = 300
BUCKET = "launcher-docker-data"
DATA_URI = f"s3://{BUCKET}/tokens/"
VOCAB = 512  # llama-tiny's vocabulary

pytestmark = [pytest.mark.torchrun, pytest.mark.engines]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    yield from container.container_engine(tmp_path_factory)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("launcher-home")


@pytest.fixture(scope="module")
def user_env(engine, home, moto_server) -> dict[str, str]:
    """A user's shell: podman's `docker` first on PATH, a private $LAUNCHER_HOME, AWS at moto."""
    aws = {
        "AWS_ENDPOINT_URL": moto_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    path = f"{engine.bin_dir}{os.pathsep}{os.environ['PATH']}"
    return {**os.environ, **aws, "PATH": path, "LAUNCHER_HOME": str(home), "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def train_data(user_env) -> str:
    """Two uint16 token shards in S3: every token 1 to 4 above the last, something to learn."""
    import boto3

    keys = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=user_env["AWS_ENDPOINT_URL"], **keys)
    s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
    for shard in range(2):
        tokens = array("H", ((i * 3 + i // 7 + shard) % VOCAB for i in range(20_000)))
        s3.put_object(Bucket=BUCKET, Key=f"tokens/shard-{shard}.bin", Body=tokens.tobytes())
    return DATA_URI


def launcher_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *args]


def launcher(env: dict[str, str], *args: str) -> str:
    """stdout of `launcher ARGS...`, which must succeed."""
    done = subprocess.run(launcher_argv(*args), env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, f"launcher {' '.join(args)} exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def submit(env, image: str, *sets: str, resume: str | None = None) -> str:
    options = [a for s in (f"cluster.image={image}", f"data.source={DATA_URI}", *SMALL, *sets) for a in ("--set", s)]
    options += ["--resume", resume] if resume else []
    return json.loads(launcher(env, "submit", str(RECIPE), "--backend", "docker", *options, "--json"))["name"]


def metrics_steps(home: Path, name: str) -> list[int]:
    path = home / "jobs" / name / "output" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(engine, user_env, train_data, torchao_wheel) -> tuple[str, str]:
    """(name, log) of a job that trained FIRST_STEPS steps in the container, followed to its end."""
    name = submit(user_env, engine.image, f"training.steps={FIRST_STEPS}")
    return name, launcher(user_env, "logs", name, "--follow")  # returns when the container exits


def test_the_rendered_docker_run_trains_to_the_end(finished, user_env, home):
    name, log = finished
    assert f"metrics step={FIRST_STEPS} " in log and "resumed_from_step=0" in log, log
    # The image has no torchao: the bootstrap installed it from the bound wheelhouse, offline.
    assert "bootstrap: installed torchao==0.18.0 offline into " in log and " fp8=tensorwise " in log, log
    status = json.loads(launcher(user_env, "status", name, "--json"))
    assert (status["state"], status["exit_code"]) == ("Completed", 0), status
    assert metrics_steps(home, name) == list(range(1, FIRST_STEPS + 1))
    assert status["metrics"]["step"] == FIRST_STEPS
    assert "metrics step=1 " in launcher(user_env, "logs", name)
    listed = json.loads(launcher(user_env, "list", "--backend", "docker", "--json"))
    assert {"name": name, "state": "Completed"}.items() <= next(j for j in listed if j["name"] == name).items()


def test_the_job_read_its_s3_data_from_the_staged_copy(finished, home):
    staged = staging_dir(DATA_URI, home)
    assert sorted(p.name for p in staged.glob("*.bin")) == ["shard-0.bin", "shard-1.bin"]
    (data,) = json.loads((home / "jobs" / finished[0] / "spec.json").read_text())["inputs"]
    # The loader reads s3:// data from SM_CHANNEL_TRAIN and fails on an empty directory, so the
    # job's training is the proof that the bind delivered the shards.
    assert data == {
        "name": "train",
        "source": DATA_URI,
        "container_path": "/opt/launcher/data/train",
        "staged_at": str(staged),
    }


def test_a_resubmit_resumes_from_the_checkpoint_and_stop_ends_it_and_its_logs(finished, engine, user_env, home):
    name = submit(user_env, engine.image, "training.steps=5000", resume=finished[0])
    follower = subprocess.Popen(
        launcher_argv("logs", name, "--follow"),
        env=user_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert follower.stdout is not None
        seen, deadline = [], time.monotonic() + JOB_TIMEOUT_S
        for line in follower.stdout:  # until it trains, so the stop interrupts real work
            seen.append(line)
            if line.startswith("metrics step=") or time.monotonic() > deadline:
                break
        assert f"resumed_from_step={FIRST_STEPS}" in "".join(seen), "".join(seen)
        assert seen[-1].startswith(f"metrics step={FIRST_STEPS + 1} "), "".join(seen)
        stopped = json.loads(launcher(user_env, "stop", name, "--grace", "30", "--json"))
        # docker stop's SIGTERM reaches the workers through the bootstrap, PID 1 (143), not past the
        # image's bash entrypoint, which would drop it until SIGKILL after the grace (137).
        assert (stopped["state"], stopped["exit_code"]) == ("Stopped", 143), stopped
        rest, _ = follower.communicate(timeout=30)  # `logs --follow` ends with the container: exit 1
        assert follower.returncode == 1
        steps = metrics_steps(home, name)
        assert steps[0] == FIRST_STEPS + 1
        # The final save landed: a complete checkpoint of the last step trained.
        last = steps[-1]
        assert f"interrupted by SIGTERM after step {last}; checkpoint saved" in "".join(seen) + rest
        lineage = home / "checkpoints" / "tiny-cpu" / finished[0]
        assert complete_checkpoints(lineage)[-1] == (last, lineage / f"step-{last:08d}"), sorted(lineage.iterdir())
    finally:
        if follower.poll() is None:
            follower.kill()
