"""`launcher data prepare`: text in, tokenized shards + document index + manifest.json out.

    settings = PrepareSettings(inputs=["corpus/*.jsonl"], tokenizer="tok/", format="jsonl")
    prepared = prepare(settings, out="data/corpus-tok")            # or out="s3://bucket/prefix/"

The pipeline: expand the inputs (downloading s3:// ones) and hash them -> read documents in a
fixed order -> cut them into chunks -> tokenize the chunks on a pool of worker processes,
collecting results in submission order -> append each document's tokens to the current shard.
Because results are taken in order, the output is byte-identical whatever the worker count.
Finished shards are recorded in progress.json; a re-run with the same key verifies them by
sha256 and continues after the last good one. The key (`dataset_key`) hashes the inputs'
contents, the tokenizer and the settings, so it also names the submit-time cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launcher.contract.dataset import FORMAT, MANIFEST, read_manifest
from launcher.data import encode, s3
from launcher.data.progress import PrepareProgress
from launcher.data.shards import PROGRESS, ShardWriter, remove_stale, sha256_of, verified, write_json
from launcher.data.sources import FORMATS, InputFile, documents, expand
from launcher.data.tokenizer import TokenizerInfo, tokenizer_info
from launcher.errors import UsageError

DEFAULT_SHARD_TOKENS = 100_000_000
LOCK = ".lock"
CHUNK_CHARS = 1 << 20
"""Documents go to a worker in chunks of about this many characters: big enough that passing
them between processes costs little next to tokenizing them."""


@dataclass(frozen=True, kw_only=True)
class PrepareSettings:
    inputs: tuple[str, ...]
    tokenizer: str
    format: str = "auto"
    field: str = "text"
    delimiter: str | None = None
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    eos_token: str | None = None

    def __post_init__(self):
        if not self.inputs:
            raise UsageError("INPUT: give at least one file, directory, glob or s3:// prefix")
        if self.format not in ("auto", *FORMATS):
            raise UsageError(f"--format: {self.format!r} is not a format; use auto, {', '.join(FORMATS)}")
        if self.shard_tokens < 1:
            raise UsageError(f"--shard-tokens: {self.shard_tokens} is not a positive number of tokens")
        if self.delimiter == "":
            raise UsageError("--delimiter: an empty delimiter splits nothing; give e.g. '\\n\\n'")


@dataclass(frozen=True)
class Prepared:
    """What one run did: where the dataset is, its manifest, and what this run tokenized."""

    out: str
    manifest: dict
    reused_shards: int
    written_shards: int
    tokenized_tokens: int
    seconds: float
    workers: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokenized_tokens / max(self.seconds, 1e-9)


@dataclass
class Opened:
    """The inputs expanded (and downloaded), hashed, and the tokenizer read: enough to name the result."""

    settings: PrepareSettings
    files: list[InputFile]
    hashes: list[str]
    tokenizer: TokenizerInfo
    key: str = field(init=False)

    def __post_init__(self):
        identity = {
            "format": FORMAT,
            "inputs": [[f.format, h] for f, h in zip(self.files, self.hashes, strict=True)],
            "tokenizer": self.tokenizer.to_dict(),
            "settings": {"field": self.settings.field, "delimiter": self.settings.delimiter},
            "shard_tokens": self.settings.shard_tokens,
        }
        self.key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def manifest(self, records: list[dict]) -> dict:
        return {
            "format": FORMAT,
            "key": self.key,
            "tokenizer": self.tokenizer.to_dict(),
            "eos_id": self.tokenizer.eos_id,
            "vocab_size": self.tokenizer.vocab_size,
            "dtype": self.tokenizer.dtype,
            "documents": sum(r["documents"] for r in records),
            "tokens": sum(r["tokens"] for r in records),
            "shards": records,
            "inputs": [
                {"uri": f.uri, "format": f.format, "sha256": h, "bytes": f.path.stat().st_size}
                for f, h in zip(self.files, self.hashes, strict=True)
            ],
            "settings": {**asdict(self.settings), "inputs": list(self.settings.inputs)},
        }


def open_inputs(settings: PrepareSettings, downloads: Path) -> Opened:
    tokenizer = tokenizer_info(settings.tokenizer, eos_token=settings.eos_token)
    files = expand(list(settings.inputs), format=settings.format, downloads=downloads)
    return Opened(settings, files, [sha256_of(f.path) for f in files], tokenizer)


def prepare(
    settings: PrepareSettings,
    *,
    out: str,
    workers: int | None = None,
    work_dir: Path | None = None,
    on_shard: Callable[[dict], None] | None = None,
) -> Prepared:
    """Prepare `settings`' inputs into `out` (a directory or an s3:// prefix).

    An s3:// `out` is built in `work_dir` (where a re-run resumes) and uploaded shard by shard,
    the manifest last. `on_shard(record)` hears of each shard this run finishes."""
    workers = workers or os.cpu_count() or 1
    if workers < 1:
        raise UsageError(f"--workers: {workers} is not a positive number of processes")
    with tempfile.TemporaryDirectory(prefix="launcher-prepare-") as downloads:
        opened = open_inputs(settings, Path(downloads))
        if not out.startswith("s3://"):
            return prepare_opened(opened, Path(out), workers=workers, on_shard=on_shard, out=out)
        if work_dir is None:
            raise UsageError(f"--out {out}: an s3:// output needs a local work directory")
        local = work_dir / hashlib.sha256(out.encode()).hexdigest()[:16]
        prepared = prepare_opened(opened, local, workers=workers, on_shard=on_shard, out=out)
        upload_dataset(local, out, prepared.manifest)
        return prepared


def prepare_opened(
    opened: Opened, directory: Path, *, workers: int, out: str, on_shard: Callable[[dict], None] | None = None
) -> Prepared:
    """Resume or start the dataset in `directory`; a complete one is verified and kept."""
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory):
        return _prepare_locked(opened, directory, workers=workers, out=out, on_shard=on_shard)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One preparation per directory at a time: two submits of one recipe share its cache."""
    with (directory / LOCK).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _prepare_locked(
    opened: Opened, directory: Path, *, workers: int, out: str, on_shard: Callable[[dict], None] | None
) -> Prepared:
    started = time.perf_counter()
    done = _resumable_records(opened, directory)
    if done is not None and (directory / MANIFEST).is_file():
        return Prepared(out, read_manifest(directory), len(done), 0, 0, time.perf_counter() - started, workers)
    done = done or []

    def finished(record: dict) -> None:
        write_json(directory / PROGRESS, {"format": FORMAT, "key": opened.key, "shards": writer.records})
        if on_shard is not None:
            on_shard(record)

    writer = ShardWriter(
        directory, dtype=opened.tokenizer.dtype, shard_tokens=opened.settings.shard_tokens, done=done, on_shard=finished
    )
    tokens = _tokenize_into(opened, writer, workers=workers)
    records = writer.finish()
    if not records:
        raise UsageError(f"INPUT {' '.join(opened.settings.inputs)}: no documents found (every file is empty)")
    manifest = opened.manifest(records)
    write_json(directory / MANIFEST, manifest)
    (directory / PROGRESS).unlink(missing_ok=True)
    remove_stale(directory, records)
    return Prepared(out, manifest, len(done), len(records) - len(done), tokens, time.perf_counter() - started, workers)


