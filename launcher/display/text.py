"""How jobs read in a terminal: `launcher status`, `list` and `metrics`, the result line of
`submit --wait`, durations and metric cells.

Like the rest of this room it knows no launcher type: a job status is anything with a
`JobStatus`'s fields (`JobStatusFields`), a metrics history any iterable of `{key: number}` rows
with a `job` name. Every value that came from an engine, a file or a process is made inert for
a terminal and kept on one line (`shown`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from launcher.contract.text import terminal_safe


class TransitionFields(Protocol):
    status: str
    start: str | None
    message: str


class JobStatusFields(Protocol):
    name: str
    backend: str
    state: str
    secondary: str | None
    transitions: Sequence[TransitionFields]
    failure_reason: str | None
    exit_code: int | None
    created: str | None
    ended: str | None
    metrics: Mapping[str, float]
    details: Mapping[str, Any]


class MetricRows(Protocol):
    job: str

    def __len__(self) -> int: ...

    def __iter__(self): ...


def duration(seconds: float) -> str:
    """A run time as people say it: 45 s, 12 min, 3.4 h, 2.5 days."""
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def metric_cell(value: Any) -> str:
    """A metric as a table shows it: blank where it was not measured (MFU on a CPU is NaN)."""
    if not isinstance(value, int | float) or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value) if isinstance(value, int) else f"{value:.4g}"


ENDED_STATES = ("Completed", "Failed", "Stopped")
"""A job status's terminal states (launcher.backends.base.TERMINAL_STATES; this room imports no backend)."""
_HEADLINE_METRICS = ("loss", "val_loss", "tokens_per_s_per_gpu", "mfu", "step")
# SageMaker's names of the metrics (launcher.contract.metrics.SAGEMAKER_METRIC_NAMES) -> the keys.
_METRIC_KEY_OF = {"validation:loss": "val_loss", "validation:perplexity": "val_perplexity"}


def shown(value) -> str:
    """A value that came from an engine, a file or a process, made inert for a terminal, on one line."""
    return terminal_safe(str(value), one_line=True)


def status_text(status: JobStatusFields) -> str:
    secondary = status.secondary if status.secondary and status.secondary != status.state else None
    state = shown(status.state) + (f" ({shown(secondary)})" if secondary else "")
    lines = [f"{shown(status.name)}  [{status.backend}]  {state}"]
    if status.created:
        lines.append(
            f"  created  {shown(status.created)}" + (f"   ended  {shown(status.ended)}" if status.ended else "")
        )
    if status.failure_reason:
        lines.append(f"  failure  {shown(status.failure_reason)}")
    if status.exit_code is not None:
        lines.append(f"  exit     {shown(status.exit_code)}")
    for t in status.transitions:
        message = f"  {shown(t.message)}" if t.message else ""
        lines.append(f"  - {shown(t.status):<24} {shown(t.start or '')}{message}")
    result = result_text(status)
    if result:
        lines.append(f"  result   {result}")
    speed = speed_text(status)
    if speed:
        lines.append(f"  speed    {speed}")
    cause = slow_cause_text(status)
    if cause:
        lines.append(f"  warning  {cause}")
    for key, value in status.details.items():
        if value not in (None, {}, "") and key not in ("summary", "predicted"):
            lines.append(f"  {key:<8} {shown(value)}")
    return "\n".join(lines)


def result_text(status: JobStatusFields) -> str:
    """`loss 3.21, tokens/s/GPU 1530, ...`: the job's summary line, else its last metrics."""
    summary = status.details.get("summary") or {}
    metrics = {_METRIC_KEY_OF.get(key, key.removeprefix("train:")): value for key, value in status.metrics.items()}
    parts = []
    for key in _HEADLINE_METRICS:
        candidates = (summary.get(f"final_{key}"), summary.get(f"mean_{key}"), metrics.get(key))
        value = next((v for v in candidates if isinstance(v, int | float) and v == v), None)  # v == v: not NaN
        if value is not None:
            label = {"tokens_per_s_per_gpu": "tokens/s/GPU", "val_loss": "validation loss"}.get(key, key)
            parts.append(f"step {int(value)}" if key == "step" else f"{label} {value:.4g}")
    return ", ".join(parts)


