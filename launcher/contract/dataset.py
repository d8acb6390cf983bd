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