def _resumable_records(opened: Opened, directory: Path) -> list[dict] | None:
    """The verified shards of an earlier run of the same key; None when there was none.

    A directory holding another dataset (another key) is refused rather than overwritten."""
    try:
        manifest = read_manifest(directory)
    except ValueError as error:
        raise UsageError(f"--out: {error}") from None
    state = manifest
    if state is None and (directory / PROGRESS).is_file():
        state = json.loads((directory / PROGRESS).read_text())
    if state is None:
        return None
    if state.get("key") != opened.key:
        raise UsageError(
            f"--out {directory}: holds a dataset of other inputs, tokenizer or settings; use an empty directory"
        )
    good = verified(directory, state["shards"])
    if manifest is not None and len(good) < len(state["shards"]):
        (directory / MANIFEST).unlink()  # damaged: redo from the first bad shard
    return good


def _tokenize_into(opened: Opened, writer: ShardWriter, *, workers: int) -> int:
    """Tokenize every document after those already in finished shards; returns the tokens written."""
    settings = opened.settings
    docs = itertools.chain.from_iterable(
        documents(f, field=settings.field, delimiter=settings.delimiter) for f in opened.files
    )
    remaining = itertools.islice(docs, writer.next_document, None)
    total_bytes = sum(f.path.stat().st_size for f in opened.files)
    start_tokens = sum(r["tokens"] for r in writer.records)
    start = (str(opened.tokenizer.file), opened.tokenizer.eos_id, opened.tokenizer.dtype)
    # The pool starts before the progress bar's thread does: fork copies no running thread.
    with _worker_pool(workers, start) as pool, PrepareProgress(total_bytes, workers) as progress:
        for chars, encoded in _encoded_chunks(pool, _chunks(remaining), workers):
            for document in encoded:
                writer.add(document)
            progress.advance(chars, documents=len(encoded), tokens=sum(map(len, encoded)) // writer.itemsize)
    return sum(r["tokens"] for r in writer.records) + writer.tokens - start_tokens


@contextlib.contextmanager
def _worker_pool(workers: int, start: tuple) -> Iterator:
    """A pool of `workers` processes, or None to tokenize in this process when workers == 1.

    fork, not spawn: spawn re-imports the caller's __main__, which `python -m launcher` does not
    guard. The tokenizers library disables its own threads in a forked child, and the workers
    call the single-threaded `encode`, so nothing in them waits on a thread fork did not copy."""
    if workers == 1:
        encode.start_worker(*start)
        yield None
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers, initializer=encode.start_worker, initargs=start) as pool:
        yield pool


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc)
        if chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _encoded_chunks(pool, chunks: Iterator[list[str]], workers: int) -> Iterator[tuple[int, list[bytes]]]:
    """(characters, token bytes per document) of each chunk, in order. At most 4 chunks per
    worker are in flight, so reading never runs far ahead of tokenizing."""
    if pool is None:
        for chunk in chunks:
            yield sum(map(len, chunk)), encode.encode_chunk(chunk)
        return
    pending: deque = deque()
    for chunk in chunks:
        pending.append((sum(map(len, chunk)), pool.apply_async(encode.encode_chunk, (chunk,))))
        if len(pending) >= 4 * workers:
            chars, result = pending.popleft()
            yield chars, result.get()
    while pending:
        chars, result = pending.popleft()
        yield chars, result.get()


def upload_dataset(local: Path, out: str, manifest: dict) -> None:
    """Upload the shards S3 does not already hold (same size and sha256), then the manifest."""
    bucket, prefix = s3.split(out.rstrip("/") + "/")
    for record in manifest["shards"]:
        for name, digest in ((record["name"], record["sha256"]), (record["index_name"], record["index_sha256"])):
            there = s3.head(bucket, prefix + name)
            if there is None or there["sha256"] != digest or there["size"] != (local / name).stat().st_size:
                s3.upload(local / name, bucket, prefix + name, digest)
    s3.upload(local / MANIFEST, bucket, prefix + MANIFEST, sha256_of(local / MANIFEST))
