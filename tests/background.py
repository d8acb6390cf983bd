"""Work the serial suite would otherwise stop and wait for, started when the session starts.

pytest runs one test at a time, and most tests use one of CI's two cores. The suite's largest
pieces of pure computation need nothing from any test: the entrypoint tests' shared torchrun
launches (tests/entrypoints/entrypoint_jobs.py), gpu_check.sh's CPU smoke run
(test_gpu_check.py), the two-host checkpoint launches (test_multihost_checkpoints.py) and the
estimator's traces (tests/estimate/traced.py). When a selected test needs one of them, the root conftest's
`_background` fixture plans it in the foreground before the first test (so it sees the session's
environment, not a variable some test has monkeypatched) and runs it in a thread of its own.
Its processes run at a lower priority (`nice`), so they take the core the serial tests leave
idle and yield it whenever a foreground test needs both. A test that needs a result waits for
it (`Background.result`); a failure of the work fails that test with the work's own message.

The processes are started in sessions of their own and are tracked, so the end of the session
(or a stop after a failure with -x) kills exactly the groups this module created.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

# Below the tests' own processes: CFS gives a nice-0 process about 9 times a nice-10 one's share.
NICE = ("nice", "-n", "10")


class Background:
    """Named pieces of work, each run in order in the thread of the group it was begun with."""

    def __init__(self, environment: Mapping[str, str]):
        self.environment = dict(environment)  # the session's, taken before any test ran
        self._futures: dict[str, Future] = {}
        self._processes: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._stopped = False

    def begin(self, work: Mapping[str, Callable[[], Any]]) -> None:
        """Run each named piece of work, in order, in one new thread (a piece that fails fails
        only the tests waiting for it; the next piece still runs)."""
        futures = {name: Future() for name in work}
        self._futures.update(futures)

        def run_all() -> None:
            for name, piece in work.items():
                future = futures[name]
                try:
                    future.set_result(piece())
                except BaseException as error:  # pytest.fail raises an OutcomeException
                    future.set_exception(error)

        threading.Thread(target=run_all, name=f"background: {', '.join(work)}", daemon=True).start()

    def result(self, name: str, timeout: float | None = None) -> Any:
        """The named work's result once it is done; its exception if it failed."""
        return self._futures[name].result(timeout)

    def popen(
        self, argv: Sequence[str], *, cwd: str | os.PathLike, env: Mapping[str, str] | None = None, **options: Any
    ) -> subprocess.Popen:
        """`subprocess.Popen(argv, **options)` at the lower priority, with the session's
        environment plus `env`, in a session of its own that `stop` kills whole."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("the session is over")
            process = subprocess.Popen(
                [*NICE, *argv], cwd=cwd, env={**self.environment, **(env or {})}, start_new_session=True, **options
            )
            self._processes.append(process)
        return process

    def run(
        self, argv: Sequence[str], *, cwd: str | os.PathLike, timeout: float, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """`subprocess.run(argv, capture_output=True, text=True, timeout=timeout)` as `popen` starts it;
        a timeout kills its whole session."""
        process = self.popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            stdout, stderr = process.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr) from None
        return subprocess.CompletedProcess(list(argv), process.returncode, stdout, stderr)

    def stop(self) -> None:
        """Kill the process groups of this object's work that are still running."""
        with self._lock:
            self._stopped = True
            running = [p for p in self._processes if p.poll() is None]
        for process in running:
            _kill_group(process)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the group `process` leads: `Background.popen` created it (start_new_session)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
