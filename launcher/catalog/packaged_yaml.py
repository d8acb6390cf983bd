"""The YAML files shipped inside launcher's packages (the catalogs, the engines' capabilities, the
training images), read as SafeLoader reads them but with libyaml's parser where PyYAML has it
(its wheels do): the same values, parsed about 9 times faster. Reading all six and building their
objects took 78 ms of CPU with the pure-Python parser and 14 ms with libyaml (one process each,
2026-12-07), in every launcher command that reads a catalog. These files are ours; recipes, which
are not, go through launcher/recipe/bounded_yaml.py."""

from __future__ import annotations

from importlib.resources import files
from typing import Any

import yaml

SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_packaged(package: str, filename: str) -> Any:
    """The YAML file `filename` of the package `package`."""
    return yaml.load(files(package).joinpath(filename).read_text(), Loader=SAFE_LOADER)
