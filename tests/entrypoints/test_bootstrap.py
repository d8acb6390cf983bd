"""entrypoints/bootstrap.py, the SageMaker container's first Python, run as a subprocess, and the
container entrypoint before it, which refuses a bundle other than the one the request names.

A fake `torchrun` first on PATH records the argv and environment the bootstrap gives it and
plays the failures torchrun reports; the last tests run the real torchrun and train.py.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

from launcher.backends import get_backend
from launcher.bundle import Bundle
from tests.backends.helpers import REPO, spec_for

BOOTSTRAP = REPO / "entrypoints" / "bootstrap.py"
JOB_ARGV = ["torchrun", "--nproc-per-node=2", "--max-restarts=0", "entrypoints/train.py", "--config", "resolved.json"]

FAKE_TORCHRUN = f"""#!{sys.executable}
import json, os, signal, sys, time
mode = os.environ.get("FAKE_TORCHRUN", "ok")
record = {{"argv": sys.argv[1:], "error_file": os.environ.get("TORCHELASTIC_ERROR_FILE"), "sid": os.getsid(0),
    "pythonpath": os.environ.get("PYTHONPATH"),
    "ifname": {{k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}}}}
with open(os.environ["FAKE_TORCHRUN_RECORD"], "w") as f:
    json.dump(record, f)
summary = '''[E] failed (exitcode: 3) local_rank: 1
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  time      : 2026-11-30_05:00:00
  host      : ip-10-0-0-12
  rank      : 2 (local_rank: 0)
  exitcode  : -15 (pid: 4241)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 4241
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_05:00:00
  host      : ip-10-0-0-12
  rank      : 3 (local_rank: 1)
  exitcode  : 3 (pid: 4242)
  error_file: <N/A>
'''
if mode == "fail":
    json.dump({{"message": {{"message": "RuntimeError: shard 7 of s3://bucket/tokens is truncated",
        "extraInfo": {{"py_callstack": "Traceback (most recent call last):\\n  File \\"entrypoints/train.py\\", line 9, in main\\n    train()\\n  File \\"entrypoints/data.py\\", line 5, in load\\n    raise RuntimeError(...)\\nRuntimeError: shard 7 of s3://bucket/tokens is truncated\\n",
        "timestamp": "1"}}, "errorCode": 3}}}}, open(os.environ["TORCHELASTIC_ERROR_FILE"], "w"))
    sys.stderr.write("[rank1]: RuntimeError: gloo connection closed by peer\\n" + summary)
    sys.exit(1)
if mode == "fail-no-error-file":
    sys.stderr.write("Traceback (most recent call last):\\n  File \\"entrypoints/train.py\\", line 9\\n")
    sys.stderr.write("ValueError: parallel.context 3 does not divide seq_len\\n" + summary)
    sys.exit(1)
if mode == "term":
    def on_term(signum, frame):
        open(os.environ["FAKE_TORCHRUN_RECORD"] + ".term", "a").write("TERM\\n")
        time.sleep(0.5)  # workers saving their last checkpoint
        sys.exit(143)
    signal.signal(signal.SIGTERM, on_term)
    open(os.environ["FAKE_TORCHRUN_RECORD"] + ".ready", "w").close()
    while True:
        time.sleep(0.05)
print("fake torchrun ran", flush=True)
"""


@pytest.fixture
def sagemaker_host(tmp_path):
    """A fake /opt/ml (resourceconfig.json, failure file path) and a fake torchrun first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)

    def run(hosts=("algo-1", "algo-2"), current="algo-2", argv=JOB_ARGV, mode="ok", python=sys.executable, **env):
        # `lo`: an interface every machine has (SageMaker names its own; the simulation's is ethwe).
        interface = env.pop("interface", "lo")
        config = tmp_path / "opt_ml" / "input" / "config" / "resourceconfig.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        resource = {"current_host": current, "hosts": list(hosts)}
        if interface is not None:
            resource["network_interface_name"] = interface
        config.write_text(json.dumps(resource))
        environment = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "LAUNCHER_RESOURCE_CONFIG": str(config),
            "LAUNCHER_FAILURE_FILE": str(tmp_path / "opt_ml" / "output" / "failure"),
            "FAKE_TORCHRUN": mode,
            "FAKE_TORCHRUN_RECORD": str(tmp_path / "torchrun.json"),
            **env,
        }
        return [python, str(BOOTSTRAP), *argv], environment

    return run


