"""What `submit --wait` shows while a job runs: its log lines and, on a terminal, one live line
with the starting phase (SageMaker's secondary status), then the step, loss and ETA.

A job status here is anything with `name`, `state`, `secondary` and `terminal`; a log line is
text, and its metrics are read with the contract's own parser.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from rich.text import Text

from launcher.contract.metrics import logged_step, parse_fields
from launcher.display.text import duration


class LiveProgress:
    """A context manager: `line(text)` for each log line, `status(status)` for each state change.

    Log lines go to `lines_to`; the live line and the states to `console` (a rich Console), and
    nothing but the log lines when that console is quiet. While the live line is shown, one
    console draws everything that reaches the terminal: a log line written past it, to a stream
    captured before the line started, would be glued to its end (`ETA 9 smetrics step=22`)."""

    def __init__(self, *, total_steps: int, console: Any, lines_to: IO[str]):
        self.total_steps, self.console, self.lines_to = total_steps, console, lines_to
        self.live = None
        self.first_step: tuple[int, float] | None = None  # (step, when its metrics line arrived)

    def __enter__(self) -> LiveProgress:
        if self.console.is_terminal and not self.console.quiet:
            from rich.live import Live

            # Live sends other print()s above the live line too; stdout only when it is the terminal,
            # so `submit --wait > log` still writes the log lines to the file.
            self.live = Live(
                "", console=self.console, transient=True, refresh_per_second=4, redirect_stdout=sys.stdout.isatty()
            )
            self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.stop()

    def line(self, text: str) -> None:
        if self.live is not None and self.lines_to.isatty():
            self.live.console.print(Text(text), soft_wrap=True)  # above the live line
        elif not self.console.quiet:
            print(text, file=self.lines_to, flush=True)
        if self.live is not None and text.startswith("metrics step="):
            fields = parse_fields(text)
            step = logged_step(fields.get("step"))  # the log is the job's: `step=inf` must not end the wait
            if step is not None:
                self.live.update(self._progress(step, fields))

    def status(self, status: Any) -> None:
        text = f"{status.name}: {status.state}" + (f" ({status.secondary})" if status.secondary else "")
        if self.live is not None:
            self.live.update(text)
        elif not status.terminal:
            self.console.print(text, markup=False)

    def _progress(self, step: int, fields: dict) -> str:
        now = time.monotonic()
        if self.first_step is None:
            self.first_step = (step, now)
        text = f"step {step}/{self.total_steps}"
        if isinstance(fields.get("loss"), float):
            text += f"  loss {fields['loss']:.4f}"
        first, since = self.first_step
        if first < step <= self.total_steps:  # past the end: a run given more steps than this one's
            text += f"  ETA {duration((now - since) / (step - first) * (self.total_steps - step))}"
        return text
