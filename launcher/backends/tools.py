"""Run an engine's command-line tool (docker, sbatch, kubectl) and turn failures into one line."""

from __future__ import annotations

import subprocess

from launcher.backends.base import EngineUnavailable
from launcher.errors import EngineError


class ToolFailed(EngineError):
    def __init__(self, message: str, output: str):
        super().__init__(message)
        self.output = output


def run_tool(argv: list[str], *, action: str, input: str | None = None, timeout: float = 120) -> str:
    """stdout of `argv`; EngineUnavailable when the tool is missing or hangs, ToolFailed on an error exit."""
    tool = argv[0]
    try:
        result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise EngineUnavailable(
            f"{action}: `{tool}` is not installed here (not on PATH); install it, or run this where {tool} works"
        ) from None
    except subprocess.TimeoutExpired:
        raise EngineUnavailable(f"{action}: `{tool}` did not answer in {timeout:.0f} s") from None
    if result.returncode:
        output = " ".join((result.stderr or result.stdout).split()) or f"exit code {result.returncode}"
        raise ToolFailed(f"{action}: {tool} failed: {output}", output)
    return result.stdout


def stream_tool(argv: list[str], *, action: str):
    """Lines of `argv`'s output as they come (for `logs --follow`, which ends when the job does)."""
    try:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except FileNotFoundError:
        raise EngineUnavailable(f"{action}: `{argv[0]}` is not installed here") from None
    with process:
        assert process.stdout is not None
        for line in process.stdout:
            yield line.rstrip("\n")
    if process.returncode:
        raise ToolFailed(f"{action}: {argv[0]} exited with code {process.returncode}", "")
