"""A Hugging Face config.json (Llama, Mistral, Qwen3, Qwen3-MoE, Mixtral) read as a catalog
architecture (`ModelArch`), with every value checked against the recipe's bounds before anything
is built from it. The field mapping is the contract's (launcher.contract.hf_checkpoint), the one
the job checks a checkpoint with."""

from __future__ import annotations

import json
import math
from pathlib import Path

from launcher.catalog import ModelArch, choices
from launcher.contract.hf_checkpoint import (
    ARCHITECTURES,
    CHECKED_FIELDS,
    dense_layers_problem,
    hf_architecture,
    hf_experts,
    hf_rope,
)
from launcher.contract.hf_checkpoint import sliding_window as attention_window
from launcher.errors import Problem
from launcher.recipe.files import UnreadableFile, read_text_file
from launcher.recipe.schema import MAX_MODEL_SHAPE, MAX_ROPE_THETA


def checked_arch(arch: ModelArch, path: str) -> tuple[ModelArch | None, list[Problem]]:
    problems = [Problem(f"{path}.{field}", msg) for field, msg in arch.shape_problems()]
    return (None if problems else arch), problems


_HF_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_MOST_EXPERTS = 4096  # DeepSeek V3 has 256 routed experts; this bound only stops absurd values
_HF_SHAPES = {  # config.json key -> the largest value it may have (the recipe's bounds)
    "hidden_size": MAX_MODEL_SHAPE["hidden_size"],
    "num_hidden_layers": MAX_MODEL_SHAPE["num_layers"],
    "num_attention_heads": MAX_MODEL_SHAPE["num_heads"],
    "num_key_value_heads": MAX_MODEL_SHAPE["num_kv_heads"],
    "intermediate_size": MAX_MODEL_SHAPE["ffn_hidden_size"],
    "vocab_size": MAX_MODEL_SHAPE["vocab_size"],
    "max_position_embeddings": MAX_MODEL_SHAPE["max_context"],
    "sliding_window": MAX_MODEL_SHAPE["max_context"],
    "head_dim": MAX_MODEL_SHAPE["hidden_size"],
    "num_experts": _MOST_EXPERTS,
    "num_local_experts": _MOST_EXPERTS,
    "num_experts_per_tok": _MOST_EXPERTS,
    "moe_intermediate_size": MAX_MODEL_SHAPE["ffn_hidden_size"],
}
_HF_NUMBERS = ("rope_theta", "rms_norm_eps")
_HF_COEFFICIENTS = ("router_aux_loss_coef",)
# rope_type -> (keys it needs, keys it may have): transformers' modeling_rope_utils.py
# (_compute_llama3_parameters, _compute_yarn_parameters). YaRN's attention_factor, mscale and
# truncate are not modelled here: a config.json that sets them is refused (see read_hf_config).
_SCALING_KEYS = {
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"), ("beta_fast", "beta_slow")),
}
_YARN_UNMODELLED = ("attention_factor", "mscale", "mscale_all_dim")


