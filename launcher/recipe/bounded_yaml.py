"""Parse YAML text once, with libyaml, and refuse what would make the launcher slow or crash.

libyaml scans and parses (in C); a composer that counts builds the node tree from libyaml's
events, one walk over that tree records the line of every key and checks the bounds, and the
data is constructed from the same tree. The bounds are far above any real recipe (a few hundred
values, four levels deep):

- nesting deeper than MAX_DEPTH (500 nested `[` made the pure-Python composer hit RecursionError);
- more than MAX_NODES values, counted as they are composed (so a 1 MiB list is refused after its
  first MAX_NODES items, not after building half a million nodes) and again with aliases
  expanded (a 342-byte alias bomb expands to billions; the count stops at the bound);
- numbers longer than MAX_NUMBER_CHARS (Python refuses to convert integers of 4,300 digits with
  a ValueError that is not a YAMLError; no field takes a number a tenth that long);
- NUL bytes in values (the operating system refuses such paths with a ValueError);
- explicitly tagged values their tag cannot build (`!!timestamp soon`, `!!int x`), each named
  with its line and what the tag accepts.
"""

from __future__ import annotations

from typing import Any

import yaml

from launcher.contract.text import choices
from launcher.errors import Problem, RecipeError

MAX_DEPTH = 32
MAX_NODES = 10_000
MAX_NUMBER_CHARS = 64
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_CORE = "tag:yaml.org,2002:"
# What each scalar tag of the safe constructor accepts, for the message when a value fails it.
_TAG_ACCEPTS = {
    "int": "an integer such as 42, -7, 0x2a or 1_000",
    "float": "a number such as 0.5, 1e-4, .inf or .nan",
    "bool": "true or false",
    "timestamp": "a date such as 2026-12-01, or a date and time such as 2026-12-01T10:00:00Z",
    "binary": "base64 text",
}
_BUILD_ERRORS = (yaml.YAMLError, ValueError, TypeError, AttributeError, OverflowError, IndexError, KeyError)

KeyPath = tuple  # of str | int


def _short(path: KeyPath) -> str:
    """A key path for a message: a deeply nested one is cut after its first parts."""
    shown = ".".join(map(str, path[:4]))
    return shown + ".…" if len(path) > 4 else shown


class _TreeCheck:
    """One walk over a composed node tree: the line of each key path, and every bound exceeded."""

    def __init__(self, shown: str, build):
        self.shown = shown
        self.build = build
        """Constructs one scalar node (cached by the loader, so the document reuses it)."""
        self.origins: dict[KeyPath, str] = {}
        self.problems: list[Problem] = []
        self.visited = 0

    def where(self, node: yaml.Node) -> str:
        return f"{self.shown}:{node.start_mark.line + 1}"

    def refuse(self, path: KeyPath, message: str, node: yaml.Node) -> None:
        self.problems.append(Problem(_short(path), message, self.where(node)))

    def walk(self, node: yaml.Node, path: KeyPath) -> bool:
        """Record and check `node` at `path`; False once a bound is exceeded (the walk then stops)."""
        self.visited += 1
        if self.visited > MAX_NODES:
            # Aliased nodes are shared, so their own line is the anchor's: point at the top-level key.
            top = path[:1]
            message = f"more than {MAX_NODES:,} values (counting aliases expanded); a recipe has a few hundred"
            self.problems.append(Problem(".".join(map(str, top)), message, self.origins.get(top, self.shown)))
            return False
        if len(path) > MAX_DEPTH:
            self.refuse(path, f"nested deeper than {MAX_DEPTH} levels; a recipe is a few levels deep", node)
            return False
        if isinstance(node, yaml.ScalarNode):
            self.check_scalar(node, path)
            return True
        if isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self.origins[path + (index,)] = self.where(item)
                if not self.walk(item, path + (index,)):
                    return False
            return True
        return self.walk_mapping(node, path)

    def walk_mapping(self, node: yaml.MappingNode, path: KeyPath) -> bool:
        seen = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                self.refuse(path, "a key is a list or mapping; keys are plain names", key_node)
                return False
            key = key_node.value
            if key in seen:
                self.refuse(path + (key,), "duplicate key; each key may appear once", key_node)
            seen.add(key)
            self.origins[path + (key,)] = self.where(key_node)
            if not self.walk(value_node, path + (key,)):
                return False
        return True

    def check_scalar(self, node: yaml.ScalarNode, path: KeyPath) -> None:
        if "\0" in node.value:
            self.refuse(path, "contains a NUL byte; remove it", node)
        elif node.tag in _NUMBER_TAGS and len(node.value) > MAX_NUMBER_CHARS:
            self.refuse(
                path, f"a number of {len(node.value):,} characters; numbers here have at most {MAX_NUMBER_CHARS}", node
            )
        elif node.tag != _CORE + "str":
            self.check_tagged(node, path)

    def check_tagged(self, node: yaml.ScalarNode, path: KeyPath) -> None:
        """Build the value now, so a tag its text does not fit is refused at its own line."""
        try:
            self.build(node)
        except _BUILD_ERRORS:
            name = node.tag.removeprefix(_CORE)
            shown = "!!" + name if node.tag.startswith(_CORE) else node.tag
            accepts = _TAG_ACCEPTS.get(name)
            valid = (
                f"{shown} takes {accepts}"
                if accepts
                else f"{shown} is unknown; the tags are {choices('!!' + t for t in _TAG_ACCEPTS)}"
            )
            value = node.value if len(node.value) <= 40 else node.value[:40] + "…"
            self.refuse(path, f"{shown} {value!r} cannot be read: {valid}; or drop the tag", node)


