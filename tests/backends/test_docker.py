"""The docker backend without an engine: the rendered command, the default images, the ECR login
(against moto) and every error a user meets, each one line.

A fake `docker` first on PATH records each call (argv and stdin) and answers from a table, as
Docker's CLI would. tests/engines/test_docker_real.py runs the same commands through podman.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from pathlib import Path

import pytest

from launcher.backends import get_backend
from launcher.backends.docker import docker_run_argv, last_error
from launcher.backends.images import default_image, ecr_registry
from launcher.backends.staging import staging_dir

from .helpers import REGION, recipe_path, spec_for

DLC = "763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch"
LOGIN = (
    "aws ecr get-login-password --region us-west-2 | "
    "docker login --username AWS --password-stdin 763104351884.dkr.ecr.us-west-2.amazonaws.com"
)

HANG = -1  # an answer's exit code that means: print, then never exit

# The fake engine: each call is appended to calls.jsonl; the first rule whose argv prefix
# matches gives (exit code, stdout, stderr). FakeDocker.answer puts the newest rule first.
FAKE_DOCKER = """\
#!{python}
import json, sys, time
from pathlib import Path
HANG = {hang}
here = Path({here!r})
args = sys.argv[1:]
stdin = "" if sys.stdin.isatty() else sys.stdin.read()
with open(here / "calls.jsonl", "a") as log:
    log.write(json.dumps({{"argv": args, "stdin": stdin}}) + "\\n")
for prefix, code, out, err in json.loads((here / "rules.json").read_text()):
    if args[: len(prefix)] == prefix:
        sys.stdout.write(out)
        sys.stderr.write(err)
        sys.stdout.flush()
        if code == HANG:
            time.sleep(3600)
        sys.exit(code)
sys.exit(0)
"""

RUNNING = json.dumps({"Status": "running", "ExitCode": 0, "StartedAt": "2026-11-30T00:00:00Z"})


class FakeDocker:
    def __init__(self, directory: Path):
        self.directory = directory
        self.rules: list = []

    def answer(self, prefix: list[str], code: int = 0, out: str = "", err: str = "") -> None:
        """Answer calls starting with `prefix` so, from now on (over any earlier answer)."""
        self.rules.insert(0, [prefix, code, out, err])
        (self.directory / "rules.json").write_text(json.dumps(self.rules))

    def calls(self) -> list[dict]:
        path = self.directory / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def commands(self) -> list[list[str]]:
        return [call["argv"][:2] for call in self.calls()]


@pytest.fixture
def fake_docker(tmp_path, monkeypatch) -> FakeDocker:
    """A `docker` that records calls, with the image absent and no container of the job's name."""
    directory = tmp_path / "fake-docker"
    directory.mkdir()
    script = directory / "docker"
    script.write_text(FAKE_DOCKER.format(python=sys.executable, here=str(directory), hang=HANG))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
    fake = FakeDocker(directory)
    fake.answer(["version"], out="27.0.0\n")
    fake.answer(["ps"], out="")  # no containers
    fake.answer(["image", "inspect"], 1, err="Error: No such image: x\n")
    fake.answer(["login"], out="Login Succeeded\n")
    fake.answer(["run"], out="0123abcd\n")
    fake.answer(["inspect"], out=RUNNING + "\n")
    return fake


def argv_of(recipe: str, **overrides) -> list[str]:
    return docker_run_argv(spec_for(recipe, "docker", **overrides))


# --- the rendered command --------------------------------------------------------------------


def test_a_cpu_job_gets_host_ipc_without_gpu_options_limits_or_a_shm_size(home):
    argv = argv_of("tiny-cpu")
    assert "--ipc=host" in argv
    assert not [a for a in argv if a.startswith(("--gpus", "--ulimit", "--shm-size"))]


def test_a_gpu_job_gets_all_gpus_and_nvidias_limits(home):
    argv = argv_of("llama3-8b-8k", **{"data.source": "/fsx/tokens"})
    assert argv[argv.index("--gpus") + 1] == "all"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--ulimit"] == [
        "memlock=-1",
        "stack=67108864",
        "nofile=1048576:1048576",
    ]
    assert not [a for a in argv if a.startswith("--shm-size")]


