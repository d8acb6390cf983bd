"""What the checkpoint digests cost: DCP save and load of an 8B-shaped state on the CPU, with
DCP's own FileSystemWriter/Reader and with the launcher's DigestingWriter/VerifyingReader.

    python scripts/bench_checkpoint.py                    # 1 Llama 3.1 8B decoder layer + AdamW: 2.6 GB
    python scripts/bench_checkpoint.py --layers 2 --dir /fsx/tmp --repeat 3

The state is what one rank saves: fp32 weights of `--layers` decoder layers of Llama 3.1 8B's
shapes (hidden 4096, FFN 14336, 8 KV heads of 128) and AdamW's two moments (12 bytes per
parameter; a rank of an 8B job on 8 GPUs holds about 12 GB). One process, no process group.
Each variant runs `--repeat` times, alternating, and the fastest run is reported:
  save          dcp.save with fsync, as the job saves (the digest is taken in the write path)
  load (cold)   dcp.load after the files' pages are dropped from the page cache (posix_fadvise)
  load (warm)   dcp.load straight after, from the page cache
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402

from entrypoints.checkpoint_digests import DigestingWriter, VerifyingReader  # noqa: E402
from entrypoints.checkpoint_files import RankHosts  # noqa: E402

HIDDEN, FFN, KV = 4096, 14336, 8 * 128
LAYER = {
    "attention.wq": (HIDDEN, HIDDEN),
    "attention.wk": (KV, HIDDEN),
    "attention.wv": (KV, HIDDEN),
    "attention.wo": (HIDDEN, HIDDEN),
    "feed_forward.w1": (FFN, HIDDEN),
    "feed_forward.w2": (HIDDEN, FFN),
    "feed_forward.w3": (FFN, HIDDEN),
    "attention_norm": (HIDDEN,),
    "ffn_norm": (HIDDEN,),
}


def make_state(layers: int) -> dict:
    model, optimizer = {}, {}
    for layer in range(layers):
        for name, shape in LAYER.items():
            key = f"layers.{layer}.{name}.weight"
            model[key] = torch.randn(shape)
            optimizer[key] = {"exp_avg": torch.randn(shape), "exp_avg_sq": torch.rand(shape), "step": torch.tensor(9.0)}
    return {"model": model, "optimizer": optimizer}


def empty_like(state: dict) -> dict:
    return {
        key: empty_like(value) if isinstance(value, dict) else torch.empty_like(value) for key, value in state.items()
    }


def drop_from_page_cache(directory: Path) -> None:
    """Only these files' pages (clean after DCP's fsync): the next read comes from the disk."""
    for file in directory.iterdir():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(action) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def run_once(state: dict, directory: Path, digests: bool) -> dict[str, float]:
    shutil.rmtree(directory, ignore_errors=True)
    writer = DigestingWriter(directory) if digests else FileSystemWriter(directory)
    times = {"save": timed(lambda: dcp.save(state, storage_writer=writer, no_dist=True))}
    recorded = {name: ("COMPLETE.node-0-of-1", digest) for name, digest in getattr(writer, "digests", {}).items()}
    target = empty_like(state)

    def load():
        reader = VerifyingReader(directory, RankHosts(0, 1, 1), recorded) if digests else FileSystemReader(directory)
        dcp.load(target, storage_reader=reader, no_dist=True)

    drop_from_page_cache(directory)
    times["load (cold)"] = timed(load)
    times["load (warm)"] = timed(load)
    assert torch.equal(target["model"]["layers.0.attention.wq.weight"], state["model"]["layers.0.attention.wq.weight"])
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1, help="8B-shaped decoder layers (2.6 GB each with AdamW)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    import warnings

    warnings.filterwarnings("ignore")  # DCP warns that it runs without a process group
    state = make_state(args.layers)
    size = sum(t.numel() * t.element_size() for part in state.values() for t in _tensors(part))
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-checkpoint-"))
    best: dict[bool, dict[str, float]] = {False: {}, True: {}}
    try:
        for _ in range(args.repeat):
            for digests in (False, True):
                for name, seconds in run_once(state, root / f"digests-{digests}", digests).items():
                    best[digests][name] = min(seconds, best[digests].get(name, seconds))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"state: {args.layers} 8B-shaped layer(s) with AdamW, {size / 1e9:.2f} GB; {os.cpu_count()} cores")
    print("| | DCP alone | with digests | cost |")
    print("|---|---|---|---|")
    for name in best[False]:
        plain, digested = best[False][name], best[True][name]
        print(
            f"| {name} | {plain:.2f} s ({size / plain / 1e9:.2f} GB/s) | {digested:.2f} s "
            f"({size / digested / 1e9:.2f} GB/s) | {100 * (digested / plain - 1):+.0f}% |"
        )
    return 0


def _tensors(tree):
    for value in tree.values():
        yield from _tensors(value) if isinstance(value, dict) else [value]


if __name__ == "__main__":
    sys.exit(main())
