"""data.validation.fraction on a real prepared dataset: the held-out share is the last whole
documents, the same every time, and training's samples never read a token of it."""

from __future__ import annotations

import json
import math

import pytest

from launcher.contract.config import ConfigError
from launcher.contract.dataset import held_out_start
from launcher.data.prepare import PrepareSettings, prepare
from launcher.recipe import Recipe
from launcher.resolve import resolve
from tests.backends.helpers import REPO

from .conftest import read_dataset

TINY = REPO / "recipes" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer_file):
    from .conftest import make_documents, write_jsonl

    root = tmp_path_factory.mktemp("held-out")
    write_jsonl(root / "docs.jsonl", make_documents(120))
    settings = PrepareSettings(inputs=(str(root / "docs.jsonl"),), tokenizer=str(tokenizer_file), shard_tokens=4000)
    prepare(settings, out=str(root / "out"), workers=1)
    return root / "out"


def test_the_split_is_at_the_start_of_the_first_held_out_document(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    starts, stream = [], []
    for tokens, offsets in read_dataset(prepared):
        starts += [len(stream) + offset for offset in offsets]
        stream += tokens
    start, held = held_out_start(prepared, manifest, 0.1)
    assert held == math.ceil(0.1 * 120) == 12
    assert start == starts[120 - 12]  # document 108 of 120 begins the held-out share
    assert stream[start - 1] == manifest["eos_id"]  # training's last document ends whole
    assert held_out_start(prepared, manifest, 0.1) == (start, held)  # the same split every time


def test_training_and_validation_read_disjoint_token_ranges(prepared):
    import torch

    from entrypoints.data import TokenFiles, token_files

    manifest = json.loads((prepared / "manifest.json").read_text())
    split, _ = held_out_start(prepared, manifest, 0.1)
    paths = token_files(str(prepared), dtype="uint16", vocab_size=300)
    total = manifest["tokens"]
    train = TokenFiles(paths, dtype="uint16", seq_len=64, vocab_size=300, span=(0, split))
    held = TokenFiles(paths, dtype="uint16", seq_len=64, vocab_size=300, span=(split, None))
    stream = torch.cat([torch.tensor(tokens) for tokens, _ in read_dataset(prepared)])
    assert len(train) == (split - 1) // 64 and len(held) == (total - split - 1) // 64
    last_train = train.sample(len(train) - 1)
    assert torch.equal(last_train, stream[(len(train) - 1) * 64 : len(train) * 64 + 1])
    assert (len(train) - 1) * 64 + 65 <= split  # its last token is before the held-out share
    assert torch.equal(held.sample(0), stream[split : split + 65])
    assert torch.equal(train.sample(len(train)), train.sample(0))  # training wraps inside its span


def test_a_damaged_index_is_one_line_naming_the_file(prepared, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    last = manifest["shards"][-1]
    (copy / last["index_name"]).write_bytes(b"\x00" * 12)
    with pytest.raises(ValueError, match=rf"{last['index_name']}: 12 bytes do not index {last['documents']} documents"):
        held_out_start(copy, manifest, 0.01)


def test_a_resolved_fraction_reaches_the_job_config_and_its_loader(prepared):
    import torch

    from entrypoints.data import DataLoader
    from entrypoints.evaluate import validation_dataset

    changes = {
        "data.source": str(prepared),
        "data.validation.fraction": 0.1,
        "training.seq_len": 64,
        "training.global_batch_size": 2,
        "training.micro_batch_size": 2,
        "parallel.tensor": 1,
        "cluster.nproc_per_node": 1,
    }
    cfg = resolve(Recipe.load(TINY, changes)).concrete.resolved()
    assert cfg.data.validation.fraction == 0.1 and cfg.data.validation.every_steps == 0
    manifest = json.loads((prepared / "manifest.json").read_text())
    split, _ = held_out_start(prepared, manifest, 0.1)
    loader = DataLoader.from_config(cfg, dp_rank=0, cp_rank=0, device=torch.device("cpu"))
    assert loader.dataset.first_token == 0 and loader.dataset.total_tokens == split
    held = validation_dataset(cfg)
    assert held.first_token == split and held.total_tokens == manifest["tokens"] - split


def test_a_fraction_of_a_dataset_that_is_not_prepared_is_refused_by_the_entrypoints(tmp_path):
    from entrypoints.data import held_out_split
    from launcher.contract.config import JobConfig

    tokens = tmp_path / "plain"
    tokens.mkdir()
    (tokens / "a.bin").write_bytes(b"\x01\x00" * 1000)
    single = {"cluster.nproc_per_node": 1, "parallel.tensor": 1}
    cfg = resolve(Recipe.load(TINY, single)).concrete.resolved().to_dict()
    cfg["data"].update(source=str(tokens), validation={"fraction": 0.5})
    with pytest.raises(ConfigError, match=r"^data.validation.fraction: .*plain is not a prepared dataset"):
        held_out_split(JobConfig.from_dict(cfg))