def wait_text(status: JobStatusFields) -> str:
    """The line `submit --wait` ends with: `NAME: Completed. loss 1.67, ...; ran at 62% of predicted`;
    a failed job's says why first, as SageMaker's FailureReason: `NAME: Failed: rank 0: ...`."""
    speed = speed_text(status)
    cause = slow_cause_text(status)
    speed += f"; warning: {cause}" if cause else ""
    head = f"{shown(status.name)}: {shown(status.state)}"
    if status.state == "Failed" and status.failure_reason:
        head += f": {shown(status.failure_reason)}"
    result = result_text(status)
    return head + (f". {result}" if result else "") + (f"; {speed}" if speed else "")


def speed_text(status: JobStatusFields) -> str:
    """`running at 62% of predicted (MFU 31%)`: the newest step's tokens/s per GPU against what the
    planner predicted for the layout (details["predicted"], from the job record); "" where nothing
    was predicted or no step has been measured yet."""
    predicted = status.details.get("predicted") or {}
    metrics = {key.removeprefix("train:"): value for key, value in status.metrics.items()}
    expected, live = predicted.get("tokens_per_s_per_gpu"), metrics.get("tokens_per_s_per_gpu")
    if not (_measured(expected) and expected > 0 and _measured(live)):
        return ""
    mfu = metrics.get("mfu")
    ran = "ran" if status.state in ENDED_STATES else "running"
    return f"{ran} at {live / expected:.0%} of predicted" + (f" (MFU {mfu:.0%})" if _measured(mfu) else "")


SLOW_BELOW = 0.8
"""A job whose live tokens/s are below this share of the prediction gets a line naming the likely cause."""
DATA_WAIT_CAUSE = 0.2


def slow_cause_text(status: JobStatusFields) -> str:
    """`running at 45% of predicted: likely cause: ...` for a job below SLOW_BELOW of its
    prediction, from what its newest metrics record holds (launcher.contract.metrics
    SPEED_CAUSE_KEYS): a straggler rank 0 named, else the step's wait for data; "" otherwise."""
    predicted = status.details.get("predicted") or {}
    metrics = {key.removeprefix("train:"): value for key, value in status.metrics.items()}
    expected, live = predicted.get("tokens_per_s_per_gpu"), metrics.get("tokens_per_s_per_gpu")
    if not (_measured(expected) and expected > 0 and _measured(live)) or live / expected >= SLOW_BELOW:
        return ""
    straggler, above = metrics.get("straggler_rank"), metrics.get("straggler_above_median")
    wait, step = metrics.get("data_wait_s"), metrics.get("step_time_s")
    if _measured(straggler) and _measured(above):
        cause = f"a straggler: rank {int(straggler)}'s compute time is {above:.0%} above the median (its log names the host)"
    elif _measured(wait) and _measured(step) and step > 0 and wait >= DATA_WAIT_CAUSE * step:
        cause = f"data wait: {wait / step:.0%} of the step waits for its batch"
    else:
        cause = "none in the metrics (no straggler named, data wait under 20% of the step, saves are outside the step)"
    return f"{live / expected:.0%} of predicted: likely cause: {cause}"


def _measured(value: Any) -> bool:
    """A finite number (metrics files and records are read back: anything may be there)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def list_text(statuses: Sequence[JobStatusFields]) -> str:
    if not statuses:
        return "no jobs"
    rows = [("NAME", "BACKEND", "STATE", "DETAIL", "CREATED")]
    rows += [
        tuple(shown(v) for v in (s.name, s.backend, s.state, s.secondary or "", s.created or "")) for s in statuses
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


_METRICS_COLUMNS = (
    ("step", "STEP"),
    ("loss", "LOSS"),
    ("tokens_per_s_per_gpu", "TOKENS/S/GPU"),
    ("mfu", "MFU"),
    ("step_time_s", "STEP_S"),
    ("mem_reserved_gib", "MEM_GIB"),
)


_VALIDATION_COLUMNS = (("val_loss", "VAL_LOSS"), ("val_perplexity", "VAL_PPL"))


def metrics_text(history: MetricRows) -> str:
    """Every logged step as a table (blank where a value was not measured, such as MFU on a CPU);
    a job that evaluates held-out data gets its validation columns, filled on the steps that did."""
    if not len(history):
        return f"{history.job}: no steps logged yet"
    columns = _METRICS_COLUMNS
    if any("val_loss" in row for row in history):
        columns = (*columns[:2], *_VALIDATION_COLUMNS, *columns[2:])
    rows = [tuple(title for _, title in columns)]
    for row in history:
        rows.append(tuple(metric_cell(row.get(key)) for key, _ in columns))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
