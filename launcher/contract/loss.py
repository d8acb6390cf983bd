"""How the fused output projection + cross-entropy splits a micro-batch's tokens into chunks.

entrypoints/model/loss.py runs the loss chunk by chunk; the memory estimator
(launcher/estimate/fsdp.py) sizes the chunk's logits and the throughput model
(launcher/plan/throughput.py) the chunk's GEMMs with the same rule.
"""

from __future__ import annotations

import math

MIN_CHUNK_TOKENS = 1024
"""The loss never works on fewer tokens at once: smaller GEMMs waste the GPU."""


def chunk_tokens(num_tokens: int, hidden: int, vocab_local: float, *, min_tokens: int = MIN_CHUNK_TOKENS) -> int:
    """Tokens per chunk: a chunk's logits hold about as many values as h, at least `min_tokens` rows."""
    chunks = max(1, math.ceil(vocab_local / hidden))
    return max(1, math.ceil(num_tokens / chunks), min(num_tokens, min_tokens))
