"""Resolve a recipe's names against the catalogs: the model, the instance and its GPUs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from launcher import catalog
from launcher.catalog import Accelerator, InstanceType, ModelArch, choices
from launcher.errors import Problem
from launcher.recipe.schema import HFConfigModel, ModelOverride, RecipeSpec


def suggest(value: str, options) -> str:
    """' (did you mean X?)' when a close match exists."""
    import difflib

    close = difflib.get_close_matches(value, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def resolve_model(ref) -> tuple[ModelArch | None, list[Problem]]:
    models = catalog.models()
    if isinstance(ref, str):
        if ref not in models:
            return None, [
                Problem("model", f"'{ref}' is not in the model catalog{suggest(ref, models)}; use {choices(models)}")
            ]
        return models[ref], []
    if isinstance(ref, ModelOverride):
        if ref.base not in models:
            msg = f"'{ref.base}' is not in the model catalog{suggest(ref.base, models)}; use {choices(models)}"
            return None, [Problem("model.base", msg)]
        changes = ref.model_dump(exclude={"base"}, exclude_none=True)
        base = models[ref.base]
        arch = base.model_copy(update={**changes, "source": f"{ref.base} with {changes}"})
        return _checked(arch, "model")
    assert isinstance(ref, HFConfigModel)
    return read_hf_config(Path(ref.hf_config))


def _checked(arch: ModelArch, path: str) -> tuple[ModelArch | None, list[Problem]]:
    problems = [Problem(f"{path}.{field}", msg) for field, msg in arch.shape_problems()]
    return (None if problems else arch), problems


_HF_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def read_hf_config(path: Path) -> tuple[ModelArch | None, list[Problem]]:
    """A ModelArch from a Hugging Face Llama/Mistral config.json."""

    def bad(message: str) -> tuple[None, list[Problem]]:
        return None, [Problem("model.hf_config", message)]

    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return bad(f"{path} does not exist")
    except (OSError, UnicodeDecodeError) as err:
        return bad(f"cannot read {path}: {getattr(err, 'strerror', None) or err}")
    except json.JSONDecodeError as err:
        return bad(f"{path} is not valid JSON (line {err.lineno}: {err.msg})")
    if not isinstance(config, dict):
        return bad(f"{path} is not a JSON object")
    model_type = config.get("model_type")
    if model_type not in ("llama", "mistral"):
        return bad(f"model_type {model_type!r} in {path} is not supported; use a llama or mistral config")
    missing = [key for key in _HF_REQUIRED if not isinstance(config.get(key), int)]
    if missing:
        return bad(f"{path} lacks integer {choices(missing)}")
    window = config.get("sliding_window")
    max_context = config.get("max_position_embeddings", 4096)
    if window and window < max_context:
        return bad(f"sliding-window attention ({window} tokens in {path}) is not supported; use a config without it")
    head_dim = config.get("head_dim")
    if head_dim and head_dim * config["num_attention_heads"] != config["hidden_size"]:
        return bad(
            f"head_dim {head_dim} x {config['num_attention_heads']} heads != hidden_size in {path}; not supported"
        )
    scaling = config.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            return bad(f"rope_scaling type {kind!r} in {path} is not supported; use llama3 scaling or none")
        scaling = {
            "type": "llama3",
            "factor": scaling["factor"],
            "low_freq_factor": scaling["low_freq_factor"],
            "high_freq_factor": scaling["high_freq_factor"],
            "original_max_context": scaling["original_max_position_embeddings"],
        }
    try:
        arch = ModelArch(
            family=model_type,
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            ffn_hidden_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            max_context=max_context,
            rope_theta=config.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            norm_eps=config.get("rms_norm_eps", 1e-5),
            source=str(path),
        )
    except (ValueError, KeyError, TypeError) as err:
        return bad(f"{path} has values this launcher cannot use: {str(err).splitlines()[0]}")
    return _checked(arch, "model")


@dataclass(frozen=True)
class Hardware:
    """What the recipe runs on: the instance, its GPUs and processes per node."""

    instance_key: str
    instance: InstanceType
    accelerator_key: str
    accelerator: Accelerator
    procs_per_node: int


def resolve_hardware(spec: RecipeSpec) -> tuple[Hardware | None, list[Problem]]:
    cluster = spec.cluster
    instances = catalog.instance_types()
    accelerators = catalog.accelerators()
    key = cluster.instance_type
    if key not in instances:
        msg = f"'{key}' is not a known instance type{suggest(key, instances)}; use {choices(instances)}"
        return None, [Problem("cluster.instance_type", msg)]
    instance = instances[key]
    problems: list[Problem] = []

    if key == "local":
        if cluster.backend == "sagemaker":
            problems.append(
                Problem(
                    "cluster.instance_type",
                    f"the sagemaker backend needs an ml.* instance type; use {choices(k for k in instances if k != 'local')}",
                )
            )
        if cluster.device == "cpu":
            if cluster.accelerator not in (None, "cpu"):
                problems.append(
                    Problem(
                        "cluster.accelerator",
                        f"'{cluster.accelerator}' is a GPU but cluster.device is cpu; remove it or set device: cuda",
                    )
                )
            accelerator_key = "cpu"
        else:
            gpus = [k for k in accelerators if k != "cpu"]
            if cluster.accelerator is None:
                problems.append(
                    Problem(
                        "cluster.accelerator",
                        f"required for a local cuda machine so memory can be checked; use {choices(gpus)}",
                    )
                )
                return None, problems
            if cluster.accelerator not in gpus:
                problems.append(
                    Problem(
                        "cluster.accelerator",
                        f"'{cluster.accelerator}' is not a known GPU{suggest(cluster.accelerator, gpus)}; use {choices(gpus)}",
                    )
                )
                return None, problems
            accelerator_key = cluster.accelerator
        procs = cluster.nproc_per_node or 1
    elif instance.accelerator == "cpu":
        # A CPU instance type: cluster.nproc_per_node gloo processes, no GPU to size.
        accelerator_key = "cpu"
        if cluster.device != "cpu":
            problems.append(Problem("cluster.device", f"{key} has no GPUs; use device: cpu"))
        procs = cluster.nproc_per_node or 1
    else:
        accelerator_key = instance.accelerator
        if cluster.device == "cpu":
            problems.append(
                Problem(
                    "cluster.device",
                    f"{key} has {instance.gpus_per_node} GPUs; use device: cuda (cpu is for the local backend)",
                )
            )
        if cluster.accelerator not in (None, accelerator_key):
            problems.append(
                Problem(
                    "cluster.accelerator",
                    f"{key} has {accelerator_key} GPUs, not {cluster.accelerator}; remove the key",
                )
            )
        if cluster.nproc_per_node not in (None, instance.gpus_per_node):
            problems.append(
                Problem(
                    "cluster.nproc_per_node",
                    f"{key} has {instance.gpus_per_node} GPUs, one process each; use {instance.gpus_per_node} or remove the key",
                )
            )
        procs = instance.gpus_per_node
    if cluster.backend == "local" and cluster.instance_count != 1:
        problems.append(
            Problem(
                "cluster.instance_count",
                f"the local backend runs on this one machine; use 1, not {cluster.instance_count}",
            )
        )
    if cluster.backend == "local" and key != "local":
        problems.append(
            Problem(
                "cluster.instance_type", f"the local backend runs on this machine; use instance_type: local, not {key}"
            )
        )
    hardware = Hardware(key, instance, accelerator_key, accelerators[accelerator_key], procs)
    return hardware, problems
