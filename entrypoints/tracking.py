"""Dashboards fed from the metrics log: TensorBoard event files and an MLflow run (rank 0 only).

`MetricsLogger` (metrics.py) hands every record it writes to metrics.jsonl to each sink here, so a
new metric (validation loss, say) reaches both dashboards with no change to this module. A sink
never raises into training and never blocks a step:
- TensorBoard: torch's `SummaryWriter`, whose event file writer has a thread and a queue of its
  own; the events sit in <output_dir>/tensorboard, the directory SageMaker syncs to S3 when the
  request sets TensorBoardOutputConfig. It needs the `tensorboard` package (the wheel channel
  brings it where the image lacks it); without it, one warning and no event files.
- MLflow: entrypoints/mlflow_sink.py, a thread behind a bounded queue.
Numbers that are not finite (MFU is nan on a CPU; metrics.jsonl writes null) are left out.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from launcher.contract.config import JobConfig
from launcher.contract.metrics import TENSORBOARD_DIR

FLUSH_S = 10
"""How often the event writer flushes: SageMaker uploads what is on disk, as it appears."""


def scalars(record: dict) -> dict[str, float]:
    """The record's finite numbers, by key, without the step."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class TensorBoardSink:
    def __init__(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for

        self.writer = SummaryWriter(log_dir=str(directory), flush_secs=FLUSH_S)

    def add(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, global_step=record["step"])

    def close(self, status: str) -> None:
        self.writer.close()


def tensorboard_sink(directory: Path) -> TensorBoardSink | None:
    try:
        return TensorBoardSink(directory)
    except ImportError as error:
        warn(
            f"tracking.tensorboard: no event files are written: {error} (torch.utils.tensorboard needs the "
            "tensorboard package: pip install 'launcher[tracking]', or the job's wheel channel)"
        )
    except OSError as error:
        warn(f"tracking.tensorboard: no event files are written: cannot create {directory} ({error.strerror})")
    return None


def sinks(cfg: JobConfig, output_dir: Path) -> list:
    """The sinks the config asks for (rank 0 calls this; the other ranks log nothing)."""
    found: list = []
    if cfg.tracking.tensorboard and (sink := tensorboard_sink(output_dir / TENSORBOARD_DIR)):
        found.append(sink)
    if cfg.tracking.mlflow is not None:
        from entrypoints.mlflow_sink import MlflowSink

        found.append(MlflowSink.start(cfg))
    return found
