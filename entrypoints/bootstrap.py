"""The first Python a job's container runs: check, install, rendezvous, run torchrun, report.

Usage (the container's working directory is the unpacked bundle):

    python3 entrypoints/bootstrap.py torchrun --nproc-per-node=8 ... entrypoints/train.py --config resolved.json
    python3 entrypoints/bootstrap.py --exec torchrun --nnodes=2 --rdzv-endpoint=... entrypoints/train.py ...

The first form (SageMaker, docker) does all five steps below. `--exec` (Slurm, Kubernetes, whose
engines give torchrun its rendezvous and signal its processes themselves) does steps 1 and 2,
then execs the command as it is: torchrun keeps the engine's rendezvous and receives the
engine's signals directly, as the container's PID 1 or in Slurm's process tree of the step.

In order:
1. Check that the image's torch is a release the entrypoints support (read from the package
   metadata, so a wrong image fails in a second, with one line, before torch is imported).
2. Install the job's pinned wheels (torchao for FP8) offline from the wheelhouse channel,
   only those the image lacks, into a directory of this process's own that PYTHONPATH hands to
   torchrun (`install_wheels`). `--no-index` makes this work under network isolation. pip reads
   only copies whose sha256 the job pins, a wheel in parts joined first (launcher.contract.wheels).
3. Read /opt/ml/input/config/resourceconfig.json and add a c10d rendezvous to the torchrun
   argv: the store on the first of the sorted hosts, which is told it serves it (is_host), and
   each host named by its algo-N (--local-addr), never by its hostname, which on SageMaker is
   not algo-N and resolves to nothing. Unlike AWS's static rendezvous it lets torchrun's
   --max-restarts restart the workers of every host together (`rendezvous_args`).
   From the same file, `network_interface_name` becomes GLOO_SOCKET_IFNAME and
   NCCL_SOCKET_IFNAME (unless the job's environment sets them): the container's hostname does
   not resolve, so without them gloo binds to loopback and no other host can reach it.
4. Run torchrun with a shutdown timeout inside the engine's grace period (the command's own
   `--shutdown-timeout`, which the launcher sets from the job's stop grace, else SageMaker's),
   in its own session, and pass SIGTERM/SIGINT on to it once: workers get time to write their
   last checkpoint. As the container's PID 1 (docker's --entrypoint, SageMaker's
   ContainerEntrypoint) it gets the engine's SIGTERM because it installs a handler for it.
5. On failure, write /opt/ml/output/failure (SageMaker's FailureReason) with the first failing
   rank's error, and exit with the workers' exit code.

Standard library only (and the standard-library contract in the bundle): it runs before anything
else is known to be importable.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

if __package__ in (None, ""):  # run as a script from the bundle root: make `launcher.contract` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher.contract.failure import ROOT_CAUSE, first_failure, reported_failures  # noqa: E402  (standard library only)
from launcher.contract.wheels import ENV_REQUIREMENTS, ENV_WHEEL_SHA256, ENV_WHEELHOUSE, PART  # noqa: E402

# The torch releases the entrypoints support, [lowest, first unsupported). The `train` extra in
# pyproject.toml states the same range (tests/entrypoints/test_bootstrap.py checks they agree).
SUPPORTED_TORCH = ((2, 13), (2, 15))

RESOURCE_CONFIG = "/opt/ml/input/config/resourceconfig.json"
FAILURE_FILE = "/opt/ml/output/failure"
MASTER_PORT = 29500
# SageMaker sends SIGKILL about 120 s after SIGTERM. torchrun gives workers this long to save
# and exit before it kills them, leaving itself and this script 20 s to finish. A command that
# names its own --shutdown-timeout keeps it (launcher.spec sets it from the job's stop grace).
SHUTDOWN_TIMEOUT_S = 100
EXEC = "--exec"
# SageMaker keeps the first 1024 characters of the failure file as the job's FailureReason.
MAX_FAILURE_CHARS = 1024
EXIT_SETUP = 2  # this script refused to start the job (wrong image, bad wheelhouse, bad config)
TAIL_LINES = 200

# Paths SageMaker fixes; tests and other engines override them through the environment.
ENV_RESOURCE_CONFIG = "LAUNCHER_RESOURCE_CONFIG"
ENV_FAILURE_FILE = "LAUNCHER_FAILURE_FILE"


class SetupError(Exception):
    """A reason not to start the job, in one line."""


# --- 1. the image's torch -------------------------------------------------------------------------


def _release(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise SetupError(f"cannot read the torch version {version!r}")
    return int(match[1]), int(match[2])


def check_torch() -> str:
    """The image's torch version, or SetupError when the entrypoints do not support it."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TORCH
    wanted = f"torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise SetupError(
            f"torch is not installed for {sys.executable}; use an image with {wanted} (cluster.image)"
        ) from None
    if not SUPPORTED_TORCH[0] <= _release(version) < SUPPORTED_TORCH[1]:
        raise SetupError(
            f"the image has torch {version}; the entrypoints support {wanted}: "
            "set cluster.image to such an image, or leave it unset for the default"
        )
    return version