def test_the_container_runs_torchrun_through_the_bootstrap_with_its_hosts_file(home):
    argv = argv_of("tiny-cpu")
    image = argv.index(f"{DLC}:2.13.0-cpu-amzn2023-sagemaker")
    # The image's Python is PID 1, not the DLC's `bash -m start_with_right_hostname.sh`, whose
    # bash would drop docker stop's SIGTERM (tests/engines/test_docker_real.py runs such an image).
    assert argv[image - 2 : image] == ["--entrypoint", "python3"]
    assert argv[image + 1 : image + 3] == ["entrypoints/bootstrap.py", "torchrun"]
    assert "--standalone" not in argv  # the bootstrap adds the rendezvous
    assert "LAUNCHER_RESOURCE_CONFIG=/opt/launcher/config/resourceconfig.json" in argv
    assert "LAUNCHER_FAILURE_FILE=/opt/launcher/output/failure" in argv
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "--mount"]
    assert any(m.endswith("target=/opt/launcher/config,readonly") for m in mounts)


def test_an_fp8_job_binds_its_wheelhouse_and_names_the_pins_for_the_bootstrap(home):
    plain, fp8 = argv_of("tiny-cpu"), argv_of("tiny-cpu", **{"precision.fp8": True})
    wheels = f"type=bind,source={home / 'jobs' / 'tiny-cpu-job' / 'wheels'},target=/opt/launcher/wheels,readonly"
    assert wheels in fp8 and "LAUNCHER_REQUIREMENTS=torchao==0.18.0" in fp8
    assert "LAUNCHER_WHEELHOUSE=/opt/launcher/wheels" in fp8
    assert not [a for a in plain if "wheels" in a or a.startswith("LAUNCHER_REQUIREMENTS")]


def test_the_stop_timeout_shutdown_timeout_and_save_budget_follow_the_predicted_step_and_save(home):
    """70B on one p5e node: a step and a save far past docker's 10 s and torchrun's 30 s."""
    spec = spec_for("llama70b-128k", "docker", **{"cluster.instance_count": 1, "data.source": "/fsx/tokens"})
    argv = docker_run_argv(spec)
    grace = int(argv[argv.index("--stop-timeout") + 1])
    assert grace == spec.stop_grace_s > 120
    assert f"--shutdown-timeout={grace - 20}" in argv
    assert spec.resolved["runtime"]["stop_budget_s"] == grace - 20
    # Without a predicted step (the host CPU): SageMaker's 120 s, for which the budget was made.
    small = spec_for("tiny-cpu", "docker")
    assert (small.stop_grace_s, small.resolved["runtime"]["stop_budget_s"]) == (120, 100)
    set_by_hand = spec_for("tiny-cpu", "docker", **{"cluster.stop_grace": "5m"})
    assert set_by_hand.stop_grace_s == 300 and "--shutdown-timeout=280" in set_by_hand.command


def test_resubmitting_with_resume_mounts_the_earlier_jobs_checkpoints(home):
    recipe = recipe_path("tiny-cpu")
    backend = get_backend("docker")
    from launcher.api import load
    from launcher.resolve import resolve

    loaded = resolve(load(recipe, backend="docker")).concrete
    first, again = backend.spec(loaded), backend.spec(loaded, lineage="tiny-cpu-earlier")
    checkpoint_sources = [
        m.source for spec in (first, again) for m in spec.mounts if m.target == "/opt/launcher/checkpoints"
    ]
    assert checkpoint_sources == [
        str(home / "checkpoints" / "tiny-cpu" / first.name),
        str(home / "checkpoints" / "tiny-cpu" / "tiny-cpu-earlier"),
    ]


# --- s3:// data: staged on this machine, bound read-only --------------------------------------


def test_s3_data_is_bound_from_its_staging_directory_never_from_the_uri(home):
    spec = spec_for("tiny-cpu", "docker", **{"data.source": "s3://bucket/tokens/"})
    argv = docker_run_argv(spec)
    staged = staging_dir("s3://bucket/tokens/", home)
    assert f"type=bind,source={staged},target=/opt/launcher/data/train,readonly" in argv
    assert "SM_CHANNEL_TRAIN=/opt/launcher/data/train" in argv
    assert not [a for a in argv if "s3://" in a]


