"""Learning-rate schedule, metrics lines and FP8 conversion, in one process (checkpoints: test_checkpoint_files.py)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from entrypoints.fp8 import Fp8Settings, convert_to_float8, fp8_settings
from entrypoints.metrics import MetricsLogger, flops_per_token, matmul_params
from entrypoints.model.llama import build_model
from entrypoints.optim import lr_at
from launcher.catalog import models
from launcher.contract.config import ConfigError, ModelConfig, MoeConfig, OptimizerConfig
from launcher.contract.metrics import SAGEMAKER_METRIC_NAMES, parse_fields


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_learning_rate_warms_up_then_decays_to_min_lr_at_the_last_step(schedule):
    cfg = OptimizerConfig(lr=1.0, warmup_steps=3, schedule=schedule, min_lr=0.1)
    lrs = [lr_at(step, cfg, total_steps=10) for step in range(10)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    constant = OptimizerConfig(lr=1.0, warmup_steps=0, schedule="constant")
    assert {lr_at(s, constant, total_steps=10) for s in range(10)} == {1.0}


def test_flops_per_token_counts_every_matmul_parameter_once():
    arch = models()["llama3-8b"]
    cfg = ModelConfig(name="llama3-8b", **{k: v for k, v in arch.model_dump().items() if k in ModelConfig.__slots__})
    norms = (2 * arch.num_layers + 1) * arch.hidden_size
    assert matmul_params(cfg) == arch.num_params() - arch.vocab_size * arch.hidden_size - norms
    attention = 6 * 32 * 4096 * 8192
    assert flops_per_token(cfg, 8192) == 6 * matmul_params(cfg) + attention


def test_metrics_lines_and_jsonl_carry_the_same_fields(tmp_path, capsys):
    logger = MetricsLogger(
        tmp_path, enabled=True, tokens_per_step=4096, world_size=2, flops_per_token=1e9, peak_flops=None
    )
    logger.log(step=3, loss=2.5, grad_norm=0.75, lr=1.5e-5, step_time_s=0.5)
    line = capsys.readouterr().out.strip()
    assert line == (
        "metrics step=3 loss=2.5 grad_norm=0.75 lr=1.5e-05 tokens_per_s_per_gpu=4096 mfu=nan "
        "step_time_s=0.5 mem_alloc_gib=0 mem_reserved_gib=0"
    )
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["mfu"] is None and record["tokens_per_s_per_gpu"] == 4096
    fields = parse_fields(line)
    assert list(fields) == list(record)
    for name, value in fields.items():
        assert (math.isnan(value) and record[name] is None) or value == pytest.approx(record[name])


def test_mfu_is_measured_against_the_bf16_peak(tmp_path, capsys):
    logger = MetricsLogger(
        tmp_path, enabled=False, tokens_per_step=1000, world_size=1, flops_per_token=2e9, peak_flops=1e13
    )
    record = logger.log(step=1, loss=1.0, grad_norm=1.0, lr=1.0, step_time_s=0.5)
    assert record["mfu"] == pytest.approx(2000 * 2e9 / 1e13)
    assert capsys.readouterr().out == "" and not (tmp_path / "metrics.jsonl").exists()


def test_fp8_converts_the_block_linears_but_not_the_output_projection():
    from torchao.float8.float8_linear import Float8Linear

    cfg = ModelConfig(
        name="t", family="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        ffn_hidden_size=160, vocab_size=128, max_context=64, rope_theta=1e4,
    )  # fmt: skip
    model = build_model(cfg, seq_len=32)
    convert_to_float8(model, Fp8Settings(recipe="rowwise", float8_all_gather=False))
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert converted == linears - {"output"}
    assert len(converted) == 2 * 7


def test_fp8_leaves_an_moe_router_in_the_compute_dtype():
    from torchao.float8.float8_linear import Float8Linear

    cfg = ModelConfig(
        name="t", family="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        ffn_hidden_size=160, vocab_size=128, max_context=64, rope_theta=1e4, head_dim=16, qk_norm=True,
        moe=MoeConfig(num_experts=16, top_k=2, expert_ffn_hidden_size=32),
    )  # fmt: skip
    model = build_model(cfg, seq_len=32)
    convert_to_float8(model, Fp8Settings(recipe="tensorwise", float8_all_gather=False))
    routers = {name for name, _ in model.named_modules() if name.endswith(".router")}
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert len(routers) == 2 and not routers & converted
    assert {name.rpartition(".")[2] for name in converted} == {"wq", "wk", "wv", "wo"}


def test_fp8_is_refused_on_a_gpu_without_fp8_tensor_cores(monkeypatch):
    from launcher.recipe import Recipe
    from launcher.resolve import resolve

    recipe = Recipe.from_dict(
        {
            "name": "a100-fp8",
            "model": "llama-tiny",
            "training": {"seq_len": 256, "global_batch_size": 1, "steps": 1},
            "precision": {"fp8": True},
            "cluster": {"device": "cpu"},
        }
    )
    cfg = resolve(recipe).concrete.resolved()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(
        ConfigError, match=r"^precision\.fp8: NVIDIA A100-SXM4-80GB \(compute capability 8\.0\) has no FP8"
    ):
        fp8_settings(cfg, device_type="cuda", backend="nccl")
    assert fp8_settings(cfg, device_type="cpu", backend="gloo") == Fp8Settings(
        recipe="tensorwise", float8_all_gather=False, emulate=True
    )


def test_sagemaker_metric_definitions_parse_a_gpu_metrics_line(tmp_path, capsys, metric_definitions):
    logger = MetricsLogger(
        tmp_path, enabled=True, tokens_per_step=32768, world_size=1, flops_per_token=8.9e9, peak_flops=989e12
    )
    record = logger.log(step=12, loss=10.98, grad_norm=0.31, lr=2.7e-4, step_time_s=0.791, val_loss=11.25)
    line = capsys.readouterr().out.strip()
    key_of = {name: key for key, name in SAGEMAKER_METRIC_NAMES.items()}
    for definition in metric_definitions:
        key = key_of[definition["Name"]]
        value = float(re.search(definition["Regex"], line).group(1))
        assert value == pytest.approx(record[key], rel=1e-5), key
    assert record["val_perplexity"] == pytest.approx(math.exp(11.25))
