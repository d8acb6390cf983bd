"""What each worker process runs: documents in, token bytes out (ids + EOS, little-endian).

Kept apart from the pipeline so a spawned worker imports only this and the tokenizers library.
Each document is encoded with `encode`, not `encode_batch`, so a worker uses exactly one core
(the batch call would start its own thread pool in every worker).
"""

from __future__ import annotations

import sys
from array import array

TYPECODES = {"uint16": "H", "uint32": "I"}
_state: dict = {}


def start_worker(file: str, eos_id: int, dtype: str) -> None:
    from tokenizers import Tokenizer

    _state.update(tokenizer=Tokenizer.from_file(file), eos_id=eos_id, typecode=TYPECODES[dtype])


def encode_chunk(texts: list[str]) -> list[bytes]:
    """Each document's tokens (the tokenizer's own special tokens included) and then EOS."""
    tokenizer, eos_id, typecode = _state["tokenizer"], _state["eos_id"], _state["typecode"]
    encoded = []
    for text in texts:
        ids = array(typecode, tokenizer.encode(text).ids)
        ids.append(eos_id)
        if sys.byteorder == "big":
            ids.byteswap()
        encoded.append(ids.tobytes())
    return encoded
