"""The prepared-dataset format `launcher data prepare` writes and the entrypoints read.

A prepared dataset is a directory (or s3:// prefix) holding:
    manifest.json          FORMAT, the tokenizer (sha256, vocab_size, eos_id), dtype, counts,
                           one record per shard, the inputs' hashes and the settings
    shard-000000.bin       little-endian token ids (dtype), whole documents, each ending in eos_id
    shard-000000.idx       little-endian uint64 token offsets of the shard's document starts
Shard names are zero-padded, so sorting them by name is their order in the token stream.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

FORMAT = "launcher.dataset/1"
MANIFEST = "manifest.json"
INDEX_DTYPE = "uint64"
TOKEN_ITEMSIZE = {"uint16": 2, "uint32": 4}


def shard_name(index: int, suffix: str = ".bin") -> str:
    return f"shard-{index:06d}{suffix}"


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def read_manifest(path: str | Path) -> dict | None:
    """The manifest of a prepared dataset directory, or None when `path` holds none.

    Raises ValueError with one line when the file exists but is not a manifest of this format."""
    file = Path(path) / MANIFEST
    if not Path(path).is_dir() or not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file} is not readable JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{file} has format {found!r}; expected {FORMAT!r} (written by `launcher data prepare`)")
    return manifest


def manifest_problem(manifest: dict, *, dtype: str | None, vocab_size: int) -> str | None:
    """One line when the dataset cannot feed a model of `vocab_size` read as `dtype`, else None."""
    if dtype is not None and manifest["dtype"] != dtype:
        return f"data.dtype: the prepared dataset holds {manifest['dtype']} tokens, not {dtype}; set data.dtype: {manifest['dtype']}"
    vocab = manifest["tokenizer"]["vocab_size"]
    if vocab > vocab_size:
        return (
            f"data.source: the dataset was tokenized with a {vocab}-token vocabulary, larger than the model's "
            f"{vocab_size}; use the model's tokenizer or a model with at least {vocab} tokens"
        )
    return None


def held_out_start(root: str | Path, manifest: dict, fraction: float) -> tuple[int, int]:
    """Where a held-out share of a prepared dataset begins: (token offset in the stream, documents held out).

    The last ceil(fraction x documents) whole documents are held out, so the split falls on a
    document start (read from that shard's .idx) and depends only on the dataset and the fraction.
    Raises ValueError with one line when the dataset cannot be split so (one document, or an index
    that does not agree with its manifest)."""
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise ValueError(f"{Path(root) / MANIFEST} lists no shards")
    documents = sum(_count(s, "documents") for s in shards)
    held = math.ceil(fraction * documents)
    if held < 1 or held >= documents:
        raise ValueError(
            f"a fraction of {fraction} of {documents} document(s) leaves no document to "
            f"{'hold out' if held < 1 else 'train on'}; the split is in whole documents"
        )
    first_held, first_token, first_document = documents - held, 0, 0
    for shard in shards:
        count, tokens = _count(shard, "documents"), _count(shard, "tokens")
        if first_held < first_document + count:
            return first_token + _document_offset(Path(root), shard, first_held - first_document, tokens), held
        first_document += count
        first_token += tokens
    raise AssertionError("unreachable: first_held < documents")


def _count(shard: dict, key: str) -> int:
    value = shard.get(key)
    if type(value) is not int or value < 0:
        raise ValueError(f"manifest shard {shard.get('name')!r}: {key} is {value!r}, not a count")
    return value


def _document_offset(root: Path, shard: dict, document: int, tokens: int) -> int:
    """The token offset, within its shard, of the shard's `document`-th document (from the .idx)."""
    name = shard.get("index_name")
    path = root / str(name)
    if not isinstance(name, str) or "/" in name or not path.is_file():
        raise ValueError(f"{path}: the document index a held-out fraction needs is missing")
    if path.stat().st_size != _count(shard, "documents") * 8:
        raise ValueError(f"{path}: {path.stat().st_size} bytes do not index {shard['documents']} documents")
    with path.open("rb") as index:
        index.seek(document * 8)
        offset = int.from_bytes(index.read(8), "little")
    if offset >= tokens:
        raise ValueError(f"{path}: document {document} starts at token {offset}, past the shard's {tokens} tokens")
    return offset