def recorded(tmp_path) -> dict:
    return json.loads((tmp_path / "torchrun.json").read_text())


def failure(tmp_path) -> str:
    return (tmp_path / "opt_ml" / "output" / "failure").read_text()


def test_the_rendezvous_comes_from_the_sorted_hosts_not_the_hostname(sagemaker_host, tmp_path):
    assert not socket.gethostname().startswith("algo-")  # as on SageMaker: the hostname proves nothing
    argv, env = sagemaker_host(hosts=["algo-2", "algo-1"], current="algo-2")
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path)["argv"] == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=algo-1:29500",
        "--rdzv-id=launcher",
        "--rdzv-conf=is_host=0",
        "--local-addr=algo-2",
        "--shutdown-timeout=100",
        "--nproc-per-node=2",
        "--max-restarts=0",
        "entrypoints/train.py",
        "--config",
        "resolved.json",
    ]
    assert "fake torchrun ran" in result.stdout
    assert not (tmp_path / "opt_ml" / "output" / "failure").exists()


def test_the_first_sorted_host_is_node_zero_and_a_single_host_is_standalone(sagemaker_host, tmp_path):
    argv, env = sagemaker_host(hosts=["algo-3", "algo-1", "algo-2"], current="algo-1")
    assert subprocess.run(argv, env=env, capture_output=True, timeout=60).returncode == 0
    assert recorded(tmp_path)["argv"][:6] == [
        "--nnodes=3",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=algo-1:29500",
        "--rdzv-id=launcher",
        "--rdzv-conf=is_host=1",
        "--local-addr=algo-1",
    ]

    argv, env = sagemaker_host(hosts=["algo-1"], current="algo-1")
    assert subprocess.run(argv, env=env, capture_output=True, timeout=60).returncode == 0
    assert recorded(tmp_path)["argv"][:2] == ["--standalone", "--shutdown-timeout=100"]


def test_a_rendezvous_in_the_command_is_refused(sagemaker_host, tmp_path):
    argv, env = sagemaker_host(argv=["torchrun", "--rdzv-endpoint=algo-1:29500", *JOB_ARGV[1:]])
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "bootstrap: the rendezvous is the bootstrap's to choose; remove --rdzv-endpoint=algo-1:29500 from the command"
    )
    assert not (tmp_path / "torchrun.json").exists()


def test_an_image_with_an_unsupported_torch_is_refused_in_one_line(sagemaker_host, tmp_path):
    # A torch 2.10 distribution ahead of the real one on sys.path: what an older DLC would have.
    site = tmp_path / "old-image-site"
    (site / "torch-2.10.0.dist-info").mkdir(parents=True)
    (site / "torch-2.10.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.10.0\n")
    argv, env = sagemaker_host(PYTHONPATH=str(site))
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    line = (
        "the image has torch 2.10.0; the entrypoints support torch>=2.13,<2.15: set cluster.image "
        "to such an image, or leave it unset for the default"
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"bootstrap: {line}"]
    assert failure(tmp_path) == line
    assert not (tmp_path / "torchrun.json").exists()  # torchrun never started


def test_the_failure_file_names_the_first_failing_ranks_error_and_the_exit_code_is_its(sagemaker_host, tmp_path):
    argv, env = sagemaker_host(mode="fail")
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    # torchrun got an error file to copy the root cause into, and its stderr still reaches the logs.
    assert recorded(tmp_path)["error_file"].endswith("error.json")
    assert "gloo connection closed by peer" in result.stderr
    lines = failure(tmp_path).splitlines()
    assert lines[0] == "rank 3 on ip-10-0-0-12 failed: RuntimeError: shard 7 of s3://bucket/tokens is truncated"
    assert lines[1:] == [
        '  File "entrypoints/train.py", line 9, in main',
        "    train()",
        '  File "entrypoints/data.py", line 5, in load',
        "    raise RuntimeError(...)",
    ]
    assert "gloo" not in failure(tmp_path)  # another rank's symptom is not the cause


