"""Hugging Face checkpoints' config.json: architecture in, config.json out, standard library only.

    hf_architecture(config)                      # config.json -> our field names and values
    architecture_mismatch(ours, config, where)   # one line naming both values, or None
    hf_config_json(model_fields, dtype="bf16")   # the config.json an export writes
    export_out_problem(out)                      # why a directory cannot take an export, or None

Tensor names are launcher.contract.hf_names'. The recipe (at load) and the entrypoints (for an
s3:// `model.init_from`, after SageMaker downloaded it) check a checkpoint against the job's
architecture with the same function, so the message is the same wherever the mismatch is found.

Rotary layout: Hugging Face Llama, Mistral, Qwen3 and Mixtral store q_proj/k_proj in the
"rotate_half" layout (the first half of each head's dimensions pairs with the second half),
which is the layout entrypoints/model/llama.py's `apply_rotary` uses, so weights copy over
without a permutation (tests/entrypoints/test_hf_weights.py proves it against transformers' logits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.contract.hf_names import HF_FAMILIES

# config.json model_type -> transformers class, from the one table of families.
ARCHITECTURES = {model_type: family.architecture for model_type, family in HF_FAMILIES.items()}
HF_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# The fields a checkpoint must agree on with the recipe; norm_eps and max_context do not change
# which weights fit, so a recipe may differ there.
CHECKED_FIELDS = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "tie_embeddings",
    "head_dim",
    "qk_norm",
    "attention_bias",
)
# config.json's model types whose attention has Qwen3's q_norm/k_norm (it has no field saying so).
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")


def hf_rope(config: dict) -> tuple[Any, Any]:
    """(rope_theta, rope scaling object or None) from either config.json spelling.

    transformers 5 writes `rope_parameters` {rope_type, rope_theta, ...}; older releases wrote
    `rope_theta` and `rope_scaling` {rope_type or type, ...} at the top level.
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type"))
        return theta, (None if kind in (None, "default") else params)
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return config.get("rope_theta", 10000.0), scaling


def _scaling_fields(scaling: Any) -> Any:
    if not isinstance(scaling, dict):
        return scaling
    return {
        "type": scaling.get("rope_type", scaling.get("type")),
        "factor": scaling.get("factor"),
        "low_freq_factor": scaling.get("low_freq_factor"),
        "high_freq_factor": scaling.get("high_freq_factor"),
        "original_max_context": scaling.get("original_max_position_embeddings"),
        "beta_fast": scaling.get("beta_fast"),
        "beta_slow": scaling.get("beta_slow"),
    }


def hf_architecture(config: dict) -> dict:
    """The architecture of a config.json in our field names (CHECKED_FIELDS, plus norm_eps)."""
    theta, scaling = hf_rope(config)
    return {
        "hidden_size": config.get("hidden_size"),
        "num_layers": config.get("num_hidden_layers"),
        "num_heads": config.get("num_attention_heads"),
        "num_kv_heads": config.get("num_key_value_heads") or config.get("num_attention_heads"),
        "ffn_hidden_size": config.get("intermediate_size"),
        "vocab_size": config.get("vocab_size"),
        "rope_theta": theta,
        "rope_scaling": _scaling_fields(scaling),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "norm_eps": config.get("rms_norm_eps", 1e-5),
        "head_dim": config.get("head_dim") or _default_head_dim(config),
        "qk_norm": config.get("model_type") in QK_NORM_MODEL_TYPES,
        "attention_bias": bool(config.get("attention_bias", False)),
    }


def _default_head_dim(config: dict) -> Any:
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def hf_experts(config: dict) -> dict | None:
    """A config.json's experts in our `moe` field names, or None for a dense checkpoint.

    Qwen3-MoE's published config.json writes num_experts and moe_intermediate_size, and
    transformers 5 rewrites num_experts as num_local_experts when it saves one; Mixtral writes
    num_local_experts and uses intermediate_size for each expert (it has no dense MLP).
    """
    experts = config.get("num_experts") or config.get("num_local_experts")
    if not experts:
        return None
    family = HF_FAMILIES.get(config.get("model_type"))
    default_normalize = True if family is None or family.normalizes_top_k is None else family.normalizes_top_k
    return {
        "num_experts": experts,
        "top_k": config.get("num_experts_per_tok"),
        "expert_ffn_hidden_size": config.get("moe_intermediate_size") or config.get("intermediate_size"),
        "normalize_top_k": bool(config.get("norm_topk_prob", default_normalize)),
    }


def dense_layers_problem(config: dict, where: str) -> str | None:
    """Qwen3-MoE can keep some layers dense (mlp_only_layers, decoder_sparse_step); ours are all MoE."""
    dense = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1)
    if dense or step not in (None, 1):
        return (
            f"model.moe: {where} keeps some layers dense (mlp_only_layers {dense}, decoder_sparse_step {step}); "
            "this launcher puts experts in every layer, so use a checkpoint with mlp_only_layers [] and "
            "decoder_sparse_step 1"
        )
    return None


def moe_mismatch(ours: dict | None, config: dict, where: str) -> str | None:
    """The first difference between the recipe's `moe` block and a config.json's experts."""
    theirs = hf_experts(config)
    if ours and theirs is None:
        return (
            f"model.moe: the recipe's model routes each token to {ours['top_k']} of {ours['num_experts']} experts, "
            f"but {where} is a dense checkpoint with no experts; use a dense model, or an MoE checkpoint"
        )
    if theirs and not ours:
        return (
            f"model.moe: {where} has {theirs['num_experts']} experts per layer, but the recipe's model is dense; "
            "use the checkpoint's MoE model"
        )
    for key in ("num_experts", "top_k", "expert_ffn_hidden_size", "normalize_top_k") if ours else ():
        if not _same(ours.get(key), theirs[key]):
            return (
                f"model.moe.{key} is {_show(ours.get(key))} in the recipe but {_show(theirs[key])} in {where}; "
                "make the recipe's model match the checkpoint"
            )
    return dense_layers_problem(config, where) if ours else None


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return all(_same(ours.get(k), theirs.get(k)) for k in set(ours) | set(theirs))
    if isinstance(ours, int | float) and isinstance(theirs, int | float) and not isinstance(ours, bool):
        return float(ours) == float(theirs)
    return ours == theirs


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items() if v is not None) + "}"
    return "none" if value is None else str(value)