def test_dry_run_says_where_s3_data_is_staged(home, cli):
    result = cli(*submit_args("data.source=s3://bucket/tokens/"), "--dry-run")
    assert result.code == 0, result.err
    staged = staging_dir("s3://bucket/tokens/", home)
    assert f"data: s3://bucket/tokens/ is downloaded at submit into {staged}" in result.err
    assert "the job reads it at /opt/launcher/data/train" in result.err


def test_submit_stages_s3_data_before_the_container_starts(aws, fake_docker, home, cli):
    import boto3

    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket="tokens", CreateBucketConfiguration={"LocationConstraint": REGION})
    s3.put_object(Bucket="tokens", Key="train/shard-0.bin", Body=b"\x01\x00" * 64)
    result = cli(*submit_args("data.source=s3://tokens/train/", "cluster.image=localhost/mine:1"))
    assert result.code == 0, result.err
    staged = staging_dir("s3://tokens/train/", home)
    assert (staged / "shard-0.bin").read_bytes() == b"\x01\x00" * 64
    run = next(call["argv"] for call in fake_docker.calls() if call["argv"][0] == "run")
    assert f"type=bind,source={staged},target=/opt/launcher/data/train,readonly" in run


# --- the default images ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "device, tag", [("cuda", "2.13.0-cu133-amzn2023-sagemaker"), ("cpu", "2.13.0-cpu-amzn2023-sagemaker")]
)
def test_the_default_image_is_the_dlc_for_the_jobs_device(device, tag):
    assert default_image("us-west-2", device) == f"{DLC}:{tag}"
    assert default_image("cn-north-1", device).startswith("727897471807.dkr.ecr.cn-north-1.amazonaws.com.cn/")


def test_a_cpu_job_without_cluster_image_gets_the_cpu_dlc_and_cluster_image_wins(home):
    assert spec_for("tiny-cpu", "docker").image == f"{DLC}:2.13.0-cpu-amzn2023-sagemaker"
    assert spec_for("tiny-cpu", "docker", **{"cluster.image": "me/mine:1"}).image == "me/mine:1"


@pytest.mark.parametrize(
    "image, found",
    [
        (f"{DLC}:2.13.0-cpu-amzn2023-sagemaker", ("763104351884", "us-west-2")),
        ("727897471807.dkr.ecr.cn-north-1.amazonaws.com.cn/pytorch:x", ("727897471807", "cn-north-1")),
        ("123456789012.dkr.ecr-fips.us-gov-west-1.amazonaws.com/r@sha256:ab", ("123456789012", "us-gov-west-1")),
        ("pytorch/pytorch:2.13.0", None),
        ("localhost/launcher-test:1", None),
        ("evil.example/123456789012.dkr.ecr.us-west-2.amazonaws.com/x", None),
    ],
)
def test_ecr_images_are_recognised_by_their_registry_host(image, found):
    registry = ecr_registry(image)
    assert (registry and (registry.account, registry.region)) == found


# --- submit: the ECR login, against moto -----------------------------------------------------


def submit_args(*sets: str) -> list[str]:
    return ["submit", str(recipe_path("tiny-cpu")), "--backend", "docker", *[a for s in sets for a in ("--set", s)]]


def test_submit_logs_in_to_ecr_with_the_token_then_pulls_then_runs(aws, fake_docker, home, cli):
    result = cli(*submit_args(f"sagemaker.region={REGION}"))
    assert result.code == 0, result.err
    registry = "763104351884.dkr.ecr.us-west-2.amazonaws.com"
    login = [call for call in fake_docker.calls() if call["argv"][0] == "login"]
    # moto's token is base64("AWS:<account>-auth-token"): the user and the password come from it.
    assert login == [
        {"argv": ["login", "--username", "AWS", "--password-stdin", registry], "stdin": "763104351884-auth-token"}
    ]
    assert fake_docker.commands() == [
        ["version", "--format"],
        ["ps", "--all"],
        ["image", "inspect"],
        ["login", "--username"],
        ["pull", f"{DLC}:2.13.0-cpu-amzn2023-sagemaker"],
        ["run", "--detach"],
    ]