def test_without_an_error_file_the_failure_is_the_ranks_last_error_line(sagemaker_host, tmp_path):
    argv, env = sagemaker_host(mode="fail-no-error-file")
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert failure(tmp_path).splitlines() == [
        "rank 3 on ip-10-0-0-12 failed (exit code 3):",
        "ValueError: parallel.context 3 does not divide seq_len",
    ]


def test_sigterm_reaches_torchrun_once_and_the_bootstrap_waits_for_it(sagemaker_host, tmp_path):
    argv, env = sagemaker_host(mode="term")
    # Its own process group, as PID 1 of a container would be: the signal goes to the bootstrap only.
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "torchrun.json.ready").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert (tmp_path / "torchrun.json.term").read_text() == "TERM\n"  # forwarded exactly once
    assert recorded(tmp_path)["sid"] != process.pid  # torchrun runs in its own session
    assert "bootstrap: got SIGTERM; passing it to torchrun" in err.decode()
    assert failure(tmp_path) == "stopped by SIGTERM (a stop request or a spot interruption) on algo-2"


SIGNALLED_AT_SPAWN = """\
import os, runpy, signal, subprocess, sys
spawn = subprocess.Popen
def spawned_then_signalled(*args, **kwargs):
    process = spawn(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # the stop request lands the moment torchrun exists
    return process
subprocess.Popen = spawned_then_signalled
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_sigterm_that_lands_as_torchrun_is_spawned_still_reaches_it(sagemaker_host, tmp_path):
    # The bootstrap's SIGTERM handler must be in place before torchrun exists: one that landed
    # on the default action then would end the bootstrap alone and leave torchrun, in a session
    # of its own, running with nobody to pass the stop on. The signal here arrives right after
    # the spawn, before any other line of the bootstrap runs.
    argv, env = sagemaker_host(mode="term")
    wrapper = tmp_path / "signalled_at_spawn.py"
    wrapper.write_text(SIGNALLED_AT_SPAWN)
    # Into files: a torchrun left running would hold pipes open, and waiting on them would hang.
    stderr = tmp_path / "bootstrap.stderr"
    with open(stderr, "w") as err:
        code = subprocess.run([argv[0], str(wrapper), *argv[1:]], env=env, stdout=err, stderr=err).returncode
    try:
        assert code == 128 + signal.SIGTERM, stderr.read_text()
        assert "bootstrap: got SIGTERM; passing it to torchrun" in stderr.read_text()
        assert failure(tmp_path) == "stopped by SIGTERM (a stop request or a spot interruption) on algo-2"
    finally:
        if code != 128 + signal.SIGTERM:  # an orphan writes its record as it starts
            deadline = time.monotonic() + 30
            while not (tmp_path / "torchrun.json").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        orphan = _running_fake_torchrun(tmp_path)
        if orphan is not None:
            os.kill(orphan, signal.SIGKILL)
    assert orphan is None, "torchrun was left running"


def _running_fake_torchrun(tmp_path: Path) -> int | None:
    """The pid of this test's fake torchrun if it still runs (its record names its session, whose
    leader it is), checked by its command line before anyone signals it."""
    record = tmp_path / "torchrun.json"
    if not record.exists():
        return None
    pid = recorded(tmp_path)["sid"]
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if str(tmp_path / "bin" / "torchrun").encode() in command else None


SOCKET_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def bootstrap_with(argv: list[str], env: dict, **job_environment: str) -> subprocess.CompletedProcess:
    """The bootstrap under `env` with only `job_environment`'s GLOO/NCCL_SOCKET_IFNAME (none of ours)."""
    env = {**{k: v for k, v in env.items() if k not in SOCKET_IFNAMES}, **job_environment}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def test_gloo_and_nccl_bind_to_the_interface_resourceconfig_names_unless_the_job_sets_them(sagemaker_host, tmp_path):
    # The container's hostname does not resolve on SageMaker, so without these gloo binds to
    # loopback and the other hosts cannot connect (tests/engines/test_sagemaker_sim.py shows it).
    argv, env = sagemaker_host(interface="lo")
    result = bootstrap_with(argv, env)
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path)["ifname"] == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    config = env["LAUNCHER_RESOURCE_CONFIG"]
    assert f"bootstrap: GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo (network_interface_name in {config})\n" in (
        result.stdout
    )

    # A value the job's environment already has is the job's choice (here an NCCL exclusion list).
    result = bootstrap_with(argv, env, NCCL_SOCKET_IFNAME="^docker0,lo")
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path)["ifname"] == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "^docker0,lo"}
    assert f"bootstrap: GLOO_SOCKET_IFNAME=lo (network_interface_name in {config})\n" in result.stdout

    # A resourceconfig.json without the key (the docker backend's one-host file) sets nothing.
    argv, env = sagemaker_host(interface=None)
    result = bootstrap_with(argv, env)
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path)["ifname"] == {"GLOO_SOCKET_IFNAME": None, "NCCL_SOCKET_IFNAME": None}
    assert "SOCKET_IFNAME" not in result.stdout


