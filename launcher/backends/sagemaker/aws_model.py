"""Check a request against botocore's own service model before it is sent.

botocore validates required members and types client-side, but not regex patterns, maximum
lengths or maximum values, and moto validates nothing; SageMaker checks all of them and
answers a bad request with a ValidationException after the bundle is uploaded. This walks the
model's input shape and reports every violation with its member path, so dry-run, submit and
the tests all hold requests to the constraints the service enforces.
"""

from __future__ import annotations

import datetime
from functools import cache
from typing import Any

# The models' patterns are Java regexes, matched against the whole value. Python's `re` lacks
# their \p{...} classes; the `regex` module (a core dependency) has them. A pattern it cannot
# compile is not checked and is listed by `unchecked_patterns` (tests assert none of ours are).


@cache
def _compile(pattern: str):
    import regex

    try:
        return regex.compile(pattern)
    except regex.error:
        return None


@cache
def _model(service: str):
    import botocore.session

    return botocore.session.get_session().get_service_model(service)


def input_shape(service: str, operation: str):
    return _model(service).operation_model(operation).input_shape


def validate(service: str, operation: str, params: dict[str, Any]) -> list[str]:
    """Every way `params` breaks the model of `service.operation`, one line each."""
    problems: list[str] = []
    _check(input_shape(service, operation), params, operation, problems)
    return problems


def unchecked_patterns(service: str, operation: str, params: dict[str, Any]) -> list[str]:
    """Member paths whose pattern could not be compiled, so were not checked."""
    skipped: list[str] = []
    _check(input_shape(service, operation), params, operation, [], skipped)
    return skipped


def _check(shape, value: Any, path: str, problems: list[str], skipped: list[str] | None = None) -> None:
    kind = shape.type_name
    meta = shape.metadata
    if kind == "structure":
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a structure, got {type(value).__name__}")
            return
        for name in shape.required_members:
            if name not in value:
                problems.append(f"{path}.{name}: required member missing")
        for name, member_value in value.items():
            if name not in shape.members:
                problems.append(f"{path}.{name}: not a member of {shape.name}")
                continue
            _check(shape.members[name], member_value, f"{path}.{name}", problems, skipped)
    elif kind == "list":
        if not isinstance(value, list | tuple):
            problems.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        _size(len(value), meta, path, "items", problems)
        for i, item in enumerate(value):
            _check(shape.member, item, f"{path}[{i}]", problems, skipped)
    elif kind == "map":
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a map, got {type(value).__name__}")
            return
        _size(len(value), meta, path, "entries", problems)
        for key, item in value.items():
            _check(shape.key, key, f"{path} key {key!r}", problems, skipped)
            _check(shape.value, item, f"{path}[{key!r}]", problems, skipped)
    elif kind == "string":
        if not isinstance(value, str):
            problems.append(f"{path}: expected a string, got {type(value).__name__}")
            return
        _size(len(value), meta, path, "characters", problems)
        if shape.enum and value not in shape.enum:
            problems.append(f"{path}: {value!r} is not one of {', '.join(shape.enum)}")
        pattern = meta.get("pattern")
        if pattern is not None:
            compiled = _compile(pattern)
            if compiled is None:
                if skipped is not None:
                    skipped.append(path)
            elif not compiled.fullmatch(value):
                problems.append(f"{path}: {value!r} does not match the pattern {pattern}")
    elif kind in ("integer", "long"):
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{path}: expected an integer, got {type(value).__name__}")
            return
        _range(value, meta, path, problems)
    elif kind in ("float", "double"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(f"{path}: expected a number, got {type(value).__name__}")
            return
        _range(value, meta, path, problems)
    elif kind == "boolean":
        if not isinstance(value, bool):
            problems.append(f"{path}: expected true or false, got {type(value).__name__}")
    elif kind == "timestamp":
        if not isinstance(value, datetime.datetime | str | int | float):
            problems.append(f"{path}: expected a timestamp, got {type(value).__name__}")
    elif kind == "blob":
        if not isinstance(value, bytes | bytearray | str):
            problems.append(f"{path}: expected bytes, got {type(value).__name__}")


def _size(n: int, meta: dict, path: str, unit: str, problems: list[str]) -> None:
    if "min" in meta and n < meta["min"]:
        problems.append(f"{path}: {n} {unit}, fewer than the minimum {meta['min']}")
    if "max" in meta and n > meta["max"]:
        problems.append(f"{path}: {n} {unit}, more than the maximum {meta['max']}")


def _range(value: float, meta: dict, path: str, problems: list[str]) -> None:
    if "min" in meta and value < meta["min"]:
        problems.append(f"{path}: {value} is below the minimum {meta['min']}")
    if "max" in meta and value > meta["max"]:
        problems.append(f"{path}: {value} is above the maximum {meta['max']}")
