"""Process-group lifecycle: one place that starts and ends torch.distributed.

    with process_group("cpu") as env:      # gloo; "cuda" -> nccl, one GPU per local rank
        env.rank, env.world_size, env.device

Under torchrun the group is created on the agent's store with a prefix per start of the worker
group (`attempt`): a restarted group otherwise meets the dead one's keys and fails to connect
in about half the runs. Run as a plain script (no RANK in the
environment) it is a one-process group. On a clean exit every rank passes a barrier before
`destroy_process_group`; without it 4-rank gloo runs aborted at exit about half the time.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from launcher.contract.config import DEFAULT_COLLECTIVE_TIMEOUT_S
from launcher.contract.fp8 import collective_backend

STORE_TIMEOUT = timedelta(minutes=30)
"""How long the store waits for every worker to join (rendezvous, not a collective)."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


_attempt: str | None = None


def attempt() -> str:
    """This start of the worker group, the same on every rank: the prefix of its keys in the
    agent's store (the process group's here, the watchdog's). "0" before `process_group`."""
    return _attempt or "0"


def _count_start(store: dist.Store, rank: int) -> str:
    """How many times this rank has started in the job, counted in the store that outlives it.

    Not TORCHELASTIC_RESTART_COUNT, which torchrun's agent counts for its own host: after one
    host's workers fail, its agent rejoins the c10d rendezvous and the other hosts' agents
    restart their workers as a membership change their count leaves out
    (torch/distributed/elastic/agent/server/api.py, _invoke_run), so the counts differ across
    hosts, while the agent's shared store and the keys the last start wrote in it remain
    (dynamic_rendezvous.py keeps its shared TCPStore server for the job). Every restart restarts
    every rank, so each rank's own count is the same on all of them, unless a rank died before it
    reached this count: from then on it counts one behind its peers, each later start fails at the
    store's timeout, and the job fails once its restarts are spent (an import error before the
    process group, the usual such death, would fail every start anyway)."""
    return str(store.add(f"launcher/starts/rank_{rank}", 1))


def _store(rank: int, world_size: int) -> dist.Store:
    global _attempt
    if "MASTER_ADDR" not in os.environ:
        return dist.HashStore()
    # torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT; other launchers
    # that only set the variables need rank 0 to host it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=None if agent_store else world_size,
        is_master=not agent_store and rank == 0,
        timeout=STORE_TIMEOUT,
        wait_for_workers=not agent_store,
    )
    _attempt = _count_start(store, rank)
    return dist.PrefixStore(f"attempt_{_attempt}", store)


@contextlib.contextmanager
def process_group(device_type: str, collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
    """Initialise the default process group for `device_type` ("cpu" or "cuda"), whose collectives
    fail after `collective_timeout_s` (runtime.collective_timeout_s: the launcher's multiple of the
    predicted step, not torch's 10 or 30 minutes)."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = collective_backend(device_type)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    options = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(
        backend,
        store=_store(rank, world_size),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout_s),
        **options,
    )
    clean = False
    try:
        yield DistEnv(rank, world_size, local_rank, device, backend)
        clean = True
    finally:
        if clean:
            dist.barrier()
        dist.destroy_process_group()
