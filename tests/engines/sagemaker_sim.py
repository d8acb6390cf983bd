"""Run a CreateTrainingJob request the way SageMaker runs it, on simulated hosts on this machine.

    sim = Simulation(s3, image=image_venv, workdir=tmp_path, grace_s=20)
    with sim.start(request) as attempt:        # the exact dict that was sent to CreateTrainingJob
        outcome = attempt.wait(timeout_s=120)  # Completed / Failed / Stopped, per-host exit codes

What the harness does, host by host (algo-1 ... algo-N, from ResourceConfig.InstanceCount):
- a network namespace on a private bridge (see netns.py): only `lo` and one interface, named as
  resourceconfig.json's `network_interface_name` says (NETWORK_INTERFACE), no route out;
- a UTS, mount and PID namespace: its hostname is an EC2-style `ip-10-213-7-1k` (SageMaker does not
  promise `algo-k`), `/etc/hosts` holds localhost and algo-1..N only, as SageMaker's DNS resolves
  them, so the container's own hostname resolves to nothing; `/opt/ml` is the host's own
  directory, and the container's command runs as PID 1, so a SIGTERM reaches it the way
  `docker stop` delivers it. The image's files are this machine's; `/opt` and
  this machine's pip configuration are hidden (the image has no local package index), and the
  image venv (image.py) gets a writable overlay layer per container, so an install stays there;
- /opt/ml/input/config/{resourceconfig,hyperparameters,inputdataconfig}.json, every channel
  downloaded from S3 into /opt/ml/input/data/<channel>/ (FastFile is copied like File), empty
  output/, model/ and the checkpoint directory, which is first filled from CheckpointConfig.S3Uri
  and then synced back (s3sync.py);
- the command `ContainerEntrypoint + ContainerArguments` with a container's environment: PATH
  with the image's bin first, HOME=/root, TRAINING_JOB_NAME and TRAINING_JOB_ARN (which the
  platform sets), then the request's Environment. Nothing else: the SM_* variables (SM_HOSTS,
  SM_CHANNEL_TRAIN, ...) come from the sagemaker-training toolkit's `train` program, which runs
  only through the image's own entrypoint; a ContainerEntrypoint replaces it, so a job that
  overrides the entrypoint must read /opt/ml/input/config itself.

The job ends as SageMaker ends it: when every container has exited 0 it is Completed; when one
exits non-zero the others are stopped and it is Failed, with the first failing host's
/opt/ml/output/failure as the reason. `stop()` is StopTrainingJob or a spot reclaim: SIGTERM to
every container, `grace_s` (SageMaker gives about 120 s), then SIGKILL. `kill(host)` is an
instance lost at once: SIGKILL, and its checkpoint sync uploads nothing more.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .netns import BRIDGE_ADDRESS, HostNetwork, NetHost, sweep_stale
from .s3endpoint import S3Endpoint
from .s3sync import CheckpointSync, download_channel

OPT_ML = "/opt/ml"
REGION_ACCOUNT = "111122223333"
EXIT_SIGKILL = 128 + signal.SIGKILL  # what docker (and so SageMaker) reports for a killed container
# resourceconfig.json's network_interface_name, and the name of each host's interface. The AWS docs
# ("How Amazon SageMaker Provides Training Information") show "eth0" only as an example; the
# sagemaker-training toolkit reads the key, defaults it to eth0 and says SageMaker training has
# named the interface "ethwe" (aws/sagemaker-training-toolkit, src/sagemaker_training/environment.py,
# where `_network_interface_name` is set; ENVIRONMENT_VARIABLES.md shows "ethwe"). So the name is
# the platform's to choose; the simulation uses the other real one, which a job that assumes eth0
# cannot pass by luck.
NETWORK_INTERFACE = "ethwe"

# Runs inside the new namespaces before the container's command: $1 hostname, $2 the host's
# /opt/ml directory, $3 its hosts file, $4 the image venv; the rest is the command, exec'd as
# PID 1. The image gets a writable layer of its own (overlayfs, as a container's image does), so
# what one container installs is seen by no other container and never reaches the image itself.
CONTAINER_SETUP = r"""set -e
hostname "$1"
mount -t tmpfs -o mode=755 sim-image-opt /opt
mkdir -p /opt/ml /opt/.image-layer/upper /opt/.image-layer/work
mount --bind "$2" /opt/ml
mount --bind "$3" /etc/hosts
mount -t overlay sim-image -o "lowerdir=$4,upperdir=/opt/.image-layer/upper,workdir=/opt/.image-layer/work" "$4"
if [ -d /root/.config/pip ]; then mount -t tmpfs sim-image-pip /root/.config/pip; fi
shift 4
cd /
exec "$@"
"""


# --- the request ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Channel:
    name: str
    uri: str
    mode: str


@dataclass(frozen=True)
class TrainingJobRequest:
    """The fields of a CreateTrainingJob request that decide what runs in the containers."""

    body: dict

    @property
    def name(self) -> str:
        return self.body["TrainingJobName"]

    @property
    def hosts(self) -> list[str]:
        return [f"algo-{k}" for k in range(1, self.body["ResourceConfig"]["InstanceCount"] + 1)]

    @property
    def command(self) -> list[str]:
        algorithm = self.body["AlgorithmSpecification"]
        if not algorithm.get("ContainerEntrypoint"):
            raise NotImplementedError(
                "the request has no ContainerEntrypoint; the image's own entrypoint is not simulated"
            )
        return [*algorithm["ContainerEntrypoint"], *algorithm.get("ContainerArguments", [])]

    @property
    def channels(self) -> list[Channel]:
        channels = []
        default_mode = self.body["AlgorithmSpecification"].get("TrainingInputMode", "File")
        for item in self.body.get("InputDataConfig", []):
            source = item["DataSource"].get("S3DataSource")
            if source is None or source["S3DataType"] != "S3Prefix":
                raise NotImplementedError(f"channel {item['ChannelName']}: only S3Prefix S3 sources are simulated")
            mode = item.get("InputMode", default_mode)
            if mode == "Pipe":
                raise NotImplementedError(f"channel {item['ChannelName']}: Pipe mode is not simulated")
            channels.append(Channel(item["ChannelName"], source["S3Uri"], mode))
        return channels

    @property
    def checkpoint(self) -> tuple[str, str] | None:
        """(S3Uri, local path) of CheckpointConfig, if any."""
        config = self.body.get("CheckpointConfig")
        if not config:
            return None
        return config["S3Uri"], config.get("LocalPath", "/opt/ml/checkpoints")

    def environment(self, *, image: Path) -> dict[str, str]:
        arn = f"arn:aws:sagemaker:{_region(self.body)}:{REGION_ACCOUNT}:training-job/{self.name.lower()}"
        return {
            "PATH": f"{image}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "TRAINING_JOB_NAME": self.name,
            "TRAINING_JOB_ARN": arn,
            **self.body.get("Environment", {}),
        }


def _region(body: dict) -> str:
    return body["RoleArn"].split(":")[3] or "us-west-2"


def resource_config(request: TrainingJobRequest, current: str, interface: str) -> dict:
    hosts = request.hosts
    instance_type = request.body["ResourceConfig"]["InstanceType"]
    return {
        "current_host": current,
        "current_instance_type": instance_type,
        "current_group_name": "homogeneousCluster",
        "hosts": hosts,
        "instance_groups": [
            {"instance_group_name": "homogeneousCluster", "instance_type": instance_type, "hosts": hosts}
        ],
        "network_interface_name": interface,
    }


# --- one host ----------------------------------------------------------------------------------


@dataclass
class HostOutcome:
    name: str
    hostname: str
    exit_code: int | None
    stdout: str
    stderr: str
    failure: str | None

    def tail(self, lines: int = 25) -> str:
        out = "\n".join(self.stdout.splitlines()[-lines:])
        err = "\n".join(self.stderr.splitlines()[-lines:])
        return f"--- {self.name} ({self.hostname}) exit {self.exit_code}\n[stdout]\n{out}\n[stderr]\n{err}\n" + (
            f"[failure]\n{self.failure}\n" if self.failure is not None else ""
        )


@dataclass
class Host:
    name: str
    net: NetHost
    root: Path
    process: subprocess.Popen | None = None
    sync: CheckpointSync | None = None
    killed: bool = False
    exit_code: int | None = None
    _files: list = field(default_factory=list)

    @property
    def opt_ml(self) -> Path:
        return self.root / "opt_ml"

    def local(self, container_path: str) -> Path:
        """Where a path under /opt/ml inside the container lies on this machine."""
        relative = Path(container_path).relative_to(OPT_ML)
        return self.opt_ml / relative

    def stdout(self) -> str:
        return (self.root / "stdout.log").read_text(errors="replace")

    def stderr(self) -> str:
        return (self.root / "stderr.log").read_text(errors="replace")

    def failure(self) -> str | None:
        path = self.opt_ml / "output" / "failure"
        return path.read_text(errors="replace") if path.is_file() else None

    def container_pid(self) -> int | None:
        """PID (on this machine) of the container's PID 1: the child that unshare forked."""
        if self.process is None or self.process.poll() is not None:
            return None
        try:
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def signal(self, number: int) -> None:
        pid = self.container_pid()
        if number == signal.SIGKILL:
            self.killed = True
        try:
            if pid is not None:
                os.kill(pid, number)
            elif number == signal.SIGKILL and self.process is not None and self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)  # not forked yet: end unshare itself
        except ProcessLookupError:
            pass

    def poll(self) -> int | None:
        if self.exit_code is None and self.process is not None and self.process.poll() is not None:
            # unshare reports a child killed by a signal badly; a kill we sent is docker's 137.
            self.exit_code = EXIT_SIGKILL if self.killed else self.process.returncode
            for handle in self._files:
                handle.close()
        return self.exit_code

    def outcome(self) -> HostOutcome:
        return HostOutcome(self.name, self.net.hostname, self.exit_code, self.stdout(), self.stderr(), self.failure())


