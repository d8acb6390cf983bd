"""The plan and estimate tables fit the terminal they are printed on, from 80 columns up, with
the columns a user needs kept whole; piped, the table is complete."""

from __future__ import annotations

import io
import json
import re

import pytest

import launcher.cli
from tests.backends.helpers import recipe_path

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def terminal(monkeypatch):
    """`launcher.cli`'s stdout console as a terminal `width` columns wide; returns what it shows."""

    def at(width: int):
        screen = io.StringIO()
        console = launcher.cli._Console(file=screen, force_terminal=True, width=width, soft_wrap=True, highlight=False)
        monkeypatch.setattr(launcher.cli, "out", console)
        return screen

    return at


def table_lines(text: str) -> list[str]:
    """The table's lines: those before the explanation that follows it."""
    lines = ANSI.sub("", text).splitlines()
    return lines[: next(i for i, line in enumerate(lines) if " is fastest at " in line or line.startswith("folded"))]


@pytest.mark.parametrize("width", [80, 100, 200])
def test_the_plan_table_fits_the_terminal_and_keeps_layout_memory_speed_time_and_cost(cli, terminal, width):
    recipe = recipe_path("mistral7b-32k")
    plans = json.loads(cli("plan", recipe, "--top", "3", "--json").out)
    screen = terminal(width)
    assert cli("plan", recipe, "--top", "3").code == 0
    shown = ANSI.sub("", screen.getvalue())
    lines = table_lines(shown)
    assert max(map(len, lines)) <= width and "…" not in shown, shown
    headers = " ".join(lines[1:4])
    for header in ("peak", "memory", "tokens/s", "run", "time", "cost"):
        assert header in headers, (header, shown)
    rows = [line.split() for line in lines if line.strip()[:1].isdigit() or line.strip().startswith("cp")]
    assert [row[-1] for row in rows] == [f"${plan['usd_per_run']:,.0f}" for plan in plans]
    for row, plan in zip(rows, plans, strict=True):
        # --json keeps one decimal: 9148.5 may print as 9,149 from the unrounded 9148.53.
        speeds = {f"{plan['tokens_per_s_per_gpu'] + d:,.0f}" for d in (-0.05, 0.05)}
        assert f"{plan['memory_utilization']:.0%}" in row and speeds & set(row), (row, plan)
    if width < 200:  # the degrees fold into one column, as the legend says
        assert "layout" in headers and "layout: tp tensor, cp context" in shown
        assert [row[1] if row[0].isdigit() else row[0] for row in rows][0] == f"cp{plans[0]['context']}"


def test_piped_plan_output_is_the_whole_table(cli):
    result = cli("plan", recipe_path("mistral7b-32k"), "--top", "3")
    plans = json.loads(cli("plan", recipe_path("mistral7b-32k"), "--top", "3", "--json").out)
    assert "…" not in result.out
    lines = table_lines(result.out)
    for header in ("tensor", "context", "pipeline", "replicate", "MFU", "$ per 1M", "fp8", "cost"):
        assert header in "\n".join(lines[:4]), header
    costs = [line.split()[-1] for line in lines if line.strip()[:1].isdigit()]
    assert costs == [f"${plan['usd_per_run']:,.0f}" for plan in plans]


def test_the_estimate_table_at_80_columns_keeps_its_row_labels_and_splits_the_stages(cli, terminal):
    screen = terminal(80)
    result = cli(
        "estimate", recipe_path("llama70b-128k"), "--set", "parallel.pipeline=8", "--set", "parallel.context=1"
    )
    shown = ANSI.sub("", screen.getvalue())
    # The sentences after the table are left to the terminal to wrap (soft wrap): only the tables must fit.
    tables = [line for line in shown.splitlines() if line[:1] in "┏┃┡│├└"]
    assert result.code == 2 and "…" not in shown and max(map(len, tables)) <= 80, shown
    assert shown.count("│ optimizer_states │") >= 2  # the labels repeat beside each group of stages
    assert all(f"stage {n}" in shown for n in range(8))