@pytest.mark.parametrize(
    ("interface", "why"),
    [
        ("ethwe0", "is not an interface of this container (it has {interfaces}); gloo and NCCL could not reach the other hosts"),
        ("eth0,lo", "is not an interface name (1 to 15 letters, digits, '.', '-' or '_')"),
        ("^lo", "is not an interface name (1 to 15 letters, digits, '.', '-' or '_')"),
        ("a" * 16, "is not an interface name (1 to 15 letters, digits, '.', '-' or '_')"),
        (7, "is not an interface name (1 to 15 letters, digits, '.', '-' or '_')"),
    ],
    ids=["absent", "a-list", "an-nccl-exclusion", "too-long", "a-number"],
)  # fmt: skip
def test_a_network_interface_name_that_is_not_one_of_this_containers_stops_the_job_in_one_line(
    sagemaker_host, tmp_path, interface, why
):
    argv, env = sagemaker_host(interface=interface)
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    interfaces = ", ".join(sorted(name for _, name in socket.if_nameindex()))
    line = f"{env['LAUNCHER_RESOURCE_CONFIG']}: network_interface_name {interface!r} " + why.format(
        interfaces=interfaces
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"bootstrap: {line}"]
    assert failure(tmp_path) == line
    assert not (tmp_path / "torchrun.json").exists()  # torchrun never started


def test_the_supported_torch_range_is_the_train_extras():
    from entrypoints.bootstrap import SUPPORTED_TORCH

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    (torch,) = [r for r in extra if re.match(r"torch[<>=]", r)]
    (lo, hi) = SUPPORTED_TORCH
    assert torch == f"torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"


def test_the_bootstrap_imports_only_the_standard_library_and_the_contract():
    # It runs before torch is known to be importable; launcher.contract is standard library only
    # (tests/test_architecture.py) and ships in the bundle beside it.
    tree = ast.parse(BOOTSTRAP.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    outside = {m for m in modules if m.split(".")[0] not in sys.stdlib_module_names} - {"__future__"}
    assert outside == {"launcher.contract.failure", "launcher.contract.wheels"}, outside


# --- the real thing: pip with no network, torchrun, train.py ------------------------------------------------


def fresh_venv_with_torch_but_no_torchao(root: Path) -> Path:
    """A new venv that sees this one's packages except torchao: the image before the install.
    Its pip is this venv's, seen like the rest (as in tests/engines/image.py): ensurepip's own copy
    of the same pip took 4 of the test's 11 s of CPU, to install and compile it."""
    venv = [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(root)]
    subprocess.run(venv, check=True, timeout=300)
    python = root / "bin" / "python"
    site_packages = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    ours = Path(next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir()))
    shadow = root / "image-packages"
    shadow.mkdir()
    for entry in ours.iterdir():
        if not entry.name.startswith("torchao") and not entry.name.endswith(".pth"):
            (shadow / entry.name).symlink_to(entry)
    (site_packages / "zz-image-packages.pth").write_text(f"{shadow}\n")
    return python


