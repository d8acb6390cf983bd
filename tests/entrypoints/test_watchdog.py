"""training.watchdog (entrypoints/watchdog.py): the stall limit's rule, and one process whose
steps stop completing. The 4-process faults (a stopped rank, a slowed one) are in
tests/backends/test_local_e2e.py, on the README's job."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from entrypoints.watchdog import EXIT_STALLED, HEARTBEAT_S, TICK_S, Watchdog, speed_causes
from launcher.contract.config import ConfigError, WatchdogConfig
from launcher.errors import LauncherError
from launcher.recipe import Recipe

REPO = Path(__file__).resolve().parents[2]


def idle_watchdog(tmp_path: Path, cfg: WatchdogConfig, first_step_limit_s: float = 1800.0) -> Watchdog:
    """A watchdog whose thread is never started: its arithmetic only."""
    return Watchdog(cfg, rank=0, world_size=1, stacks_dir=tmp_path, first_step_limit_s=first_step_limit_s)


def test_the_defaults_catch_a_stalled_tiny_cpu_job_within_two_minutes(tmp_path):
    watchdog = idle_watchdog(tmp_path, WatchdogConfig())
    for step, seconds in enumerate(
        [9.0, 0.8, 2.3, 0.9, 6.0, 1.1], start=1
    ):  # tiny-cpu here, first step and a loaded machine
        watchdog.step_done(step, seconds)
    # The thread compares every TICK_S and reads the store every HEARTBEAT_S.
    assert watchdog.limit_s() + TICK_S + HEARTBEAT_S < 120
    assert watchdog.limit_s() == 60.0


def test_a_healthy_slow_step_and_a_save_are_held_to_longer_limits(tmp_path):
    watchdog = idle_watchdog(tmp_path, WatchdogConfig(), first_step_limit_s=2400.0)
    assert watchdog.limit_s() == 2400.0  # before the first step: the collective timeout (compile, model load)
    for step in range(1, 6):
        watchdog.step_done(step, 45.0)  # a 70B step at 128K
    assert watchdog.limit_s() == 450.0
    with watchdog.paused():
        assert watchdog.limit_s() == 2400.0  # a checkpoint save or an evaluation
    assert watchdog.limit_s() == 450.0


def test_time_in_a_save_does_not_count_toward_a_stall(tmp_path):
    watchdog = idle_watchdog(tmp_path, WatchdogConfig())
    watchdog.step_done(1, 1.0)
    before = watchdog.clock.progress_at
    with watchdog.paused():
        pass
    assert watchdog.clock.progress_at >= before and watchdog.clock.paused_at is None


def test_a_process_whose_steps_stop_dumps_its_stacks_records_the_failure_and_exits_5(tmp_path):
    """One real process: a step, a save longer than the stall limit (held to the long limit, so
    it survives), a step, then a main thread that never completes another (here: a sleep)."""
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from entrypoints.watchdog import Watchdog
        from launcher.contract.config import WatchdogConfig
        cfg = WatchdogConfig(stall_factor=2, min_stall_s=0.5)
        watchdog = Watchdog.start(cfg, rank=0, world_size=1, stacks_dir=Path({str(tmp_path / "stacks")!r}),
                                  first_step_limit_s=5.0)
        watchdog.step_done(1, 0.01)
        with watchdog.paused():
            time.sleep(1.5)
        watchdog.step_done(2, 0.01)
        print("survived the save", flush=True)
        def stuck_in_a_step():
            time.sleep(60)
        stuck_in_a_step()
        """
    )
    error_file = tmp_path / "error.json"
    environment = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "RANK")}
    environment.update(PYTHONPATH=str(REPO), TORCHELASTIC_ERROR_FILE=str(error_file))
    done = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=50, cwd=tmp_path
    )
    assert done.returncode == EXIT_STALLED, done.stderr[-2000:]
    assert done.stdout == "survived the save\n"
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error: ")]
    host = socket.gethostname()
    assert line.startswith("error: watchdog: no step completed for 1 s after step 2 on rank 0 (limit 0 s: ")
    assert f"stuck: rank 0 on {host} (this rank's own step)" in line
    stacks = (tmp_path / "stacks" / "rank-0.txt").read_text()
    assert stacks.startswith(f"# rank 0 on {host} (pid ")
    assert "line 15 in stuck_in_a_step" in stacks and "Current thread" in stacks  # the main thread, and the watchdog's
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "WatchdogStall: " + line.removeprefix("error: ")
    assert float(message["extraInfo"]["raised_at"]) > 0


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("stall_factor", 0.5, "training.watchdog.stall_factor: expected at least 1.0, got 0.5"),
        ("min_stall_s", 0, "training.watchdog.min_stall_s: expected a positive number, got 0"),
        ("straggler_every", -1, "training.watchdog.straggler_every: expected at least 0, got -1"),
        ("straggler_margin", 0, "training.watchdog.straggler_margin: expected a positive number, got 0"),
    ],
)
def test_rejects_a_watchdog_threshold_out_of_range(key, value, error):
    with pytest.raises(LauncherError, match=r"^overrides " + error.replace(".", r"\.") + "$"):
        Recipe.load(REPO / "recipes" / "tiny-cpu.yaml", {f"training.watchdog.{key}": value})