def test_the_token_is_decoded_as_user_colon_password():
    token = base64.b64encode(b"AWS:pass:with:colons").decode()
    user, _, password = base64.b64decode(token).decode().partition(":")
    assert (user, password) == ("AWS", "pass:with:colons")


def test_without_aws_credentials_the_error_is_the_one_login_command_to_run(fake_docker, home, cli, monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    from launcher.backends.sagemaker import aws as aws_clients

    aws_clients.reset_clients()
    aws_clients._session.cache_clear()
    result = cli(*submit_args())
    assert result.code != 0
    # submit's stage lines (memory, the predicted time, the checkpoint cost, the grace, the job), then the one error
    stages = ("memory: ", "time: ", "checkpoint ", "cluster.stop_grace: ", "job tiny-cpu")
    assert all(line.startswith(stages) for line in result.err_lines[:-1]), result.err_lines
    assert result.err_lines[-1].endswith(f"`{LOGIN}`")
    assert "Traceback" not in result.err
    assert ["run", "--detach"] not in fake_docker.commands()


def test_a_failed_docker_login_names_the_command_to_run(aws, fake_docker, home, cli):
    fake_docker.answer(["login"], 1, err="Error response from daemon: login denied\n")
    result = cli(*submit_args(f"sagemaker.region={REGION}"))
    assert result.code != 0
    assert "docker login failed (Error response from daemon: login denied)" in result.err_lines[-1]
    assert result.err_lines[-1].endswith(f"`{LOGIN}`")


# --- errors: one line each -------------------------------------------------------------------


def last_line(result) -> str:
    assert result.code != 0 and "Traceback" not in result.err, result.err
    return result.err_lines[-1]


def test_a_local_image_that_is_absent_and_cannot_be_pulled_is_one_line(fake_docker, home, cli):
    fake_docker.answer(["pull"], 125, err="Trying to pull...\nError: pinging registry: refused\n")
    line = last_line(cli(*submit_args("cluster.image=localhost/absent:1")))
    assert line == (
        "cluster.image: localhost/absent:1 is not on this machine and pulling it failed "
        "(Error: pinging registry: refused); build or pull it, or set cluster.image to an image this "
        "machine has (docker images)"
    )
    assert ["login", "--username"] not in fake_docker.commands()


def test_a_name_already_taken_is_refused_before_anything_runs(fake_docker, home, cli, fixed_names):
    fake_docker.answer(["ps"], out="tiny-cpu-job\n")
    line = last_line(cli(*submit_args("cluster.image=localhost/mine:1")))
    assert line == "a container named tiny-cpu-job already exists; remove it (docker rm tiny-cpu-job) or submit again"
    assert ["run", "--detach"] not in fake_docker.commands()


@pytest.mark.parametrize(
    "verb, action",
    [("status", "reading the status of"), ("logs", "reading the status of"), ("stop", "stopping")],
)
@pytest.mark.parametrize(
    "said", ["Error: No such object: ghost", 'Error: no container with name or ID "ghost" found: no such container']
)
def test_an_unknown_container_is_one_line_for_docker_and_podman(verb, action, said, fake_docker, home, cli):
    fake_docker.answer(["inspect"], 1, err=said + "\n")
    fake_docker.answer(["stop"], 125, err=said + "\n")
    line = last_line(cli(verb, "ghost", "--backend", "docker"))
    assert line == f"{action} ghost: no container named ghost here (docker ps --all lists them)"


@pytest.mark.parametrize("labels", ['{"maintainer":"someone"}', '{"launcher.job":"other-job"}', "null", "<no value>"])
def test_stop_of_a_container_launcher_did_not_start_for_the_job_signals_nothing(labels, fake_docker, home, cli):
    fake_docker.answer(["inspect", "--format", "{{json .Config.Labels}}"], out=labels + "\n")
    result = cli("stop", "tiny-cpu-job", "--backend", "docker")
    assert result.code == 1
    assert last_line(result).startswith("not stopping tiny-cpu-job: container tiny-cpu-job was not started by launcher")
    assert last_line(result).endswith("; nothing was signalled")
    assert ["stop", "--time"] not in fake_docker.commands()


@pytest.mark.parametrize("verb", [["status", "x"], ["logs", "x"], ["stop", "x"], ["list"]])
def test_without_docker_installed_the_advice_fits_the_command(verb, home, cli, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker anywhere
    line = last_line(cli(*verb, "--backend", "docker"))
    assert "`docker` is not installed here; install Docker (or podman with its docker command)" in line
    assert "--dry-run" not in line


def test_submit_without_docker_suggests_the_dry_run(home, cli, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    line = last_line(cli(*submit_args()))
    assert "install Docker (or podman with its docker command)" in line and "--dry-run" in line


@pytest.mark.parametrize(
    "said",
    [
        "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?",
        "Cannot connect to Podman. Please verify your connection to the Linux system",
    ],
)
def test_an_engine_that_is_down_is_one_line(said, fake_docker, home, cli):
    fake_docker.answer([], 1, err=said + "\n")
    line = last_line(cli("status", "x", "--backend", "docker"))
    assert (
        line
        == f"reading the status of x: no container engine answers ({said}); start Docker (or podman), then run this again"
    )


# --- status --------------------------------------------------------------------------------


def inspect_says(fake_docker, **state) -> None:
    fake_docker.answer(["inspect"], out=json.dumps({"StartedAt": "t0", "FinishedAt": "t1", **state}))


@pytest.mark.parametrize(
    "code, state", [(0, "Completed"), (143, "Stopped"), (137, "Stopped"), (1, "Failed"), (2, "Failed")]
)
def test_exit_codes_map_to_job_states(code, state, fake_docker, home, cli):
    inspect_says(fake_docker, Status="exited", ExitCode=code)
    result = cli("status", "job", "--backend", "docker", "--json")
    found = json.loads(result.out)
    assert (found["state"], found["exit_code"]) == (state, code)


def test_a_failed_jobs_reason_is_the_bootstraps_failure_file(fake_docker, home, cli):
    (home / "jobs" / "job" / "output").mkdir(parents=True)
    (home / "jobs" / "job" / "output" / "failure").write_text("rank 1 failed: ValueError: bad shard\n")
    inspect_says(fake_docker, Status="exited", ExitCode=1)
    found = json.loads(cli("status", "job", "--backend", "docker", "--json").out)
    assert found["failure_reason"] == "rank 1 failed: ValueError: bad shard"


def test_list_reads_every_labelled_container_in_one_inspect(fake_docker, home, cli):
    fake_docker.answer(["ps"], out="a\nb\n")
    fake_docker.answer(["inspect"], out=RUNNING + "\n" + json.dumps({"Status": "exited", "ExitCode": 0}) + "\n")
    found = json.loads(cli("list", "--backend", "docker", "--json").out)
    assert [(s["name"], s["state"]) for s in found] == [("a", "InProgress"), ("b", "Completed")]
    assert fake_docker.calls()[-1]["argv"] == ["inspect", "--format", "{{json .State}}", "a", "b"]


def test_logs_follow_ends_when_the_container_has_even_if_the_engines_follow_does_not(fake_docker, home, monkeypatch):
    from launcher.backends import docker

    monkeypatch.setattr(docker, "FLUSH_S", 0.5)
    fake_docker.answer(["logs", "--follow"], HANG, out="metrics step=1\n")
    fake_docker.answer(["inspect"], out=json.dumps({"Status": "exited", "ExitCode": 0}))
    started = time.monotonic()
    assert list(docker.follow_logs("job", poll_s=0.2)) == ["metrics step=1"]
    assert time.monotonic() - started < 5


def test_the_engines_last_error_is_kept_short():
    output = "Trying... level=warning msg=Failed, retrying ... Error: first try Error: final reason " + "x" * 400
    assert last_error(output).startswith("Error: final reason") and len(last_error(output)) == 300
