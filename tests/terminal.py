"""The CLI under a real pseudo-terminal of a given size, and the screen it leaves.

`screen_lines` replays what was written the way a VT100 terminal draws it, for the controls
rich writes (carriage return, line feed, cursor up, erase in line, colours): the lines a user
would read, scrollback included, so a test can assert that no line is glued to another.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable

from tests import REPO

_CONTROL = re.compile(r"\x1b\[([?0-9;]*)([A-Za-z])|\x1b\][^\x07]*\x07|[\r\n\x08]|[^\x1b\r\n\x08]+")
_SIZE_VARIABLES = ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")


class Terminal:
    """A command run with stdin, stdout and stderr on one pty `columns` wide."""

    def __init__(self, argv: list[str], *, columns: int, env: dict[str, str]):
        self.columns = columns
        self.primary, secondary = pty.openpty()
        fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
        environment = {k: v for k, v in os.environ.items() if k not in _SIZE_VARIABLES}
        environment |= {"TERM": "xterm-256color", "PYTHONPATH": str(REPO), **env}
        self.process = subprocess.Popen(
            argv, cwd=REPO, env=environment, stdin=secondary, stdout=secondary, stderr=secondary, start_new_session=True
        )
        os.close(secondary)
        self.written = ""

    def read_until(self, done: Callable[[str], bool], timeout_s: float = 60.0) -> str:
        """Read what the command writes until `done(everything so far)` or it ends."""
        deadline = time.monotonic() + timeout_s
        while not done(self.written):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; the terminal shows:\n{self.written[-2000:]}")
            ready, _, _ = select.select([self.primary], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(self.primary, 65536)
                except OSError:  # EIO: every writer closed the pty
                    chunk = b""
                if not chunk:
                    break
                self.written += chunk.decode(errors="replace")
        return self.written

    def finish(self, timeout_s: float = 60.0) -> int:
        """Read to the end and return the exit code."""
        self.read_until(lambda _: False if self.process.poll() is None else self._drained(), timeout_s)
        os.close(self.primary)
        return self.process.wait(timeout=timeout_s)

    def _drained(self) -> bool:
        ready, _, _ = select.select([self.primary], [], [], 0.05)
        return not ready


def screen_lines(written: str, columns: int) -> list[str]:
    rows: list[list[str]] = [[]]
    row = col = 0
    for match in _CONTROL.finditer(written):
        text, (params, final) = match.group(0), match.groups()
        if final == "A":  # cursor up
            row = max(0, row - int(params or 1))
        elif final == "K":  # erase in line: 2 the whole line, else from the cursor on
            rows[row][:] = [] if params == "2" else rows[row][:col]
        elif final is not None or text.startswith("\x1b]"):
            continue  # colours, cursor visibility, hyperlinks: nothing drawn
        elif text == "\r":
            col = 0
        elif text == "\n":
            row += 1
            rows.extend([] for _ in range(row + 1 - len(rows)))
        elif text == "\x08":
            col = max(0, col - 1)
        else:
            for char in text:
                if col == columns:  # a full line wraps to the next
                    row, col = row + 1, 0
                    rows.extend([] for _ in range(row + 1 - len(rows)))
                line = rows[row]
                line.extend(" " * (col + 1 - len(line)))
                line[col] = char
                col += 1
    lines = ["".join(line).rstrip() for line in rows]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def launcher_argv(*args: str, fake_trainer: bool = False) -> list[str]:
    """`launcher ARGS` in a fresh Python; with fake_trainer, local jobs run the stand-in trainer
    (tests/backends/fake_entrypoints) directly, as the no_torchrun fixture arranges in-process."""
    if not fake_trainer:
        return [sys.executable, "-m", "launcher", *args]
    setup = (
        "import sys; import launcher.bundle, launcher.backends.local.backend as local; "
        "from tests.backends.helpers import FAKE_ENTRYPOINTS; "
        "launcher.bundle.find_entrypoints = lambda: FAKE_ENTRYPOINTS; "
        "local.torchrun_argv = lambda c: [sys.executable, *c[c.index('entrypoints/train.py'):]]; "
        "from launcher.cli import main; main(sys.argv[1:])"
    )
    return [sys.executable, "-c", setup, *args]
