"""Shared fixtures: run the real CLI in-process and capture what a user would see."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `launcher ARGS...` through `launcher.cli.main`, returning exit code, stdout, stderr."""
    from launcher.cli import main

    def run(*args: str) -> CliResult:
        monkeypatch.setattr(sys, "argv", ["launcher", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run
