"""A prepared directory is a data.source as it is: the training reader takes its shards in the
manifest's order, and the reader and the recipe check its dtype and vocabulary."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from entrypoints.data import TokenFiles, token_files
from launcher.contract.config import ConfigError
from launcher.data.prepare import PrepareSettings, prepare
from launcher.errors import RecipeError
from launcher.recipe import Recipe
from launcher.resolve import resolve
from tests.backends.helpers import REPO

from .conftest import make_documents, read_dataset, write_jsonl


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer_file):
    root = tmp_path_factory.mktemp("prepared")
    write_jsonl(root / "corpus.jsonl", make_documents(30))
    given = PrepareSettings(inputs=(str(root / "corpus.jsonl"),), tokenizer=str(tokenizer_file), shard_tokens=1500)
    prepare(given, out=str(root / "out"), workers=1)
    return root / "out"


def tiny_recipe(**overrides) -> Recipe:
    data = yaml.safe_load((REPO / "recipes" / "tiny-cpu.yaml").read_text())
    return Recipe.from_dict(data, overrides)


def test_the_reader_takes_the_manifests_shards_in_order_and_nothing_else(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    (copy / "0-stray.bin").write_bytes(b"\xff\xff" * 100)  # sorts first; not the dataset's
    files = token_files(str(copy), dtype="uint16", vocab_size=512)
    assert [f.name for f in files] == [f"shard-{n:06d}.bin" for n in range(len(read_dataset(prepared)))]
    stream = [token for tokens, _ in read_dataset(prepared) for token in tokens]
    reader = TokenFiles(files, dtype="uint16", seq_len=64, vocab_size=512)
    assert reader.sample(3).tolist() == stream[3 * 64 : 4 * 64 + 1]  # spans a shard boundary
    assert len(reader) == (len(stream) - 1) // 64


def test_the_reader_refuses_another_dtype_and_a_larger_vocabulary(prepared):
    with pytest.raises(ConfigError) as wrong_dtype:
        token_files(str(prepared), dtype="uint32", vocab_size=512)
    assert str(wrong_dtype.value) == (
        "data.dtype: the prepared dataset holds uint16 tokens, not uint32; set data.dtype: uint16"
    )
    with pytest.raises(ConfigError) as small_model:
        token_files(str(prepared), dtype="uint16", vocab_size=256)
    assert str(small_model.value) == (
        "data.source: the dataset was tokenized with a 300-token vocabulary, larger than the model's 256; "
        "use the model's tokenizer or a model with at least 300 tokens"
    )


def test_the_recipe_reads_its_dtype_from_the_manifest_and_checks_the_vocabulary(prepared, tmp_path):
    copy = tmp_path / "wide"
    shutil.copytree(prepared, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "dtype": "uint32"}))
    assert tiny_recipe(**{"data.source": str(copy)}).data.dtype == "uint32"
    eos_id = json.loads((prepared / "manifest.json").read_text())["eos_id"]
    assert resolve(tiny_recipe(**{"data.source": str(prepared)})).concrete.resolved().to_dict()["data"] == {
        "source": str(prepared),
        "dtype": "uint16",
        "document_masking": False,
        "document_separator": eos_id,  # the manifest's, for document masking
        "document_positions": "restart",
        "validation": None,  # no data.validation in the recipe
    }

    with pytest.raises(RecipeError) as small_model:
        tiny_recipe(**{"data.source": str(prepared), "model": {"base": "llama-tiny", "vocab_size": 256}})
    assert small_model.value.lines() == [
        "overrides data.source: the dataset was tokenized with a 300-token vocabulary, larger than the model's 256; "
        "use the model's tokenizer or a model with at least 300 tokens"
    ]
    with pytest.raises(RecipeError) as wrong_dtype:
        tiny_recipe(**{"data.source": str(prepared), "data.dtype": "uint32"})
    assert wrong_dtype.value.lines()[0].endswith(
        "data.dtype: the prepared dataset holds uint16 tokens, not uint32; set data.dtype: uint16"
    )


def test_raw_text_with_a_tokenizer_needs_a_source_and_an_engine_that_reads_this_machine(tokenizer_file):
    with pytest.raises(RecipeError) as synthetic:
        tiny_recipe(**{"data.tokenizer": str(tokenizer_file)})
    assert [p.path for p in synthetic.value.problems] == ["data.tokenizer"]
    assert "data.source is synthetic" in synthetic.value.problems[0].message
    with pytest.raises(RecipeError) as sagemaker:
        tiny_recipe(
            **{"data.tokenizer": str(tokenizer_file), "data.source": "s3://bucket/raw/", "cluster.backend": "sagemaker"}
        )
    assert any(p.path == "data.tokenizer" and "launcher data prepare" in p.message for p in sagemaker.value.problems)