def test_allows_the_watchdog_off_and_the_contract_refuses_what_the_recipe_does():
    recipe = Recipe.load(REPO / "recipes" / "tiny-cpu.yaml", {"training.watchdog.enabled": False})
    assert recipe.training.watchdog.enabled is False
    with pytest.raises(ConfigError, match=r"^training\.watchdog\.stall_factor: 0\.5; use 1 or more$"):
        WatchdogConfig(stall_factor=0.5)


def test_a_step_records_its_data_wait_only_when_it_is_a_fifth_of_the_step_and_the_named_straggler():
    assert speed_causes(0.01, 1.0, None) == {}  # a job nothing slows: its metrics lines stay as they were
    assert speed_causes(0.25, 1.0, None) == {"data_wait_s": 0.25}
    assert speed_causes(0.0, 1.0, (2, 0.9)) == {"straggler_rank": 2, "straggler_above_median": 0.9}


RANK_SCRIPT = """
import sys, time
from pathlib import Path
from entrypoints.watchdog import Watchdog
from launcher.contract.config import WatchdogConfig
rank = int(sys.argv[1])
cfg = WatchdogConfig(stall_factor=2, min_stall_s=0.5)
watchdog = Watchdog.start(cfg, rank=rank, world_size=3, stacks_dir=Path(sys.argv[2]), first_step_limit_s=600.0)
for step in range(1, 4):
    watchdog.step_done(step, 0.01)
if rank == 1:  # a peer that keeps stepping until it is stopped
    print("stepping", flush=True)
    step = 3
    while True:
        time.sleep(0.05)
        step += 1
        watchdog.step_done(step, 0.05)
with watchdog.paused():  # rank 0: a save whose collectives wait for rank 1 for good
    while True:
        print("saving", flush=True)
        time.sleep(0.5)
"""


SAVING_LINES = 26  # rank 0 prints one every 0.5 s of its save


