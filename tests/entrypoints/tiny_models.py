"""Tiny model configs shared by the model tests and the attention-path launches."""

from __future__ import annotations

from launcher.contract.config import ModelConfig, RopeScaling

LLAMA31_SCALING = RopeScaling(
    type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_context=8192
)


def tiny(**changes) -> ModelConfig:
    fields = dict(
        name="t",
        family="llama",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=48,
        vocab_size=61,
        max_context=64,
        rope_theta=10000.0,
    )
    return ModelConfig(**{**fields, **changes})
