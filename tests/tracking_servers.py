"""Real MLflow tracking servers (`mlflow server` on 127.0.0.1), started once per session.

A server takes tens of seconds to start (its database migrations, then uvicorn), a minute and
more on a loaded machine: the root conftest's `_background` starts each one a selected test asks
for before the first test runs, so it comes up beside the serial tests. `mlflow_server` is shared
(a test reads its own runs back by their lineage tag); `doomed_mlflow_server` is the one a test
kills mid-run. Each runs in a session of its own (tests/background.py), which the end of the
session kills whole; `kill` ends one earlier with a real SIGKILL to the group it leads.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SERVERS = ("mlflow_server", "doomed_mlflow_server")
START_LIMIT_S = 600.0


@dataclass
class MlflowServer:
    url: str
    process: subprocess.Popen
    log: Path

    def wait_ready(self) -> MlflowServer:
        deadline = time.monotonic() + START_LIMIT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"mlflow server exited {self.process.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"mlflow server not up after {START_LIMIT_S:.0f} s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL to the server's group: the mlflow command and the uvicorn process it started."""
        os.killpg(self.process.pid, signal.SIGKILL)  # its own session, made by Background.popen
        self.process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(root: Path, background) -> MlflowServer:
    root.mkdir(parents=True)
    port = _free_port()
    log = root / "server.log"
    argv = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    argv += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art")]
    # No job executor: its worker processes serve nothing these tests use.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log.open("w") as out:
        process = background.popen(argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    return MlflowServer(f"http://127.0.0.1:{port}", process, log)


def wants_mlflow(item) -> bool:
    return any(name in SERVERS for name in item.fixturenames)


def mlflow_work(items, tmp_path_factory, background) -> dict:
    """Start now each server a selected test asks for; the work only hands it over."""
    wanted = [name for name in SERVERS if any(name in item.fixturenames for item in items)]
    if not wanted:
        return {}
    root = tmp_path_factory.mktemp("mlflow")
    servers = {name: start(root / name, background) for name in wanted}
    return {name: (lambda server=server: server) for name, server in servers.items()}
