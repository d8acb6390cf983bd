"""Every error a user can cause derives from LauncherError; the CLI prints it in one place.

The exit codes, the same for every command (README "Exit codes"):
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

from launcher.contract.text import terminal_safe

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


# --- what a service said -------------------------------------------------------------------------

SERVICE_TEXT_LIMIT = 300
"""Characters of a service's words kept in one line of ours."""
# A body in markup: a proxy's or load balancer's error page, or XML where the client expected JSON.
# botocore itself replaces only a 5xx body that starts with `<html>` (botocore/parsers.py,
# `_is_generic_error_response`); `<!doctype html>`, XML and any 4xx page reach the error as sent.
_MARKUP = re.compile(r"<(?:!doctype|html|head|body|title|\?xml|Error\b|ErrorResponse\b)", re.IGNORECASE)
_HIDDEN = re.compile(r"<(script|style)\b.*?</\1\s*>|<!--.*?-->", re.IGNORECASE | re.DOTALL)
_TAG = re.compile(r"<[^>]*>")


def _element(name: str, text: str) -> str | None:
    match = re.search(rf"<{name}\b[^>]*>(.*?)</{name}\s*>", text, re.IGNORECASE | re.DOTALL)
    return match.group(1) if match else None


def service_text(text: str) -> str:
    """A service's words for one line of ours: an HTML or XML body is reduced to its message
    (an XML `<Message>`, else the page's `<title>`, else its text), never its markup; no escape
    sequences, one line, at most SERVICE_TEXT_LIMIT characters."""
    if _MARKUP.search(text):
        text = _HIDDEN.sub(" ", text)
        text = _element("Message", text) or _element("title", text) or text
        text = html.unescape(_TAG.sub(" ", text))
    text = terminal_safe(text, one_line=True)
    return text if len(text) <= SERVICE_TEXT_LIMIT else text[: SERVICE_TEXT_LIMIT - 3] + "..."


def service_error(error: Exception) -> tuple[str, str]:
    """(code, message) of an error a service answered (a botocore ClientError's `response`), each
    made one plain line by `service_text`; the code of an XML body is its `<Code>`."""
    details = (getattr(error, "response", None) or {}).get("Error", {})
    code, message = str(details.get("Code", "")), str(details.get("Message", ""))
    if _MARKUP.search(message):
        code = service_text(_element("Code", message) or "") or code
    return service_text(code), service_text(message)
