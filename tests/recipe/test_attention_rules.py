"""parallel.cp_attention and data.document_masking: one line naming the key for each bad recipe,
and the concrete choice the resolved config carries."""

from __future__ import annotations

import pytest

from launcher.contract.config import ConfigError, JobConfig
from launcher.recipe import Recipe
from launcher.resolve import resolve

from .test_bad_recipes import BASE


def validate(tmp_path, monkeypatch, cli, text: str):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text(text)
    return cli("validate", "r.yaml")


ULYSSES_16_WAYS = BASE + "  instance_count: 2\nparallel:\n  tensor: 2\n  context: 8\n  cp_attention: ulysses\n"


def test_rejects_ulysses_when_kv_heads_do_not_split_over_tensor_x_context(tmp_path, monkeypatch, cli):
    result = validate(tmp_path, monkeypatch, cli, ULYSSES_16_WAYS)
    assert result.code == 2
    assert result.err_lines == [
        "r.yaml:14 parallel.cp_attention: ulysses needs num_heads 32 and num_kv_heads 8 divisible by "
        "tensor 2 x context 8 = 16; use allgather or auto"
    ]


def test_allows_ulysses_when_both_head_counts_split(tmp_path, monkeypatch, cli):
    text = ULYSSES_16_WAYS
    result = validate(tmp_path, monkeypatch, cli, text.replace("llama3-8b", "{base: llama3-8b, num_kv_heads: 32}"))
    assert result.code == 0, result.err


def test_rejects_document_masking_on_token_files_without_a_separator(tmp_path, monkeypatch, cli):
    text = BASE.replace("sagemaker\n", "local\n").replace("ml.p5.48xlarge", "local\n  device: cpu")
    text += "data:\n  source: /data/tokens\n  dtype: uint32\n  document_masking: true\n"
    result = validate(tmp_path, monkeypatch, cli, text)
    assert result.code == 2
    [line] = result.err_lines
    assert line.endswith(
        "data.document_separator: document_masking needs the token id that ends each document; "
        "set it to the tokenizer's EOS id"
    ), line


def test_rejects_a_separator_outside_the_vocabulary(tmp_path, monkeypatch, cli):
    text = BASE + "data:\n  document_masking: true\n  document_separator: 128256\n"
    result = validate(tmp_path, monkeypatch, cli, text)
    assert result.code == 2
    [line] = result.err_lines
    assert line.endswith(
        "data.document_separator: 128256 is not a token id of the 128256-token vocabulary; use 0 to 128255"
    ), line


def resolved(**changes) -> dict:
    base = {
        "name": "t",
        "model": "llama3-8b",
        "training": {"seq_len": 8192, "global_batch_size": 16, "steps": 10},
        "cluster": {"backend": "sagemaker", "instance_type": "ml.p5.48xlarge", "instance_count": 2},
    }
    return resolve(Recipe.from_dict(base, changes)).concrete.resolved().to_dict()


@pytest.mark.parametrize(
    "model, context, expected",
    [
        ("llama3-8b", 1, "allgather"),  # no context parallelism: the choice does not matter
        ("llama3-8b", 2, "allgather"),  # GQA 32/8: Ulysses moves (32 + 8)/2 = 20 heads' worth, all-gather 8
        ("llama3-8b", 8, "ulysses"),  # (32 + 8)/8 = 5 < 8: Ulysses moves fewer bytes
        # cp 4, every layer kept: 2 passes x (32 + 8)/4 = 20 against 3 regathering collectives x 8 = 24
        ("llama3-8b", 4, "ulysses"),
        ({"base": "llama3-8b", "num_kv_heads": 32}, 2, "ulysses"),  # MHA: equal bytes, plain causal kernel
    ],
)
def test_auto_resolves_to_the_path_that_moves_fewer_bytes(model, context, expected):
    found = resolved(**{"model": model, "parallel.context": context})
    assert found["parallel"]["cp_attention"] == expected


def test_auto_weighs_checkpointing_since_kept_layers_regather_their_k_and_v():
    # Llama 3 8B at cp 4: with full checkpointing both paths run three times per layer, and
    # Ulysses' (32 + 8)/4 = 10 heads' worth loses to the all-gather's 8.
    found = resolved(**{"parallel.context": 4, "parallel.activation_checkpointing": "full"})
    assert found["parallel"]["cp_attention"] == "allgather"


def test_auto_falls_back_to_allgather_when_heads_do_not_split():
    # Llama 3 8B at tensor 8 x context 2: 8 KV heads do not split 16 ways.
    found = resolved(**{"parallel.context": 2, "parallel.tensor": 8})
    assert found["parallel"]["cp_attention"] == "allgather"


def test_the_entrypoints_refuse_a_resolved_ulysses_config_whose_heads_do_not_split():
    config = resolved(**{"parallel.context": 2, "parallel.tensor": 8})
    config["parallel"]["cp_attention"] = "ulysses"
    with pytest.raises(ConfigError, match=r"^parallel.cp_attention: ulysses needs num_heads 32 and num_kv_heads 8"):
        JobConfig.from_dict(config)


def test_document_masking_on_synthetic_data_resolves_its_separator():
    found = resolved(**{"data.document_masking": True})
    assert found["data"]["document_separator"] == 0
    assert JobConfig.from_dict(found).data.document_positions == "restart"
