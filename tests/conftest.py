"""Shared fixtures: run the real CLI in-process and capture what a user would see."""

from __future__ import annotations

import os
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


@pytest.fixture(autouse=True)
def _no_ambient_aws_region(monkeypatch):
    """A region from the developer's shell or ~/.aws/config would change what recipes render
    (sagemaker.region follows the AWS CLI's order); tests that need one set it themselves."""
    for key in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)


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
