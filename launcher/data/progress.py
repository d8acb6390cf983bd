"""The progress bar of a preparation: rich, on stderr, and silent when stderr is no terminal."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn


class PrepareProgress:
    """Advanced by characters read (against the inputs' bytes: an estimate for JSON and Parquet)."""

    def __init__(self, total_bytes: int, workers: int):
        console = Console(stderr=True)
        self.bar = Progress(
            TextColumn("tokenizing on {task.fields[workers]} workers"),
            BarColumn(),
            TextColumn("{task.fields[documents]:,} documents, {task.fields[tokens]:,} tokens"),
            TimeRemainingColumn(),
            console=console,
            disable=not console.is_terminal,
        )
        self.task = self.bar.add_task("prepare", total=max(total_bytes, 1), workers=workers, documents=0, tokens=0)
        self.documents = self.tokens = 0

    def __enter__(self) -> PrepareProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.update(self.task, completed=self.bar.tasks[0].total)
        self.bar.stop()

    def advance(self, chars: int, *, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.bar.update(self.task, advance=chars, documents=self.documents, tokens=self.tokens)
