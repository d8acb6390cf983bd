"""Small HTML pieces for `_repr_html_`: a key/value table, a grid with a header, a link.

Every text that reaches the page goes through `html.escape` here, once, so a recipe name or a
cloud's status message cannot inject markup.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

_CELL = "padding:2px 8px;text-align:left"


def _caption(title: str | None) -> str:
    return f"<caption style='text-align:left;font-weight:bold'>{html.escape(title)}</caption>" if title else ""


def table(rows: Iterable[tuple[str, str]], *, title: str | None = None, raw: Iterable[tuple[str, str]] = ()) -> str:
    """A two-column table of (key, text) rows; `raw` rows hold markup already built here (links, SVG)."""
    cells = [
        f"<tr><th style='{_CELL}'>{html.escape(str(key))}</th><td style='{_CELL}'>{html.escape(str(value))}</td></tr>"
        for key, value in rows
    ]
    cells += [
        f"<tr><th style='{_CELL}'>{html.escape(key)}</th><td style='{_CELL}'>{markup}</td></tr>" for key, markup in raw
    ]
    return f"<table>{_caption(title)}{''.join(cells)}</table>"


def grid(
    header: Sequence[str], rows: Iterable[Sequence[str]], *, title: str | None = None, marked: int | None = None
) -> str:
    """A table with a header row; row number `marked` (the best plan) is shown in bold."""
    head = "".join(f"<th style='{_CELL}'>{html.escape(str(h))}</th>" for h in header)
    body = []
    for index, row in enumerate(rows):
        style = _CELL + (";font-weight:bold" if index == marked else "")
        body.append("<tr>" + "".join(f"<td style='{style}'>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    return f"<table>{_caption(title)}<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def link(text: str, url: str) -> str:
    return f"<a href='{html.escape(url, quote=True)}' target='_blank'>{html.escape(text)}</a>"


def links(pairs: Iterable[tuple[str, str]]) -> str:
    """(text, url) pairs as links separated by a dot."""
    return " · ".join(link(text, url) for text, url in pairs)


def block(*parts: str) -> str:
    """Pieces of markup one under the other."""
    return "<div>" + "".join(f"<div style='margin:4px 0'>{part}</div>" for part in parts) + "</div>"
