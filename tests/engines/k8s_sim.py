"""Run a PyTorchJob the way the Kubeflow training operator (v1.9) and the kubelet run it, on
simulated pods on this machine.

    sim = PyTorchJobSim(image=image_venv, workdir=tmp_path)
    with sim.start(documents) as job:        # the ConfigMap and PyTorchJob that submit created
        outcome = job.wait(timeout_s=120)    # Succeeded / Failed, per-pod exit codes

What the harness does, pod by pod (`<job>-master-0`, `<job>-worker-0`, ...):
- a network namespace on a private bridge (netns.py), a UTS namespace whose hostname is the pod
  name (a pod's hostname is its name) and an /etc/hosts that resolves every pod's name, as the
  operator's headless Service per pod does through cluster DNS;
- a mount and PID namespace with a root of its own (chroot): this machine's /usr, /etc, /dev and
  /sys read-only or shared as a node gives them, a fresh /tmp and /root, the image venv (the
  stand-in for the container image) at its own path, and the pod's volumes: a ConfigMap's keys
  at its mountPath (read-only) as the kubelet lays them out (symlinks into `..data`), a
  projected volume the keys of all its ConfigMaps in one such directory, each
  PersistentVolumeClaim as a host directory shared by every pod (`claims` maps claim name ->
  directory), emptyDir as a fresh directory or tmpfs (medium Memory), hostPath bound;
- the container's `command + args` as PID 1, with the environment a container gets: PATH (the
  image's bin first), HOSTNAME, HOME, the container's own `env`, then what the operator appends
  (operator_environment: its v1.9 envvar.go and master.go, read from the job itself).

Like the operator with restartPolicy Never: the job Succeeded when every pod exited 0; the
first pod that fails ends the others and the job is Failed. `stop` deletes the pods as the
kubelet does: SIGTERM to each container's PID 1, SIGKILL after terminationGracePeriodSeconds.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .netns import HostNetwork, NetHost, sweep_stale

DEFAULT_PORT = 23456  # kubeflowv1.PyTorchJobDefaultPort, when no container port is named pytorchjob-port
PORT_NAME = "pytorchjob-port"
SYSTEM_DIRS = ("/usr", "/etc")  # read-only: the files an image's layers give a container

# Runs in the new namespaces as root: $1 hostname, $2 the pod's root, $3 its hosts file, $4 a
# file of mounts (kind<TAB>source<TAB>target<TAB>ro|rw per line); the rest is the container's
# argv, exec'd in the new root as PID 1.
POD_SETUP = r"""set -e
hostname "$1"
root="$2"; hosts="$3"; mounts="$4"; shift 4
mount --make-rprivate /
mount -t tmpfs -o mode=755 pod-root "$root"
for link in bin lib lib64 sbin; do if [ -L "/$link" ]; then ln -s "$(readlink "/$link")" "$root/$link"; fi; done
mkdir -p "$root/dev" "$root/proc" "$root/sys" "$root/tmp" "$root/root"
mount --rbind /dev "$root/dev"
mount --rbind /sys "$root/sys"
mount -t proc proc "$root/proc"
mount -t tmpfs -o mode=1777 pod-tmp "$root/tmp"
while IFS="$(printf '\t')" read -r kind source target mode; do
  case "$kind" in
    tmpfs) mkdir -p "$root$target"; mount -t tmpfs pod-tmpfs "$root$target" ;;
    file) mkdir -p "$(dirname "$root$target")"; touch "$root$target"; mount --bind "$source" "$root$target" ;;
    *) mkdir -p "$root$target"; mount --rbind "$source" "$root$target" ;;
  esac
  if [ "$mode" = ro ]; then mount -o remount,bind,ro "$root$target"; fi
