"""The metric lines the entrypoints print on rank 0 and the launcher's backends read.

Every logged step prints exactly one line, every run one summary line at the end:

    metrics step=12 loss=2.3456 grad_norm=0.8123 lr=0.0003 tokens_per_s_per_gpu=5321.4 mfu=0.3712 step_time_s=1.5394 mem_alloc_gib=61.2 mem_reserved_gib=70.5
    metrics step=20 loss=2.1 ... mem_reserved_gib=70.5 val_loss=2.2 val_perplexity=9.03   # a step that evaluated
    summary steps=3 final_loss=2.1 mean_tokens_per_s_per_gpu=310.5 ...

`METRIC_REGEXES` are what log scrapers (SageMaker MetricDefinitions) apply to these lines, one
capture group each; `parse_fields` reads any such line back into numbers (nan included).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

METRIC_KEYS = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s_per_gpu",
    "mfu",
    "step_time_s",
    "mem_alloc_gib",
    "mem_reserved_gib",
)
VALIDATION_KEYS = ("val_loss", "val_perplexity")
"""Appended to the line (and the JSONL record) of a step after which the job evaluated its held-out data."""
SPEED_CAUSE_KEYS = ("data_wait_s", "straggler_rank", "straggler_above_median")
"""Appended where measured: the step's wait for its batch (when at least 20% of the step), and the
straggler rank 0 last named with its compute time's share above the median (while it is named)."""
SUMMARY_KEYS = (
    "steps",
    "final_loss",
    "mean_tokens_per_s_per_gpu",
    "mean_mfu",
    "mean_step_time_s",
    "peak_mem_alloc_gib",
    "peak_mem_reserved_gib",
    "total_time_s",
)
VALIDATION_SUMMARY_KEYS = ("final_val_loss",)
"""Appended to the summary of a job that evaluated."""
METRICS_FILE = "metrics.jsonl"
"""One JSON object per logged step, in the job's output directory."""
TENSORBOARD_DIR = "tensorboard"
"""With tracking.tensorboard: the event files, in the job's output directory (on SageMaker the
TensorBoardOutputConfig LocalPath, synced to S3 while the job runs)."""
METRICS_PREFIX = "metrics"
SUMMARY_PREFIX = "summary"
MAX_STEPS = 10**9
"""The most optimizer steps a job runs (the recipe schema's bound on training.steps), so the
largest step a metrics line or record of a real job can name."""

_FLOAT = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"


def metric_regex(key: str) -> str:
    # Fields are space separated after `metrics step=N`; the space before the key keeps `loss`
    # from matching inside another key. No anchor: the platform may prefix the line. nan does
    # not match: a scraped metric is a number or absent.
    return rf"{METRICS_PREFIX} step=(\d+)" if key == "step" else rf"{METRICS_PREFIX} step=\d+.* {key}={_FLOAT}"


METRIC_REGEXES = {key: metric_regex(key) for key in METRIC_KEYS}
VALIDATION_REGEXES = {key: metric_regex(key) for key in VALIDATION_KEYS}
# What SageMaker calls them: the "validation:<name>" of its built-in algorithms' metrics.
SAGEMAKER_METRIC_NAMES = {
    **{key: f"train:{key}" for key in METRIC_KEYS},
    **{key: f"validation:{key.removeprefix('val_')}" for key in VALIDATION_KEYS},
}


def format_value(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "nan"
    return f"{value:.6g}"


def metrics_line(record: Mapping[str, float]) -> str:
    keys = [*METRIC_KEYS, *(k for k in (*VALIDATION_KEYS, *SPEED_CAUSE_KEYS) if k in record)]
    return f"{METRICS_PREFIX} " + " ".join(f"{k}={format_value(record[k])}" for k in keys)


def summary_line(summary: Mapping[str, float]) -> str:
    keys = [*SUMMARY_KEYS, *(k for k in VALIDATION_SUMMARY_KEYS if k in summary)]
    return f"{SUMMARY_PREFIX} " + " ".join(f"{k}={format_value(summary[k])}" for k in keys)


def parse_fields(line: str) -> dict[str, float | str]:
    """`summary loss=2.1 tokens_per_s_per_gpu=310.5` as a dict (numbers where they parse)."""
    values: dict[str, float | str] = {}
    for token in line.split()[1:]:
        key, sep, text = token.partition("=")
        if sep:
            try:
                values[key] = float(text)
            except ValueError:
                values[key] = text
    return values


def logged_step(value: object) -> int | None:
    """The step a metrics record or line names, or None where it names none a job could log: logs
    and files are read back and may hold anything (inf, nan, 2.5, -3, a string, 1e308)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not (math.isfinite(value) and value == int(value) and 0 <= value <= MAX_STEPS):
        return None
    return int(value)


def metric_rows(lines: Iterable[str]) -> list[dict[str, float]]:
    """Every `metrics step=N ...` line among `lines` as a dict, by step; other lines are skipped.

    The line may carry a prefix (a host label, a platform's timestamp), as the regexes allow.
    A step logged twice (a restarted run logs its steps again) keeps its latest values.
    """
    rows: dict[int, dict[str, float]] = {}
    marker = f"{METRICS_PREFIX} step="
    for line in lines:
        start = line.find(marker)
        if start < 0:
            continue
        fields = {k: v for k, v in parse_fields(line[start:]).items() if isinstance(v, float)}
        step = logged_step(fields.get("step"))
        if step is not None:
            rows[step] = {**fields, "step": step}
    return [rows[step] for step in sorted(rows)]