# --- 2. offline install from the wheelhouse --------------------------------------------------------


def missing(requirements: list[str], path: list[str] | None = None) -> list[str]:
    """The `name==version` pins whose exact version is not installed (on `path`, default sys.path)."""
    result = []
    for requirement in requirements:
        name, _, version = requirement.partition("==")
        found = next(iter(importlib.metadata.distributions(name=name, path=path or sys.path)), None)
        if found is None or found.version != version:
            result.append(requirement)
    return result


def install_offline(
    requirements: list[str], wheelhouse: str | None, target: str | None = None, shown_as: str | None = None
) -> list[str]:
    """pip-install the missing pins from `wheelhouse` without any index, into the environment or
    into the directory `target`; returns what it installed. `shown_as`: the wheelhouse's name in
    a failure (the job's own directory, when `wheelhouse` is its checked copy)."""
    needed = missing(requirements)
    if not needed:
        return []
    if not wheelhouse or not Path(wheelhouse).is_dir():
        raise SetupError(f"the job needs {' '.join(needed)} but the wheelhouse {wheelhouse!r} is not a directory")
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", wheelhouse, "--no-deps"]
    command += ["--disable-pip-version-check", "--no-input", *(["--target", target] if target else []), *needed]
    result = subprocess.run(command, capture_output=True, text=True)
    still = missing(needed, [target] if target else None) if result.returncode == 0 else needed
    if still:
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise SetupError(f"offline install of {' '.join(still)} from {shown_as or wheelhouse} failed: {last}")
    return needed


# --- 3. the rendezvous, from SageMaker's resourceconfig.json -------------------------------------


def read_hosts(path: str) -> tuple[list[str], str]:
    """(hosts, current_host) of the job, hosts sorted: every host computes the same order."""
    try:
        config = json.loads(Path(path).read_text())
        hosts, current = sorted(config["hosts"]), config["current_host"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SetupError(f"cannot read the hosts from {path}: {error}") from None
    if current not in hosts:
        raise SetupError(f"{path}: current_host {current!r} is not one of the hosts {hosts}")
    return hosts, current


# Why name the interface rather than fix the hostname as AWS's image does:
# - gloo binds to the address its hostname resolves to and, when that fails, to 127.0.0.1, which
#   no other host can reach ("Gloo connectFullMesh failed ... 127.0.0.1"); GLOO_SOCKET_IFNAME makes
#   it bind to that interface's address with no name lookup (pytorch/pytorch,
#   torch/csrc/distributed/c10d/ProcessGroupGloo.cpp: createDefaultDevice, createDeviceForInterface).
#   A SageMaker container's hostname is not algo-N and does not resolve.
# - The DLC's fix compiles changehostname.c with gcc at start and LD_PRELOADs it into every process
#   so that gethostname() says algo-N (aws/deep-learning-containers,
#   scripts/pytorch/start_with_right_hostname.sh and docker/pytorch/training/common/changehostname.c),
#   but only when the command is the toolkit's `train`, which our ContainerEntrypoint replaces; it
#   needs a compiler in the image and still relies on algo-N resolving to a local address.
# - AWS's own launchers name the interface from resourceconfig.json's network_interface_name:
#   NCCL_SOCKET_IFNAME in aws/sagemaker-training-toolkit src/sagemaker_training/torch_distributed.py
#   (`_setup`) and mpi.py, and in aws/sagemaker-python-sdk
#   src/sagemaker/modules/train/container_drivers/distributed_drivers/torchrun_driver.py (`setup_env`).
#   They overwrite it; we keep what the job's environment sets.
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# Linux interface names are at most 15 bytes. Commas (gloo's and NCCL's list separator) and NCCL's
# `^`/`=` prefixes would change what the variables mean, so a name is letters, digits, `.`, `-`, `_`.
_INTERFACE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,14}")


