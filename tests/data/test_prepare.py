"""`launcher data prepare` on a local JSONL corpus: the shards and their document index against
the source text, the manifest's hashes, determinism across worker counts, and resuming."""

from __future__ import annotations

import hashlib
import json

import pytest
from tokenizers import Tokenizer

from launcher.data import prepare as pipeline
from launcher.data.prepare import PrepareSettings, prepare

from .conftest import files_of, read_dataset


def settings(corpus_glob: str, tokenizer_file, **changes) -> PrepareSettings:
    return PrepareSettings(inputs=(corpus_glob,), tokenizer=str(tokenizer_file), shard_tokens=4000, **changes)


def test_every_document_decodes_back_to_its_text_and_the_index_marks_where_it_starts(corpus, tokenizer_file, tmp_path):
    corpus_glob, docs = corpus
    done = prepare(settings(corpus_glob, tokenizer_file), out=str(tmp_path / "out"), workers=1)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos = tokenizer.token_to_id("</s>")

    decoded = []
    for tokens, starts in read_dataset(tmp_path / "out"):
        assert starts[0] == 0 and tokens[-1] == eos  # shards hold whole documents
        for start, end in zip(starts, [*starts[1:], len(tokens)], strict=True):
            document = tokens[start:end]
            assert document[-1] == eos and eos not in document[:-1]
            decoded.append(tokenizer.decode(document[:-1]))
    assert decoded == docs

    manifest = done.manifest
    shards = read_dataset(tmp_path / "out")
    assert len(shards) > 3 and all(len(tokens) >= 4000 for tokens, _ in shards[:-1])
    assert (manifest["documents"], manifest["tokens"]) == (len(docs), sum(len(t) for t, _ in shards))
    assert (manifest["eos_id"], manifest["dtype"], manifest["vocab_size"]) == (eos, "uint16", 300)
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    for record in manifest["shards"]:
        assert record["sha256"] == hashlib.sha256((tmp_path / "out" / record["name"]).read_bytes()).hexdigest()
    for entry in manifest["inputs"]:
        assert entry["sha256"] == hashlib.sha256(open(entry["uri"], "rb").read()).hexdigest()
    assert [e["uri"].rsplit("/", 1)[1] for e in manifest["inputs"]] == ["part-0.jsonl", "part-1.jsonl", "part-2.jsonl"]


def test_the_output_is_byte_identical_whatever_the_number_of_workers(corpus, tokenizer_file, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "CHUNK_CHARS", 3000)  # many chunks, so three workers finish out of order
    corpus_glob, _ = corpus
    one = prepare(settings(corpus_glob, tokenizer_file), out=str(tmp_path / "one"), workers=1)
    three = prepare(settings(corpus_glob, tokenizer_file), out=str(tmp_path / "three"), workers=3)
    assert (one.workers, three.workers) == (1, 3)
    assert files_of(tmp_path / "one") == files_of(tmp_path / "three")


class Interrupted(Exception):
    pass


def test_an_interrupted_run_resumes_after_its_last_finished_shard_and_a_damaged_shard_is_redone(
    corpus, tokenizer_file, tmp_path
):
    corpus_glob, _ = corpus
    clean = tmp_path / "clean"
    prepare(settings(corpus_glob, tokenizer_file), out=str(clean), workers=1)

    def stop_after_two(record):
        if record["name"] == "shard-000001.bin":
            raise Interrupted

    out = tmp_path / "out"
    with pytest.raises(Interrupted):
        prepare(settings(corpus_glob, tokenizer_file), out=str(out), workers=1, on_shard=stop_after_two)
    progress = json.loads((out / "progress.json").read_text())
    assert [r["name"] for r in progress["shards"]] == ["shard-000000.bin", "shard-000001.bin"]
    assert not (out / "manifest.json").exists()

    resumed = prepare(settings(corpus_glob, tokenizer_file), out=str(out), workers=1)
    total = len(resumed.manifest["shards"])
    assert (resumed.reused_shards, resumed.written_shards) == (2, total - 2)
    assert files_of(out) == files_of(clean)  # no progress.json or partial file is left either

    again = prepare(settings(corpus_glob, tokenizer_file), out=str(out), workers=1)
    assert (again.reused_shards, again.written_shards, again.tokenized_tokens) == (total, 0, 0)

    damaged = out / "shard-000002.bin"
    damaged.write_bytes(damaged.read_bytes()[:-2] + b"\0\0")
    redone = prepare(settings(corpus_glob, tokenizer_file), out=str(out), workers=1)
    assert (redone.reused_shards, redone.written_shards) == (2, total - 2)
    assert files_of(out) == files_of(clean)


def test_text_parquet_and_saved_datasets_inputs_give_the_same_shards_as_jsonl(corpus, tokenizer_file, tmp_path):
    import pyarrow
    import pyarrow.ipc
    import pyarrow.parquet

    _, docs = corpus
    docs = docs[:40]  # the first file's documents
    corpus_glob = corpus[0].replace("*", "part-0")
    prepare(settings(corpus_glob, tokenizer_file), out=str(tmp_path / "jsonl"), workers=1)
    expected = {k: v for k, v in files_of(tmp_path / "jsonl").items() if k.startswith("shard-")}

    (tmp_path / "corpus.txt").write_text("<|doc|>".join(docs))
    table = pyarrow.table({"id": list(range(len(docs))), "body": docs})
    pyarrow.parquet.write_table(table, tmp_path / "corpus.parquet", row_group_size=15)
    saved = tmp_path / "saved"  # the layout `datasets.Dataset.save_to_disk` writes
    saved.mkdir()
    with pyarrow.ipc.new_stream(saved / "data-00000-of-00001.arrow", table.schema) as stream:
        stream.write_table(table, max_chunksize=12)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))

    for name, given, changes in [
        ("text", tmp_path / "corpus.txt", {"delimiter": "<|doc|>"}),
        ("parquet", tmp_path / "corpus.parquet", {"field": "body"}),
        ("arrow", saved, {"field": "body"}),
    ]:
        done = prepare(settings(str(given), tokenizer_file, **changes), out=str(tmp_path / name), workers=1)
        assert done.manifest["inputs"][0]["format"] == name
        assert {k: v for k, v in files_of(tmp_path / name).items() if k.startswith("shard-")} == expected, name


def test_vocabularies_past_65536_tokens_are_written_as_uint32(tokenizer_file):
    from array import array

    from launcher.contract.dataset import token_dtype
    from launcher.data import encode

    assert (token_dtype(65536), token_dtype(65537), token_dtype(128256)) == ("uint16", "uint32", "uint32")
    encode.start_worker(str(tokenizer_file), 1, "uint32")
    (written,) = encode.encode_chunk(["the long context model"])
    ids = Tokenizer.from_file(str(tokenizer_file)).encode("the long context model").ids
    assert array("I", written).tolist() == [*ids, 1]
