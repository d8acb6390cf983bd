"""Rewrite the command outputs quoted in README.md and docs/*.md from the commands themselves.

A quoted output is a fenced block with no language whose first line is `$ launcher ARGS`, with
an optional `2>&1 | head -N`; the lines after it are what the command prints, stdout and stderr
together as a terminal shows them, piped (so tables are whole). Each command runs in this
process, through `launcher.cli.main`, so the check is cheap enough for the test suite
(tests/test_docs_examples.py).

    python scripts/docs_examples.py           # rewrite every stale block
    python scripts/docs_examples.py --check   # list them and exit 1; change nothing
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```\n(\$ launcher [^\n]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
HEAD = re.compile(r"\s*(?:2>&1\s*)?\|\s*head -(?:n\s*)?(\d+)\s*$")


@dataclass(frozen=True)
class Example:
    path: Path
    command: str  # as quoted, without the `$ `
    quoted: str  # the lines after it, each ending in a newline
    start: int  # where the block's output begins and ends in the file
    end: int

    def output(self) -> str:
        """What the command prints now."""
        head = HEAD.search(self.command)
        args = shlex.split(self.command[: head.start()] if head else self.command)[1:]
        text = run_launcher(args)
        if head:
            text = "".join(text.splitlines(keepends=True)[: int(head.group(1))])
        return text if text.endswith("\n") or not text else text + "\n"


def run_launcher(args: list[str]) -> str:
    """`launcher ARGS` in this process from the repository root, stdout and stderr as one stream."""
    from launcher.cli import main

    written = io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(written), contextlib.redirect_stderr(written):
        with contextlib.suppress(SystemExit):
            main(args)
    return written.getvalue()


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def examples(path: Path) -> list[Example]:
    text = path.read_text()
    return [Example(path, m.group(1)[2:], m.group(2), m.start(2), m.end(2)) for m in BLOCK.finditer(text)]


def stale() -> list[tuple[Example, str]]:
    """(example, what it prints now) for each quoted output that differs."""
    found = []
    for path in documents():
        for example in examples(path):
            now = example.output()
            if now != example.quoted:
                found.append((example, now))
    return found


def rewrite(changes: list[tuple[Example, str]]) -> None:
    by_file: dict[Path, list[tuple[Example, str]]] = {}
    for example, now in changes:
        by_file.setdefault(example.path, []).append((example, now))
    for path, edits in by_file.items():
        text = path.read_text()
        for example, now in sorted(edits, key=lambda edit: edit[0].start, reverse=True):
            text = text[: example.start] + now + text[example.end :]
        path.write_text(text)


def main(argv: list[str]) -> int:
    changes = stale()
    for example, _ in changes:
        print(f"{example.path.relative_to(REPO)}: `{example.command}` prints something else now")
    if "--check" in argv:
        return 1 if changes else 0
    rewrite(changes)
    print(f"{len(changes)} block(s) rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
