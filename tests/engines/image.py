"""The stand-in for the training image: this machine's Python and torch, without torchao.

No PyTorch training image that SageMaker offers ships torchao, so the simulated containers must
not find it either. `build_image(source_venv, destination)` makes a venv whose site-packages
links every distribution of `source_venv` except torchao (and except the launcher itself, which
runs on the user's machine, never in the container). What the job installs there at run time
(torchao from its wheelhouse) lands in the image venv's own directory, never in the source.

Inside a container the image is used through PATH (`<image>/bin` first), the way a DLC's
Python is the first on its PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# Left out of the image: what no SageMaker PyTorch image has (with every top-level file and
# directory their RECORD lists: torchao's wheel also installs a top-level `test` package).
_ABSENT = re.compile(r"^(torchao|launcher)-[^-]+\.dist-info$", re.IGNORECASE)
_EDITABLE = re.compile(r"^__editable__.*launcher.*$")


def absent_entries(site: Path) -> set[str]:
    """Names in `site` that belong to the distributions the image must not have."""
    names = set()
    for info in site.iterdir():
        if not _ABSENT.match(info.name):
            continue
        names.add(info.name)
        record = info / "RECORD"
        for line in record.read_text().splitlines() if record.is_file() else []:
            top = line.split(",", 1)[0].split("/", 1)[0]
            if top and top != "..":
                names.add(top)
    return names | {entry.name for entry in site.iterdir() if _EDITABLE.match(entry.name)}


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if len(found) != 1:
        raise RuntimeError(f"{venv}: expected one lib/python3*/site-packages, found {found}")
    return found[0]


def build_image(source_venv: Path, destination: Path) -> Path:
    """A venv at `destination` with `source_venv`'s packages minus torchao and the launcher."""
    python = source_venv / "bin" / "python"
    subprocess.run([str(python), "-m", "venv", "--without-pip", str(destination)], check=True, timeout=120)
    source, target = site_packages(source_venv), site_packages(destination)
    absent = absent_entries(source)
    for entry in sorted(source.iterdir()):
        if entry.name in absent or (target / entry.name).exists():
            continue
        os.symlink(entry, target / entry.name)
    # Console scripts the container's command may name; their shebang is the image's Python.
    for script, module in {"torchrun": "torch.distributed.run", "pip": "pip"}.items():
        path = destination / "bin" / script
        path.write_text(
            f"#!{destination / 'bin' / 'python'}\nimport sys\nfrom runpy import run_module\n"
            f"sys.argv[0] = {script!r}\nrun_module({module!r}, run_name='__main__', alter_sys=True)\n"
        )
        path.chmod(0o755)
    check = subprocess.run(
        [str(destination / "bin" / "python"), "-c", "import importlib.util as u; print(u.find_spec('torchao'))"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if check.stdout.strip() != "None":
        raise RuntimeError(f"the image at {destination} still finds torchao: {check.stdout}{check.stderr}")
    return destination


def default_source_venv() -> Path:
    """The venv running the tests (the worktree's .venv)."""
    return Path(sys.prefix)