done < "$mounts"
mount --bind "$hosts" "$root/etc/hosts"
exec chroot "$root" "$@"
"""


def operator_environment(job: dict, role: str, index: int) -> list[tuple[str, str]]:
    """What training-operator v1.9 appends to the `pytorch` container of pod `<job>-<role>-<index>`
    (pkg/controller.v1/pytorch/envvar.go setPodEnv, master.go), in its order: node-level RANK,
    WORLD_SIZE = replicas x nprocPerNode, PET_NNODES only without an elasticPolicy."""
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(r.get("replicas", 1) for r in replicas.values())
    nproc = spec.get("nprocPerNode", "auto")
    master = f"{job['metadata']['name']}-master-0"
    port = next(
        (p["containerPort"] for c in replicas["Master"]["template"]["spec"]["containers"] if c["name"] == "pytorch"
         for p in c.get("ports", []) if p.get("name") == PORT_NAME),
        DEFAULT_PORT,
    )  # fmt: skip
    rank = index + 1 if role == "worker" else index
    env = [("PYTHONUNBUFFERED", "1"), ("MASTER_PORT", str(port)), ("PET_MASTER_PORT", str(port))]
    env += [("MASTER_ADDR", master), ("PET_MASTER_ADDR", master)]
    env += [("WORLD_SIZE", str(total * (int(nproc) if nproc.isdigit() else 1))), ("RANK", str(rank))]
    env += [("PET_NODE_RANK", str(rank)), ("PET_NPROC_PER_NODE", nproc)]
    if "elasticPolicy" in spec:
        raise NotImplementedError("elastic PyTorchJobs (PET_RDZV_*, PET_NNODES=min:max) are not simulated")
    return [*env, ("PET_NNODES", str(total))]


def atomic_write(directory: Path, files: dict[str, bytes]) -> Path:
    """`files` as the kubelet's AtomicWriter lays out a ConfigMap or projected volume
    (kubernetes/kubernetes pkg/volume/util/atomic_writer.go, Write): the bytes in a timestamped
    directory `..<date>.<random>`, `..data` a symlink to it, each key a symlink `key -> ..data/key`."""
    directory.mkdir(parents=True)
    stamped = directory / time.strftime("..%Y_%m_%d_%H_%M_%S.000000001", time.gmtime())
    stamped.mkdir(mode=0o755)
    for key, data in files.items():
        (stamped / key).write_bytes(data)
        (stamped / key).chmod(0o644)  # ConfigMapVolumeSource.defaultMode
        (directory / key).symlink_to(Path("..data") / key)
    (directory / "..data").symlink_to(stamped.name)
    return directory


def container_exit_code(returncode: int) -> int:
    """The exitCode the kubelet reports in the pod's containerStatuses: a container whose PID 1
    died by signal N ends with 128 + N, e.g. 137 for SIGKILL (OpenShift's and Kubernetes' own
    OOMKilled examples: docs.openshift.com/container-platform/3.9/dev_guide/application_memory_sizing.html).
    `unshare --fork` ends by the signal its child died of, which Popen reports as -N."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Pod:
    name: str
    role: str
    index: int
    net: NetHost
    root: Path
    process: subprocess.Popen | None = None
    exit_code: int | None = None
    _files: list = field(default_factory=list)

    def log(self) -> str:
        return (self.root / "container.log").read_text(errors="replace")

    def poll(self) -> int | None:
        if self.exit_code is None and self.process is not None and self.process.poll() is not None:
            self.exit_code = container_exit_code(self.process.returncode)
            for handle in self._files:
                handle.close()
        return self.exit_code

    def init_pid(self) -> int | None:
        """The host's pid of the container's PID 1: unshare's one child (`--fork`), which became
        the container's command by exec."""
        if self.process is None or self.process.poll() is not None:
            return None
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return int(children[0]) if children else None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)
        self.poll()


@dataclass
class Outcome:
    status: str  # Succeeded or Failed
    exit_codes: dict[str, int | None]
    logs: dict[str, str]
    timed_out: bool = False

    def report(self, lines: int = 30) -> str:
        parts = [f"status {self.status}{' (timed out)' if self.timed_out else ''}, exit codes {self.exit_codes}"]
        for name, log in self.logs.items():
            parts.append(f"--- {name}\n" + "\n".join(log.splitlines()[-lines:]))
        return "\n".join(parts)


