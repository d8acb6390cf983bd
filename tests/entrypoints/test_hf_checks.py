"""model.init_from is checked against the recipe, at load and in the job; safetensors slices read only their rows."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import torch

from launcher.contract.config import ConfigError, JobConfig
from launcher.errors import RecipeError
from launcher.recipe import Recipe
from launcher.resolve import resolve

from .hf_models import MODELS

REPO = Path(__file__).resolve().parents[2]
LLAMA = MODELS["llama"][1]  # what transformers writes for this config is the test's input
CPU_ONE = {"training.seq_len": 128, "parallel.tensor": 1, "cluster.nproc_per_node": 1}


def save_config(directory: Path, class_name: str = "LlamaConfig", **changes) -> Path:
    import transformers

    getattr(transformers, class_name)(**{**LLAMA, **changes}).save_pretrained(directory)
    return directory


def test_a_recipe_of_another_architecture_is_refused_naming_both_values(tmp_path):
    checkpoint = save_config(tmp_path / "ckpt")
    with pytest.raises(RecipeError) as err:
        Recipe.load(
            REPO / "recipes/tiny-cpu.yaml",
            {**CPU_ONE, "model": {"base": "llama3.1-tiny", "init_from": str(checkpoint)}},
        )
    assert (
        f"model.init_from: model.hidden_size is 128 in the recipe but 64 in {checkpoint}/config.json; "
        "make the recipe's model match the checkpoint" in str(err.value)
    )


def test_rope_scaling_differences_are_mismatches_too(tmp_path):
    checkpoint = save_config(tmp_path / "ckpt", rope_scaling=None)
    overrides = {
        **CPU_ONE,
        "model": {"hf_config": str(save_config(tmp_path / "arch") / "config.json"), "init_from": str(checkpoint)},
    }
    with pytest.raises(
        RecipeError, match=r"model.rope_scaling is \{type: llama3, factor: 8.0, .*\} in the recipe but none in"
    ):
        Recipe.load(REPO / "recipes/tiny-cpu.yaml", overrides)


def test_init_from_alone_takes_the_architecture_from_the_checkpoint_relative_to_the_recipe(tmp_path):
    save_config(tmp_path / "ckpt")
    recipe_file = tmp_path / "fine-tune.yaml"
    recipe_file.write_text(
        textwrap.dedent(
            f"""
            extends: {REPO / "recipes/tiny-cpu.yaml"}
            name: fine-tune
            model: {{init_from: ./ckpt}}
            checkpoint: {{export_hf: true}}
            """
        )
    )
    recipe = Recipe.load(recipe_file, {"parallel.tensor": 1, "cluster.nproc_per_node": 1})
    arch = recipe.arch
    assert (arch.hidden_size, arch.num_kv_heads, arch.rope_theta) == (64, 2, 500000.0)
    assert arch.rope_scaling.original_max_context == 64  # read from transformers 5's rope_parameters
    resolved = resolve(recipe).concrete.resolved().to_dict()
    assert resolved["model"]["init_from"] == str(tmp_path / "ckpt")
    assert resolved["checkpoint"]["export_hf"] == "hf"
    assert JobConfig.from_dict(resolved).model.init_from == str(tmp_path / "ckpt")


def test_an_s3_checkpoint_alone_asks_for_the_architecture():
    with pytest.raises(RecipeError, match="model.init_from: an s3:// checkpoint's config.json is read only by the job"):
        Recipe.load(REPO / "recipes/tiny-cpu.yaml", {**CPU_ONE, "model": {"init_from": "s3://bucket/llama"}})


def test_a_sliding_window_shorter_than_the_sequence_is_refused(tmp_path):
    checkpoint = save_config(tmp_path / "ckpt", "MistralConfig", sliding_window=64)
    arch = save_config(tmp_path / "arch", "MistralConfig", sliding_window=64) / "config.json"
    with pytest.raises(RecipeError, match="sliding_window 64 in .* is shorter than training.seq_len 128"):
        Recipe.load(
            REPO / "recipes/tiny-cpu.yaml", {**CPU_ONE, "model": {"hf_config": str(arch), "init_from": str(checkpoint)}}
        )


def s3_job(tmp_path) -> JobConfig:
    recipe = Recipe.load(
        REPO / "recipes/tiny-cpu.yaml",
        {**CPU_ONE, "model": {"base": "llama3.1-tiny", "init_from": "s3://bucket/llama"}},
    )
    return resolve(recipe).concrete.resolved()


def test_the_job_checks_an_s3_checkpoint_from_the_model_channel_with_the_same_message(tmp_path, monkeypatch):
    from entrypoints.hf_weights import load_hf_weights

    cfg = s3_job(tmp_path)
    monkeypatch.setenv("SM_CHANNEL_MODEL", str(save_config(tmp_path / "channel")))
    with pytest.raises(ConfigError) as err:
        load_hf_weights([], cfg)
    assert str(err.value).startswith(
        "model.init_from: model.hidden_size is 128 in the recipe but 64 in s3://bucket/llama/config.json;"
    )


def test_an_s3_checkpoint_outside_sagemaker_names_the_channel(tmp_path, monkeypatch):
    from entrypoints.hf_weights import load_hf_weights

    monkeypatch.delenv("SM_CHANNEL_MODEL", raising=False)
    with pytest.raises(ConfigError, match="read from the SageMaker 'model' channel, but SM_CHANNEL_MODEL is not set"):
        load_hf_weights([], s3_job(tmp_path))


def test_a_resumed_run_does_not_load_the_checkpoint(tmp_path):
    from entrypoints.hf_weights import load_hf_weights

    assert load_hf_weights([], s3_job(tmp_path), fresh_start=False) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slice_reads_only_its_rows_from_a_file_the_safetensors_library_wrote(tmp_path, dtype):
    from safetensors.torch import save_file

    from entrypoints.hf_weights import SafetensorsCheckpoint

    first, second = torch.randn(6, 5).to(dtype), torch.randn(7).to(dtype)
    save_file({"a": first, "b": second}, tmp_path / "model.safetensors")
    checkpoint = SafetensorsCheckpoint(tmp_path)
    assert torch.equal(checkpoint.read_slice("a", (2, 1), (3, 2)), first[2:5, 1:3])
    assert checkpoint.bytes_read == 3 * 5 * first.element_size()  # rows 2..4 only, all their columns
    assert torch.equal(checkpoint.read_slice("b", (4,), (3,)), second[4:7])
    checkpoint.close()


def test_a_truncated_file_is_one_line(tmp_path):
    from safetensors.torch import save_file

    from entrypoints.hf_weights import SafetensorsCheckpoint

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(64, 4)}, path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ConfigError, match="ends before its tensors do"):
        SafetensorsCheckpoint(tmp_path).read_slice("a", (0, 0), (64, 4))


def test_the_exported_config_is_one_transformers_reads_back():
    from transformers import LlamaConfig

    from launcher.contract.hf_checkpoint import hf_architecture, hf_config_json

    model = {
        **dataclasses.asdict(
            resolve(Recipe.load(REPO / "recipes/tiny-cpu.yaml", CPU_ONE | {"model": "llama3.1-tiny"}))
            .concrete.resolved()
            .model
        )
    }
    config = LlamaConfig(**hf_config_json(model, dtype="bf16"))
    again = hf_architecture(config.to_dict())
    assert {k: again[k] for k in ("hidden_size", "num_kv_heads", "rope_theta", "rope_scaling")} == {
        "hidden_size": model["hidden_size"],
        "num_kv_heads": model["num_kv_heads"],
        "rope_theta": model["rope_theta"],
        "rope_scaling": model["rope_scaling"],
    }


def test_export_files_stay_under_the_size_limit_and_never_span_two_pipeline_stages():
    from entrypoints.export_hf import export_plan
    from entrypoints.model.llama import build_model

    overrides = {"model": "llama3.1-tiny", "parallel.pipeline": 2, "parallel.tensor": 1, "cluster.nproc_per_node": 2}
    cfg = resolve(Recipe.load(REPO / "recipes/tiny-cpu.yaml", overrides)).concrete.resolved()
    limit = 200_000  # bytes: a few of the tiny model's fp32 weights per file
    plan = export_plan(cfg, max_file_bytes=limit)
    shapes = {name: tuple(p.shape) for name, p in build_model(cfg.model, seq_len=128).named_parameters()}
    assert [t for f in plan for t in f.tensors] == list(shapes.items())  # every tensor once, in model order
    assert [f.name for f in plan][-1] == f"model-{len(plan):05d}-of-{len(plan):05d}.safetensors"
    for file in plan:
        sizes = [4 * torch.Size(shape).numel() for _, shape in file.tensors]
        assert sum(sizes) <= limit or len(sizes) == 1, file.name
        layers = {int(n.split(".")[1]) for n, _ in file.tensors if n.startswith("layers.")}
        assert layers <= set(range(2 * file.stage, 2 * file.stage + 2)), file.name  # 4 layers, 2 per stage
    assert {f.stage for f in plan if any(n == "tok_embeddings.weight" for n, _ in f.tensors)} == {0}
    assert {f.stage for f in plan if any(n == "output.weight" for n, _ in f.tensors)} == {1}


@pytest.mark.parametrize("key", ["qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_each_familys_exported_config_reads_back_through_transformers_as_the_catalog_model(tmp_path, key):
    """Our config.json -> transformers' own config class -> save_pretrained (its spellings: it
    writes Qwen3-MoE's num_experts as num_local_experts) -> read as a recipe's hf_config."""
    import transformers

    from launcher.catalog import models
    from launcher.contract.hf_checkpoint import ARCHITECTURES, hf_config_json
    from launcher.recipe.hf_config import read_hf_config

    catalog = models()[key]
    written = hf_config_json(catalog.model_dump(mode="json"), dtype="bf16")
    config_class = getattr(transformers, ARCHITECTURES[catalog.family].replace("ForCausalLM", "Config"))
    config_class(**written).save_pretrained(tmp_path)
    arch, problems = read_hf_config(tmp_path / "config.json")
    assert problems == []
    assert arch.model_dump(exclude={"source"}) == catalog.model_dump(exclude={"source"})


QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 128,
    "norm_topk_prob": True,
}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"mlp_only_layers": [1]},
            "keeps some layers dense (mlp_only_layers [1], decoder_sparse_step 1); this launcher puts experts in "
            "every layer",
        ),
        ({"decoder_sparse_step": 2}, "keeps some layers dense (mlp_only_layers [], decoder_sparse_step 2)"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 2}},
            "sets mscale, which the model here does not compute",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "needs positive numbers original_max_position_embeddings",
        ),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
        ({"num_experts": 100000}, "num_experts 100000 in"),
        ({"router_aux_loss_coef": -1}, "router_aux_loss_coef -1 in"),
        ({"model_type": "deepseek_v3"}, "use a llama, mistral, qwen3, qwen3_moe, mixtral config"),
    ],
)
def test_a_config_json_the_model_cannot_compute_is_one_line_naming_the_key(tmp_path, changes, message):
    import json

    from launcher.recipe.hf_config import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_MOE, **changes}))
    arch, problems = read_hf_config(tmp_path / "config.json")
    assert arch is None and len(problems) == 1
    assert problems[0].path == "model.hf_config" and message in problems[0].message, problems[0].message


def test_a_checkpoint_that_renormalises_differently_is_a_mismatch_and_qwen3s_off_window_is_ignored(tmp_path):
    import json

    from launcher.contract.hf_checkpoint import architecture_mismatch, sliding_window_problem
    from launcher.recipe.hf_config import read_hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_MOE))
    ours = read_hf_config(path)[0].model_dump(mode="json")
    assert architecture_mismatch(ours, QWEN3_MOE, "c.json") is None
    # Qwen3MoeConfig's default is norm_topk_prob false: a config.json without it does not renormalise.
    unnormalised = {k: v for k, v in QWEN3_MOE.items() if k != "norm_topk_prob"}
    assert architecture_mismatch(ours, unnormalised, "c.json").startswith(
        "model.moe.normalize_top_k is True in the recipe but False in c.json"
    )
    window = {**QWEN3_MOE, "sliding_window": 64}
    assert sliding_window_problem({**window, "use_sliding_window": False}, 128, "c.json") is None
    assert "sliding_window 64 in c.json is shorter" in sliding_window_problem(window, 128, "c.json")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"shared_experts": 1}, "a qwen3_moe checkpoint has no shared experts; use model.moe.shared_experts: 0"),
        ({"router_score": "sigmoid"}, "a qwen3_moe checkpoint routes with a softmax; use model.moe.router_score"),
    ],
)
def test_an_moe_the_checkpoint_layout_cannot_hold_is_refused_before_any_tensor_is_read(tmp_path, changes, message):
    """The recipe cannot change the router; a hand-edited resolved config can, and the job refuses it."""
    from entrypoints.hf_weights import check_checkpoint
    from launcher.contract.config import ModelConfig, MoeConfig

    moe = MoeConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=32, **changes)
    model = ModelConfig(
        name="t", family="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        ffn_hidden_size=96, vocab_size=128, max_context=256, rope_theta=1e4, rope_scaling=None,
        tie_embeddings=False, norm_eps=1e-6, qk_norm=True, moe=moe, init_from=str(tmp_path),
    )  # fmt: skip
    with pytest.raises(ConfigError) as err:
        check_checkpoint(model, 128, tmp_path)  # no config.json here: the layout is refused first
    assert str(err.value).startswith(f"model.init_from: {message}")
