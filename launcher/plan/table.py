"""How `launcher plan` shows a search: one row per layout, then why the best one wins."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from launcher.display.text import duration
from launcher.plan.explain import against_recipe, why
from launcher.plan.result import Search

# parallel.grad_accumulation, short: when FSDP reduce-scatters gradients (and re-gathers weights).
GRAD_SYNC = {"sync_each": "each", "sync_last": "last", "sync_last_gathered": "last+kept", "auto": "auto"}

COLUMNS = (
    "#",
    "tensor",
    "context",
    "pipeline",
    "data\nshard",
    "data\nreplicate",
    "micro\nbatch",
    "AC",
    "grad\nsync",
    "fp8",
    "peak\nmemory",
    "tokens/s\n/GPU",
    "MFU",
    "$ per 1M\ntokens",
    "run\ntime",
    "run\ncost",
)


def plan_table(search: Search, title: str = "") -> Group:
    table = Table(title=title or None, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("AC", "grad\nsync") else "right", no_wrap=True)
    for rank, plan in enumerate(search.ranked, 1):
        layout, speed = plan.layout, plan.throughput
        pipeline = str(layout.pipeline) + (f" (v{layout.virtual_stages})" if layout.virtual_stages > 1 else "")
        table.add_row(
            str(rank),
            str(layout.tensor),
            str(layout.context),
            pipeline,
            str(layout.data_shard),
            str(layout.data_replicate),
            str(plan.micro_batch_size),
            plan.activation_checkpointing,
            GRAD_SYNC[plan.grad_accumulation],
            "yes" if plan.fp8 else "no",
            f"{plan.memory.utilization:.0%}",
            f"{speed.tokens_per_s_per_gpu:,.0f}",
            f"{speed.mfu:.0%}",
            f"{speed.usd_per_million_tokens:.2f}",
            "-" if speed.time_to_train_s is None else duration(speed.time_to_train_s),
            "-" if speed.usd_per_run is None else f"${speed.usd_per_run:,.0f}",
            style="bold" if rank == 1 else None,
        )
    lines: list = [table, Text(why(search))]
    note = against_recipe(search)
    if note:
        lines.append(Text(note))
    lines += [Text(f"note: {note}", style="yellow") for note in search.notes]
    lines.append(
        Text(
            f"{search.considered:,} valid layouts scored, {search.estimated:,} memory estimates, "
            f"{search.elapsed_s * 1000:.0f} ms; speeds are model predictions (docs/planner.md gives their error).",
            style="dim",
        )
    )
    return Group(*lines)
