"""Throughput of `launcher data prepare` against the `tokenizers` library's own `encode_batch`,
on the same corpus, tokenizer and cores, in one run.

    python scripts/bench_data_prepare.py                      # this machine's cores, ~16 MB corpus
    python scripts/bench_data_prepare.py --workers 8 --megabytes 64 --tokenizer path/tokenizer.json

The corpus is real text that needs no download: the Python standard library's sources, one
document per file, written as JSONL. Without --tokenizer a 32K-token byte-level BPE is trained on
it first. Reported per core, so machines of different sizes compare:
  encode_batch   tokens / wall seconds / workers, with RAYON_NUM_THREADS=workers (its own threads)
  prepare        tokens / wall seconds / workers of the whole `launcher data prepare` command:
                 reading JSONL, tokenizing on `workers` processes, writing shards, index, hashes
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_corpus(path: Path, megabytes: float) -> list[str]:
    docs, size = [], 0
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = source.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append(text)
        size += len(text.encode())
        if size >= megabytes * 1e6:
            break
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    return docs


def train_tokenizer(docs: list[str], path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs[: max(1, len(docs) // 4)], trainer=trainer)
    tokenizer.save(str(path))


def run_timed(command: list[str], env: dict) -> tuple[str, float, float]:
    """(stdout, wall seconds, CPU seconds of the process and every process it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return result.stdout, wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def encode_batch_rate(tokenizer: Path, corpus: Path, workers: int) -> dict:
    """encode_batch over the corpus in a fresh process whose thread pool has `workers` threads;
    only the call itself is timed (process_time counts every thread's CPU)."""
    code = (
        "import json, sys, time; from tokenizers import Tokenizer\n"
        "tok = Tokenizer.from_file(sys.argv[1]); docs = [json.loads(l)['text'] for l in open(sys.argv[2])]\n"
        "wall, cpu = time.perf_counter(), time.process_time(); out = tok.encode_batch(docs)\n"
        "wall, cpu = time.perf_counter() - wall, time.process_time() - cpu\n"
        "print(json.dumps({'tokens': sum(len(e.ids) for e in out), 'wall_s': wall, 'cpu_s': cpu}))\n"
    )
    env = {**os.environ, "RAYON_NUM_THREADS": str(workers), "TOKENIZERS_PARALLELISM": "true"}
    stdout, _, _ = run_timed([sys.executable, "-c", code, str(tokenizer), str(corpus)], env)
    return json.loads(stdout)


def prepare_rate(tokenizer: Path, corpus: Path, workers: int) -> dict:
    """The whole `launcher data prepare` command, start to exit; EOS tokens are not counted."""
    command = [sys.executable, "-m", "launcher", "data", "prepare", str(corpus), "--tokenizer", str(tokenizer)]
    command += ["--out", str(corpus.parent / "prepared"), "--workers", str(workers), "--json"]
    stdout, wall, cpu = run_timed(command, {**os.environ, "PYTHONPATH": str(REPO)})
    manifest = json.loads(stdout)
    return {"tokens": manifest["tokens"] - manifest["documents"], "wall_s": wall, "cpu_s": cpu}


def rates(measured: dict, workers: int) -> dict:
    return {
        **{k: round(v, 2) if isinstance(v, float) else v for k, v in measured.items()},
        "tokens_per_s_per_core": round(measured["tokens"] / measured["wall_s"] / workers),
        "tokens_per_cpu_s": round(measured["tokens"] / measured["cpu_s"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--megabytes", type=float, default=16.0)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json (default: train a 32K BPE here)")
    parser.add_argument("--vocab-size", type=int, default=32000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as scratch:
        root = Path(scratch)
        docs = write_corpus(root / "corpus.jsonl", args.megabytes)
        corpus_mb = round((root / "corpus.jsonl").stat().st_size / 1e6, 1)
        tokenizer = root / "tokenizer.json"
        if args.tokenizer:
            tokenizer.write_bytes(args.tokenizer.read_bytes())
        else:
            train_tokenizer(docs, tokenizer, args.vocab_size)
        batch = rates(encode_batch_rate(tokenizer, root / "corpus.jsonl", args.workers), args.workers)
        prepared = rates(prepare_rate(tokenizer, root / "corpus.jsonl", args.workers), args.workers)
    rows = {
        "corpus": {"documents": len(docs), "jsonl_megabytes": corpus_mb},
        "workers": args.workers,
        "load_average_1min": round(os.getloadavg()[0], 1),
        "encode_batch": batch,
        "prepare": prepared,
        "prepare_vs_encode_batch": {
            "per_core": round(prepared["tokens_per_s_per_core"] / batch["tokens_per_s_per_core"], 2),
            "per_cpu_s": round(prepared["tokens_per_cpu_s"] / batch["tokens_per_cpu_s"], 2),
        },
    }
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