# --- the job -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    status: str  # Completed, Failed or Stopped
    failure_reason: str | None
    hosts: list[HostOutcome]
    timed_out: bool = False

    def report(self) -> str:
        head = f"status {self.status}" + (" (timed out)" if self.timed_out else "")
        head += f", reason: {self.failure_reason}" if self.failure_reason else ""
        return head + "\n" + "".join(h.tail() for h in self.hosts)

    def lines(self, prefix: str) -> list[str]:
        """Every stdout line, of every host, that starts with `prefix` (host order, then time)."""
        return [line for h in self.hosts for line in h.stdout.splitlines() if line.startswith(prefix)]


class Simulation:
    """Settings shared by every attempt: S3 client, image, where hosts live, timings."""

    def __init__(self, s3, *, image: Path, workdir: Path, grace_s: float = 20.0, sync_poll_s: float = 0.2):
        self.s3, self.image, self.workdir = s3, image, workdir
        self.grace_s, self.sync_poll_s = grace_s, sync_poll_s
        self.attempts = 0

    def start(self, request: dict, *, hold_uploads: dict[str, Callable[[str], bool]] | None = None) -> Attempt:
        """Provision fresh hosts for `request` and start its containers (one attempt of the job).

        `hold_uploads` maps a host name to a predicate on checkpoint paths: files it matches stay
        on that host until the job ends (an upload still under way), so `kill(host)` in that
        window leaves a checkpoint that is complete on the hosts but not in S3.
        """
        self.attempts += 1
        attempt = Attempt(self, TrainingJobRequest(request), self.workdir / f"attempt-{self.attempts}")
        try:
            attempt.provision(hold_uploads or {})
            attempt.launch()
        except BaseException:
            attempt.close()
            raise
        return attempt