class PyTorchJobSim:
    """Settings shared by every run: the image venv, where pods and claims live."""

    def __init__(self, *, image: Path, workdir: Path, claims: dict[str, Path] | None = None):
        self.image, self.workdir = image, workdir
        self.claims = dict(claims or {})

    def claim(self, name: str) -> Path:
        """The host directory behind claim `name` (made on first use): shared by every pod."""
        path = self.claims.setdefault(name, self.workdir / "claims" / name)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self, documents: list[dict]) -> Run:
        run = Run(self, documents)
        try:
            run.provision()
            run.launch()
        except BaseException:
            run.close()
            raise
        return run


class Run:
    """One PyTorchJob on fresh pods. Use as a context manager: exit always cleans up."""

    def __init__(self, sim: PyTorchJobSim, documents: list[dict]):
        self.sim = sim
        (self.job,) = [d for d in documents if d["kind"] == "PyTorchJob"]
        self.config_maps = {d["metadata"]["name"]: d for d in documents if d["kind"] == "ConfigMap"}
        self.root = sim.workdir / "pods"
        name = self.job["metadata"]["name"]
        self.roles = [
            (role.lower(), index)
            for role, replica in self.job["spec"]["pytorchReplicaSpecs"].items()
            for index in range(replica.get("replicas", 1))
        ]
        self.network = HostNetwork([f"{name}-{role}-{index}" for role, index in self.roles])
        self.pods: list[Pod] = []
        self.outcome: Outcome | None = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def template(self, role: str) -> dict:
        return self.job["spec"]["pytorchReplicaSpecs"][role.capitalize()]["template"]["spec"]

    def provision(self) -> None:
        sweep_stale()
        self.network.__enter__()
        everyone = {h.hostname: h.hostname for h in self.network.hosts}
        for (role, index), net in zip(self.roles, self.network.hosts, strict=True):
            pod = Pod(net.hostname, role, index, net, self.root / net.hostname)
            (pod.root / "fs").mkdir(parents=True)
            (pod.root / "hosts").write_text(self.network.hosts_file(everyone))
            (pod.root / "mounts").write_text("".join("\t".join(m) + "\n" for m in self.mounts(pod)))
            self.pods.append(pod)

    def mounts(self, pod: Pod) -> list[tuple[str, str, str, str]]:
        """(kind, source, target, ro|rw): the image and the node's files, then the pod's volumes."""
        python = [Path(p).resolve() for p in (self.sim.image, sys.prefix, sys.base_prefix)]
        found = [("bind", d, d, "ro") for d in SYSTEM_DIRS]
        found += [("bind", str(p), str(p), "ro") for p in dict.fromkeys(python)]
        spec = self.template(pod.role)
        (container,) = [c for c in spec["containers"] if c["name"] == "pytorch"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for mount in container["volumeMounts"]:
            volume = volumes[mount["name"]]
            mode = "ro" if mount.get("readOnly") else "rw"
            found.append(self.volume(pod, volume, mount["mountPath"], mode))
        return found

    def config_map_files(self, name: str) -> dict[str, bytes]:
        config_map = self.config_maps[name]  # a KeyError: the pod would never start
        files = {key: base64.b64decode(value) for key, value in config_map.get("binaryData", {}).items()}
        return files | {key: value.encode() for key, value in config_map.get("data", {}).items()}

    def volume(self, pod: Pod, volume: dict, target: str, mode: str) -> tuple[str, str, str, str]:
        if "configMap" in volume or "projected" in volume:
            # A projected volume shows the keys of all its ConfigMaps in one directory.
            sources = [volume] if "configMap" in volume else volume["projected"]["sources"]
            files: dict[str, bytes] = {}
            for source in sources:
                if "configMap" not in source:
                    raise NotImplementedError(f"volume {volume['name']}: projected {sorted(source)} is not simulated")
                files |= self.config_map_files(source["configMap"]["name"])
            return ("bind", str(atomic_write(pod.root / "volumes" / volume["name"], files)), target, "ro")
        if "persistentVolumeClaim" in volume:
            return ("bind", str(self.sim.claim(volume["persistentVolumeClaim"]["claimName"])), target, mode)
        if "emptyDir" in volume:
            if volume["emptyDir"].get("medium") == "Memory":
                return ("tmpfs", "-", target, mode)
            directory = pod.root / "volumes" / volume["name"]
            directory.mkdir(parents=True)
            return ("bind", str(directory), target, mode)
        if "hostPath" in volume:
            return ("bind", volume["hostPath"]["path"], target, mode)
        raise NotImplementedError(f"volume {volume['name']}: {sorted(volume)} is not simulated")

    def environment(self, pod: Pod) -> dict[str, str]:
        (container,) = [c for c in self.template(pod.role)["containers"] if c["name"] == "pytorch"]
        env = {
            "PATH": f"{self.sim.image}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOSTNAME": pod.name,
            "HOME": "/root",
        }
        # The kubelet applies the list in order, so a later entry of the same name wins.
        for name, value in [*((e["name"], e["value"]) for e in container.get("env", [])),
                            *operator_environment(self.job, pod.role, pod.index)]:  # fmt: skip
            env[name] = value
        return env

    def launch(self) -> None:
        unshare = shutil.which("unshare")
        if unshare is None or shutil.which("ip") is None or shutil.which("chroot") is None:
            raise RuntimeError("the simulation needs `ip` (iproute2), `unshare` (util-linux) and `chroot` (coreutils)")
        for pod in self.pods:  # the master first: the operator's init container holds workers until it resolves
            (container,) = [c for c in self.template(pod.role)["containers"] if c["name"] == "pytorch"]
            log = open(pod.root / "container.log", "wb")  # noqa: SIM115
            pod._files = [log]
            argv = ["ip", "netns", "exec", pod.net.namespace,
                    unshare, "--uts", "--mount", "--pid", "--fork", "--kill-child",
                    "/bin/bash", "-c", POD_SETUP, "sim-pod", pod.name, str(pod.root / "fs"),
                    str(pod.root / "hosts"), str(pod.root / "mounts"),
                    *container.get("command", []), *container.get("args", [])]  # fmt: skip
            pod.process = subprocess.Popen(
                argv, env=self.environment(pod), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def stop(self, *, timeout_s: float) -> Outcome:
        """Delete the pods as the kubelet does: SIGTERM to each container's PID 1, SIGKILL after the
        pod's terminationGracePeriodSeconds (30 s when the spec has none: Kubernetes API, PodSpec),
        then wait for every pod (at most `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        kill_at = {}
        for pod in self.pods:
            pid = pod.init_pid()
            if pid is not None:
                os.kill(pid, signal.SIGTERM)  # a PID 1 gets it only if it handles it, as in a container
            kill_at[pod.name] = time.monotonic() + self.template(pod.role).get("terminationGracePeriodSeconds", 30)
        while self.running() and time.monotonic() < deadline:
            for pod in self.running():
                if time.monotonic() > kill_at[pod.name]:
                    pod.kill()
            time.sleep(0.1)
        return self._finish("Failed", timed_out=bool(self.running()))

    def running(self) -> list[Pod]:
        return [p for p in self.pods if p.poll() is None]

    def wait(self, *, timeout_s: float) -> Outcome:
        """Until every pod has exited; the first failure ends the rest (restartPolicy Never)."""
        deadline = time.monotonic() + timeout_s
        while self.running():
            if any(p.poll() not in (None, 0) for p in self.pods):
                return self._finish("Failed")
            if time.monotonic() > deadline:
                return self._finish("Failed", timed_out=True)
            time.sleep(0.1)
        return self._finish("Succeeded" if all(p.exit_code == 0 for p in self.pods) else "Failed")

    def _finish(self, status: str, *, timed_out: bool = False) -> Outcome:
        if self.outcome is None:
            for pod in self.pods:
                pod.kill()
            codes = {p.name: p.exit_code for p in self.pods}
            self.outcome = Outcome(status, codes, {p.name: p.log() for p in self.pods}, timed_out)
        return self.outcome

    def close(self) -> None:
        """Always runs: end every pod's processes, delete the namespaces."""
        try:
            for pod in self.pods:
                pod.kill()
        finally:
            self.network.close()
