"""Turn pydantic's validation errors into one readable line per key: what, where, what is valid."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from launcher.catalog import choices, suggest
from launcher.errors import Problem
from launcher.recipe.schema import MODEL_REF_TAGS, HFConfigModel, ModelOverride, model_kind

# Keys that older recipes may still hold, and where they live now.
MOVED_KEYS = {"sagemaker.max_run": "cluster.max_run", "sagemaker.image_uri": "cluster.image"}


def show(value: Any) -> str:
    text = (
        (f"'{value}'" if value.isprintable() else repr(value))  # a newline must not split the line
        if isinstance(value, str)
        else "null"
        if value is None
        else str(value).lower()
        if isinstance(value, bool)
        else repr(value)
    )
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return show(value)


_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
    "tuple_type": "a list",
}


def _expected(error: dict) -> str | None:
    kind = error["type"]
    ctx = error.get("ctx", {})
    if kind in _EXPECTED:
        return _EXPECTED[kind]
    if kind == "literal_error":
        return ctx["expected"]
    if kind == "greater_than":
        return f"a number above {ctx['gt']}" if ctx["gt"] else "a positive number"
    if kind == "greater_than_equal":
        return f"at least {ctx['ge']}"
    if kind == "less_than_equal":
        return f"at most {ctx['le']}"
    if kind == "less_than":
        return f"less than {ctx['lt']}"
    return None


def _location(loc: tuple, data: Any, kind: str) -> tuple:
    """The key path into the user's data; drops union and discriminator tags from pydantic's loc."""
    path: list = []
    node = data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            path.append(part)
            node = node[part]
        elif isinstance(node, dict) and i == len(loc) - 1 and kind == "missing":
            path.append(part)
        elif path == ["model"] and part in MODEL_REF_TAGS:
            continue
        elif isinstance(part, str) and ("[" in part or part in ("int", "str", "float", "bool", "constrained-int")):
            continue
    return tuple(path)


def _fields_at(model: type[BaseModel], path: tuple, data: Any) -> list[str]:
    """Field names valid at `path` (for 'unknown key' messages)."""
    current: Any = model
    for part in path[:-1]:
        if current is None:
            return []
        if part == "model":
            value = data.get("model") if isinstance(data, dict) else None
            current = HFConfigModel if model_kind(value) == "hf_config" else ModelOverride
            continue
        info = current.model_fields.get(part)
        annotation = getattr(info, "annotation", None)
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return list(current.model_fields) if current is not None else []


def problems_from_validation(err: ValidationError, data: Any, model: type[BaseModel]) -> list[tuple[tuple, Problem]]:
    """(key path, problem) pairs, one per key, from a pydantic ValidationError."""
    grouped: dict[tuple, list[dict]] = {}
    for error in err.errors():
        path = _location(error["loc"], data, error["type"])
        grouped.setdefault(path, []).append(error)

    out = []
    for path, errors in grouped.items():
        dotted = ".".join(map(str, path))
        first = errors[0]
        kind = first["type"]
        value = first.get("input")
        if kind == "value_error" and hasattr((first.get("ctx") or {}).get("error"), "problems"):
            continue  # rule violations are collected separately, with their own paths
        if kind == "missing":
            message = "is required"
        elif kind == "extra_forbidden" and dotted in MOVED_KEYS:
            message = f"moved to {MOVED_KEYS[dotted]}: every backend reads it there; write it under that key instead"
        elif kind == "extra_forbidden":
            valid = _fields_at(model, path, data)
            key = str(path[-1]) if path else ""
            message = (
                f"unknown key{suggest(key, valid)}; valid keys here: {', '.join(valid)}" if valid else "unknown key"
            )
        elif kind == "model_ref":
            message = f"{first['msg']}, got {_kind(value)}"
        elif kind == "string_pattern_mismatch" and dotted == "name":
            message = (
                f"{show(value)} must be letters, digits and single hyphens, starting and ending with a letter or digit"
            )
        elif kind == "string_pattern_mismatch":
            message = f"{show(value)} does not match {first['ctx']['pattern']}"
        elif kind == "string_too_long":
            message = f"{show(value)} is longer than {first['ctx']['max_length']} characters"
        elif kind in ("too_short", "too_long") and isinstance(value, (list, tuple)):
            message = (
                f"expected {first['ctx'].get('max_length') or first['ctx'].get('min_length')} items, got {len(value)}"
            )
        elif kind == "value_error":
            message = str(first["ctx"]["error"])
        else:
            expected = [e for e in (_expected(error) for error in errors) if e]
            expected = list(dict.fromkeys(expected))
            if expected:
                message = f"expected {choices(expected)}, got {_kind(value)}"
            else:
                message = first["msg"]
        out.append((path, Problem(dotted, message)))
    return out
