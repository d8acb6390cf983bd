"""How the suite is ordered, in one process or split between pytest-xdist's workers.

One process (`pytest -n 0`): the modules of single-process tests first, then those that start
multi-process jobs (a test marked `torchrun` or `engines`), each module kept whole and in its
order. The single-process tests leave a core idle, which the background work takes
(tests/background.py); the multi-process tests need both cores, and by their turn the
background work is done. All the background work is begun before the first test.

Two workers (`pytest -n 2`, the default in pyproject.toml): every module is one unit that runs
whole on one worker, so its module- and session-scoped fixtures (a Slurm cluster, a container
image, a launch) are made once and its tests keep their order. Every module that waits for
background work runs on the first worker (gw0), which begins all that work before its first
test, as one process does; no other worker begins any. The units are queued longest first: the
engines' modules, the other multi-process modules, the modules waiting for background work,
then the single-process modules, many and short. The other workers take units from the front
of the queue (the long ones first), gw0 from the back: the short ones first, while its
background work runs, then the modules waiting for it, by when most of it is done.

xdist's own `--dist loadgroup` names units by rewriting each test's node id, which pytest 9
no longer allows, so `UnitScheduling` (xdist's loadscope scheduler by module) does it: each
worker writes the waiting modules it found at collection to a file the controller names
(`configure_node`), and the controller reads it when it schedules.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

UNITS_FILE = "launcher_units_file"  # the key of xdist's workerinput that names the file
BACKGROUND_WORKER = "gw0"  # xdist's first worker, there whenever -n is 1 or more


@dataclass(frozen=True)
class Starter:
    """One kind of background work: which tests wait for it, and how it is planned for them."""

    wants: Callable[[pytest.Item], bool]
    plan: Callable  # (items, tmp_path_factory, background) -> {name: work}


@dataclass
class Lanes:
    runs_background: bool = True  # one process, or the worker every waiting module runs on


def _heavy(item: pytest.Item) -> bool:
    return bool(item.get_closest_marker("torchrun") or item.get_closest_marker("engines"))


def _module_path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def order(config: pytest.Config, items: list[pytest.Item], starters: Mapping[str, Starter]) -> Lanes:
    """Sort `items` in place for this process, and under xdist tell the controller the units."""
    heavy = {_module_path(item.nodeid) for item in items if _heavy(item)}
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        items.sort(key=lambda item: _module_path(item.nodeid) in heavy)  # stable: each part keeps its order
        return Lanes()
    lanes = Lanes(runs_background=workerinput["workerid"] == BACKGROUND_WORKER)
    engines = {_module_path(item.nodeid) for item in items if item.get_closest_marker("engines")}
    # The background work runs in `starters` order; gw0 takes the waiting modules from the back,
    # so they are queued in the reverse of it: the first piece's modules are taken first.
    first_wanted: dict[str, int] = {}
    for item in items:
        for index, starter in enumerate(starters.values()):
            if starter.wants(item):
                module = _module_path(item.nodeid)
                first_wanted[module] = min(first_wanted.get(module, index), index)

    def rank(item: pytest.Item) -> tuple[int, int]:
        module = _module_path(item.nodeid)
        if module in first_wanted:
            return (2, -first_wanted[module])
        return (0 if module in engines else 1 if module in heavy else 3, 0)

    items.sort(key=rank)
    _write_atomically(Path(workerinput[UNITS_FILE]), json.dumps(sorted(first_wanted)))
    return lanes


def plan_work(starters: Mapping[str, Starter], items, tmp_path_factory, background) -> dict:
    pieces: dict = {}
    for starter in starters.values():
        pieces.update(starter.plan(items, tmp_path_factory, background))
    return pieces


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_text(text)
    partial.replace(path)  # every worker writes the same units; the controller reads a whole file


# The controller's side.


def units_file(config: pytest.Config) -> Path:
    """The file the workers write the waiting modules to, made once by the controller."""
    if not hasattr(config, "_launcher_units_dir"):
        config._launcher_units_dir = Path(tempfile.mkdtemp(prefix="launcher-test-units-"))
    return config._launcher_units_dir / "units.json"


def remove_units_file(config: pytest.Config) -> None:
    directory = getattr(config, "_launcher_units_dir", None)
    if directory is not None:
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()


def make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        """xdist's loadscope scheduling with modules as its scopes: the modules waiting for
        background work go to its worker alone, which takes modules from the back of the
        queue; the others take them from the front."""

        _waiting: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            return _module_path(nodeid)

        def _assign_work_unit(self, node) -> None:
            background_worker = node.gateway.id == BACKGROUND_WORKER
            queue = reversed(self.workqueue) if background_worker else iter(self.workqueue)
            if self._waiting is None:  # the workers wrote it at collection, before scheduling
                self._waiting = set(json.loads(units_file(self.config).read_text()))
            waiting = self._waiting
            scope = next((s for s in queue if background_worker or s not in waiting), None)
            if scope is None:
                # What is left waits for the background worker. A worker runs a test only once it
                # knows the next (pytest's nextitem) or is told to shut down, so without this its
                # last test waited for the whole queue to empty: idle, then run after the rest.
                node.shutdown()
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    config.option.loadscopereorder = False  # by number of tests, not their length: keep ours
    return UnitScheduling(config, log)
