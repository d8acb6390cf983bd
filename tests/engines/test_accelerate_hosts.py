"""The accelerate render, run as its header says on two hosts: the real `accelerate launch`.

Each host is a network namespace of its own (netns.py: its own interface and address, one
switch between them), runs the rendered launch script from its own copy of the unpacked bundle
with NODE_RANK and MAIN_PROCESS_IP set, as a user would on each node, and shares one checkpoint
directory with the other (the file system the recipe's `checkpoint.dir` names). accelerate's
MULTI_GPU launcher starts torchrun (accelerate/commands/launch.py, `launch_command`), with the
static rendezvous on the main node's address that the script asks for.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import api
from tests.backends.helpers import recipe_path

from .netns import HostNetwork

pytestmark = [pytest.mark.torchrun, pytest.mark.engines]

STEPS = 4
QUIET_LIMIT_S = 180.0  # no new output line for this long fails the test; a busy machine is only slow
_METRICS = re.compile(r"^metrics step=(\d+) ", re.MULTILINE)


def rendered(checkpoints: Path):
    sets = [
        "cluster.instance_count=2",
        "cluster.nproc_per_node=1",
        "parallel.tensor=1",
        f"training.steps={STEPS}",
        f"checkpoint.dir={checkpoints}",
        "checkpoint.every_steps=2",
    ]
    return api.submit(recipe_path("tiny-cpu"), backend="accelerate", set_options=sets, dry_run=True).rendering


def node_directory(rendering, root: Path) -> Path:
    """One node's working directory: the unpacked bundle, the config file and the launch script."""
    rendering.payload["bundle"].extract(root)
    (root / "accelerate.yaml").write_text(rendering.text)
    (root / "launch.sh").write_text(rendering.data["launch_script"])
    return root


def run_on_hosts(net: HostNetwork, directories: list[Path]) -> list[tuple[int, str]]:
    """Start the script on every host at once; wait while any log grows; (exit code, log) per host."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert accelerate, "the accelerate command is not installed beside this Python (the dev extra has it)"
    logs, processes = [], []
    for node, (host, directory) in enumerate(zip(net.hosts, directories, strict=True)):
        environment = {
            **os.environ,
            "PATH": f"{Path(accelerate).parent}{os.pathsep}{os.environ['PATH']}",
            "NODE_RANK": str(node),
            "MAIN_PROCESS_IP": net.hosts[0].address,
            "GLOO_SOCKET_IFNAME": host.interface,  # the node's own interface, as on any cluster
        }
        log = directory / "node.log"
        logs.append(log)
        with log.open("wb") as out:
            processes.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", host.namespace, "bash", "launch.sh"],
                    cwd=directory,
                    env=environment,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            )
    try:
        seen, last_change = -1, time.monotonic()
        while any(p.poll() is None for p in processes):
            size = sum(log.stat().st_size for log in logs)
            if size != seen:
                seen, last_change = size, time.monotonic()
            elif time.monotonic() - last_change > QUIET_LIMIT_S:
                raise AssertionError(f"no output for {QUIET_LIMIT_S:.0f} s:\n" + "\n".join(tail(log) for log in logs))
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # the session this test started for it
                process.wait()
    return [(p.returncode, log.read_text(errors="replace")) for p, log in zip(processes, logs, strict=True)]


def tail(log: Path, lines: int = 30) -> str:
    return f"--- {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def test_two_hosts_rendezvous_train_and_write_every_hosts_part_of_each_checkpoint(tmp_path, home):
    checkpoints = tmp_path / "shared" / "checkpoints"
    rendering = rendered(checkpoints)
    script = rendering.data["launch_script"]
    assert "accelerate launch --config_file accelerate.yaml --rdzv_backend static --machine_rank" in script
    directories = [node_directory(rendering, tmp_path / f"node-{k}") for k in range(2)]
    with HostNetwork(["node-1", "node-2"]) as net:
        results = run_on_hosts(net, directories)
    report = "\n".join(f"exit {code}\n{text[-3000:]}" for code, text in results)
    assert [code for code, _ in results] == [0, 0], report
    main = results[0][1]
    # One job of two ranks, one per host: neither host trained alone.
    assert re.search(r"^start job=tiny-cpu .*layout=dp_shard2 world_size=2 ", main, re.MULTILINE), report
    assert [int(s) for s in _METRICS.findall(main)] == list(range(1, STEPS + 1)), report
    # The shared directory holds both hosts' parts of each checkpoint, so a resume can use it.
    for step in (2, 4):
        names = sorted(p.name for p in (checkpoints / f"step-{step:08d}").iterdir() if p.name.startswith("COMPLETE"))
        assert names == ["COMPLETE.node-0-of-2", "COMPLETE.node-1-of-2"], names
