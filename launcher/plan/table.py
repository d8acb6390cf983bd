"""How `launcher plan` shows a search: one row per layout, then why the best one wins.

The table fits the width it is printed in: when all its columns do not, the parallel degrees
fold into one `layout` column, then the columns a user needs least fold away, one at a time,
until it fits; the layout, memory, speed, run time and cost always stay. With no width (a pipe,
a file) every column is shown."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from launcher.display.text import duration
from launcher.plan.explain import against_recipe, why
from launcher.plan.result import LayoutPlan, Search

# parallel.grad_accumulation, short: when FSDP reduce-scatters gradients (and re-gathers weights).
GRAD_SYNC = {"sync_each": "each", "sync_last": "last", "sync_last_gathered": "last+kept", "auto": "auto"}

# The parallel degrees as the folded `layout` column writes them: "tp4 cp2 fsdp8".
SHORT_DEGREES = {"tensor": "tp", "context": "cp", "pipeline": "pp", "data_shard": "fsdp", "data_replicate": "dp"}
# Expert parallelism, shown only where a mixture-of-experts search has it.
EXPERT_SHORT = ("expert", "ep")


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    cell: Callable[[int, LayoutPlan], str]
    left: bool = False


def _pipeline(plan: LayoutPlan) -> str:
    layout = plan.layout
    return str(layout.pipeline) + (f" (v{layout.virtual_stages})" if layout.virtual_stages > 1 else "")


def _short_layout(plan: LayoutPlan) -> str:
    layout = plan.layout
    degrees = [*SHORT_DEGREES.items(), EXPERT_SHORT]
    parts = [f"{short}{getattr(layout, name)}" for name, short in degrees if getattr(layout, name) > 1]
    if layout.virtual_stages > 1:
        parts = [part + f"v{layout.virtual_stages}" if part.startswith("pp") else part for part in parts]
    return " ".join(parts) or "fsdp1"


RANK = Column("#", lambda rank, plan: str(rank))
DEGREES = [
    Column("tensor", lambda rank, plan: str(plan.layout.tensor)),
    Column("context", lambda rank, plan: str(plan.layout.context)),
    Column("pipeline", lambda rank, plan: _pipeline(plan)),
    Column("data\nshard", lambda rank, plan: str(plan.layout.data_shard)),
    Column("data\nreplicate", lambda rank, plan: str(plan.layout.data_replicate)),
]
EXPERT = Column("expert", lambda rank, plan: str(plan.layout.expert))
LAYOUT = Column("layout", lambda rank, plan: _short_layout(plan), left=True)
MICRO_BATCH = Column("micro\nbatch", lambda rank, plan: str(plan.micro_batch_size))
AC = Column("AC", lambda rank, plan: plan.activation_checkpointing, left=True)
GRAD = Column("grad\nsync", lambda rank, plan: GRAD_SYNC[plan.grad_accumulation], left=True)
FP8 = Column("fp8", lambda rank, plan: "yes" if plan.fp8 else "no")
MEMORY = Column("peak\nmemory", lambda rank, plan: f"{plan.memory.utilization:.0%}")
SPEED = Column("tokens/s\n/GPU", lambda rank, plan: f"{plan.throughput.tokens_per_s_per_gpu:,.0f}")
MFU = Column("MFU", lambda rank, plan: plan.throughput.mfu_text())
PER_TOKEN = Column("$ per 1M\ntokens", lambda rank, plan: f"{plan.throughput.usd_per_million_tokens:.2f}")
RUN_TIME = Column(
    "run\ntime",
    lambda rank, plan: "-" if plan.throughput.time_to_train_s is None else duration(plan.throughput.time_to_train_s),
)
RUN_COST = Column(
    "run\ncost",
    lambda rank, plan: "-" if plan.throughput.usd_per_run is None else f"${plan.throughput.usd_per_run:,.0f}",
)
COLUMNS = (RANK, *DEGREES, MICRO_BATCH, AC, GRAD, FP8, MEMORY, SPEED, MFU, PER_TOKEN, RUN_TIME, RUN_COST)
FOLD_AWAY = (PER_TOKEN, MFU, GRAD, MICRO_BATCH, RANK, FP8, AC)
"""What goes, in this order, when the table is still too wide with the degrees folded."""


def plan_table(search: Search, title: str = "", width: int | None = None) -> Group:
    """The ranked layouts, fitted to `width` columns (None: every column, however wide)."""
    columns, hidden = _fitting_columns(search, width)
    lines: list = [_table(search, columns, title)]
    if hidden:
        names = ", ".join(column.header.replace("\n", " ") for column in hidden)
        lines.append(Text(f"folded to fit {width} columns: {names}; a pipe or --json shows them all", style="dim"))
    if LAYOUT in columns:
        degrees = [*SHORT_DEGREES.items(), *([EXPERT_SHORT] if _has_experts(search) else [])]
        legend = ", ".join(f"{short} {name}" for name, short in degrees)
        lines.append(Text(f"layout: {legend}", style="dim"))
    lines.append(Text(why(search)))
    note = against_recipe(search)
    if note:
        lines.append(Text(note))
    lines += [Text(f"note: {note}", style="yellow") for note in search.notes]
    errors = "docs/planner.md" if search.budget.accelerator.peak_bf16_tflops else "docs/monitoring.md, on CPUs,"
    lines.append(
        Text(
            f"{search.considered:,} valid layouts scored, {search.estimated:,} memory estimates, "
            f"{search.elapsed_s * 1000:.0f} ms; speeds are model predictions ({errors} gives their error).",
            style="dim",
        )
    )
    return Group(*lines)


def _fitting_columns(search: Search, width: int | None) -> tuple[list[Column], list[Column]]:
    """The columns to show within `width`, and those folded away (the degrees are not: they are
    in `layout`)."""
    degrees = [*DEGREES, EXPERT] if _has_experts(search) else DEGREES
    columns = list(COLUMNS)
    start = columns.index(DEGREES[0])
    columns[start : start + len(DEGREES)] = degrees
    if width is None or _width(_table(search, columns)) <= width:
        return columns, []
    columns[start : start + len(degrees)] = [LAYOUT]
    hidden: list[Column] = []
    for column in FOLD_AWAY:
        if _width(_table(search, columns)) <= width:
            break
        columns.remove(column)
        hidden.append(column)
    return columns, hidden


def _has_experts(search: Search) -> bool:
    return any(plan.layout.expert > 1 for plan in search.ranked)


def _width(table: Table) -> int:
    console = Console(file=io.StringIO(), width=100_000)
    return console.measure(table).maximum


def _table(search: Search, columns: list[Column], title: str = "") -> Table:
    table = Table(title=title or None, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    per_rank = search.best.memory.device != "GPU"  # the host CPU: tokens/s per CPU rank
    for column in columns:
        header = "tokens/s\n/CPU rank" if column is SPEED and per_rank else column.header
        table.add_column(header, justify="left" if column.left else "right", no_wrap=True)
    for rank, plan in enumerate(search.ranked, 1):
        table.add_row(*(column.cell(rank, plan) for column in columns), style="bold" if rank == 1 else None)
    return table
