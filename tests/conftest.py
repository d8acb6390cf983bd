"""Shared fixtures of the whole suite.

- `cli`: the real CLI in-process, capturing what a user would see;
- `moto_server` / `aws`: one moto server per session on 127.0.0.1 at a free port; each test that
  asks for `aws` gets fake credentials, AWS_ENDPOINT_URL pointing at it, and a freshly reset state;
- `home`: a private $LAUNCHER_HOME; `fake_bundle`, `fixed_names`, `no_torchrun`: fixed bytes,
  fixed names and a stand-in trainer for the tests that need no torch;
- one wheel cache per session, and the real pinned torchao wheel in it;
- `_background`: the shared torchrun launches and the estimator's traces, run beside the other
  tests (tests/background.py);
- the suite's order, and how `pytest -n 2` splits it between two workers (tests/lanes.py).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.backends.helpers import ACCOUNT, FAKE_ENTRYPOINTS, REGION


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def _no_ambient_aws_region(monkeypatch):
    """A region from the developer's shell or ~/.aws/config would change what recipes render
    (sagemaker.region follows the AWS CLI's order); tests that need one set it themselves."""
    for key in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    # Nor may the developer's credentials reach a test: a dry run with credentials reads the
    # account's quotas from AWS. Tests that talk to moto or a Stubber set fake ones themselves.
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@functools.cache
def _built(command):
    """The click command tree `command()` builds, built once: a `launcher` process builds it once,
    but `main` built it on each call, and typer reads the signature and type hints of every
    command to do so (30 ms, on each of the suite's 800 in-process `launcher` calls)."""
    return command()


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `launcher ARGS...` through `launcher.cli.main`, returning exit code, stdout, stderr."""
    import launcher.cli
    from launcher.cli import main

    build = launcher.cli.command
    monkeypatch.setattr(launcher.cli, "command", lambda: _built(build))

    def run(*args: str) -> CliResult:
        monkeypatch.setattr(sys, "argv", ["launcher", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_server():
    """`moto_server -H 127.0.0.1 -p PORT`, stopped at the end of the session. Yields its URL."""
    executable = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if executable is None:
        pytest.fail("moto_server is not installed; pip install 'moto[server]' (the dev extra)")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # Every resource and STS's caller identity in one account of the tests' (not moto's default,
    # 123456789012, which is an example account of AWS's documentation that submit refuses).
    process = subprocess.Popen(
        [executable, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "MOTO_ACCOUNT_ID": ACCOUNT},
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"moto_server did not start on {url}")
            time.sleep(0.05)
    yield url
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture
def aws(moto_server, monkeypatch):
    """Fake credentials and AWS_ENDPOINT_URL at the moto server, whose state is reset first."""
    from launcher.backends.sagemaker import aws as aws_clients

    request = urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST")
    urllib.request.urlopen(request, timeout=10).close()
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_RETRY_MODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    aws_clients.reset_clients()
    yield moto_server
    aws_clients.reset_clients()


@pytest.fixture(scope="session", autouse=True)
def shared_wheel_cache(tmp_path_factory):
    """One wheel cache for the session: FP8 submits fetch the pinned torchao wheel once, not per test."""
    from launcher.backends.wheelhouse import CACHE_ENV

    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("wheel-cache"))
    yield Path(os.environ[CACHE_ENV])
    if previous is None:
        os.environ.pop(CACHE_ENV)
    else:
        os.environ[CACHE_ENV] = previous


def pytest_configure(config):
    """Under PYTHONDONTWRITEBYTECODE (as CI runs) no process writes the bytecode of the checkout's
    modules, so every process the suite starts compiled what it imported of launcher/,
    entrypoints/ and tests/ again: 0.1 to 0.25 CPU s per process (a launcher CLI, a runner, a
    rank), in a suite that starts hundreds. Compiled once here, by the controller before any worker,
    in 0.5 CPU s; Python still checks each file against its source's time and size."""
    if sys.dont_write_bytecode and not hasattr(config, "workerinput"):
        import compileall

        from tests import REPO

        for package in ("launcher", "entrypoints", "tests"):
            compileall.compile_dir(REPO / package, quiet=1)


LANES = pytest.StashKey["Lanes"]()


def _starters() -> dict:
    """The background work (tests/background.py), in the order one process runs it: the traces
    first, since their test runs among the single-process tests (tests/lanes.py)."""
    from tests.entrypoints.conftest import launch_work, wants_launches
    from tests.entrypoints.test_gpu_check import cpu_smoke_work, wants_cpu_smoke
    from tests.entrypoints.test_multihost_checkpoints import host_runs_work, wants_host_runs
    from tests.estimate.traced import trace_work, wants_traces
    from tests.lanes import Starter
    from tests.tracking_servers import mlflow_work, wants_mlflow

    return {
        # Started when planned: they come up beside the tests, and the work only hands them over.
        "mlflow servers": Starter(wants_mlflow, mlflow_work),
        "traces": Starter(wants_traces, trace_work),
        "launches": Starter(wants_launches, launch_work),
        "cpu smoke": Starter(wants_cpu_smoke, cpu_smoke_work),
        "host runs": Starter(wants_host_runs, host_runs_work),
    }


def pytest_collection_modifyitems(session, config, items):
    """The suite's order, and under xdist its units of work (tests/lanes.py)."""
    from tests.lanes import order

    config.stash[LANES] = order(config, items, _starters())


def pytest_collection_finish(session):
    """What the imports and the collection made lives for the whole session: out of every later
    garbage collection (gc.freeze). Collections took 18% of the in-process tests' CPU time
    (16.7 of 93 CPU s over tests/plan, estimate and recipe), 12% once frozen (11.1 of 89.7)."""
    import gc

    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller: tell each worker where to write the units it computes."""
    from tests.lanes import UNITS_FILE, units_file

    node.workerinput[UNITS_FILE] = str(units_file(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from tests.lanes import make_scheduler

    return make_scheduler(config, log)


def pytest_unconfigure(config):
    from tests.lanes import remove_units_file

    remove_units_file(config)


@pytest.fixture(scope="session", autouse=True)
def _background(request, tmp_path_factory):
    """Before the first test: start the work that selected tests will wait for, beside the
    other tests (tests/background.py); under xdist, only on the worker their modules run on
    (tests/lanes.py). At the end, stop what is still running."""
    from tests.background import Background
    from tests.lanes import plan_work

    work = Background(os.environ)
    if request.config.stash[LANES].runs_background:
        pieces = plan_work(_starters(), request.session.items, tmp_path_factory, work)
        if pieces:
            work.begin(pieces)
    yield work
    work.stop()


@pytest.fixture(scope="session")
def mlflow_server(_background):
    """A real MLflow tracking server on 127.0.0.1 for the session (tests/tracking_servers.py)."""
    return _background.result("mlflow_server").wait_ready()


@pytest.fixture(scope="session")
def doomed_mlflow_server(_background):
    """A real MLflow tracking server that one test kills mid-run."""
    return _background.result("doomed_mlflow_server").wait_ready()


@pytest.fixture(scope="session")
def torchao_wheel(shared_wheel_cache) -> Path:
    """The real pinned torchao wheel (pip download on first use, then the cache)."""
    from launcher.backends.wheelhouse import ensure, pinned

    return ensure(pinned("torchao"))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A private $LAUNCHER_HOME."""
    path = tmp_path / "launcher-home"
    monkeypatch.setenv("LAUNCHER_HOME", str(path))
    return path


@pytest.fixture
def fake_bundle(monkeypatch) -> Path:
    """Bundle tests/backends/fake_entrypoints instead of the real entrypoints (fixed bytes, no torch)."""
    import launcher.bundle

    monkeypatch.setattr(launcher.bundle, "find_entrypoints", lambda: FAKE_ENTRYPOINTS)
    return FAKE_ENTRYPOINTS


@pytest.fixture
def fixed_names(monkeypatch):
    """Job names without the clock and the random suffix: `<recipe>-job`."""
    import launcher.backends.base

    monkeypatch.setattr(launcher.backends.base, "job_name", lambda recipe, max_len=63: f"{recipe.lower()}-job")


@pytest.fixture
def no_torchrun(monkeypatch, fake_bundle, home):
    """Local jobs run the stand-in trainer with this Python instead of torchrun (a fraction of a second each)."""
    import launcher.backends.local.backend as local

    def direct(command):
        return [sys.executable, *command[command.index("entrypoints/train.py") :]]

    monkeypatch.setattr(local, "torchrun_argv", direct)
    return home
