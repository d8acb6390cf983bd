"""How `launcher estimate` shows a MemoryEstimate: one column per pipeline stage."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from launcher.estimate.breakdown import COMPONENTS
from launcher.estimate.memory import MemoryEstimate

VERDICT_STYLE = {"fits": "green", "risky": "yellow", "oom": "red"}


def estimate_table(estimate: MemoryEstimate, title: str = "") -> Group:
    # A tiny CPU model would show 0.00 in every row in GiB: below one GiB of peak the table is in MiB.
    unit, scale = ("GiB", 2**30) if max(s.peak_bytes for s in estimate.stages) >= 2**30 else ("MiB", 2**20)

    def amount(value: int) -> str:
        return f"{value / scale:.2f}"

    table = Table(title=title or None, title_justify="left", show_footer=True)
    table.add_column(f"{unit} per GPU", footer="peak")
    for stage in estimate.stages:
        label = f"stage {stage.stage}" if len(estimate.stages) > 1 else "all layers"
        table.add_column(
            f"{label}\n{stage.layers} layers, {stage.phase}",
            justify="right",
            footer=amount(stage.peak_bytes),
            style="bold" if stage.stage == estimate.peak_stage and len(estimate.stages) > 1 else None,
        )
    for name in COMPONENTS:
        if name == "cuda_context":
            table.add_row(
                Text("allocated", style="italic"),
                *(Text(amount(stage.allocated_bytes), style="italic") for stage in estimate.stages),
                end_section=True,
            )
        if any(stage.breakdown[name] for stage in estimate.stages):
            table.add_row(name, *(amount(stage.breakdown[name]) for stage in estimate.stages))
    style = VERDICT_STYLE[estimate.verdict]
    lines: list = [table, Text.from_markup(f"[{style}]{estimate.headline()}[/]")]
    if estimate.suggestion:
        lines.append(Text(f"suggestion: {estimate.suggestion}"))
    lines += [Text(f"note: {note}", style="dim") for note in estimate.notes]
    return Group(*lines)
