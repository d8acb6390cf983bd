"""Which checkpoints a checkpoint directory holds: the rule the entrypoints write by and the
launcher reads by, standard library only.

A checkpoint is a directory `step-NNNNNNNN` (the step, 8 digits). It counts once every host of
the run that wrote it left its marker there, `COMPLETE.node-k-of-n` for each k < n: a host
writes its marker only after its ranks' files are durable (entrypoints/checkpoint.py), so a
directory without all n is a save that did not finish. The launcher reads the same rule to say,
before a job on this machine starts, which checkpoint it resumes from.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d{8})$")
MARKER = re.compile(r"^COMPLETE\.node-(\d+)-of-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def marker_name(node: int, instance_count: int) -> str:
    return f"COMPLETE.node-{node}-of-{instance_count}"


def is_complete(path: Path) -> bool:
    """All hosts' markers of one run are present: `COMPLETE.node-k-of-n` for every k < n."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return has_every_marker(names)


def has_every_marker(names) -> bool:
    """Among file `names` of one step directory, the markers of all hosts of one run."""
    nodes_by_total: dict[int, set[int]] = defaultdict(set)
    for name in names:
        match = MARKER.match(name)
        if match:
            nodes_by_total[int(match.group(2))].add(int(match.group(1)))
    return any(total > 0 and nodes >= set(range(total)) for total, nodes in nodes_by_total.items())


def step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step directory, complete or not, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = STEP_DIR.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `directory`, oldest first."""
    return [(step, path) for step, path in step_dirs(directory) if is_complete(path)]
