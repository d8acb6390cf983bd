"""S3 for the simulated hosts: moto's server, reached through the bridge of their private network.

    with S3Endpoint(net.switch, BRIDGE_ADDRESS, "http://127.0.0.1:PORT") as endpoint:
        endpoint.url                    # http://10.213.7.1:PORT2, what AWS_ENDPOINT_URL says in the hosts
        endpoint.bytes_to("10.213.7.12")  # what moto sent that host: its downloads, measured here

A SageMaker host reaches S3 through its VPC; a simulated host has no route out of its network
(netns.py). So a listening socket is made inside the namespace of the bridge that the test
itself created (a thread enters it with setns(2), binds, and returns), and each connection is
relayed to moto on this machine's loopback. Every byte moto answers is counted by the address
of the host that asked, which is how a test measures what each host downloads on resume.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections import defaultdict

CLONE_NEWNET = 0x40000000
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


def _enter(namespace_fd: int) -> None:
    if _LIBC.setns(namespace_fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET) failed")


def listen_in(namespace: str, address: str) -> socket.socket:
    """A listening TCP socket on `address` inside network namespace `namespace` (`ip netns` name)."""
    box: list = []

    def bind() -> None:  # in a thread of its own: setns changes only the calling thread
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
        try:
            _enter(target)
            try:
                box.append(socket.create_server((address, 0)))
            finally:
                _enter(own)
        except OSError as error:
            box.append(error)
        finally:
            os.close(own)
            os.close(target)

    thread = threading.Thread(target=bind)
    thread.start()
    thread.join()
    if isinstance(box[0], OSError):
        raise box[0]
    return box[0]


class S3Endpoint:
    def __init__(self, namespace: str, address: str, upstream_url: str):
        host, _, port = upstream_url.removeprefix("http://").partition(":")
        self._upstream = (host, int(port))
        self._server = listen_in(namespace, address)
        self.url = f"http://{address}:{self._server.getsockname()[1]}"
        self._sent: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> S3Endpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def bytes_to(self, address: str) -> int:
        with self._lock:
            return self._sent[address]

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, (peer, _) = self._server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self._upstream, timeout=30)
            threading.Thread(target=self._relay, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client, peer), daemon=True).start()

    def _relay(self, source: socket.socket, target: socket.socket, counted_for: str | None) -> None:
        try:
            while data := source.recv(1 << 16):
                target.sendall(data)
                if counted_for is not None:
                    with self._lock:
                        self._sent[counted_for] += len(data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._server.close()
