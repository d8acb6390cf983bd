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

from launcher.errors import Problem, RecipeError
from launcher.recipe.bounded_yaml import parse_yaml
from launcher.recipe.files import UnreadableFile, read_text_file

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
    except (ValueError, OSError, RuntimeError):  # not under the cwd; NUL, too long; a symlink loop (3.11)
        return str(path)


def read_yaml(path: Path, text: str | None = None) -> tuple[dict, dict[KeyPath, str]]:
    """One YAML mapping and the line of each key in it; `text` is the file's, if already read."""
    shown = _display(path)

    def fail(message: str, line: int | None = None) -> RecipeError:
        return RecipeError([Problem("", message, f"{shown}:{line}" if line else shown)])

    if text is None:
        try:
            text = read_text_file(path)
        except UnreadableFile as err:
            raise fail(str(err)) from None
    data, origins, line = parse_yaml(text, shown)
    if line is None:
        raise fail("is empty; a recipe needs at least name, model and training")
    if not isinstance(data, dict):
        kind = type(data).__name__ if not isinstance(data, list) else "a list"
        raise fail(f"expected a mapping of keys (name, model, training, ...), got {kind}", line)
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


def _absolute(directory: Path, name: str) -> str:
    """`name` relative to `directory`, resolved; left as written when the OS refuses the path
    (a NUL byte, a name too long), so the reader of the file reports it with the recipe's line."""
    try:
        return str((directory / name).resolve())
    except (ValueError, OSError, RuntimeError):  # RuntimeError: a symlink loop (Python 3.11)
        return str(directory / name)


def _make_absolute(data: dict, directory: Path) -> None:
    """Paths a recipe names on this machine are relative to the recipe file that names them."""
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("hf_config"), str):
        model["hf_config"] = _absolute(directory, model["hf_config"])
    if isinstance(model, dict) and isinstance(model.get("init_from"), str) and "://" not in model["init_from"]:
        model["init_from"] = _absolute(directory, model["init_from"])
    section = data.get("data") if isinstance(data.get("data"), dict) else {}
    validation = section.get("validation") if isinstance(section.get("validation"), dict) else {}
    for holder, key in ((section, "source"), (section, "tokenizer"), (validation, "source")):
        value = holder.get(key)
        if isinstance(value, str) and value != "synthetic" and "://" not in value:
            holder[key] = _absolute(directory, value)


MAX_EXTENDS_DEPTH = 16
"""Files in one `extends` chain; real chains are two or three deep."""


def _chain_text(chain: list[Path]) -> str:
    return " -> ".join(_display(p) for p in chain)


def _read_parent(path: Path, data: dict, origins: dict, chain: list[Path]) -> tuple[Path, str] | None:
    """The file `path` extends and its text (None if it extends none); a problem with the
    parent points at the `extends` line, which is what the user edits."""
    parent_ref = data.pop("extends", None)
    if parent_ref is None:
        return None
    where = origins.pop(("extends",))

    def refuse(message: str) -> RecipeError:
        return RecipeError([Problem("extends", message, where)])

    if not isinstance(parent_ref, str) or not parent_ref.strip():
        raise refuse("expected the path of another recipe file, relative to this one")
    parent = path.parent / parent_ref
    shown_ref = parent_ref if len(parent_ref) <= 80 else parent_ref[:60] + "…"
    try:
        real = parent.resolve()
    except (ValueError, OSError, RuntimeError):  # RuntimeError: a symlink loop (Python 3.11)
        real = None  # a NUL byte or a name too long: reading the file below says which
    if real is not None and real in [p.resolve() for p in chain]:
        cycle = _chain_text(chain[[p.resolve() for p in chain].index(real) :] + [parent])
        raise refuse(f"{shown_ref} extends back to a file of this chain ({cycle}); remove the cycle")
    if len(chain) >= MAX_EXTENDS_DEPTH:
        raise refuse(
            f"{shown_ref} would make an extends chain longer than {MAX_EXTENDS_DEPTH} files "
            f"({_display(chain[0])} -> ... -> {_display(path)}); merge some of them"
        )
    try:
        return parent, read_text_file(parent)
    except UnreadableFile as err:
        if str(err) == "no such file":
            raise refuse(f"{shown_ref} does not exist (looked in {_display(path.parent)}/)") from None
        raise refuse(f"{shown_ref}: {err}") from None


