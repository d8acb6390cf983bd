"""torchrun, except that a stop ends it with one line instead of a traceback.

    python -m entrypoints.torchrun --nproc-per-node 4 entrypoints/train.py --config resolved.json

`launcher stop` sends SIGTERM to torchrun and its workers. The workers checkpoint and exit; the
agent raises SignalException, and torchrun would print its traceback as the job's last lines,
making a clean stop read like a crash. Here the agent's stop ends with `torchrun: stopped by
SIGTERM` and the shell's exit status, 128 + the signal; every other failure is torchrun's own.
"""

from __future__ import annotations

import gc
import sys

from entrypoints.garbage_collection import imports_done, pause_during_startup

STARTING = __name__ == "__main__"  # the agent's process, not a test importing this module
if STARTING:
    pause_during_startup()  # importing torch makes no garbage worth the collections' walks over it
from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.run import main  # noqa: E402

if STARTING:
    imports_done()
    gc.enable()  # then as Python collects: the agent allocates little, and no collective waits on it


def run() -> int:
    try:
        main()
    except SignalException as stop:
        print(f"torchrun: stopped by {stop.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(run())
