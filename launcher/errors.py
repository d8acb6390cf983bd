"""Every error a user can cause derives from LauncherError; the CLI prints it in one place."""

from __future__ import annotations

from dataclasses import dataclass


class LauncherError(Exception):
    """An error caused by input or environment, shown to the user as text, never as a traceback."""

    exit_code = 1

    def lines(self) -> list[str]:
        return [str(self)]


class UsageError(LauncherError):
    """Bad input on the command line or in a file: exit code 2."""

    exit_code = 2


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
