"""Real small file systems for the full-disk tests: a tmpfs of a given size, filled to the block."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path


@contextlib.contextmanager
def small_disk(directory: Path, size: str = "256k"):
    """A real tmpfs of `size` mounted at `directory` (made if missing), unmounted at the end."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], check=True)
    try:
        yield directory
    finally:
        if subprocess.run(["umount", str(directory)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(directory)], check=True)  # a file still open in it


def fill_disk(directory: Path, leave_blocks: int = 0) -> None:
    """Write a filler file until exactly `leave_blocks` blocks of the file system stay free."""
    free = os.statvfs(directory)
    with (directory / "filler").open("ab") as filler:
        filler.write(b"\0" * ((free.f_bavail - leave_blocks) * free.f_bsize))
    assert os.statvfs(directory).f_bavail == leave_blocks
