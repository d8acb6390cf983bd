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
