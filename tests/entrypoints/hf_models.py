"""Tiny random transformers models saved with `save_pretrained`, and transformers' own forward.

transformers is a dev-only dependency: only the tests import it, never the entrypoints.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

SEQ_LEN = 128
COMMON = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
}
# name -> (class name, config keywords): Llama 3.1 RoPE scaling + GQA + untied output; Mistral
# with tied embeddings, other GQA ratio, another theta, and a sliding window longer than the
# sequence (which therefore changes nothing); Qwen3 with QK-norm, attention biases, YaRN and a
# head_dim that is not hidden / heads (8 x 16 = 128 != 64); Qwen3-MoE routing 2 of 6 experts (3 a
# rank under EP 2, which FSDP 2 shards on dim 1) and Mixtral 2 of 4. The MoE checkpoints train without the balancing loss: the layout jobs' loss is then
# transformers' cross-entropy (the loss is per micro-batch, transformers' over the whole batch;
# test_architectures.py and test_expert_parallel.py check the balancing loss itself).
MODELS = {
    "llama": (
        "LlamaForCausalLM",
        {
            **COMMON,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": (
        "MistralForCausalLM",
        {**COMMON, "num_key_value_heads": 4, "tie_word_embeddings": True, "rope_theta": 10000.0, "sliding_window": 512},
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        {
            **COMMON,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "attention_bias": True,
            "tie_word_embeddings": False,
            "rope_theta": 1000000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {
            **COMMON,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "router_aux_loss_coef": 0.0,
            "tie_word_embeddings": False,
            "rope_theta": 1000000.0,
        },
    ),
    "mixtral": (
        "MixtralForCausalLM",
        {
            **COMMON,
            "num_key_value_heads": 4,
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.0,
            "tie_word_embeddings": False,
            "rope_theta": 1000000.0,
        },
    ),
}


def build_hf_model(kind: str, seed: int = 0):
    """A random fp32 transformers model; norm weights are random too, so a swapped norm shows."""
    import transformers

    class_name, kwargs = MODELS[kind]
    model_class = getattr(transformers, class_name)
    config_class = getattr(transformers, class_name.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    model = model_class(config_class(**kwargs, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0, 0.08)
    return model


def save_hf_model(kind: str, directory: Path):
    """Save it sharded (several safetensors files and the index), as published checkpoints are."""
    model = build_hf_model(kind)
    model.save_pretrained(directory, max_shard_size="60KB")
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def hf_loss(model, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    logits = hf_logits(model, tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
