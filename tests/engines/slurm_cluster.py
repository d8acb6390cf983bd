"""A real Slurm cluster on this machine, for the Slurm backend's tests.

slurmctld plus two slurmd "nodes" (node1, node2: both this host at 127.0.0.1, each slurmd on
its own port) and a private munged, all under one temporary directory with its own slurm.conf.
Nothing outside that directory is touched: munged listens on a socket in it (slurm.conf's
AuthInfo names that socket), so an installed munge service is neither needed nor disturbed.
Every Slurm command finds the cluster through SLURM_CONF, as the launcher's own sbatch, squeue,
scontrol and scancel calls do when a test sets it.

Needs root (slurmd runs jobs as their user, and SlurmUser is root here) and Debian's
`slurm-wlm` and `munge` packages, as CI has; elsewhere the tests that use it are skipped with
the reason.

Two settings differ from a production cluster, to keep the tests short: a requeued job waits
`cred_expire` seconds before it may start again (5 here, 120 by default), and the scheduler
looks at the queue every 2 s (60 by default).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
NODES = ("node1", "node2")
CPUS_PER_NODE = 2
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


def missing_prerequisites() -> str | None:
    """Why this machine cannot run the cluster (None when it can)."""
    if os.geteuid() != 0:
        return f"a real Slurm cluster needs root (running as uid {os.geteuid()})"
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if missing:
        return f"a real Slurm cluster needs Debian's slurm-wlm and munge packages (missing: {', '.join(missing)})"
    return None


def free_ports(count: int) -> list[int]:
    """Ports nothing listens on now (all held open together, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def slurm_conf(root: Path, *, munge_socket: Path, ctld_port: int, node_ports: list[int]) -> str:
    host = socket.gethostname()
    nodes = [
        f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} "
        "RealMemory=4000 State=UNKNOWN"
        for node, port in zip(NODES, node_ports, strict=True)
    ]
    return "\n".join(
        [
            "ClusterName=launchertest",
            # The controller's address given, so this host's name need not resolve.
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket},cred_expire=5",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/slurmctld.log",
            f"SlurmdLogFile={root}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            "ReturnToService=2",
            "MpiDefault=none",
            *nodes,
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@dataclass
class SlurmCluster:
    root: Path
    conf: Path

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode:
            raise AssertionError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def node_states(self) -> dict[str, str]:
        result = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False)
        return dict(line.split() for line in result.stdout.splitlines() if len(line.split()) == 2)

    def wait_until_idle(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while (states := self.node_states()) != {node: "idle" for node in NODES}:
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm nodes not idle after {timeout:.0f} s: {states}; see {self.root}/*.log")
            time.sleep(0.5)

    def job_field(self, job_id: str, key: str) -> str | None:
        """One field of `scontrol show job` (JobState, Restarts, ...); None once Slurm forgot the job."""
        result = self.run("scontrol", "--oneliner", "show", "job", job_id, check=False)
        for item in result.stdout.split():
            name, _, value = item.partition("=")
            if name == key:
                return value
        return None

    def cancel_everything(self) -> None:
        """Cancel every job, so a failed test leaves no job holding the nodes for the next one."""
        self.run("scancel", "--user=root", check=False)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.run("squeue", "--noheader", check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); its /proc status says Z.
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    except OSError:
        return False


def _stop_pids(pids: list[int], timeout: float) -> None:
    """Wait for the processes to exit; SIGKILL what is left after `timeout`."""
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def start_munge(root: Path) -> Path:
    """A private munged with a fresh key; returns its socket."""
    directory = root / "munge"
    directory.mkdir(mode=0o755)
    key = directory / "munge.key"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
    sock = directory / "munge.socket"
    subprocess.run(
        [
            "munged",
            "--force",  # root owns the key and directory; munged refuses that without --force
            f"--socket={sock}",
            f"--key-file={key}",
            f"--pid-file={directory / 'munged.pid'}",
            f"--log-file={directory / 'munged.log'}",
            f"--seed-file={directory / 'munged.seed'}",
        ],
        check=True,
        capture_output=True,
    )
    return sock


def start_cluster(root: Path) -> SlurmCluster:
    """Write slurm.conf under `root`, start munged, slurmctld and both slurmd; wait until idle."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # slurmd opens paths under it for the job's user
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    munge_socket = start_munge(root)
    ctld_port, *node_ports = free_ports(1 + len(NODES))
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, munge_socket=munge_socket, ctld_port=ctld_port, node_ports=node_ports))
    cluster = SlurmCluster(root=root, conf=conf)
    # -i: ignore state files; a fresh cluster every session.
    cluster.run("slurmctld", "-i")
    for node in NODES:
        cluster.run("slurmd", "-N", node)
    cluster.wait_until_idle()
    return cluster


def stop_cluster(cluster: SlurmCluster) -> None:
    """Cancel jobs, `scontrol shutdown`, wait for the daemons; then stop munged. Never raises
    for a daemon that is already gone."""
    root = cluster.root
    daemon_pids = [
        pid for name in ("slurmctld", *(f"slurmd-{n}" for n in NODES)) if (pid := _pid(root / f"{name}.pid"))
    ]
    try:
        cluster.cancel_everything()
        cluster.run("scontrol", "shutdown", check=False)
    finally:
        _stop_pids(daemon_pids, STOP_TIMEOUT_S)
        munged = _pid(root / "munge" / "munged.pid")
        if munged and _alive(munged):
            os.kill(munged, signal.SIGTERM)
            _stop_pids([munged], 5.0)
