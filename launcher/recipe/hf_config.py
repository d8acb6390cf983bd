"""A Hugging Face Llama/Mistral config.json read as a catalog architecture (`ModelArch`), with
every value checked against the recipe's bounds before anything is built from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from launcher.catalog import ModelArch, choices
from launcher.contract.hf_checkpoint import hf_rope
from launcher.errors import Problem
from launcher.recipe.files import UnreadableFile, read_text_file
from launcher.recipe.schema import MAX_MODEL_SHAPE, MAX_ROPE_THETA


def checked_arch(arch: ModelArch, path: str) -> tuple[ModelArch | None, list[Problem]]:
    problems = [Problem(f"{path}.{field}", msg) for field, msg in arch.shape_problems()]
    return (None if problems else arch), problems


_HF_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_HF_SHAPES = {  # config.json key -> recipe shape whose bound applies
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "intermediate_size": "ffn_hidden_size",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_context",
    "sliding_window": "max_context",
    "head_dim": "hidden_size",
}
_HF_NUMBERS = ("rope_theta", "rms_norm_eps")
_HF_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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
    if model_type not in ("llama", "mistral"):
        return f"model_type {show(model_type)} in {path} is not supported; use a llama or mistral config"
    missing = [key for key in _HF_REQUIRED if not isinstance(config.get(key), int)]
    if missing:
        return f"{path} lacks integer {choices(missing)}"
    for key, shape in _HF_SHAPES.items():
        value = config.get(key)
        if value is None:
            continue
        most = MAX_MODEL_SHAPE[shape]
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
            return f"{key} {show(value)} in {path} is not a whole number from 1 to {most:,}"
    for key in _HF_NUMBERS:
        if key in config and not (_is_number(config[key]) and 0 < config[key] <= MAX_ROPE_THETA):
            return f"{key} {show(config[key])} in {path} is not a positive number"
    theta, scaling = hf_rope(config)
    if not (_is_number(theta) and 0 < theta <= MAX_ROPE_THETA):
        return f"rope_theta {show(theta)} in {path} is not a positive number"
    if scaling is not None and not isinstance(scaling, dict):
        return f"rope_scaling in {path} is not an object"
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        bad = [key for key in _HF_SCALING if not (_is_number(scaling.get(key)) and 0 < scaling[key] <= 2**24)]
        if bad:
            return f"rope_scaling in {path} needs positive numbers {choices(bad)}"
    return None


def show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_hf_config(path: Path) -> tuple[ModelArch | None, list[Problem]]:
    """A ModelArch from a Hugging Face Llama/Mistral config.json."""

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
    window = config.get("sliding_window")
    max_context = min(config.get("max_position_embeddings", 4096), window or 2**62)
    head_dim = config.get("head_dim")
    if head_dim and head_dim * config["num_attention_heads"] != config["hidden_size"]:
        return bad(
            f"head_dim {head_dim} x {config['num_attention_heads']} heads != hidden_size in {path}; not supported"
        )
    rope_theta, scaling = hf_rope(config)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            return bad(f"rope_scaling type {show(kind)} in {path} is not supported; use llama3 scaling or none")
        scaling = {
            "type": "llama3",
            "factor": scaling["factor"],
            "low_freq_factor": scaling["low_freq_factor"],
            "high_freq_factor": scaling["high_freq_factor"],
            "original_max_context": scaling["original_max_position_embeddings"],
        }
    try:
        arch = ModelArch(
            family=config["model_type"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            ffn_hidden_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            max_context=max_context,
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            norm_eps=config.get("rms_norm_eps", 1e-5),
            source=str(path),
        )
    except (ValueError, KeyError, TypeError) as err:
        return bad(f"{path} has values this launcher cannot use: {str(err).splitlines()[0]}")
    return checked_arch(arch, "model")
