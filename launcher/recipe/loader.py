"""Read recipe files: YAML with line numbers, `extends`, and `--set` overrides.

Every value remembers where it came from ("recipes/x.yaml:14" or "--set"), so a problem found
later, by pydantic or by a rule, can point at the line the user has to change.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from launcher.errors import Problem, RecipeError

KeyPath = tuple  # of str | int


@dataclass
class RawRecipe:
    """Merged recipe data before validation, with the origin of every key."""

    data: dict
    origins: dict[KeyPath, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)

    def origin(self, path: KeyPath) -> str:
        """The origin of the deepest known key on `path`, else of the file itself."""
        for end in range(len(path), 0, -1):
            if path[:end] in self.origins:
                return self.origins[path[:end]]
        return str(self.files[-1]) if self.files else ""


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def read_yaml(path: Path) -> tuple[dict, dict[KeyPath, str]]:
    """One YAML mapping and the line of each key in it."""
    shown = _display(path)

    def fail(message: str, line: int | None = None) -> RecipeError:
        return RecipeError([Problem("", message, f"{shown}:{line}" if line else shown)])

    try:
        text = path.read_text()
    except FileNotFoundError:
        raise fail("no such file") from None
    except IsADirectoryError:
        raise fail("is a directory, not a recipe file") from None
    except UnicodeDecodeError:
        raise fail("is not a text file") from None
    except OSError as err:
        raise fail(f"cannot read: {err.strerror}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        detail = " ".join(part for part in (err.context, err.problem) if part)
        raise fail(f"YAML syntax error: {detail}", mark.line + 1 if mark else None) from None
    except yaml.YAMLError as err:
        raise fail(f"YAML error: {err}") from None
    if node is None:
        raise fail("is empty; a recipe needs at least name, model and training")
    if not isinstance(data, dict):
        kind = type(data).__name__ if not isinstance(data, list) else "a list"
        raise fail(f"expected a mapping of keys (name, model, training, ...), got {kind}", node.start_mark.line + 1)

    origins: dict[KeyPath, str] = {}
    duplicates: list[Problem] = []

    def walk(n: yaml.Node, path: KeyPath) -> None:
        if isinstance(n, yaml.MappingNode):
            seen = set()
            for key_node, value_node in n.value:
                key = key_node.value
                where = f"{shown}:{key_node.start_mark.line + 1}"
                if key in seen:
                    duplicates.append(
                        Problem(".".join(map(str, path + (key,))), "duplicate key; each key may appear once", where)
                    )
                seen.add(key)
                origins[path + (key,)] = where
                walk(value_node, path + (key,))
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                origins[path + (i,)] = f"{shown}:{item.start_mark.line + 1}"
                walk(item, path + (i,))

    walk(node, ())
    if duplicates:
        raise RecipeError(duplicates)
    return data, origins


def deep_merge(base: dict, child: dict) -> dict:
    """Child wins; mappings merge key by key, everything else is replaced whole."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _make_absolute(data: dict, origins: dict, directory: Path) -> None:
    """Paths a recipe names on this machine are relative to the recipe file that names them."""
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("hf_config"), str):
        model["hf_config"] = str((directory / model["hf_config"]).resolve())
    source = data.get("data", {}).get("source") if isinstance(data.get("data"), dict) else None
    if isinstance(source, str) and source != "synthetic" and "://" not in source:
        data["data"]["source"] = str((directory / source).resolve())


def load_raw(path: str | Path, _chain: tuple[Path, ...] = ()) -> RawRecipe:
    path = Path(path)
    data, origins = read_yaml(path)
    _make_absolute(data, origins, path.parent)
    real = path.resolve()
    parent_ref = data.pop("extends", None)
    if parent_ref is None:
        return RawRecipe(data, origins, [path])
    where = origins[("extends",)]
    if not isinstance(parent_ref, str):
        raise RecipeError([Problem("extends", "expected the path of another recipe file", where)])
    parent_path = path.parent / parent_ref
    if parent_path.resolve() in _chain + (real,):
        raise RecipeError([Problem("extends", f"{parent_ref} extends back to this file; remove the cycle", where)])
    if not parent_path.exists():
        raise RecipeError(
            [Problem("extends", f"{parent_ref} does not exist (looked in {_display(path.parent)}/)", where)]
        )
    parent = load_raw(parent_path, _chain + (real,))
    origins.pop(("extends",))
    return RawRecipe(deep_merge(parent.data, data), {**parent.origins, **origins}, parent.files + [path])


def parse_set_options(options: Iterable[str]) -> dict[str, Any]:
    """`--set a.b=c` options as {dotted path: value}; values are YAML, so 16 is an int."""
    overrides = {}
    for option in options:
        key, sep, text = option.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RecipeError(
                [Problem("", f"'{option}' is not KEY=VALUE; write e.g. --set parallel.context=16", "--set")]
            )
        try:
            overrides[key] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            overrides[key] = text
    return overrides


def apply_overrides(raw: RawRecipe, overrides: Mapping[str, Any], origin: str = "--set") -> RawRecipe:
    data = copy.deepcopy(raw.data)
    origins = dict(raw.origins)
    for dotted, value in overrides.items():
        parts = [int(p) if p.isdigit() else p for p in dotted.split(".")]
        if not all(str(p) for p in parts):
            raise RecipeError([Problem(dotted, "is not a dotted key path; write e.g. parallel.context", origin)])
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part) if isinstance(node, dict) else None
            if child is None:
                child = node[part] = {}
            if not isinstance(child, (dict, list)):
                here = ".".join(map(str, parts[: depth + 1]))
                raise RecipeError(
                    [
                        Problem(
                            dotted,
                            f"{here} is {child!r}, not a mapping; set it whole, e.g. --set {here}='{{...}}'",
                            origin,
                        )
                    ]
                )
            node = child
        last = parts[-1]
        if isinstance(node, list):
            if not isinstance(last, int) or last >= len(node):
                raise RecipeError([Problem(dotted, f"index {last} is outside the list of {len(node)}", origin)])
        node[last] = value
        prefix = tuple(parts)
        for key in [k for k in origins if k[: len(prefix)] == prefix]:
            del origins[key]
        origins[prefix] = origin
    return RawRecipe(data, origins, raw.files)
