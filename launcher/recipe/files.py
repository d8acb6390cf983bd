"""Read a file a user named (a recipe, an `extends` target, a Hugging Face config.json) safely.

Only regular files are read, and only up to a size cap: a FIFO would block the reader forever,
/dev/zero would fill memory, and a 10 MB "recipe" is a mistake, not a recipe. Every refusal is an
`UnreadableFile` whose message says what the path is and what would be valid; callers add where
the path came from.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

MAX_FILE_BYTES = 1 << 20
"""1 MiB: recipes and model configs are a few kilobytes; anything near this is not one."""


class UnreadableFile(Exception):
    """A path that is not a readable regular text file under the cap; the message is one line."""


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _os_error_text(err: OSError) -> str:
    if err.errno == errno.ENOENT:
        return "no such file"
    if err.errno == errno.ENAMETOOLONG:
        return "name is too long for the file system (at most 255 characters per name)"
    if err.errno == errno.ENOTDIR:
        return "a part of the path is not a directory"
    if err.errno == errno.ELOOP:
        return "symbolic links loop"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return f"cannot read: {err.strerror or err}"


def _too_big(size: int, limit: int, what: str) -> UnreadableFile:
    return UnreadableFile(f"is {size:,} bytes; a {what} may be at most {limit:,} bytes ({limit >> 20} MiB)")


def read_text_file(path: str | Path, *, what: str = "recipe file", limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of the regular file `path`, at most `limit` bytes, or UnreadableFile."""
    name = os.fspath(path)
    if "\0" in name:
        raise UnreadableFile("path contains a NUL byte; write the file's path")
    try:
        # stat first so a FIFO or a device is refused before open could block or stream forever.
        kind = _kind(os.stat(name).st_mode)
        if kind is not None:
            raise UnreadableFile(f"is {kind}, not a {what}")
        # O_NONBLOCK: if the path became a FIFO since the stat, open returns instead of waiting.
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise UnreadableFile(_os_error_text(err)) from None
    try:
        status = os.fstat(fd)
        kind = _kind(status.st_mode)
        if kind is not None:
            raise UnreadableFile(f"is {kind}, not a {what}")
        if status.st_size > limit:
            raise _too_big(status.st_size, limit, what)
        with os.fdopen(fd, "rb", closefd=False) as stream:
            data = stream.read(limit + 1)  # one byte more tells a file that grew since the fstat
    except OSError as err:
        raise UnreadableFile(_os_error_text(err)) from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise _too_big(len(data), limit, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UnreadableFile(f"is not UTF-8 text (byte {err.start}); a {what} is text") from None
    if "\0" in text:
        line = text.count("\n", 0, text.index("\0")) + 1
        raise UnreadableFile(f"contains a NUL byte on line {line}; a {what} is text")
    return text