class _TooBig(Exception):
    """A bound exceeded while composing; carries the message and the line it was reached on."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


class _CountingComposer(yaml.composer.Composer):
    """PyYAML's composer over libyaml's events, refusing depth and size beyond the bounds before
    it recurses or allocates further."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.composed = 0

    def compose_node(self, parent, index):
        self.composed += 1
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH or self.composed > MAX_NODES:
                line = self.peek_event().start_mark.line + 1
                if self.depth > MAX_DEPTH:
                    raise _TooBig(f"nested deeper than {MAX_DEPTH} levels; a recipe is a few levels deep", line)
                raise _TooBig(f"more than {MAX_NODES:,} values; a recipe has a few hundred", line)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


# libyaml is present wherever PyYAML ships wheels; the pure-Python parser is a slow fallback.
if getattr(yaml, "__with_libyaml__", False):
    from yaml.cyaml import CParser as _Parser
else:  # pragma: no cover
    from yaml.loader import Parser as _Parser
LIBYAML = _Parser.__module__ != "yaml.parser"


class BoundedLoader(_CountingComposer, _Parser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
    """yaml.SafeLoader's constructor and resolver, libyaml's parser, the counting composer."""

    def __init__(self, text: str):
        if LIBYAML:
            _Parser.__init__(self, text)
        else:
            yaml.reader.Reader.__init__(self, text)
            yaml.scanner.Scanner.__init__(self)
            yaml.loader.Parser.__init__(self)
        _CountingComposer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)

    def dispose(self) -> None:
        if LIBYAML:
            _Parser.dispose(self)


def _syntax_error(err: yaml.YAMLError, shown: str) -> RecipeError:
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        detail = " ".join(part for part in (err.context, err.problem) if part)
        return RecipeError([Problem("", f"YAML syntax error: {detail}", f"{shown}:{mark.line + 1}" if mark else shown)])
    return RecipeError([Problem("", f"YAML error: {err}", shown)])


def parse_yaml(text: str, shown: str) -> tuple[Any, dict[KeyPath, str], int | None]:
    """The data of one YAML document, the origin ("file:line") of each key path, and the line the
    document starts on (None for an empty document). `shown` names the text in problems."""
    loader = BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}, None
        check = _TreeCheck(shown, loader.construct_object)
        check.walk(node, ())
        if check.problems:
            raise RecipeError(check.problems)
        return loader.construct_document(node), check.origins, node.start_mark.line + 1
    except _TooBig as err:
        raise RecipeError([Problem("", str(err), f"{shown}:{err.line}")]) from None
    except yaml.YAMLError as err:
        raise _syntax_error(err, shown) from None
    except RecursionError:  # only the pure-Python fallback composer recurses
        raise RecipeError([Problem("", f"nested deeper than {MAX_DEPTH} levels", shown)]) from None
    except (ValueError, TypeError, AttributeError, OverflowError, IndexError, KeyError) as err:
        # Kept as a last guard: tagged scalars are built (and refused with their line) in the walk.
        raise RecipeError([Problem("", f"a YAML value cannot be read: {str(err)[:200]}", shown)]) from None
    finally:
        loader.dispose()
