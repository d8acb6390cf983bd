"""The tokenizer: a Hugging Face tokenizer.json (or a directory holding one), its hash and its EOS.

The end-of-document id is `--eos-token` when given, else the tokenizer_config.json's eos_token
beside the file, else the first of the usual end-of-text tokens the vocabulary holds.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from launcher.contract.dataset import token_dtype
from launcher.errors import UsageError

TOKENIZERS_MISSING = "tokenizing needs the tokenizers library; install the data extra: pip install 'launcher[data]'"
TOKENIZER_FILE = "tokenizer.json"
# Llama 3, GPT-2/Qwen, Llama 2/Mistral, Gemma: the end-of-text tokens of the common families.
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


@dataclass(frozen=True)
class TokenizerInfo:
    file: Path
    sha256: str
    vocab_size: int
    eos_id: int
    eos_token: str

    @property
    def dtype(self) -> str:
        return token_dtype(self.vocab_size)

    def to_dict(self) -> dict:
        return {
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
        }


def load_tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(TOKENIZERS_MISSING) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises a bare Exception
        raise UsageError(f"--tokenizer {path}: not a Hugging Face tokenizer.json ({error})") from None


def tokenizer_info(given: str, *, eos_token: str | None) -> TokenizerInfo:
    if given.startswith("s3://"):
        raise UsageError(f"--tokenizer {given}: give a local tokenizer.json or a directory holding one")
    path = Path(given)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise UsageError(f"--tokenizer {given}: no {TOKENIZER_FILE} there; give the file or a directory holding one")
    tokenizer = load_tokenizer(file)
    eos = eos_token or _configured_eos(file.parent) or _known_eos(tokenizer)
    if eos is None:
        raise UsageError(f"--tokenizer {given}: no end-of-text token found; name it with --eos-token (e.g. '</s>')")
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        raise UsageError(f"--eos-token {eos!r}: not a token of {file}; name one of its special tokens")
    return TokenizerInfo(
        file=file,
        sha256=hashlib.sha256(file.read_bytes()).hexdigest(),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        eos_id=eos_id,
        eos_token=eos,
    )


def _configured_eos(directory: Path) -> str | None:
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


def _known_eos(tokenizer) -> str | None:
    return next((token for token in EOS_CANDIDATES if tokenizer.token_to_id(token) is not None), None)