def load_raw(path: str | Path) -> RawRecipe:
    """The recipe at `path` merged over the chain of files it `extends`, child keys winning."""
    path = Path(path)
    chain: list[Path] = []
    layers: list[tuple[dict, dict]] = []
    step: tuple[Path, str | None] | None = (path, None)
    while step is not None:  # a loop, not recursion: the chain is bounded and its errors name it
        current, text = step
        chain.append(current)
        data, origins = read_yaml(current, text)
        _make_absolute(data, current.parent)
        step = _read_parent(current, data, origins, chain)
        layers.append((data, origins))
    merged: dict = {}
    merged_origins: dict = {}
    for data, origins in reversed(layers):
        merged = deep_merge(merged, data)
        merged_origins.update(origins)
    return RawRecipe(merged, merged_origins, list(reversed(chain)))


MAX_KEY_PARTS = 16
MAX_SET_INDEX = 10**6


def _key_part(part: str) -> str | int:
    """A dotted key part: a list index if it is a (short, ASCII) number, else a key."""
    return int(part) if part.isascii() and part.isdigit() and len(part) <= 7 else part


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
        if not text.strip():
            overrides[key] = ""
            continue
        try:
            value, _, _ = parse_yaml(text, "--set")
        except RecipeError as err:
            if not any(p.message.startswith("YAML") for p in err.problems):
                # A bound exceeded (nesting, size, NUL): name the key that was being set.
                raise RecipeError([Problem(key, p.message, "--set") for p in err.problems]) from None
            value = text  # not YAML: the text itself, e.g. a path with a colon
        overrides[key] = value
    return overrides


def _set_error(dotted: str, message: str, origin: str) -> RecipeError:
    return RecipeError([Problem(dotted, message, origin)])


def _descend(node: Any, part: str | int, node_path: str, dotted: str, origin: str) -> Any:
    """The child of `node` (at `node_path`) at `part`, on the way to an override's target; a
    missing mapping is made, anything else that is not a mapping or a list is refused."""
    child_path = f"{node_path}.{part}" if node_path else str(part)
    if isinstance(node, list):
        _check_index(node, part, node_path, dotted, origin)
        child = node[part]
    else:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
    if not isinstance(child, (dict, list)):
        raise _set_error(
            dotted, f"{child_path} is {child!r}, not a mapping; set it whole, e.g. --set {child_path}='{{...}}'", origin
        )
    return child


def _check_index(node: list, part: str | int, node_path: str, dotted: str, origin: str) -> None:
    if isinstance(part, int) and part < len(node):
        return
    indexes = f"0 to {len(node) - 1}" if node else "none, it is empty"
    raise _set_error(
        dotted,
        f"{node_path} is a list of {len(node)}; {part} is not an index of it ({indexes}); "
        f"set the list whole, e.g. --set {node_path}='[...]'",
        origin,
    )


def apply_overrides(raw: RawRecipe, overrides: Mapping[str, Any], origin: str = "--set") -> RawRecipe:
    data = copy.deepcopy(raw.data)
    origins = dict(raw.origins)
    for dotted, value in overrides.items():
        parts = [_key_part(p) for p in str(dotted).split(".")]
        if not all(str(p) for p in parts):
            raise _set_error(dotted, "is not a dotted key path; write e.g. parallel.context", origin)
        if len(parts) > MAX_KEY_PARTS:
            raise _set_error(dotted, f"has {len(parts)} parts; a recipe key path has at most {MAX_KEY_PARTS}", origin)
        node = data
        for depth, part in enumerate(parts[:-1]):
            node = _descend(node, part, ".".join(map(str, parts[:depth])), dotted, origin)
        last = parts[-1]
        if isinstance(node, list):
            _check_index(node, last, ".".join(map(str, parts[:-1])), dotted, origin)
        node[last] = value
        prefix = tuple(parts)
        for key in [k for k in origins if k[: len(prefix)] == prefix]:
            del origins[key]
        origins[prefix] = origin
    return RawRecipe(data, origins, raw.files)
