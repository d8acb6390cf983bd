"""A stand-in for entrypoints/train.py that keeps contracts 1 and 2 without torch.

Reads --config, prints `metrics ...` lines and a `summary ...` line, writes metrics.jsonl to
runtime.output_dir. FAKE_TRAIN picks the behaviour: ok (default), fail, or hang (until SIGTERM;
with FAKE_TRAIN_IGNORE_TERM=1 it ignores SIGTERM too, so only SIGKILL ends it; with
FAKE_TRAIN_SLOW_EXIT=S it prints the trainer's stop line on SIGTERM and exits S seconds later). With
FAKE_TRAIN_HOLD=1 it prints "holding" after its steps and goes on only once `release` appears in
the output directory (so a test can act at that point, e.g. kill the runner or fill the disk).
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
config = json.loads(Path(parser.parse_args().config).read_text())
mode = os.environ.get("FAKE_TRAIN", "ok")
output = Path(config["runtime"]["output_dir"] or "output")
output.mkdir(parents=True, exist_ok=True)
print(f"fake trainer for {config['name']} pid={os.getpid()} pgid={os.getpgid(0)}", flush=True)
(output / "fake.pid").write_text(str(os.getpid()))

for step in range(1, 4):
    record = {
        "step": step,
        "loss": 5.0 / step,
        "grad_norm": 1.25,
        "lr": 0.001,
        "tokens_per_s_per_gpu": 1000.0 + step,
        "mfu": None,
        "step_time_s": 0.01,
        "mem_alloc_gib": 0.0,
        "mem_reserved_gib": 0.0,
    }
    line = " ".join(f"{k}={'nan' if v is None else v}" for k, v in record.items())
    print(f"metrics {line}", flush=True)
    with (output / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")

if os.environ.get("FAKE_TRAIN_HOLD"):
    print("holding", flush=True)
    while not (output / "release").exists():
        time.sleep(0.02)

if mode == "fail":
    print("Traceback (most recent call last):", file=sys.stderr)
    print("RuntimeError: fake failure in step 4", file=sys.stderr, flush=True)
    sys.exit(3)
if mode == "hang":
    if os.environ.get("FAKE_TRAIN_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("FAKE_TRAIN_SLOW_EXIT"):
        # As entrypoints/train.py: the stop line once the last save is done, then a slow exit.
        def stop(signum, frame):
            print("interrupted by SIGTERM after step 3; checkpoint saved", flush=True)
            time.sleep(float(os.environ["FAKE_TRAIN_SLOW_EXIT"]))
            sys.exit(128 + signal.SIGTERM)

        signal.signal(signal.SIGTERM, stop)
    print("hanging", flush=True)
    while True:
        time.sleep(0.05)
print("summary steps=3 final_loss=1.6667 mean_tokens_per_s_per_gpu=1002.5 mean_mfu=nan total_time_s=0.1", flush=True)