def read_interface(path: str) -> str | None:
    """resourceconfig.json's network_interface_name, checked against this container's interfaces;
    None when the file has no such key."""
    try:
        config = json.loads(Path(path).read_text())
        name = config.get("network_interface_name") if isinstance(config, dict) else None
    except (OSError, ValueError) as error:
        raise SetupError(f"cannot read the hosts from {path}: {error}") from None
    if name is None:
        return None
    if not isinstance(name, str) or not _INTERFACE_NAME.fullmatch(name):
        raise SetupError(
            f"{path}: network_interface_name {name!r} is not an interface name "
            "(1 to 15 letters, digits, '.', '-' or '_')"
        )
    interfaces = sorted(interface for _, interface in socket.if_nameindex())
    if name not in interfaces:
        raise SetupError(
            f"{path}: network_interface_name {name!r} is not an interface of this container "
            f"(it has {', '.join(interfaces) or 'none'}); gloo and NCCL could not reach the other hosts"
        )
    return name


def socket_environment(interface: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME = `interface`, each unless `environ` sets it."""
    if interface is None:
        return {}
    return {name: interface for name in SOCKET_IFNAME_VARIABLES if name not in environ}


# Why a c10d rendezvous, told who hosts it and what each host is called:
# - A static rendezvous (--node-rank, --master-addr: AWS's toolkit, torch_distributed.py) cannot
#   restart: its num_nodes_waiting() is always 0 (torch/distributed/elastic/rendezvous/
#   static_tcp_rendezvous.py), so when one host's agent restarts its workers the other hosts'
#   agents never learn of it (torch/distributed/elastic/agent/server/api.py, _invoke_run) and keep
#   a stopped worker, or wait for a peer that is gone. A c10d agent that sees a host waiting to
#   join restarts its own workers too, so --max-restarts resumes a stalled job on every host.
# - c10d decides who serves the store by matching the endpoint against the hostname, which on
#   SageMaker is not algo-N and resolves to nothing (_matches_machine_hostname in torch's
#   rendezvous/utils.py): nobody would serve it. is_host says it instead (c10d_rendezvous_backend.py,
#   _create_tcp_store).
# - Each host is named by its node description's address, getfqdn() unless --local-addr is given
#   (dynamic_rendezvous.py, _NodeDescGenerator.generate); rank 0's becomes the workers'
#   MASTER_ADDR (RendezvousStoreInfo.build), so it must be algo-N, which every host resolves.
#   Node ranks follow the sorted descriptions (_mark_rendezvous_complete): the sorted hosts' order.
def rendezvous_args(hosts: list[str], current: str, run_id: str) -> list[str]:
    if len(hosts) == 1:
        return ["--standalone"]
    return [
        f"--nnodes={len(hosts)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={hosts[0]}:{MASTER_PORT}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf=is_host={int(current == hosts[0])}",
        f"--local-addr={current}",
    ]


RENDEZVOUS_OPTIONS = frozenset(
    ("--nnodes", "--standalone", "--node-rank", "--master-addr", "--master-port", "--local-addr")
    + ("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf")
)


def torchrun_argv(argv: list[str], rendezvous: list[str]) -> list[str]:
    """The job's `torchrun ...` argv with the rendezvous and the shutdown timeout added."""
    if not argv or Path(argv[0]).name != "torchrun":
        raise SetupError(f"expected a torchrun command after bootstrap.py, got {' '.join(argv) or 'nothing'}")
    taken = [a for a in argv[1:] if a.split("=")[0].replace("_", "-") in RENDEZVOUS_OPTIONS]
    if taken:
        raise SetupError(f"the rendezvous is the bootstrap's to choose; remove {' '.join(taken)} from the command")
    return [argv[0], *rendezvous, *with_shutdown_timeout(argv[1:])]


def with_shutdown_timeout(options: list[str]) -> list[str]:
    """torchrun's options with a --shutdown-timeout: the command's own, else SHUTDOWN_TIMEOUT_S.
    torchrun's default is 30 s before it SIGKILLs the workers (torch/distributed/run.py,
    `--shutdown-timeout`; TORCH_ELASTIC_SHUTDOWN_TIMEOUT), too short for a large final save."""
    if any(a.split("=")[0] in ("--shutdown-timeout", "--shutdown_timeout") for a in options):
        return options
    return [f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}", *options]


# --- 4. torchrun, with signals passed on ----------------------------------------------------------


class Torchrun:
    """torchrun in its own session: its stderr is relayed (and its tail kept), signals forwarded once."""

    def __init__(self, argv: list[str], error_file: str, environment: Mapping[str, str]):
        env = {**os.environ, **environment, "TORCHELASTIC_ERROR_FILE": error_file}
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.signalled: int | None = None
        self.process: subprocess.Popen | None = None
        self._forwarded = False
        # The handlers come first: a SIGTERM that found the default action once torchrun had
        # started would end this script alone and leave torchrun, in a session of its own, running
        # with nobody to pass it on.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.forward)
        # Its own session: a signal to this script's process group reaches torchrun only through
        # `forward`, once (a second SIGTERM while torchrun waits for its workers would cut that
        # wait short).
        self.process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, start_new_session=True)
        if self.signalled is not None and not self._forwarded:  # it came while torchrun started
            self._send(self.signalled)
        self._relay = threading.Thread(target=self._relay_stderr, daemon=True)
        self._relay.start()

    def _relay_stderr(self) -> None:
        out = sys.stderr.buffer
        for line in self.process.stderr:
            out.write(line)
            out.flush()
            self.tail.append(line.decode(errors="replace").rstrip("\n"))

    def forward(self, signum: int, _frame=None) -> None:
        """The first SIGTERM or SIGINT, passed on to torchrun (once it has started)."""
        if self.signalled is not None or (self.process is not None and self.process.poll() is not None):
            return
        self.signalled = signum
        print(f"bootstrap: got {signal.Signals(signum).name}; passing it to torchrun", file=sys.stderr, flush=True)
        if self.process is not None:
            self._send(signum)

    def _send(self, signum: int) -> None:
        self._forwarded = True
        assert self.process is not None
        self.process.send_signal(signum)

    def wait(self) -> int:
        assert self.process is not None
        code = self.process.wait()
        self._relay.join(timeout=10)
        return code