class Attempt:
    """One run of the job on fresh hosts. Use as a context manager: exit always cleans up."""

    def __init__(self, sim: Simulation, request: TrainingJobRequest, root: Path):
        self.sim, self.request, self.root = sim, request, root
        self.hostnames = [f"ip-10-213-7-{10 + k}" for k in range(1, len(request.hosts) + 1)]
        self.network = HostNetwork(self.hostnames, interface=NETWORK_INTERFACE)
        self.hosts: list[Host] = []
        self.outcome: Outcome | None = None
        self.s3_endpoint: S3Endpoint | None = None

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    # --- provisioning ------------------------------------------------------------------------

    def provision(self, hold_uploads: dict[str, Callable[[str], bool]]) -> None:
        sweep_stale()
        self.network.__enter__()
        aliases = dict(zip(self.request.hosts, self.hostnames, strict=True))
        for name, net in zip(self.request.hosts, self.network.hosts, strict=True):
            host = Host(name, net, self.root / name)
            self._prepare_opt_ml(host)
            (host.root / "hosts").write_text(self.network.hosts_file(aliases))
            self._prepare_checkpoints(host, hold_uploads.get(name))
            self.hosts.append(host)

    def _prepare_opt_ml(self, host: Host) -> None:
        config = host.opt_ml / "input" / "config"
        for directory in (config, host.opt_ml / "output" / "data", host.opt_ml / "model", host.opt_ml / "code"):
            directory.mkdir(parents=True, exist_ok=True)
        body = self.request.body
        (config / "resourceconfig.json").write_text(
            json.dumps(resource_config(self.request, host.name, host.net.interface))
        )
        (config / "hyperparameters.json").write_text(json.dumps(body.get("HyperParameters", {})))
        input_config = {
            c.name: {"TrainingInputMode": c.mode, "S3DistributionType": "FullyReplicated", "RecordWrapperType": "None"}
            for c in self.request.channels
        }
        (config / "inputdataconfig.json").write_text(json.dumps(input_config))
        for channel in self.request.channels:
            target = host.opt_ml / "input" / "data" / channel.name
            target.mkdir(parents=True, exist_ok=True)
            if not download_channel(self.sim.s3, channel.uri, target):
                raise RuntimeError(f"channel {channel.name}: nothing in S3 under {channel.uri}")

    def _prepare_checkpoints(self, host: Host, hold: Callable[[str], bool] | None) -> None:
        if self.request.checkpoint is None:
            return
        uri, local_path = self.request.checkpoint
        if not local_path.startswith(OPT_ML + "/"):
            raise NotImplementedError(
                f"CheckpointConfig.LocalPath {local_path}: only paths under {OPT_ML} are simulated"
            )
        host.sync = CheckpointSync(
            self.sim.s3,
            host.local(local_path),
            uri,
            poll_s=self.sim.sync_poll_s,
            hold=hold,
        )
        host.sync.download()

    def launch(self) -> None:
        ip, unshare = shutil.which("ip"), shutil.which("unshare")
        if ip is None or unshare is None:
            raise RuntimeError("the simulation needs `ip` (iproute2) and `unshare` (util-linux)")
        env = self.request.environment(image=self.sim.image)
        if "LAUNCHER_CHECKPOINT_S3" in env:
            env.update(self._s3_access())
        for host in self.hosts:
            stdout, stderr = (open(host.root / name, "wb") for name in ("stdout.log", "stderr.log"))  # noqa: SIM115
            host._files = [stdout, stderr]
            argv = [ip, "netns", "exec", host.net.namespace,
                    unshare, "--uts", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child",
                    "/bin/bash", "-c", CONTAINER_SETUP, "sim-container",
                    host.net.hostname, str(host.opt_ml), str(host.root / "hosts"), str(self.sim.image),
                    *self.request.command]  # fmt: skip
            host.process = subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
            if host.sync is not None:
                host.sync.start()

    def _s3_access(self) -> dict[str, str]:
        """A job that reads and writes S3 itself (per-host checkpoints): moto through the bridge,
        and credentials as the instance role's would be (this test's fake ones)."""
        self.s3_endpoint = S3Endpoint(self.network.switch, BRIDGE_ADDRESS, self.sim.s3.meta.endpoint_url)
        names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
        return {"AWS_ENDPOINT_URL": self.s3_endpoint.url, **{name: os.environ[name] for name in names}}

    def s3_bytes_to(self, name: str) -> int:
        """What S3 sent host `name` during this attempt (its downloads), measured at the bridge."""
        return self.s3_endpoint.bytes_to(self.host(name).net.address) if self.s3_endpoint else 0

    # --- running -----------------------------------------------------------------------------

    def running(self) -> list[Host]:
        return [h for h in self.hosts if h.poll() is None]

    def wait_for(self, condition: Callable[[Attempt], bool], *, timeout_s: float, what: str) -> None:
        """Poll until `condition(self)` holds; fail with every host's output if it never does."""
        deadline = time.monotonic() + timeout_s
        while not condition(self):
            if not self.running() or time.monotonic() > deadline:
                why = "every container exited" if not self.running() else f"{timeout_s:.0f} s passed"
                raise AssertionError(f"{what}: never happened ({why})\n" + self._finish("Stopped", None).report())
            time.sleep(0.1)

    def wait(self, *, timeout_s: float) -> Outcome:
        """Until every container has exited; the first failure stops the rest (as SageMaker does)."""
        deadline = time.monotonic() + timeout_s
        while self.running():
            failed = [h for h in self.hosts if h.poll() not in (None, 0)]
            if failed:
                self._terminate()
                return self._finish("Failed", self._reason(failed[0]))
            if time.monotonic() > deadline:
                self._terminate()
                return self._finish("Stopped", f"the simulation's time limit of {timeout_s:.0f} s", timed_out=True)
            time.sleep(0.1)
        failed = [h for h in self.hosts if h.exit_code != 0]
        return self._finish("Failed", self._reason(failed[0])) if failed else self._finish("Completed", None)

    def stop(self) -> Outcome:
        """StopTrainingJob or a spot reclaim: SIGTERM everywhere, the grace period, then SIGKILL."""
        self._terminate()
        return self._finish("Stopped", None)

    def kill(self, name: str) -> None:
        """The instance `name` is lost at once: SIGKILL, and no further checkpoint upload."""
        host = self.host(name)
        if host.sync is not None:
            host.sync.abandon()
        host.signal(signal.SIGKILL)

    def _terminate(self) -> None:
        for host in self.running():
            host.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.sim.grace_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        for host in self.running():
            host.signal(signal.SIGKILL)
        for host in self.hosts:
            if host.process is not None:
                host.process.wait(timeout=30)
            host.poll()

    @staticmethod
    def _reason(host: Host) -> str:
        failure = host.failure()
        if failure:
            return failure.strip()
        return f"AlgorithmError: {host.name} exited with code {host.exit_code} (no /opt/ml/output/failure)"

    def _finish(self, status: str, reason: str | None, *, timed_out: bool = False) -> Outcome:
        if self.outcome is None:
            self._terminate()
            for host in self.hosts:
                if host.sync is not None and not host.killed:
                    host.sync.finish()
                elif host.sync is not None:
                    host.sync.abandon()
            self.outcome = Outcome(status, reason, [h.outcome() for h in self.hosts], timed_out)
        return self.outcome

    def close(self) -> None:
        """Always runs: end every process, stop every sync thread, delete the namespaces."""
        try:
            for host in self.hosts:
                if host.process is not None and host.process.poll() is None:
                    host.signal(signal.SIGKILL)
                    try:
                        os.killpg(host.process.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    host.process.wait(timeout=30)
                host.poll()
                if host.sync is not None:
                    host.sync.abandon()
        finally:
            if self.s3_endpoint is not None:
                self.s3_endpoint.close()
            self.network.close()