def architecture_mismatch(ours: dict, config: dict, where: str) -> str | None:
    """The first CHECKED_FIELDS value where `ours` (our field names) and config.json differ.

    `where` names the config.json in the message, e.g. "s3://bucket/llama/config.json".
    """
    theirs = hf_architecture(config)
    if config.get("model_type") not in ARCHITECTURES:
        return (
            f"model_type {config.get('model_type')!r} in {where} is not supported; "
            f"use a {', '.join(ARCHITECTURES)} checkpoint"
        )
    for key in CHECKED_FIELDS:
        if not _same(ours.get(key), theirs[key]):
            return (
                f"model.{key} is {_show(ours.get(key))} in the recipe but {_show(theirs[key])} in {where}; "
                "make the recipe's model match the checkpoint (model: {hf_config: that config.json})"
            )
    return moe_mismatch(ours.get("moe"), config, where)


def sliding_window(config: dict) -> int | None:
    """The attention window of a config.json, or None. Qwen3's config.json carries a
    sliding_window that only `use_sliding_window: true` switches on (configuration_qwen3.py);
    Mistral's has no switch, so its window is on whenever it is set."""
    if config.get("use_sliding_window") is False:
        return None
    return config.get("sliding_window") or None


def sliding_window_problem(config: dict, seq_len: int, where: str) -> str | None:
    """Mistral's sliding window changes attention only for sequences longer than the window,
    and the model here has no sliding window: refuse a checkpoint whose window is shorter."""
    window = sliding_window(config)
    if window and window < seq_len:
        return (
            f"sliding_window {window} in {where} is shorter than training.seq_len {seq_len}; this model attends "
            f"to the whole sequence, so use training.seq_len <= {window}"
        )
    return None


def _rope_parameters(model: dict) -> dict:
    rope = {"rope_type": "default", "rope_theta": model["rope_theta"]}
    scaling = model.get("rope_scaling")
    if not scaling:
        return rope
    rope = {
        "rope_type": scaling["type"],
        "rope_theta": model["rope_theta"],
        "factor": scaling["factor"],
        "original_max_position_embeddings": scaling["original_max_context"],
    }
    # llama3's frequency bands, or YaRN's beta_fast / beta_slow where the recipe set them.
    for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
        if scaling.get(key) is not None:
            rope[key] = scaling[key]
    return rope


def _expert_fields(model: dict) -> dict:
    """The MoE keys of config.json (configuration_qwen3_moe.py, configuration_mixtral.py)."""
    moe = model.get("moe")
    if not moe:
        return {}
    family = HF_FAMILIES[model["family"]]
    fields = {
        family.experts_key: moe["num_experts"],
        family.expert_width_key: moe["expert_ffn_hidden_size"],
        "num_experts_per_tok": moe["top_k"],
        "router_aux_loss_coef": moe["aux_loss_coef"],
        "output_router_logits": False,
    }
    if family.normalizes_top_k is False:  # a family whose config.json says whether it renormalises
        fields["norm_topk_prob"] = moe["normalize_top_k"]
    return fields


def hf_config_json(model: dict, *, dtype: str) -> dict:
    """A config.json that transformers loads as the model's family (HF_FAMILIES' classes).

    `model` holds the resolved config's model fields (family, hidden_size, ..., moe).
    """
    family = model.get("family", "llama")
    rope = _rope_parameters(model)
    config = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["ffn_hidden_size"],
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": model.get("head_dim") or model["hidden_size"] // model["num_heads"],
        "vocab_size": model["vocab_size"],
        "max_position_embeddings": model["max_context"],
        "rms_norm_eps": model["norm_eps"],
        "hidden_act": "silu",
        "attention_bias": bool(model.get("attention_bias")),
        "tie_word_embeddings": bool(model.get("tie_embeddings")),
        # Both spellings: transformers 5 reads rope_parameters, earlier releases rope_theta/rope_scaling.
        "rope_parameters": rope,
        "rope_theta": model["rope_theta"],
        "rope_scaling": rope if model.get("rope_scaling") else None,
        "dtype": HF_DTYPES[dtype],
        "torch_dtype": HF_DTYPES[dtype],
        **HF_FAMILIES[family].config_extras,
    }
    # After the common keys: Mixtral's one width (intermediate_size) is its experts'.
    config.update(_expert_fields(model))
    return config


def export_out_problem(out: Path) -> str | None:
    """Why `out` cannot take an export, or None. An export writes only into a new or empty
    directory, so it never overwrites what is there: a config.json or the safetensors of another
    model would be lost without a word. `launcher export` asks before it starts the job's
    exporter; the exporter asks again, for its own command line."""
    if out.exists() and not out.is_dir():
        return f"--out {out}: is a file, not a directory; name a new or empty directory"
    try:
        held = sorted(path.name for path in out.iterdir()) if out.is_dir() else []
    except OSError as error:
        return f"--out {out}: cannot read the directory: {error.strerror}"
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        return f"--out {out}: holds {shown}; name a new or empty directory, so nothing there is overwritten"
    return None
