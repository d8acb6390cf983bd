"""Every error a user can cause derives from LauncherError; the CLI prints it in one place.

The exit codes, the same for every command (README "Exit codes"):
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK = 0
EXIT_JOB_FAILED = 1
"""The job ran and failed (submit --wait, logs --follow), or an error of no other kind."""
EXIT_USAGE = 2
"""Bad input: a recipe, an option, a file; or a job that would not fit in GPU memory."""
EXIT_ENGINE = 3
"""The cloud or the engine refused or failed: AWS, Slurm, kubectl, docker."""
EXIT_DETACHED = 130
"""Ctrl-C while following a job: the job goes on."""


class LauncherError(Exception):
    """An error caused by input or environment, shown to the user as text, never as a traceback."""

    exit_code = EXIT_JOB_FAILED

    def lines(self) -> list[str]:
        return [str(self)]


class UsageError(LauncherError):
    """Bad input on the command line or in a file: exit code 2."""

    exit_code = EXIT_USAGE


class EngineError(LauncherError):
    """AWS, Slurm, Kubernetes or docker refused or failed: exit code 3."""

    exit_code = EXIT_ENGINE


class Detached(LauncherError):
    """Ctrl-C while following a job: the job keeps running; the message says how to reach it."""

    exit_code = EXIT_DETACHED

    def __init__(self, name: str):
        super().__init__(
            f"detached from {name}; it is still running. Follow it with `launcher logs {name} --follow`, "
            f"stop it with `launcher stop {name}`"
        )
        self.name = name


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a recipe: where it is and what would be valid."""

    path: str  # dotted key path, "" for the whole file
    message: str
    source: str = ""  # "recipes/x.yaml:14", "--set", or "" when unknown

    def __str__(self) -> str:
        where = " ".join(part for part in (self.source, self.path + ":" if self.path else "") if part)
        return f"{where} {self.message}" if where else self.message


class RecipeError(UsageError):
    """A recipe that cannot be run; carries one Problem per thing wrong."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    def lines(self) -> list[str]:
        return [str(p) for p in self.problems]
