"""A tiny BPE tokenizer trained here on local text, and a JSONL corpus of varied documents."""

from __future__ import annotations

import json
import random

import pytest

WORDS = "the long context model reads every document to its end and then begins the next one again".split()


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Documents of 1 to 400 words, some with newlines, quotes and non-ASCII text."""
    rng = random.Random(seed)
    docs = []
    for number in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 400))]
        if number % 7 == 0:
            words.insert(rng.randrange(len(words)), 'naïve "quoted"\nline — ünïcode')
        docs.append(" ".join(words))
    return docs


def train_tokenizer(path, vocab_size: int = 300) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(make_documents(50, seed=1), trainer=trainer)
    tokenizer.save(str(path))


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_tokenizer(path)
    return path


def write_jsonl(path, docs: list[str], field: str = "text") -> None:
    path.write_text("".join(json.dumps({field: doc, "id": n}) + "\n" for n, doc in enumerate(docs)))


@pytest.fixture
def corpus(tmp_path):
    """Three JSONL files of 120 documents in all; returns (glob, documents in order)."""
    docs = make_documents(120)
    directory = tmp_path / "corpus"
    directory.mkdir()
    for part in range(3):
        write_jsonl(directory / f"part-{part}.jsonl", docs[part * 40 : (part + 1) * 40])
    return str(directory / "*.jsonl"), docs


def read_dataset(directory) -> list[tuple[list[int], list[int]]]:
    """(token ids, document start offsets) of each shard the manifest lists, in order."""
    from array import array

    manifest = json.loads((directory / "manifest.json").read_text())
    shards = []
    for shard in manifest["shards"]:
        tokens = array("H" if manifest["dtype"] == "uint16" else "I", (directory / shard["name"]).read_bytes())
        offsets = array("Q", (directory / shard["index_name"]).read_bytes())
        shards.append((tokens.tolist(), offsets.tolist()))
    return shards


def files_of(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.name != ".lock"}
