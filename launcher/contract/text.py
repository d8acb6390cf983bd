"""How error messages, on either side of the contract, list what would be valid."""

from __future__ import annotations


def choices(names) -> str:
    """'a, b or c'."""
    names = [str(n) for n in names]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
