"""How text is shown on either side of the contract: lists of valid choices, and text from
elsewhere (the cloud, a job's log) made safe for a terminal."""

from __future__ import annotations

import re

# ANSI/VT escape sequences (CSI, OSC, and two-byte ESC forms), then any other control character.
_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]{0,4096}(?:\x07|\x1b\\)?|[@-Z\\-_])")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str, *, one_line: bool = False) -> str:
    """`text` without escape sequences or control characters, so it cannot move the cursor,
    recolour or forge lines on a terminal. `one_line` also folds newlines and tabs into spaces."""
    text = _CONTROLS.sub("", _ESCAPES.sub("", text))
    return " ".join(text.split()) if one_line else text


def choices(names) -> str:
    """'a, b or c'."""
    names = [str(n) for n in names]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
