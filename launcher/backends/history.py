"""A job's metrics history: every logged step, from whichever backend ran it.

Each backend finds the rows its own way (a metrics.jsonl it can read, else the `metrics step=N`
lines of its logs); `MetricsHistory` is what they all return, the same for every engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.contract.metrics import METRIC_KEYS, VALIDATION_KEYS, logged_step, metric_rows
from launcher.display import html
from launcher.display.text import metric_cell

# What a notebook shows of a long run: the first and last few steps.
SHOWN_ROWS = 10


@dataclass(frozen=True)
class MetricsHistory:
    """Every logged step of one job, by step, as `{key: number}` rows (the contract's keys)."""

    job: str
    rows: tuple[dict[str, float], ...] = ()

    @classmethod
    def from_rows(cls, job: str, rows: Iterable[Mapping[str, Any]]) -> MetricsHistory:
        """Rows by step; a step logged twice (a run that restarted from a checkpoint) keeps its latest values.

        The rows come from files a job wrote and may be damaged: a row that is not an object with
        a step a job could log (`logged_step`) is skipped, and so is any value in it that is not a number."""
        by_step: dict[int, dict[str, float]] = {}
        for row in rows:
            step = logged_step(row.get("step")) if isinstance(row, Mapping) else None
            if step is not None:
                values = {
                    key: value
                    for key, value in row.items()
                    if isinstance(key, str) and (value is None or _number(value))
                }
                by_step[step] = {**values, "step": step}
        return cls(job, tuple(by_step[step] for step in sorted(by_step)))

    @classmethod
    def from_lines(cls, job: str, lines: Iterable[str]) -> MetricsHistory:
        """From log lines: the `metrics step=N ...` lines rank 0 prints (launcher.contract.metrics)."""
        return cls.from_rows(job, metric_rows(lines))

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, float]]:
        return iter(self.rows)

    @property
    def last(self) -> dict[str, float]:
        """The latest step's metrics ({} before the first step is logged)."""
        return dict(self.rows[-1]) if self.rows else {}

    def to_rows(self) -> list[dict[str, float]]:
        return [dict(row) for row in self.rows]

    def column(self, key: str) -> list[float]:
        """One metric over the steps (nan where a step did not log or measure it)."""
        return [math.nan if row.get(key) is None else float(row[key]) for row in self.rows]

    def to_dict(self) -> dict[str, Any]:
        """JSON has no NaN: a value that was not measured (MFU on a CPU) is null."""
        clean = [
            {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()} for row in self.rows
        ]
        return {"job": self.job, "steps": len(self.rows), "rows": clean}

    def plot(self, path: str | Path) -> Path:
        """Loss (and validation loss), tokens/s/GPU, MFU and memory against step, as a PNG at `path` (the `plot` extra)."""
        from launcher.display.plots import plot_metrics

        return plot_metrics(self, path)

    def _repr_html_(self) -> str:
        if not self.rows:
            return html.table([("job", self.job), ("steps", "none logged yet")])
        keys = [k for k in (*METRIC_KEYS, *VALIDATION_KEYS) if any(k in row for row in self.rows)]
        shown = list(self.rows)
        if len(shown) > SHOWN_ROWS:
            shown = shown[: SHOWN_ROWS // 2] + shown[-SHOWN_ROWS // 2 :]
        title = f"{self.job}: {len(self.rows)} steps logged, last step {self.rows[-1]['step']}"
        return html.grid(keys, [[metric_cell(row.get(k)) for k in keys] for row in shown], title=title)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
