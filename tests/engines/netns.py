"""A private network of simulated hosts: one network namespace per host, joined by a bridge.

    with HostNetwork(["ip-10-213-7-11", "ip-10-213-7-12"], interface="ethwe") as net:
        net.hosts[0].namespace, net.hosts[0].address   # "smsim-1234-ab-h1", "10.213.7.11"

The bridge lives in a namespace of its own, so nothing is added to the machine's own network.
Each host sees only `lo` and its one interface (named `interface`) on 10.213.7.0/24 and has no
default route: nothing outside the simulated cluster can be reached from inside it (SageMaker's
network isolation). Every namespace is deleted on exit, and `sweep_stale()` removes what a killed
test run left behind.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from dataclasses import dataclass

SUBNET = "10.213.7"
PREFIX_LEN = 24
BRIDGE_ADDRESS = f"{SUBNET}.1"
"""The bridge's own address, in its namespace: where a service the test runs for the hosts
listens (s3endpoint.py), as a VPC endpoint would serve SageMaker's hosts."""
_NAME = re.compile(r"^smsim-(\d+)-[0-9a-f]+-(?:sw|h\d+)$")


def ip(*args: str, namespace: str | None = None) -> str:
    argv = ["ip", *(["-n", namespace] if namespace else []), *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result.stdout


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Delete simulation namespaces whose creating process is gone (a run killed mid-test)."""
    removed = []
    for name in namespaces():
        match = _NAME.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            ip("netns", "del", name)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class NetHost:
    hostname: str
    namespace: str
    address: str
    interface: str


class HostNetwork:
    """Namespaces for `hostnames`, in order: host k gets address 10.213.7.(10 + k) on `interface`."""

    def __init__(self, hostnames: list[str], *, interface: str = "eth0"):
        if not 0 < len(hostnames) < 200:
            raise ValueError(f"{len(hostnames)} hosts: the simulation supports 1 to 199")
        self.tag = f"smsim-{os.getpid()}-{secrets.token_hex(2)}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [
            NetHost(hostname=name, namespace=f"{self.tag}-h{k}", address=f"{SUBNET}.{10 + k}", interface=interface)
            for k, name in enumerate(hostnames, start=1)
        ]
        self._created: list[str] = []

    def __enter__(self) -> HostNetwork:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self._created.append(name)
        ip("link", "set", "lo", "up", namespace=name)

    def _build(self) -> None:
        self._add_namespace(self.switch)
        ip("link", "add", "br0", "type", "bridge", namespace=self.switch)
        ip("addr", "add", f"{BRIDGE_ADDRESS}/{PREFIX_LEN}", "dev", "br0", namespace=self.switch)
        ip("link", "set", "br0", "up", namespace=self.switch)
        for k, host in enumerate(self.hosts, start=1):
            self._add_namespace(host.namespace)
            # One end on the bridge, the other as the host's interface: created in place, so the
            # machine's own namespace never holds either end.
            port = f"v{k}"
            ip("link", "add", port, "type", "veth", "peer", "name", host.interface, "netns", host.namespace,
               namespace=self.switch)  # fmt: skip
            ip("link", "set", port, "master", "br0", namespace=self.switch)
            ip("link", "set", port, "up", namespace=self.switch)
            ip("addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", host.interface, namespace=host.namespace)
            ip("link", "set", host.interface, "up", namespace=host.namespace)

    def close(self) -> None:
        errors = []
        for name in reversed(self._created):
            try:
                ip("netns", "del", name)
            except RuntimeError as error:
                errors.append(str(error))
        self._created.clear()
        if errors:
            raise RuntimeError("; ".join(errors))

    def hosts_file(self, aliases: dict[str, str]) -> str:
        """/etc/hosts as every host sees it: localhost and `aliases` (name -> hostname), nothing else.

        A Kubernetes pod's own name is among its aliases (the kubelet writes it into /etc/hosts).
        SageMaker's DNS resolves algo-1..N to the instances; a container's own hostname (an
        EC2-style ip-* name, or `aws` as the DLC's changehostname.c says) is not among those names,
        so it does not resolve. PyTorch's gloo then binds to loopback unless GLOO_SOCKET_IFNAME
        names the interface (pytorch/pytorch, torch/csrc/distributed/c10d/ProcessGroupGloo.cpp,
        `createDefaultDevice`): mapping the own hostname here would hide that failure.
        """
        by_hostname = {h.hostname: h.address for h in self.hosts}
        lines = ["127.0.0.1 localhost"]
        lines += [f"{by_hostname[hostname]} {alias}" for alias, hostname in aliases.items()]
        return "\n".join(lines) + "\n"