@pytest.mark.torchrun
def test_the_real_torchao_wheel_installs_offline_with_no_network(sagemaker_host, tmp_path, torchao_wheel):
    python = fresh_venv_with_torch_but_no_torchao(tmp_path / "image")
    probe = [python, "-c", "import importlib.util as u; print(u.find_spec('torchao') is None)"]
    assert subprocess.run(probe, capture_output=True, text=True).stdout.strip() == "True"

    wheelhouse = tmp_path / "opt_ml" / "input" / "data" / "wheels"
    wheelhouse.mkdir(parents=True)
    (wheelhouse / torchao_wheel.name).write_bytes(torchao_wheel.read_bytes())
    argv, env = sagemaker_host(
        python=str(python),
        LAUNCHER_REQUIREMENTS="torchao==0.18.0",
        LAUNCHER_WHEELHOUSE=str(wheelhouse),
        LAUNCHER_WHEEL_SHA256=sha256(torchao_wheel),
    )
    # A network namespace with nothing but a down loopback: pip cannot reach any index.
    result = subprocess.run(["unshare", "--net", *argv], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "bootstrap: installed torchao==0.18.0 offline into " in result.stderr

    # Into a directory of its own, first on torchrun's PYTHONPATH; the image stays as it was
    # (it may be read-only, or shared by several nodes).
    target = recorded(tmp_path)["pythonpath"].split(os.pathsep)[0]
    check = "import torchao, torch; print(torchao.__version__, torchao.__file__)"
    found = subprocess.run(
        [python, "-c", check], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": target}
    )
    version, location = found.stdout.split()
    assert version == "0.18.0" and location.startswith(target)
    assert subprocess.run(probe, capture_output=True, text=True).stdout.strip() == "True"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_wheelhouse_without_the_pinned_wheel_stops_the_job_in_one_line(sagemaker_host, tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()
    pins = dict(LAUNCHER_REQUIREMENTS="not-a-real-package-xyz==1.0", LAUNCHER_WHEEL_SHA256="ab" * 32)
    argv, env = sagemaker_host(LAUNCHER_WHEELHOUSE=str(empty), **pins)
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == (
        f"bootstrap: the wheelhouse {empty} has no wheel with sha256 {'ab' * 32} of the job's pins; it is incomplete\n"
    )
    assert not (tmp_path / "torchrun.json").exists()


def bootstrap_pinning(sagemaker_host, wheel: Path, requirement: str, **env) -> subprocess.CompletedProcess:
    """The bootstrap of a job that pins `requirement` and the sha256 of `wheel`, from its directory."""
    pins = dict(LAUNCHER_REQUIREMENTS=requirement, LAUNCHER_WHEEL_SHA256=sha256(wheel))
    argv, environment = sagemaker_host(LAUNCHER_WHEELHOUSE=str(wheel.parent), **pins, **env)
    return subprocess.run(argv, env=environment, capture_output=True, text=True, timeout=120)


def test_a_pinned_wheel_pip_cannot_install_stops_the_job_in_one_line(sagemaker_host, tmp_path):
    wheel = make_wheel(tmp_path / "wheels", "launcher_probe", "1.0")
    result = bootstrap_pinning(sagemaker_host, wheel, "launcher-probe==2.0")
    assert result.returncode == 2
    assert re.fullmatch(
        rf"bootstrap: offline install of launcher-probe==2\.0 from {re.escape(str(wheel.parent))} failed: .*"
        r"(No matching distribution|Could not find a version).*\n",
        result.stderr,
    ), result.stderr
    assert not (tmp_path / "torchrun.json").exists()


def test_a_full_temporary_disk_stops_the_job_in_one_line_and_leaves_nothing(sagemaker_host, tmp_path):
    from tests.disks import small_disk

    wheel = make_wheel(tmp_path / "wheels", "launcher_probe", "1.0")
    with zipfile.ZipFile(wheel, "a") as archive:  # larger than the disk: its checked copy cannot be written
        archive.writestr("launcher_probe/payload.bin", os.urandom(256 * 1024), zipfile.ZIP_STORED)
    with small_disk(tmp_path / "tmp", "128k") as tmp:
        result = bootstrap_pinning(sagemaker_host, wheel, "launcher-probe==1.0", TMPDIR=str(tmp))
        left = sorted(p.name for p in tmp.iterdir())
    assert result.returncode == 2
    assert re.fullmatch(
        rf"bootstrap: cannot copy {wheel.name} from the wheelhouse {re.escape(str(wheel.parent))} to "
        rf"{re.escape(str(tmp))}/launcher-wheelhouse-\w+: \[Errno 28\] No space left on device.*\n",
        result.stderr,
    ), result.stderr
    assert left == [] and not (tmp_path / "torchrun.json").exists()


def kubelet_volume(directory: Path, files: dict[str, bytes]) -> Path:
    """`files` as the kubelet's atomic writer shows a ConfigMap volume: the bytes in a timestamped
    `..<date>` directory, `..data` linking to it, each key a symlink into `..data`
    (kubernetes/kubernetes pkg/volume/util/atomic_writer.go)."""
    stamped = directory / "..2026_12_03_08_00_00.123456789"
    stamped.mkdir(parents=True)
    for key, data in files.items():
        (stamped / key).write_bytes(data)
        (directory / key).symlink_to(Path("..data") / key)
    (directory / "..data").symlink_to(stamped.name)
    return directory


def test_a_wheel_in_config_map_parts_is_joined_in_order_and_trusted_by_its_sha256(tmp_path):
    from entrypoints.bootstrap import SetupError, checked_wheelhouse
    from launcher.contract.wheels import part_name

    wheel = make_wheel(tmp_path / "built", "launcher_probe", "1.0")
    data, file = wheel.read_bytes(), wheel.name
    thirds = [data[: len(data) // 3], data[len(data) // 3 : 2 * len(data) // 3], data[2 * len(data) // 3 :]]
    parts = {part_name(file, i): part for i, part in enumerate(thirds)}
    volume = kubelet_volume(tmp_path / "volume", parts)
    (tmp_path / "out").mkdir()
    joined = checked_wheelhouse(str(volume), {sha256(wheel)}, tmp_path / "out")
    assert [p.name for p in joined.iterdir()] == [file] and (joined / file).read_bytes() == data

    def refusal(files: dict[str, bytes], pinned: set[str]) -> str:
        volume = kubelet_volume(tmp_path / f"v{len(list(tmp_path.iterdir()))}", files)
        out = tmp_path / f"o{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        with pytest.raises(SetupError) as raised:
            checked_wheelhouse(str(volume), pinned, out)
        return str(raised.value).replace(str(volume), "VOLUME")

    swapped = {part_name(file, 0): thirds[1], part_name(file, 1): thirds[0], part_name(file, 2): thirds[2]}
    assert refusal(swapped, {sha256(wheel)}).startswith(f"{file} in the wheelhouse VOLUME has sha256 ")
    assert refusal(swapped, {sha256(wheel)}).endswith(
        "which the job does not pin (LAUNCHER_WHEEL_SHA256); the wheelhouse is damaged or not this job's"
    )
    without_middle = {k: v for k, v in parts.items() if not k.endswith("part001")}
    assert refusal(without_middle, {sha256(wheel)}) == f"the wheelhouse VOLUME has parts 0, 2 of {file}, not 0 to 1"
    assert (
        refusal({**parts, file: data}, {sha256(wheel)})
        == f"the wheelhouse VOLUME has {file} both whole and in parts; it is damaged"
    )
    assert refusal(parts, {sha256(wheel), "cd" * 32}) == (
        f"the wheelhouse VOLUME has no wheel with sha256 {'cd' * 32} of the job's pins; it is incomplete"
    )


def make_wheel(directory: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel (one module) that pip installs offline."""
    import zipfile

    directory.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


def test_exec_keeps_the_engines_rendezvous_and_installs_the_pins_into_a_directory_of_its_own(sagemaker_host, tmp_path):
    """Slurm and Kubernetes: the bootstrap installs, then becomes torchrun (no session of its own,
    no forwarding: the engine signals torchrun itself) with the command's rendezvous as it is."""
    wheel = make_wheel(tmp_path / "wheels", "launcher_probe", "1.0")
    engine_argv = ["--exec", "torchrun", "--nnodes=2", "--rdzv-endpoint=node1:29500", *JOB_ARGV[1:]]
    argv, env = sagemaker_host(
        argv=engine_argv,
        LAUNCHER_REQUIREMENTS="launcher-probe==1.0",
        LAUNCHER_WHEELHOUSE=str(wheel.parent),
        LAUNCHER_WHEEL_SHA256=sha256(wheel),
    )
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    record = recorded(tmp_path)
    assert record["argv"] == ["--shutdown-timeout=100", *engine_argv[2:]]
    assert record["sid"] == os.getsid(0)  # the same process group's session: exec'd, not started
    target = Path(record["pythonpath"].split(os.pathsep)[0])
    assert (target / "launcher_probe" / "__init__.py").is_file() and not (tmp_path / "torchrun.json.term").exists()
    timed = sagemaker_host(argv=[*engine_argv[:2], "--shutdown-timeout=400", *engine_argv[2:]])
    assert subprocess.run(timed[0], env=timed[1], capture_output=True, timeout=60).returncode == 0
    assert recorded(tmp_path)["argv"].count("--shutdown-timeout=400") == 1  # the command's own grace is kept
    assert not [a for a in recorded(tmp_path)["argv"] if a == "--shutdown-timeout=100"]


def tiny_resolved(tmp_path: Path, **overrides) -> Path:
    from launcher.recipe import Recipe
    from launcher.resolve import resolve

    changes = {"cluster.nproc_per_node": 2, "training.steps": 3, "training.global_batch_size": 2}
    changes |= {"checkpoint.every_steps": 0, **overrides}
    recipe = resolve(Recipe.load(REPO / "recipes" / "tiny-cpu.yaml", changes)).concrete
    resolved = recipe.resolved(checkpoint_dir=str(tmp_path / "checkpoints"), output_dir=str(tmp_path / "output"))
    path = tmp_path / "resolved.json"
    path.write_text(json.dumps(resolved.to_dict()))
    return path


@pytest.mark.torchrun
def test_the_bootstrap_runs_the_real_torchrun_and_train_py_on_one_host(sagemaker_host, tmp_path):
    config = tiny_resolved(tmp_path)
    job = ["torchrun", "--nproc-per-node=2", "--max-restarts=0", "entrypoints/train.py", "--config", str(config)]
    argv, env = sagemaker_host(hosts=["algo-1"], current="algo-1", argv=job)
    env["PATH"] = os.environ["PATH"]  # the real torchrun
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^metrics step=3 loss=[\d.]+", result.stdout, re.M), result.stdout[-2000:]
    assert "bootstrap: algo-1 is node 0 of 1" in result.stdout


@pytest.mark.torchrun
def test_a_real_worker_failure_becomes_the_failure_file(sagemaker_host, tmp_path):
    config = tmp_path / "resolved.json"
    config.write_text(json.dumps({"format": "not a launcher config"}))
    job = ["torchrun", "--nproc-per-node=2", "--max-restarts=0", "entrypoints/train.py", "--config", str(config)]
    argv, env = sagemaker_host(hosts=["algo-1"], current="algo-1", argv=job)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    result = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2  # train.py's exit code for a bad config
    lines = failure(tmp_path).splitlines()
    # train.py records its ConfigError in its error file (entrypoints/failure.py), so the failure
    # names the exception itself, followed by the innermost frames of where it was raised.
    assert re.fullmatch(
        r"rank [01] on \S+ failed: ConfigError: format: 'not a launcher config' is not a resolved config format "
        r"these entrypoints read; expected 1 \(write it with `launcher show --json` or Recipe.resolved\(\) of the "
        r"same launcher version\)",
        lines[0],
    ), lines
    assert any("launcher/contract/config.py" in line for line in lines[1:]), lines


RAISING_WORKER = """
import os, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise RuntimeError("shard 7 of the train channel is truncated")
    time.sleep(60)  # rank 0 is still working when torchrun stops it: a symptom, not the cause

main()
"""


@pytest.mark.torchrun
def test_a_real_recorded_exception_reaches_the_failure_file_through_torchrun(sagemaker_host, tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(RAISING_WORKER)
    argv, env = sagemaker_host(hosts=["algo-1"], current="algo-1", argv=["torchrun", "--nproc-per-node=2", str(worker)])
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = failure(tmp_path).splitlines()
    assert re.fullmatch(r"rank 1 on \S+ failed: RuntimeError: shard 7 of the train channel is truncated", lines[0])
    assert any("in main" in line for line in lines[1:]), lines


# --- the bundle is checked against the request before anything of it runs ------------------------

# A bundle's own bootstrap.py that proves it ran: a tampered bundle would do anything here.
RUNS_AND_TELLS = 'import os\nopen(os.environ["BUNDLE_RAN"], "w").write("ran")\n'


@pytest.fixture
def container(tmp_path, fake_bundle, home):
    """The rendered SageMaker request's container command and environment, on this machine's paths.

    Returns run(archive) -> (CompletedProcess, failure file text or None); the bundle at `archive`
    stands in for the `code` channel, and BUNDLE_RAN names the file its bootstrap.py would write."""
    request = get_backend("sagemaker").render(spec_for("llama3-8b-8k", "sagemaker")).data["request"]
    algorithm = request["AlgorithmSpecification"]
    output = tmp_path / "opt_ml" / "output"
    output.mkdir(parents=True)

    def run(archive: Path, **environment: str):
        env = {
            **request["Environment"],
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin",
            "LAUNCHER_BUNDLE": str(archive),
            "LAUNCHER_CODE": str(tmp_path / "opt_ml_code"),
            "LAUNCHER_FAILURE_FILE": str(output / "failure"),
            "BUNDLE_RAN": str(tmp_path / "bundle-ran"),
            **environment,
        }
        argv = [*algorithm["ContainerEntrypoint"], *algorithm["ContainerArguments"]]
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        text = (output / "failure").read_text() if (output / "failure").exists() else None
        return result, text

    run.sha256 = request["Environment"].get("LAUNCHER_BUNDLE_SHA256")
    return run


def a_bundle_that_tells(tmp_path: Path, name: str) -> tuple[Path, Bundle]:
    source = tmp_path / f"{name}-entrypoints"
    source.mkdir()
    (source / "bootstrap.py").write_text(RUNS_AND_TELLS)
    bundle = Bundle.build('{"name": "x"}\n', source)
    return bundle.write(tmp_path / name / "code.tar.gz"), bundle


REFUSED = (
    "bundle check: refused the code bundle {}: its sha256 is not the LAUNCHER_BUNDLE_SHA256 of the job's request "
    "(it was changed or damaged after upload); nothing from it ran\n"
)


def test_a_bundle_whose_bytes_differ_from_the_requests_sha256_is_refused_and_nothing_of_it_runs(container, tmp_path):
    archive, bundle = a_bundle_that_tells(tmp_path, "tampered")
    assert bundle.sha256 != container.sha256
    result, failure_text = container(archive)
    assert result.returncode == 2, result.stderr
    assert failure_text == REFUSED.format(archive)  # one line: the job's FailureReason
    assert result.stderr.endswith(REFUSED.format(archive))
    assert not (tmp_path / "bundle-ran").exists()
    assert not (tmp_path / "opt_ml_code").exists()  # not even unpacked


@pytest.mark.parametrize("sha256", ["", "0" * 64, "not a digest"], ids=["empty", "zeros", "garbage"])
def test_a_request_without_the_bundles_sha256_runs_nothing(container, tmp_path, sha256):
    archive, bundle = a_bundle_that_tells(tmp_path, "any")
    result, failure_text = container(archive, LAUNCHER_BUNDLE_SHA256=sha256)
    assert (result.returncode, failure_text) == (2, REFUSED.format(archive))
    assert not (tmp_path / "bundle-ran").exists()


def test_a_bundle_with_the_requests_sha256_is_unpacked_and_run(container, tmp_path):
    archive, bundle = a_bundle_that_tells(tmp_path, "uploaded")
    result, failure_text = container(archive, LAUNCHER_BUNDLE_SHA256=bundle.sha256)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "bundle-ran").read_text() == "ran" and failure_text is None