# --- 5. the root cause ------------------------------------------------------------------------


def root_cause(error_file: str, tail: list[str]) -> tuple[str, int | None]:
    """(a few lines naming the first failing rank's error, that rank's exit code if known).

    The first failing rank is the one that raised first (launcher.contract.failure, from the error
    files torchrun's report lists); torchrun's own root cause, copied to TORCHELASTIC_ERROR_FILE,
    is the fallback. A rank that left no error file (killed, or exited without raising) is named
    with its exit code and the workers' last error lines."""
    failure = first_failure(tail, fallback_error_file=error_file)
    where = "a worker"
    if failure is not None and failure.rank is not None:
        where = f"rank {failure.rank}" + (f" on {failure.host}" if failure.host else "")
    code = _exit_status(failure.exitcode) if failure is not None and failure.exitcode is not None else None
    if failure is not None and failure.message and failure.exitcode is not None and failure.exitcode < 0:
        code = _own_exit_status(tail) or code
    if failure is not None and failure.message:
        frames = [line for line in failure.stack.strip().splitlines() if line.strip()][-5:-1]
        return "\n".join([f"{where} failed: {failure.message}", *frames]), code or 1
    cut = next((i for i, line in enumerate(tail) if ROOT_CAUSE in line), len(tail))
    # Exception lines and `error: ...` lines of the workers; torchrun's own ChildFailedError is no cause.
    errors = [
        line
        for line in tail[:cut]
        if re.search(r"\b\w*(Error|Exception)\b.*:|^error:", line) and "ChildFailedError" not in line
    ]
    lines = list(dict.fromkeys(errors))[-3:] or [line for line in tail[:cut] if line.strip()][-3:]
    return "\n".join([f"{where} failed (exit code {code if code is not None else 'unknown'}):", *lines]), code


