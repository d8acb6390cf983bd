"""How the suite is ordered, in one process or split between pytest-xdist's workers.

One process (`pytest -n 0`): the modules of single-process tests first, then those that start
multi-process jobs (a test marked `torchrun` or `engines`), each module kept whole and in its
order. The single-process tests leave a core idle, which the background work takes
(tests/background.py); the multi-process tests need both cores, and by their turn the
background work is done. All the background work is begun before the first test.

Two workers (`pytest -n 2`, the default in pyproject.toml): every module is one unit that runs
whole on one worker, so its module- and session-scoped fixtures (a Slurm cluster, a container
image, a launch) are made once and its tests keep their order. The modules that wait for the
same piece of background work join one unit, and the worker that runs the unit begins the
piece when it starts it, so no piece runs twice. The units are handed out in this order: those
with background work, then the modules of multi-process jobs, engines first, then the
single-process modules, many and short, which fill the end of the run on whichever worker is
free.

xdist's own `--dist loadgroup` names units by rewriting each test's node id, which pytest 9
no longer allows, so `UnitScheduling` (xdist's loadscope scheduler, told the units) does it:
each worker writes the units it computed at collection to a file the controller names
(`configure_node`), and the controller reads it when it schedules.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

UNITS_FILE = "launcher_units_file"  # the key of xdist's workerinput that names the file


@dataclass(frozen=True)
class Starter:
    """One kind of background work: which tests wait for it, and how it is planned for them."""

    wants: Callable[[pytest.Item], bool]
    plan: Callable  # (items, tmp_path_factory, background) -> {name: work}


@dataclass
class Lanes:
    split: bool  # run by an xdist worker
    unit_of_module: dict[str, str] = field(default_factory=dict)
    starters_of_unit: dict[str, list[str]] = field(default_factory=dict)


def _heavy(item: pytest.Item) -> bool:
    return bool(item.get_closest_marker("torchrun") or item.get_closest_marker("engines"))


def _module_path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _units(items: list[pytest.Item], starters: Mapping[str, Starter]) -> Lanes:
    """Each module its own unit, except that modules waiting for a common piece of work share one."""
    wanted: dict[str, set[str]] = {}
    for item in items:
        names = wanted.setdefault(_module_path(item.nodeid), set())
        names.update(name for name, starter in starters.items() if starter.wants(item))
    groups: list[set[str]] = []  # starters that share a module run on one worker: join them
    for names in wanted.values():
        joined = set(names)
        for group in [group for group in groups if group & joined]:
            groups.remove(group)
            joined |= group
        if joined:
            groups.append(joined)
    lanes = Lanes(split=True)
    for group in groups:
        ordered = [name for name in starters if name in group]
        lanes.starters_of_unit["background: " + ", ".join(ordered)] = ordered
    for module, names in wanted.items():
        unit = next((unit for unit, members in lanes.starters_of_unit.items() if names & set(members)), None)
        lanes.unit_of_module[module] = unit or module
    return lanes


def order(config: pytest.Config, items: list[pytest.Item], starters: Mapping[str, Starter]) -> Lanes:
    """Sort `items` in place for this process, and under xdist tell the controller the units."""
    heavy = {_module_path(item.nodeid) for item in items if _heavy(item)}
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        items.sort(key=lambda item: _module_path(item.nodeid) in heavy)  # stable: each part keeps its order
        return Lanes(split=False)
    lanes = _units(items, starters)
    engines = {_module_path(item.nodeid) for item in items if item.get_closest_marker("engines")}
    first_starter = {unit: list(starters).index(names[0]) for unit, names in lanes.starters_of_unit.items()}

    def rank(item: pytest.Item) -> tuple[int, int]:
        module = _module_path(item.nodeid)
        unit = lanes.unit_of_module[module]
        if unit in first_starter:
            return (0, first_starter[unit])
        return (1 if module in engines else 2 if module in heavy else 3, 0)

    items.sort(key=rank)
    _write_atomically(Path(workerinput[UNITS_FILE]), json.dumps(lanes.unit_of_module))
    return lanes


def unit_of(lanes: Lanes, item: pytest.Item) -> str | None:
    return lanes.unit_of_module.get(_module_path(item.nodeid)) if lanes.split else None


def items_of(lanes: Lanes, unit: str, items: Iterable[pytest.Item]) -> list[pytest.Item]:
    return [item for item in items if lanes.unit_of_module.get(_module_path(item.nodeid)) == unit]


def plan_work(starters: Mapping[str, Starter], names: Iterable[str], items, tmp_path_factory, background) -> dict:
    pieces: dict = {}
    for name in names:
        pieces.update(starters[name].plan(items, tmp_path_factory, background))
    return pieces


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_text(text)
    partial.replace(path)  # both workers write the same units; the controller reads a whole file


# The controller's side.


def units_file(config: pytest.Config) -> Path:
    """The file the workers write their units to, made once by the controller."""
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
        """xdist's loadscope scheduling, with the units the workers computed as its scopes,
        handed out in the collection's order."""

        _units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._units is None:
                self._units = json.loads(units_file(self.config).read_text())
            module = _module_path(nodeid)
            return self._units.get(module, module)

    config.option.loadscopereorder = False  # by number of tests: not their length; keep ours
    return UnitScheduling(config, log)
