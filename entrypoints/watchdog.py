"""The watchdog: a thread on every rank that notices a stalled job and names the stuck ranks.

    watchdog = Watchdog.start(cfg.training.watchdog, rank=r, world_size=n, stacks_dir=out / "stacks",
                              first_step_limit_s=cfg.runtime.collective_timeout_s)
    watchdog.step_began(); ...; watchdog.step_done(step, step_time_s)   # the main loop (no I/O: numbers)
    with watchdog.paused(): checkpoints.save(step)   # saves and evaluations do not count as stalls
    watchdog.straggler(step, device)                 # one all_gather every straggler_every steps

**Stall.** When no step completes within max(stall_factor x the running median step time,
min_stall_s) of the rank's own time (time its training thread waited for a CPU, or the process
did not run, does not count: a loaded machine makes a rank slow, not stalled; a thread that only
sleeps measures the latter by how late it wakes), the rank dumps its Python stacks with
faulthandler to <stacks_dir>/rank-<r>.txt, records the failure in torchrun's error file
(entrypoints/failure.py, so the launcher and the SageMaker bootstrap name it) and exits with
EXIT_STALLED, and the restart (torchrun --max-restarts, or the engine's rerun of a failed job:
Slurm's requeue) resumes from the newest checkpoint. Before the first step, and during a
save or an evaluation, the limit is `first_step_limit_s` (the collective timeout, which covers a
compile and a model load).

**Which rank is stuck.** A stuck rank cannot say so (a SIGSTOPped process runs no thread), and
the others are blocked in a collective that waits for it, so no collective can carry the news.
Every watchdog thread instead writes a heartbeat (its rank's last step, host and pid, and a
counter) every HEARTBEAT_S to the rendezvous store torchrun's agent serves, through a client of
its own: the store is outside the process group, reachable from every host, and alive while
any worker is stopped. A rank whose heartbeat has not changed for STALE_S is stuck (its whole
process stopped, or the interpreter is wedged); where none is stale, the ranks whose step is
behind; where every rank is at the same step, every rank waits (a collective that never
completes). A report waits (at most STALE_S past the limit) while any heartbeat is neither
fresh nor stale (`_stuck_known`).

**A peer stopped during a save.** Every rank holds a save (or an evaluation) to the long limit,
but rank 0 also reads the heartbeats while it saves, and fires once a peer's heartbeat has been
unchanged for the step's limit (STALE_S at least): a rank stopped just before the save's collectives would
otherwise hold every other rank in them until the collective timeout (a CI run of the Slurm
test, 2026-12-04). Rank 0 alone, so a save costs the store world_size reads a second while it lasts; a
stopped rank 0 is still caught by the collective timeout. Only a peer whose last heartbeat
names rank 0's step (or the one before) counts: one whose store client failed long before (it
warns once) stops writing heartbeats, and must not fail a healthy save. And a rank that ends its
training writes a last heartbeat saying it closed: the others leave the last save's collectives
before rank 0 has finished that save, and exit.

The first rank to fire posts its report under `fired`; every other watchdog sees
it within HEARTBEAT_S, dumps its own stacks and fails with the same report, and no rank exits
before every live rank has dumped (or DUMP_WAIT_S passed): the first to exit ends its peers'
collectives, and a peer whose collective fails would exit before its dump.

**Straggler.** A rank's compute time for a step is the CPU time its training thread used plus
the time the process did not run at all (a thread that only sleeps measures how late its
wake-ups are: a stopped, starved or swapping host); a wait for a peer counts in neither, so the
slow rank stands out even though every rank's step lasts as long as the slowest's. Every straggler_every steps each rank
contributes its mean over those steps (one float, all_gather), and rank 0 prints
`straggler step=N rank=R host=H ...` when the slowest is more than straggler_margin above the
median. On a GPU the CPU time includes waits on the device (the CUDA sync spins), so there the
measure finds slow hosts and stopped processes rather than slow GPUs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from entrypoints import failure
from entrypoints.parallel import process_group
from launcher.contract.config import WatchdogConfig

EXIT_STALLED = 5
TICK_S = 0.1
"""How often the thread wakes: the resolution of the not-running time and of the stall clock."""
HEARTBEAT_S = 1.0
STALE_S = 10.0
"""A heartbeat unchanged for this long belongs to a process that does not run."""
OBSERVE_S = STALE_S + 2 * HEARTBEAT_S
HOSTS_EVERY = 30
"""Rank 0 reads every rank's host from the heartbeats every this many beats."""
DUMP_WAIT_S = 10.0
STORE_TIMEOUT_S = 10.0
MEDIAN_WINDOW = 100


