"""How `launcher estimate` shows a MemoryEstimate: one column per pipeline stage."""

from __future__ import annotations

import io

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from launcher.estimate.breakdown import COMPONENTS
from launcher.estimate.memory import MemoryEstimate

VERDICT_STYLE = {"fits": "green", "risky": "yellow", "oom": "red"}


def estimate_table(estimate: MemoryEstimate, title: str = "", width: int | None = None) -> Group:
    """One column per pipeline stage; when they do not all fit in `width` columns, the stages
    are shown in as few tables as fit, each with the row labels (None: one table, however wide)."""
    # A tiny CPU model would show 0.00 in every row in GiB: below one GiB of peak the table is in MiB.
    unit = ("GiB", 2**30) if max(s.peak_bytes for s in estimate.stages) >= 2**30 else ("MiB", 2**20)
    groups: list[list] = [[]]
    for stage in estimate.stages:
        if groups[-1] and width is not None and _width(_stages_table(estimate, [*groups[-1], stage], unit)) > width:
            groups.append([])
        groups[-1].append(stage)
    lines: list = [_stages_table(estimate, group, unit, title if i == 0 else "") for i, group in enumerate(groups)]
    style = VERDICT_STYLE[estimate.verdict]
    lines.append(Text.from_markup(f"[{style}]{estimate.headline()}[/]"))
    if estimate.suggestion:
        lines.append(Text(f"suggestion: {estimate.suggestion}"))
    lines += [Text(f"note: {note}", style="dim") for note in estimate.notes]
    return Group(*lines)


def _stages_table(estimate: MemoryEstimate, stages: list, unit: tuple[str, int], title: str = "") -> Table:
    name, scale = unit

    def amount(value: int) -> str:
        return f"{value / scale:.2f}"

    table = Table(title=title or None, title_justify="left", show_footer=True)
    table.add_column(f"{name} {estimate.per_device}", footer="peak", no_wrap=True)
    for stage in stages:
        label = f"stage {stage.stage}" if len(estimate.stages) > 1 else "all layers"
        table.add_column(
            f"{label}\n{stage.layers} layers, {stage.phase}",  # may wrap: its numbers cannot
            justify="right",
            footer=amount(stage.peak_bytes),
            style="bold" if stage.stage == estimate.peak_stage and len(estimate.stages) > 1 else None,
        )
    for component in COMPONENTS:
        if component == "cuda_context":
            table.add_row(
                Text("allocated", style="italic"),
                *(Text(amount(stage.allocated_bytes), style="italic") for stage in stages),
                end_section=True,
            )
        if any(stage.breakdown[component] for stage in estimate.stages):
            table.add_row(component, *(amount(stage.breakdown[component]) for stage in stages))
    return table


def _width(table: Table) -> int:
    """The fewest columns `table` takes with its headers wrapped and no cell cut."""
    return Console(file=io.StringIO(), width=100_000).measure(table).minimum