def test_rank_0_in_a_save_names_a_stopped_peer_at_the_step_limit_not_the_long_one(tmp_path, monkeypatch):
    """Three watchdogs on a real TCPStore, as torchrun's agent serves it: ranks 0 and 1 in real
    processes, rank 2 here. Rank 2 ends its training (its watchdog closes) first. Rank 0 sits in
    a save (held to the 600 s long limit) while rank 1 keeps stepping: 12.5 s there, past both the
    step limit and the 10 s a heartbeat must stay unchanged, and rank 0 survives. Then rank 1 is stopped (SIGSTOP): rank 0 fires once rank 1's
    heartbeat is stale (10 s), at the step's limit and not the long one (its message says which),
    names it alone (rank 2's last heartbeat says it closed), and exits 5."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "TORCHELASTIC_ERROR_FILE")}
    environment.update(PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    stacks = tmp_path / "stacks"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    ended = Watchdog.start(
        WatchdogConfig(stall_factor=2, min_stall_s=0.5),
        rank=2,
        world_size=3,
        stacks_dir=stacks,
        first_step_limit_s=600.0,
    )
    for step in range(1, 4):
        ended.step_done(step, 0.01)
    ended.close()
    assert json.loads(store.get("watchdog/attempt_0/beat/2"))["closed"] is True
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), str(stacks)],
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for rank in (0, 1)
    ]
    try:
        assert ranks[1].stdout.readline() == "stepping\n"
        # 12.5 s into the save, past the 10 s a heartbeat must stay unchanged: rank 1 is alive,
        # and rank 2's closed heartbeat has stood unchanged all along.
        for _ in range(SAVING_LINES):
            assert ranks[0].stdout.readline() == "saving\n"
        assert ranks[0].poll() is None
        os.kill(ranks[1].pid, signal.SIGSTOP)
        _, err = ranks[0].communicate(timeout=300)  # a last resort: the long limit is 600 s
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    assert ranks[0].returncode == EXIT_STALLED, err[-2000:]
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert line.startswith("error: watchdog: no step completed for ")
    assert "a save or an evaluation waiting on a rank that does not run is held to the step's limit" in line
    assert f"stuck: rank 1 on {socket.gethostname()} (heartbeat older than 10 s: the process does not run)" in line
    assert "stuck: rank 1" in (stacks / "rank-0.txt").read_text()


def test_in_a_save_only_a_peer_stale_since_the_last_step_counts_as_stopped(tmp_path):
    """The heartbeats rank 0 has read during a save, at step 10: rank 1's stopped changing 30 s
    ago at step 4 (its store client failed long before: it warned), rank 2's 12 s ago at step 9
    (stopped after its last step), rank 3's are fresh and rank 4's not read yet. Only rank 2 may
    fail the save, once unchanged for the step's limit (at least 10 s); the report still names
    every stale rank. Unless rank 2's last heartbeat says it closed (a rank that ended its training)."""
    watchdog = Watchdog(WatchdogConfig(), rank=0, world_size=5, stacks_dir=tmp_path, first_step_limit_s=600.0)
    watchdog._store = object()  # read already: only its presence matters here
    watchdog.step_done(10, 1.0)
    now = time.monotonic()

    def beat(step: int, seen_s_ago: float) -> tuple[str, float]:
        return json.dumps({"step": step, "host": "h", "pid": 1, "beat": 1}), now - seen_s_ago

    watchdog._beats = {0: beat(10, 0.0), 1: beat(4, 30.0), 2: beat(9, 12.0), 3: beat(10, 0.5)}
    assert watchdog._stopped_at_this_step(5.0) == [2]
    assert watchdog._stopped_at_this_step(20.0) == []  # a step limit of 20 s: 12 s unchanged is not enough yet
    assert watchdog._stale_ranks() == [1, 2, 4]  # the step's check: by then unseen means never written
    # Rank 2's last heartbeat says it closed: it ended its training and exited, it is not stuck.
    closed = {"step": 10, "host": "h", "pid": 1, "closed": True}
    watchdog._beats[2] = (json.dumps(closed), now - 12.0)
    assert watchdog._stopped_at_this_step(5.0) == [] and watchdog._stale_ranks() == [1, 4]


class SlowStore:
    """The watchdog's store client where every call takes 0.4 s to answer, as torchrun's agent
    answers from a loaded host. Rank 1's heartbeat changes at every read: a live peer."""

    CALL_S = 0.4

    def __init__(self):
        self.values: dict[str, str] = {}
        self.reads = 0

    def _answer(self) -> None:
        time.sleep(self.CALL_S)

    def set(self, key: str, value: str) -> None:
        self._answer()
        self.values[key] = value

    def check(self, keys: list[str]) -> bool:
        self._answer()
        return all(key in self.values or key == "beat/1" for key in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._answer()
        self.reads += 1
        peer = json.dumps({"step": 3, "host": "h", "pid": 1, "beat": self.reads})
        return [self.values.get(key, peer).encode() for key in keys]


def test_a_slow_store_does_not_hold_the_stall_clock(tmp_path, monkeypatch):
    """Each heartbeat costs four store calls (set, check, multi_get, the check for a report):
    1.6 s a beat here. Counted as time the process did not run (the watchdog thread's own late
    ticks, as it was), they held the stall clock to 0.1 s per 1.7 s: no report in 20 s of a 3 s
    limit, 18 s counted as not running. Measured by a thread that only sleeps, the clock runs at
    the wall clock's pace: the report comes about 6 s in (3 s, one beat's calls, the check)."""
    watchdog = Watchdog(
        WatchdogConfig(stall_factor=2, min_stall_s=3.0),
        rank=0,
        world_size=2,
        stacks_dir=tmp_path,
        first_step_limit_s=600,
    )
    watchdog._store = SlowStore()
    reports = []

    def fired(report: dict, *, first: bool) -> None:
        reports.append((report, first, time.monotonic()))
        watchdog._stop.set()

    monkeypatch.setattr(watchdog, "_fire", fired)
    for step in range(1, 4):
        watchdog.step_done(step, 0.01)
    began = time.monotonic()
    watchdog._clock_thread.start()
    watchdog._thread.start()
    watchdog._thread.join(timeout=12.0)
    watchdog.close()
    assert reports, "no stall reported within 12 s of a 3 s limit"
    report, first, at = reports[0]
    assert first and at - began < 12.0
    assert "every rank is alive at step 3: a collective that never completes" in report["message"]
    assert watchdog.not_running_s < 1.0  # the store's waits are not the process's