class WatchdogStall(Exception):
    """No step completed within the watchdog's limit (the message names the stuck ranks)."""


class _StepClock:
    """When the last step completed, the recent step times, and whether a save or evaluation runs."""

    def __init__(self):
        self.lock = threading.Lock()
        self.progress_at = time.monotonic()
        self.paused_at: float | None = None
        self.step = 0
        self.step_times: deque[float] = deque(maxlen=MEDIAN_WINDOW)

    def mark(self) -> float:
        """When the clock last started: the last step's end, or the start of a save."""
        return self.paused_at if self.paused_at is not None else self.progress_at


def runqueue_wait_s(thread_id: int) -> float:
    """Seconds the thread waited for a CPU while runnable (/proc/self/task/TID/schedstat, its
    second field, in ns; 0 where the kernel does not keep it)."""
    try:
        fields = Path(f"/proc/self/task/{thread_id}/schedstat").read_text().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Watchdog:
    def __init__(self, cfg: WatchdogConfig, *, rank: int, world_size: int, stacks_dir: Path, first_step_limit_s: float):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.stacks_dir = stacks_dir
        self.first_step_limit_s = max(first_step_limit_s, cfg.min_stall_s)
        self.clock = _StepClock()
        self.host = socket.gethostname()
        self.not_running_s = 0.0
        self._step_started: tuple[float, float] | None = None  # (training thread CPU time, not-running time)
        self._window_compute_s, self._window_steps = 0.0, 0
        self.named_straggler: tuple[int, float] | None = None
        """Rank 0's latest comparison, when it named a straggler: (rank, share above the median)."""
        self._stop = threading.Event()
        self._store = None
        self._beats: dict[int, tuple[str, float]] = {}  # rank -> (heartbeat text, when it last changed)
        self._hosts: dict[int, str] = {}  # rank -> its host, as its heartbeat says (checked, at most 255 characters)
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._clock_thread = threading.Thread(target=self._measure_not_running, name="watchdog-clock", daemon=True)
        self._training_thread = threading.get_native_id()

    @classmethod
    def start(cls, cfg: WatchdogConfig, **kwargs) -> Watchdog:
        """A started watchdog; with training.watchdog.enabled false one that watches nothing."""
        watchdog = cls(cfg, **kwargs)
        if cfg.enabled:
            watchdog._store = _store_client()
            watchdog._clock_thread.start()
            watchdog._thread.start()
        return watchdog

    # --- the main loop's side: numbers only, no I/O -------------------------------------------

    def step_began(self) -> None:
        self._step_started = self.compute_s()

    def step_done(self, step: int, step_time_s: float) -> None:
        if self._step_started is not None:
            now, began = self.compute_s(), self._step_started
            self._window_compute_s += now[0] - began[0] + now[1] - began[1]
            self._window_steps += 1
        with self.clock.lock:
            self.clock.progress_at = time.monotonic()
            self.clock.step = step
            self.clock.step_times.append(step_time_s)

    @contextlib.contextmanager
    def paused(self):
        """A save or an evaluation: slow, and not a step; it is held to the long limit only."""
        with self.clock.lock:
            self.clock.paused_at = time.monotonic()
        try:
            yield
        finally:
            with self.clock.lock:
                self.clock.progress_at += time.monotonic() - self.clock.paused_at
                self.clock.paused_at = None

    def limit_s(self) -> float:
        clock = self.clock
        if clock.paused_at is not None or not clock.step_times:
            return self.first_step_limit_s
        return self.step_limit_s()

    def step_limit_s(self) -> float:
        """max(stall_factor x the running median step, min_stall_s); the first step's limit before one."""
        if not self.clock.step_times:
            return self.first_step_limit_s
        return max(self.cfg.stall_factor * statistics.median(self.clock.step_times), self.cfg.min_stall_s)

    def watches_peers_in_pause(self) -> bool:
        """Whether this rank, in a save or an evaluation, names a peer that does not run at the
        step's limit rather than the long one: rank 0 alone (a save then costs the store
        world_size reads a second, not world_size squared), once a step has completed."""
        clock = self.clock
        return self.rank == 0 and self.world_size > 1 and clock.paused_at is not None and bool(clock.step_times)

    def close(self) -> None:
        """Stop the thread, and leave a last heartbeat that says this rank closed: a rank that ends
        its training (the last save's collectives behind it) and exits is not a stopped one, to
        rank 0 still finishing its own save."""
        self._stop.set()
        for thread in (self._thread, self._clock_thread):
            if thread.is_alive():
                thread.join(timeout=2 * TICK_S + 1)
        if self._store is not None and not self._thread.is_alive():
            text = json.dumps({"step": self.clock.step, "host": self.host, "pid": os.getpid(), "closed": True})
            with contextlib.suppress(Exception):
                self._store.set(f"beat/{self.rank}", text)

    # --- stragglers ---------------------------------------------------------------------------

    def compute_s(self) -> tuple[float, float]:
        """(CPU seconds of the calling thread, seconds the process did not run): their sum grows
        only while the training thread computes or the process is held. The training thread's
        own CPU time, not the process's: with the process's, the tiny CPU job saving every 2
        steps (asynchronous saves, in threads of their own) named false stragglers at +57% and
        +96%. On a CPU the matmuls run on it (torchrun sets OMP_NUM_THREADS=1 for several
        processes a node)."""
        return time.thread_time(), self.not_running_s

    def straggler(self, step: int, device: torch.device) -> str | None:
        """Every straggler_every steps: gather each rank's mean compute time per step since the
        last gather; rank 0 prints and returns the straggler line (None elsewhere, or when none).
        Every rank calls it after every step (the collective runs at the same steps everywhere)."""
        every = self.cfg.straggler_every
        if not self.cfg.enabled or not every or step % every or not self._window_steps:
            return None
        spent = self._window_compute_s / self._window_steps
        self._window_compute_s, self._window_steps = 0.0, 0
        gathered = [torch.zeros(1, device=device) for _ in range(self.world_size)]
        dist.all_gather(gathered, torch.tensor([spent], device=device))
        times = [t.item() for t in gathered]
        return self._straggler_line(step, times) if self.rank == 0 else None

    def _straggler_line(self, step: int, times: list[float]) -> str | None:
        median = statistics.median(times)
        slowest = max(range(len(times)), key=times.__getitem__)
        if median <= 0 or times[slowest] <= median * (1 + self.cfg.straggler_margin):
            self.named_straggler = None
            return None
        self.named_straggler = (slowest, times[slowest] / median - 1)
        host = self._host(slowest)
        line = (
            f"straggler step={step} rank={slowest} host={host} compute_s={times[slowest]:.3f} "
            f"median_s={median:.3f} above_median={times[slowest] / median - 1:.0%}"
        )
        print(line, flush=True)
        return line

    # --- the thread ---------------------------------------------------------------------------

    def _held_s(self) -> float:
        """Seconds this process could not work: the training thread waiting for a CPU (a
        machine loaded past its cores), or the whole process not running (stopped)."""
        return runqueue_wait_s(self._training_thread) + self.not_running_s

    def _measure_not_running(self) -> None:
        """`not_running_s`: how late this thread's wake-ups are, which only a stopped, starved or
        swapping process makes late. A thread of its own that does nothing else: the watchdog
        thread's store calls wait on the agent's host, and counted there, a slow store (its host
        loaded) read as a process that did not run, and the stall clock stood still."""
        last_tick = time.monotonic()
        while not self._stop.wait(TICK_S):
            now = time.monotonic()
            self.not_running_s += max(0.0, now - last_tick - TICK_S)
            last_tick = now

    def _run(self) -> None:
        last_beat = time.monotonic()
        beat = 0
        # A heartbeat at once: a rank stopped in its first second is still named with its host.
        self._write_heartbeat(beat, read_others=False)
        mark, held_at_mark = None, 0.0
        while not self._stop.wait(TICK_S):
            now = time.monotonic()
            with self.clock.lock:
                limit, started = self.limit_s(), self.clock.mark()
                step_limit, in_pause = self.step_limit_s(), self.watches_peers_in_pause()
            if started != mark:
                mark, held_at_mark = started, self._held_s()
            # A starved or stopped rank is slow, not stalled: time it could not run does not count
            # (a machine loaded past its cores, such as CI's background launches at nice 10).
            idle = now - mark - (self._held_s() - held_at_mark)
            if now - last_beat >= HEARTBEAT_S:
                beat += 1
                last_beat = now
                # The others' heartbeats are read only from OBSERVE_S before the limit: long enough
                # to see which have gone stale, and no store traffic of world_size reads per rank
                # per second while the job is healthy.
                # Rank 0 also reads them now and then for the hosts its straggler line names.
                hosts_due = self.rank == 0 and beat % HOSTS_EVERY == 2
                observing = idle > limit - OBSERVE_S or in_pause
                self._write_heartbeat(beat, read_others=observing or hosts_due)
                fired = self._fired_report()
                if fired is not None:
                    self._fire(fired, first=False)
            if idle > limit and self._stuck_known(idle - limit):
                self._fire(self._report(idle, limit), first=True)
            elif in_pause and idle > step_limit and self._stopped_at_this_step(step_limit):
                # A peer that does not run holds the save's collectives for good: waiting out the
                # long limit (the collective timeout, at least 600 s) would only delay the restart.
                self._fire(self._report(idle, step_limit, in_pause=True), first=True)

    def _report(self, idle: float, limit: float, *, in_pause: bool = False) -> dict:
        clock = self.clock
        if in_pause:
            rule = "a save or an evaluation waiting on a rank that does not run is held to the step's limit"
        elif clock.step_times and clock.paused_at is None:
            median = statistics.median(clock.step_times)
            rule = (
                f"max({self.cfg.stall_factor:g} x median step {median:.3g} s, min_stall_s {self.cfg.min_stall_s:g} s)"
            )
        else:
            rule = "the first step's or a save's limit, runtime.collective_timeout_s"
        stuck, why = self._stuck_ranks()
        named = ", ".join(f"rank {r} on {self._host(r)}" for r in stuck)
        message = (
            f"watchdog: no step completed for {idle:.0f} s after step {clock.step} on rank {self.rank} "
            f"(limit {limit:.0f} s: {rule}); stuck: {named or 'no rank'} ({why}); "
            f"Python stacks of the live ranks in {self.stacks_dir}"
        )
        return {"message": message, "stuck": stuck, "raised_at": time.time(), "by": self.rank}

    def _stuck_known(self, overdue: float) -> bool:
        """Whether the heartbeats can tell the stuck ranks yet. A rank stopped just after its last
        step still has a fresh heartbeat when a limit as short as STALE_S runs out (the tiny CPU
        job's min_stall_s is 10 s): its heartbeat goes stale only STALE_S after the stop. So the
        report waits, at most STALE_S past the limit, while any heartbeat is neither fresh (seen
        changing within 2 x HEARTBEAT_S: a live rank) nor stale."""
        if overdue >= STALE_S or self._store is None or self.world_size == 1:
            return True
        now = time.monotonic()
        ages = [now - self._beats[r][1] if r in self._beats else float("inf") for r in range(self.world_size)]
        return any(age > STALE_S for age in ages) or all(age <= 2 * HEARTBEAT_S for age in ages)

    def _stale_ranks(self, *, unseen_are_stale: bool = True, older_than: float = STALE_S) -> list[int]:
        """The ranks whose heartbeat has not changed for `older_than` while this rank read it:
        processes that do not run (one whose last heartbeat says it closed ended on its own). A rank not read
        yet counts as stale only with `unseen_are_stale` (the step's check reads from OBSERVE_S
        before its limit, so by then unseen means never written)."""
        if self._store is None:
            return []
        now = time.monotonic()
        missing = float("inf") if unseen_are_stale else 0.0
        ages = {r: now - self._beats[r][1] if r in self._beats else missing for r in range(self.world_size)}
        return [r for r, age in ages.items() if age > older_than and self._heartbeat(r).get("closed") is not True]

    def _stopped_at_this_step(self, step_limit_s: float) -> list[int]:
        """During a save: the peers whose heartbeat has not changed for the step's limit (STALE_S
        at least; a peer thread held off the GIL for a few seconds in its own save must not fail
        the job) and whose last one names this rank's step or the one before (written at most
        HEARTBEAT_S after it), so stopped since the step before the save. A peer whose heartbeats
        ended long before (its store client failed: it warned) is left to the long limit."""
        step, older_than = self.clock.step, max(STALE_S, step_limit_s)
        stale = self._stale_ranks(unseen_are_stale=False, older_than=older_than)
        return [r for r in stale if _whole(self._heartbeat(r).get("step")) >= step - 1]

    def _stuck_ranks(self) -> tuple[list[int], str]:
        """The ranks whose heartbeat is oldest: not updated for STALE_S, else the lowest step."""
        if self._store is None or self.world_size == 1:
            return ([self.rank], "this rank's own step") if self.world_size == 1 else ([], "no store to read")
        stale = self._stale_ranks()
        if stale:
            return stale, f"heartbeat older than {STALE_S:g} s: the process does not run"
        steps = {r: _whole(self._heartbeat(r).get("step")) for r in range(self.world_size)}
        behind = [r for r, s in steps.items() if s < max(steps.values())]
        if behind:
            return behind, "its last step is behind the others'"
        return [], f"every rank is alive at step {max(steps.values())}: a collective that never completes"

    def _fire(self, report: dict, *, first: bool) -> None:
        """Dump this rank's stacks, record the failure, wait for the live ranks' dumps, exit."""
        self._dump_stacks(report)
        store = self._store
        with contextlib.suppress(Exception):
            if store is not None:
                if first and not store.check(["fired"]):
                    store.set("fired", json.dumps(report))
                store.set(f"dumped/{self.rank}", "1")
        print(f"error: {report['message']}", file=sys.stderr, flush=True)
        try:  # raised, so the error file's call stack is this thread's
            raise WatchdogStall(report["message"])
        except WatchdogStall as stall:
            failure.HANDLER.record_exception(stall)
        if store is not None:  # every rank waits: one that exits ends its peers' collectives, and
            self._wait_for_dumps(report.get("stuck"))  # a peer whose collective fails exits before its dump
        sys.stdout.flush()
        os._exit(EXIT_STALLED)

    def _wait_for_dumps(self, stuck) -> None:
        stuck = stuck if isinstance(stuck, list) else []  # read back from the store
        ended = {r for r in range(self.world_size) if self._heartbeat(r).get("closed") is True}  # no dump to wait for
        live = [f"dumped/{r}" for r in range(self.world_size) if r not in stuck and r not in ended and r != self.rank]
        deadline = time.monotonic() + DUMP_WAIT_S
        with contextlib.suppress(Exception):
            while live and time.monotonic() < deadline and not self._store.check(live):
                time.sleep(TICK_S)

    def _dump_stacks(self, report: dict) -> None:
        try:
            self._write_stacks(report)
        except OSError as error:  # a full or read-only output: the job must still fail and restart
            print(f"warning: watchdog: cannot write the stacks to {self.stacks_dir}: {error}", file=sys.stderr)

    def _write_stacks(self, report: dict) -> None:
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        with open(self.stacks_dir / f"rank-{self.rank}.txt", "a") as f:
            f.write(f"# rank {self.rank} on {self.host} (pid {os.getpid()}), attempt {attempt}, at step ")
            f.write(f"{self.clock.step}, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
            f.write(f"# {report['message']}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)

    # --- the store ----------------------------------------------------------------------------

    def _write_heartbeat(self, beat: int, *, read_others: bool) -> None:
        if self._store is None:
            return
        text = json.dumps({"step": self.clock.step, "host": self.host, "pid": os.getpid(), "beat": beat})
        try:
            self._store.set(f"beat/{self.rank}", text)
            if read_others:
                self._read_heartbeats()
            else:
                self._beats.clear()  # a step completed: what was seen before says nothing now
        except Exception as error:  # a store that went away: the local stall check still runs
            print(f"warning: watchdog: the rendezvous store stopped answering ({error})", file=sys.stderr, flush=True)
            self._store = None

    def _read_heartbeats(self) -> None:
        """Every rank's heartbeat: two round trips to the store once all have written one (a
        check and a multi_get), one check and get per rank before (a get of a missing key waits)."""
        keys = [f"beat/{r}" for r in range(self.world_size)]
        now = time.monotonic()
        texts = self._all_heartbeats(keys) if self._store.check(keys) else None
        if texts is None:
            texts = [self._store.get(key).decode() if self._store.check([key]) else None for key in keys]
        for r, text in enumerate(texts):
            if text is None:
                continue
            if r not in self._beats or self._beats[r][0] != text:
                self._beats[r] = (text, now)
            host = self._heartbeat(r).get("host")
            if isinstance(host, str) and host.isprintable() and host:
                self._hosts[r] = host[:255]

    def _all_heartbeats(self, keys: list[str]) -> list[str] | None:
        """Every key in one multi_get (torch 2.13's TCPStore and PrefixStore have it); None where
        the store lacks it or refuses, and the caller gets each key instead."""
        multi_get = getattr(self._store, "multi_get", None)
        if multi_get is None:
            return None
        try:
            return [value.decode() for value in multi_get(keys)]
        except RuntimeError:  # c10d's errors, DistStoreError among them: the caller gets each key
            return None

    def _heartbeat(self, rank: int) -> dict:
        if rank == self.rank:
            return {"step": self.clock.step, "host": self.host, "pid": os.getpid()}
        try:
            data = json.loads(self._beats[rank][0])
        except (KeyError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _host(self, rank: int) -> str:
        """The host a rank's heartbeat names (read back from the store: checked, and kept short)."""
        return self.host if rank == self.rank else self._hosts.get(rank, "an unknown host")

    def _fired_report(self) -> dict | None:
        try:
            if self._store is None or not self._store.check(["fired"]):
                return None
            report = json.loads(self._store.get("fired").decode())
        except Exception:
            return None
        return report if isinstance(report, dict) and isinstance(report.get("message"), str) else None


DATA_WAIT_RECORDED = 0.2
"""A step's data wait enters its metrics record when it is at least this share of the step."""


def speed_causes(data_wait_s: float, step_time_s: float, straggler: tuple[int, float] | None) -> dict:
    """What may slow the job, for its metrics record (launcher.contract.metrics.SPEED_CAUSE_KEYS):
    the step's wait for its batch where it is DATA_WAIT_RECORDED of the step or more, and the
    straggler rank 0 last named; {} for a job that nothing slows (its lines stay as they were)."""
    causes: dict = {}
    if step_time_s > 0 and data_wait_s >= DATA_WAIT_RECORDED * step_time_s:
        causes["data_wait_s"] = data_wait_s
    if straggler is not None:
        causes.update(straggler_rank=straggler[0], straggler_above_median=straggler[1])
    return causes


def _whole(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _store_client():
    """A client of its own to the rendezvous store (None without one: a single process), under a
    prefix per start of the worker group, the process group's (entrypoints/parallel/process_group.py)."""
    if "MASTER_ADDR" not in os.environ:
        return None
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=STORE_TIMEOUT_S),
            wait_for_workers=False,
        )
    except Exception as error:
        print(f"warning: watchdog: no rendezvous store ({error}); stuck ranks go unnamed", file=sys.stderr, flush=True)
        return None
    return dist.PrefixStore(f"watchdog/attempt_{process_group.attempt()}", store)