def _own_exit_status(tail: list[str]) -> int | None:
    """The exit status of the first rank that raised and then exited by itself.

    Ranks that fail together (a bad config) raise within milliseconds of each other; torchrun
    then stops the others with SIGTERM, so the rank that raised first may be one torchrun killed on
    its way out (-15). Its exception is still the cause; the job's exit status is the one a rank
    chose itself (train.py's 2 for a bad config), not the signal of torchrun's teardown."""
    raised = sorted((f for f in reported_failures(tail) if f.raised_at is not None), key=lambda f: f.raised_at)
    return next((f.exitcode for f in raised if f.exitcode is not None and f.exitcode > 0), None)


def _exit_status(code: int) -> int:
    """A shell-style exit status: a worker killed by signal N (torchrun reports -N) becomes 128 + N."""
    return 128 - code if code < 0 else code


def write_failure(path: str, text: str) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text[:MAX_FAILURE_CHARS])
    except OSError as error:
        print(f"bootstrap: cannot write {path}: {error}", file=sys.stderr)


def _wheel_pieces(wheelhouse: Path) -> dict[str, dict[int | None, Path]]:
    """The wheelhouse's wheels by file name: {None: the whole file} or {0: part 0, 1: part 1, ...}.
    Names starting with `..` are skipped: the kubelet's atomic writer keeps a ConfigMap volume's
    files under `..data` and a timestamped `..<date>` directory and shows each key as a symlink
    into them (kubernetes/kubernetes pkg/volume/util/atomic_writer.go)."""
    pieces: dict[str, dict[int | None, Path]] = {}
    try:
        entries = sorted(wheelhouse.iterdir())
    except OSError as error:
        raise SetupError(f"cannot list the wheelhouse {wheelhouse}: {error}") from None
    for entry in entries:
        part = PART.match(entry.name)
        if entry.name.startswith(".."):
            continue
        if part:
            pieces.setdefault(part["file"], {})[int(part["index"])] = entry
        elif entry.name.endswith(".whl"):
            pieces.setdefault(entry.name, {})[None] = entry
    return pieces


def _join(file: str, parts: dict[int | None, Path], wheelhouse: Path, destination: Path) -> str:
    """Write `file` whole into `destination` (its parts in order); its sha256."""
    if None in parts and len(parts) > 1:
        raise SetupError(f"the wheelhouse {wheelhouse} has {file} both whole and in parts; it is damaged")
    order = [None] if None in parts else list(range(len(parts)))
    if set(order) != set(parts):
        have = ", ".join(str(i) for i in sorted(i for i in parts if i is not None))
        raise SetupError(f"the wheelhouse {wheelhouse} has parts {have} of {file}, not 0 to {len(parts) - 1}")
    digest = hashlib.sha256()
    with open(destination / file, "wb") as out:
        for index in order:
            with open(parts[index], "rb") as part:
                for block in iter(lambda: part.read(1 << 20), b""):  # a huge stray file never fills memory
                    digest.update(block)
                    out.write(block)
    return digest.hexdigest()


def checked_wheelhouse(wheelhouse: str | None, pinned: set[str], destination: Path) -> Path:
    """`destination` holding every wheel of `wheelhouse` whole, each with one of the `pinned`
    sha256 digests. A channel, a bind, a shared directory or a ConfigMap may hold other bytes
    than the launcher sent (a damaged copy, another job's files), so a wheel is trusted only by
    its content, and pip reads only the checked copies."""
    if not wheelhouse or not Path(wheelhouse).is_dir():
        raise SetupError(f"the wheelhouse {wheelhouse!r} is not a directory")
    found = set()
    for file, parts in _wheel_pieces(Path(wheelhouse)).items():
        try:
            digest = _join(file, parts, Path(wheelhouse), destination)
        except OSError as error:  # an unreadable part, a full /tmp
            raise SetupError(f"cannot copy {file} from the wheelhouse {wheelhouse} to {destination}: {error}") from None
        if digest not in pinned:
            raise SetupError(
                f"{file} in the wheelhouse {wheelhouse} has sha256 {digest}, which the job does not pin "
                f"({ENV_WHEEL_SHA256}); the wheelhouse is damaged or not this job's"
            )
        found.add(digest)
    if pinned - found:
        raise SetupError(
            f"the wheelhouse {wheelhouse} has no wheel with sha256 {' '.join(sorted(pinned - found))} "
            "of the job's pins; it is incomplete"
        )
    return destination


