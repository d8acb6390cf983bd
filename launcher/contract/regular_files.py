"""Files a job writes, read without trusting what stands at their path, standard library only.

A job's log, its error file, its records: the job (or whatever damaged its directory) may have
put a FIFO, a device or a directory where the file should be. A plain open blocks on a FIFO
until someone writes it, and reading /dev/zero to its end never ends, so every reader of such a
file opens it with `open_regular_file`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO


class NotRegularFile(OSError):
    """Something other than a regular file stands where one is read: `shape` says what."""

    def __init__(self, path: Path, shape: str):
        super().__init__(f"{path} is {shape}, not a file")
        self.shape = shape


def open_regular_file(path: Path) -> BinaryIO:
    """`path` opened to read, if it is a regular file; NotRegularFile for a directory, FIFO or
    device in its place (a FIFO would block the reader, /dev/zero would never end); the open's
    own OSError (FileNotFoundError, ...) otherwise. Files a job writes are read with it."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    kind = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(kind):
        os.close(descriptor)
        shapes = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"))
        raise NotRegularFile(path, next((name for test, name in shapes if test(kind)), "not a regular file"))
    return os.fdopen(descriptor, "rb")
