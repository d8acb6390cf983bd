"""Shards on disk: written whole documents at a time, renamed into place when complete, and
recorded in progress.json, so an interrupted run keeps every finished shard.

A shard closes at the first document boundary at or past `shard_tokens`, so where shards end
depends only on the documents, never on how many workers tokenized them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from array import array
from collections.abc import Callable
from pathlib import Path

from launcher.contract.dataset import MANIFEST, TOKEN_ITEMSIZE, shard_name

PROGRESS = "progress.json"
PARTIAL = ".partial"


def write_json(path: Path, data: dict) -> None:
    """Atomically, with sorted keys: the same data always gives the same bytes."""
    temporary = path.with_name(path.name + PARTIAL)
    temporary.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(temporary, path)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def verified(directory: Path, records: list[dict]) -> list[dict]:
    """The longest prefix of `records` whose files are on disk with their recorded hashes."""
    good = []
    for record in records:
        bin_path, idx_path = directory / record["name"], directory / record["index_name"]
        if not (bin_path.is_file() and idx_path.is_file()):
            break
        if sha256_of(bin_path) != record["sha256"] or sha256_of(idx_path) != record["index_sha256"]:
            break
        good.append(record)
    return good


class ShardWriter:
    """Appends documents' token bytes to the current shard; closes it past `shard_tokens`."""

    def __init__(self, directory: Path, *, dtype: str, shard_tokens: int, done: list[dict], on_shard: Callable):
        self.directory, self.itemsize, self.shard_tokens = directory, TOKEN_ITEMSIZE[dtype], shard_tokens
        self.records = list(done)
        self.on_shard = on_shard
        self.next_document = sum(r["documents"] for r in done)
        self._open()

    def _open(self) -> None:
        self.index = len(self.records)
        self.path = self.directory / shard_name(self.index)
        self.stream = self.path.with_name(self.path.name + PARTIAL).open("wb")
        self.digest = hashlib.sha256()
        self.offsets = array("Q")
        self.tokens = 0

    def add(self, document: bytes) -> None:
        self.offsets.append(self.tokens)
        self.stream.write(document)
        self.digest.update(document)
        self.tokens += len(document) // self.itemsize
        if self.tokens >= self.shard_tokens:
            self._close()
            self._open()

    def finish(self) -> list[dict]:
        if self.tokens:
            self._close()
        else:
            self.stream.close()
            os.unlink(self.stream.name)
        return self.records

    def _close(self) -> None:
        self.stream.flush()
        os.fsync(self.stream.fileno())
        self.stream.close()
        index_path = self.directory / shard_name(self.index, ".idx")
        offsets = array("Q", self.offsets)
        if sys.byteorder == "big":
            offsets.byteswap()
        index_bytes = offsets.tobytes()
        index_path.with_name(index_path.name + PARTIAL).write_bytes(index_bytes)
        os.replace(index_path.with_name(index_path.name + PARTIAL), index_path)
        os.replace(self.stream.name, self.path)
        record = {
            "name": self.path.name,
            "index_name": index_path.name,
            "tokens": self.tokens,
            "documents": len(self.offsets),
            "first_document": self.next_document,
            "sha256": self.digest.hexdigest(),
            "index_sha256": hashlib.sha256(index_bytes).hexdigest(),
        }
        self.next_document += len(self.offsets)
        self.records.append(record)
        self.on_shard(record)


def remove_stale(directory: Path, keep: list[dict]) -> None:
    """Shard files no record names (from an earlier, longer run) and leftover partial files."""
    names = {r["name"] for r in keep} | {r["index_name"] for r in keep} | {MANIFEST}
    for path in directory.glob("shard-*"):
        if path.name not in names:
            path.unlink()
    for path in directory.glob(f"*{PARTIAL}"):
        path.unlink()