def install_wheels(environment: dict[str, str]) -> None:
    """Install the job's missing pins offline into a new directory of this process's own, and
    put it first on `environment`'s PYTHONPATH (torchrun's, so the workers import from it).

    Not into the image's environment: it may be read-only (a bound or read-only root file
    system), and on Slurm several nodes may share one environment (slurm.venv) and install at once."""
    requirements = os.environ.get(ENV_REQUIREMENTS, "").split()
    needed = missing(requirements)
    if not needed:
        return
    pinned = set(os.environ.get(ENV_WHEEL_SHA256, "").split())
    if not pinned:
        raise SetupError(f"the job needs {' '.join(needed)} but names no sha256 for its wheels ({ENV_WHEEL_SHA256})")
    try:
        target = tempfile.mkdtemp(prefix="launcher-wheels-")
        checked = Path(tempfile.mkdtemp(prefix="launcher-wheelhouse-"))
    except OSError as error:
        raise SetupError(f"cannot make a directory for the job's wheels in {tempfile.gettempdir()}: {error}") from None
    try:
        wheelhouse = checked_wheelhouse(os.environ.get(ENV_WHEELHOUSE), pinned, checked)
        installed = install_offline(requirements, str(wheelhouse), target, shown_as=os.environ.get(ENV_WHEELHOUSE))
    except SetupError:
        shutil.rmtree(target, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(checked, ignore_errors=True)
    print(f"bootstrap: installed {' '.join(installed)} offline into {target}", file=sys.stderr, flush=True)
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (target, environment.get("PYTHONPATH")) if p)


def run(argv: list[str]) -> int:
    check_torch()
    environment: dict[str, str] = dict(os.environ)
    install_wheels(environment)
    resource_config = os.environ.get(ENV_RESOURCE_CONFIG, RESOURCE_CONFIG)
    hosts, current = read_hosts(resource_config)
    run_id = os.environ.get("TRAINING_JOB_NAME") or "launcher"  # the same on every host of the job
    command = torchrun_argv(argv, rendezvous_args(hosts, current, run_id))
    sockets = socket_environment(read_interface(resource_config), os.environ)
    environment.update(sockets)
    print(f"bootstrap: {current} is node {hosts.index(current)} of {len(hosts)}: {' '.join(command)}", flush=True)
    if sockets:
        chosen = " ".join(f"{name}={value}" for name, value in sockets.items())
        print(f"bootstrap: {chosen} (network_interface_name in {resource_config})", flush=True)
    with tempfile.TemporaryDirectory(prefix="launcher-bootstrap-") as scratch:
        error_file = os.path.join(scratch, "error.json")
        torchrun = Torchrun(command, error_file, environment)
        code = torchrun.wait()
        if code == 0:
            return 0
        failure_file = os.environ.get(ENV_FAILURE_FILE, FAILURE_FILE)
        if torchrun.signalled is not None:
            name = signal.Signals(torchrun.signalled).name
            write_failure(failure_file, f"stopped by {name} (a stop request or a spot interruption) on {current}")
            return 128 + torchrun.signalled
        text, worker_code = root_cause(error_file, list(torchrun.tail))
        write_failure(failure_file, text)
        return worker_code or code


def exec_torchrun(argv: list[str]) -> None:
    """`--exec`: check the image, install the missing pins into a directory of this process's
    own, then replace this process with the command (its rendezvous as the engine gave it)."""
    if not argv or Path(argv[0]).name != "torchrun":
        raise SetupError(f"expected a torchrun command after bootstrap.py {EXEC}, got {' '.join(argv) or 'nothing'}")
    check_torch()
    environment = dict(os.environ)
    install_wheels(environment)
    command = [argv[0], *with_shutdown_timeout(argv[1:])]
    sys.stdout.flush()
    try:
        os.execvpe(command[0], command, environment)
    except OSError as error:
        raise SetupError(
            f"cannot run {command[0]}: {error.strerror}; the image needs torch's torchrun on PATH"
        ) from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [EXEC]:
        try:
            exec_torchrun(argv[1:])
        except SetupError as error:
            print(f"bootstrap: {error}", file=sys.stderr, flush=True)
            return EXIT_SETUP
    try:
        return run(argv)
    except SetupError as error:
        print(f"bootstrap: {error}", file=sys.stderr, flush=True)
        write_failure(os.environ.get(ENV_FAILURE_FILE, FAILURE_FILE), str(error))
        return EXIT_SETUP


if __name__ == "__main__":
    sys.exit(main())
