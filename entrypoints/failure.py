"""The per-rank error file torchrun reads, with the moment the error was raised.

    @failure.record
    def main(): ...                  # an exception is written to $TORCHELASTIC_ERROR_FILE
    with failure.timed():            # around the training: notes when the first exception passed
        train(cfg, env)

torchrun's agent gives every worker a TORCHELASTIC_ERROR_FILE; torch's `record` writes the
exception there as {"message": {"message": "Error: text", "extraInfo": {"py_callstack", "timestamp"}}}.
Its timestamp has whole seconds, and torchrun's "Root Cause (first observed failure)" among ranks
that fail in the same second is the first process it saw exit: often a peer's symptom (gloo's
"Connection closed by peer" after rank 0 died) rather than the rank that raised first (measured:
rank 0's NotADirectoryError at the first checkpoint was reported as rank 2's gloo error). So the
file also gets `extraInfo.raised_at`: time.time() to the microsecond, taken when the exception
left the training code (before the process group is torn down). The launcher's local runner
orders ranks by it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.distributed.elastic.multiprocessing.errors import record as _torch_record

_raised_at: float | None = None


class TimedErrorHandler(ErrorHandler):
    def record_exception(self, e: BaseException) -> None:
        super().record_exception(e)
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if not path or not os.path.isfile(path):
            return
        with open(path) as f:
            data = json.load(f)
        data["message"]["extraInfo"]["raised_at"] = f"{_raised_at or time.time():.6f}"
        with open(path, "w") as f:
            json.dump(data, f)


HANDLER = TimedErrorHandler()


def record(fn):
    return _torch_record(fn, error_handler=HANDLER)


@contextlib.contextmanager
def timed():
    global _raised_at
    try:
        yield
    except BaseException:
        _raised_at = _raised_at or time.time()
        raise