def read_hf_json(path: Path) -> tuple[dict | None, str | None]:
    """The config.json object at `path`, or why it cannot be read (one line)."""
    try:
        config = json.loads(read_text_file(path, what="Hugging Face config.json"))
    except UnreadableFile as err:
        return None, f"{path} does not exist" if str(err) == "no such file" else f"{path} {err}"
    except json.JSONDecodeError as err:
        return None, f"{path} is not valid JSON (line {err.lineno}: {err.msg})"
    except (ValueError, RecursionError):  # a 5,000-digit integer, or arrays nested thousands deep
        return None, f"{path} holds a number too long or nesting too deep for a model config"
    if not isinstance(config, dict):
        return None, f"{path} is not a JSON object"
    return config, None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _hf_value_problem(config: dict, path: Path) -> str | None:
    """The first field of a config.json this launcher cannot use, checked before any arithmetic."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        return f"model_type {show(model_type)} in {path} is not supported; use a {', '.join(ARCHITECTURES)} config"
    missing = [key for key in _HF_REQUIRED if not isinstance(config.get(key), int)]
    if missing:
        return f"{path} lacks integer {choices(missing)}"
    for key, most in _HF_SHAPES.items():
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
            return f"{key} {show(value)} in {path} is not a whole number from 1 to {most:,}"
    for key in _HF_NUMBERS:
        if key in config and not (_is_number(config[key]) and 0 < config[key] <= MAX_ROPE_THETA):
            return f"{key} {show(config[key])} in {path} is not a positive number"
    for key in _HF_COEFFICIENTS:
        if key in config and not (_is_number(config[key]) and 0 <= config[key] <= 1e6):
            return f"{key} {show(config[key])} in {path} is not a number from 0 to 1,000,000"
    theta, scaling = hf_rope(config)
    if not (_is_number(theta) and 0 < theta <= MAX_ROPE_THETA):
        return f"rope_theta {show(theta)} in {path} is not a positive number"
    if scaling is not None and not isinstance(scaling, dict):
        return f"rope_scaling in {path} is not an object"
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in _SCALING_KEYS:
        return f"rope_scaling type {show(kind)} in {path} is not supported; use {choices(_SCALING_KEYS)} or none"
    needed, optional = _SCALING_KEYS[kind]
    bad = [key for key in needed if not _scaling_number(scaling.get(key))]
    bad += [key for key in optional if key in scaling and not _scaling_number(scaling[key])]
    if bad:
        return f"rope_scaling in {path} needs positive numbers {choices(bad)}"
    return None


def _scaling_number(value) -> bool:
    return _is_number(value) and 0 < value <= 2**24


def show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _rope_scaling(scaling: dict | None, path: Path) -> tuple[dict | None, str | None]:
    """config.json's RoPE scaling in our field names, or why the model here cannot compute it."""
    if not scaling:
        return None, None
    kind = scaling.get("rope_type", scaling.get("type"))
    unmodelled = [key for key in _YARN_UNMODELLED if scaling.get(key) is not None]
    if scaling.get("truncate", True) is not True:
        unmodelled.append("truncate")
    if unmodelled:
        return None, f"rope_scaling in {path} sets {choices(unmodelled)}, which the model here does not compute"
    ours = {
        "type": kind,
        "factor": scaling["factor"],
        "original_max_context": scaling["original_max_position_embeddings"],
    }
    for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
        if scaling.get(key) is not None:
            ours[key] = scaling[key]
    return ours, None


def _moe(config: dict, path: Path) -> tuple[dict | None, str | None]:
    """The `moe` block of a config.json's experts (hf_experts' fields plus the loss weight)."""
    experts = hf_experts(config)
    if experts is None:
        return None, None
    problem = dense_layers_problem(config, str(path))
    if problem:
        return None, problem.removeprefix("model.moe: ")
    if not isinstance(experts["top_k"], int) or not isinstance(experts["expert_ffn_hidden_size"], int):
        return None, f"{path} lacks integer num_experts_per_tok and moe_intermediate_size (or intermediate_size)"
    # Both families' routers take a softmax over the experts (Qwen3MoeTopKRouter, MixtralTopKRouter).
    return {**experts, "router_score": "softmax", "aux_loss_coef": config.get("router_aux_loss_coef", 0.001)}, None


def read_hf_config(path: Path) -> tuple[ModelArch | None, list[Problem]]:
    """A ModelArch from a Hugging Face config.json of one of the contract's families."""

    def bad(message: str) -> tuple[None, list[Problem]]:
        return None, [Problem("model.hf_config", message)]

    config, unreadable = read_hf_json(path)
    if config is None:
        return bad(unreadable)
    problem = _hf_value_problem(config, path)
    if problem:
        return bad(problem)
    # Up to its window, sliding-window attention (Mistral 7B v0.1) is full causal attention, which
    # is what the model here computes: the window is the context it can train at.
    window = attention_window(config)
    max_context = min(config.get("max_position_embeddings", 4096), window or 2**62)
    scaling, problem = _rope_scaling(hf_rope(config)[1], path)
    moe, moe_problem = _moe(config, path)
    if problem or moe_problem:
        return bad(problem or moe_problem)
    fields = hf_architecture(config)
    try:
        arch = ModelArch(
            family=config["model_type"],
            **{key: fields[key] for key in _ARCH_FIELDS},
            max_context=max_context,
            rope_scaling=scaling,
            moe=moe,
            source=str(path),
        )
    except (ValueError, KeyError, TypeError) as err:
        return bad(f"{path} has values this launcher cannot use: {str(err).splitlines()[0]}")
    return checked_arch(arch, "model")


# What hf_architecture reads that a ModelArch takes as it is (RoPE scaling is translated above).
_ARCH_FIELDS = (*(key for key in CHECKED_FIELDS if key != "rope_scaling"), "norm_eps")
