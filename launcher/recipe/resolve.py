"""Resolve a recipe's names against the catalogs: the model, the instance and its GPUs."""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from launcher import catalog
from launcher.catalog import Accelerator, InstanceType, ModelArch, choices
from launcher.contract.dataset import read_manifest
from launcher.contract.hf_checkpoint import architecture_mismatch, hf_rope, sliding_window_problem
from launcher.errors import Problem
from launcher.recipe.files import UnreadableFile, read_text_file
from launcher.recipe.schema import (
    MAX_MODEL_SHAPE,
    MAX_ROPE_THETA,
    Cluster,
    HFConfigModel,
    ModelOverride,
    RecipeSpec,
)


def suggest(value: str, options) -> str:
    """' (did you mean X?)' when a close match exists."""
    close = difflib.get_close_matches(value, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def dataset_manifest(source: str) -> tuple[dict | None, Problem | None]:
    """The manifest of a local prepared dataset (None for synthetic, s3:// and plain token files)."""
    if source == "synthetic" or "://" in source:
        return None, None
    try:
        return read_manifest(source), None
    except (ValueError, OSError) as error:
        return None, Problem("data.source", str(error))


def fill_from_manifest(data: dict) -> dict:
    """The recipe data with what a prepared dataset's manifest knows filled in where not given:
    data.dtype, and data.document_separator (the tokenizer's end-of-text id, `eos_id`)."""
    section = data.get("data")
    if not isinstance(section, dict) or section.get("tokenizer") is not None:
        return data
    source = section.get("source")
    manifest, _ = dataset_manifest(source) if isinstance(source, str) else (None, None)
    if manifest is None:
        return data
    filled = dict(section)
    if "dtype" not in section and manifest.get("dtype") in ("uint16", "uint32"):
        filled["dtype"] = manifest["dtype"]
    if section.get("document_separator") is None and type(manifest.get("eos_id")) is int:
        filled["document_separator"] = manifest["eos_id"]
    return {**data, "data": filled}


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
    if ref.hf_config is not None:
        return read_hf_config(Path(ref.hf_config))
    if ref.init_from is None or ref.init_from.startswith("s3://"):
        message = (
            "an s3:// checkpoint's config.json is read only by the job; give the architecture too: "
            "{base: CATALOG_KEY, init_from: ...} or {hf_config: a local copy of its config.json, init_from: ...}"
        )
        return None, [Problem("model.init_from" if ref.init_from else "model.hf_config", message)]
    return read_hf_config(Path(ref.init_from) / "config.json")


def _checked(arch: ModelArch, path: str) -> tuple[ModelArch | None, list[Problem]]:
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


def _read_hf_json(path: Path) -> tuple[dict | None, str | None]:
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

    config, unreadable = _read_hf_json(path)
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
    return _checked(arch, "model")


def init_from_problems(ref, arch: ModelArch, seq_len: int) -> list[Problem]:
    """A local model.init_from checked against the recipe's architecture now; an s3:// one is
    checked by the entrypoints (hf_weights.py) with the same message once SageMaker downloaded it."""
    init_from = getattr(ref, "init_from", None)
    if not init_from or init_from.startswith("s3://"):
        return []
    path = Path(init_from) / "config.json"
    config, unreadable = _read_hf_json(path)
    if config is None:
        return [Problem("model.init_from", f"{unreadable}; give a Hugging Face checkpoint directory")]
    ours = arch.model_dump(mode="json")
    problem = architecture_mismatch(ours, config, str(path)) or sliding_window_problem(config, seq_len, str(path))
    return [Problem("model.init_from", problem)] if problem else []


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """What a job runs on: an instance type, its GPUs, processes per node, how many instances, and
    the price of one instance per hour. Every estimate and prediction takes one."""

    instance_key: str
    instance: InstanceType
    accelerator_key: str
    accelerator: Accelerator
    procs_per_node: int
    instance_count: int = 1
    usd_per_hour: float = 0.0

    @property
    def world_size(self) -> int:
        return self.procs_per_node * self.instance_count

    def __str__(self) -> str:
        if self.instance_key == "local":
            return f"{self.world_size} x {self.accelerator_key} on this machine"
        return f"{self.instance_count} x {self.instance_key} ({self.world_size} x {self.accelerator_key})"


def find_instance_type(key: str) -> tuple[InstanceType | None, Problem | None]:
    """The catalog's instance type `key`, or the problem (with a close match) if there is none."""
    instances = catalog.instance_types()
    if key not in instances:
        msg = f"'{key}' is not a known instance type{suggest(key, instances)}; use {choices(instances)}"
        return None, Problem("cluster.instance_type", msg)
    return instances[key], None


def hardware_for(
    instance_key: str,
    *,
    accelerator_key: str | None = None,
    procs_per_node: int | None = None,
    instance_count: int = 1,
    usd_per_hour: float | None = None,
) -> Hardware:
    """The hardware of `instance_count` instances of a catalog instance type.

    An ml.* instance type fixes its GPUs and runs one process per GPU; `local` (this machine)
    takes the accelerator and the process count given. `usd_per_hour` (one instance) defaults to
    the catalog's price. Names must be in the catalogs (`find_instance_type` checks the first).
    """
    instance = catalog.instance_types()[instance_key]
    if instance.gpus_per_node:  # an ml.* GPU type; `local` and CPU types take what they are given
        accelerator_key, procs_per_node = instance.accelerator, instance.gpus_per_node
    assert accelerator_key is not None and procs_per_node is not None, "local hardware needs both"
    return Hardware(
        instance_key=instance_key,
        instance=instance,
        accelerator_key=accelerator_key,
        accelerator=catalog.accelerators()[accelerator_key],
        procs_per_node=procs_per_node,
        instance_count=instance_count,
        usd_per_hour=instance.usd_per_hour if usd_per_hour is None else usd_per_hour,
    )


def resolve_hardware(spec: RecipeSpec) -> tuple[Hardware | None, list[Problem]]:
    """The recipe's hardware, and every way its cluster section contradicts itself or the catalogs."""
    cluster = spec.cluster
    key = cluster.instance_type
    instance, unknown = find_instance_type(key)
    if unknown is not None:
        return None, [unknown]
    if key == "local":
        accelerator_key, problems = _local_accelerator(cluster)
        if accelerator_key is None:
            return None, problems
    elif instance.accelerator == "cpu":
        # A CPU instance type: cluster.nproc_per_node gloo processes, no GPU to size.
        accelerator_key, problems = "cpu", []
        if cluster.device != "cpu":
            problems.append(Problem("cluster.device", f"{key} has no GPUs; use device: cpu"))
    else:
        accelerator_key, problems = instance.accelerator, _instance_problems(cluster, instance)
    problems += _backend_problems(cluster)
    hardware = hardware_for(
        key,
        accelerator_key=accelerator_key,
        procs_per_node=cluster.nproc_per_node or 1,
        instance_count=cluster.instance_count,
        usd_per_hour=cluster.usd_per_hour,
    )
    return hardware, problems


def _local_accelerator(cluster: Cluster) -> tuple[str | None, list[Problem]]:
    """This machine's accelerator: the CPU, or the GPU `cluster.accelerator` names (None if unusable)."""
    accelerators = catalog.accelerators()
    if cluster.backend == "sagemaker":
        instances = catalog.instance_types()
        problems = [
            Problem(
                "cluster.instance_type",
                f"the sagemaker backend needs an ml.* instance type; use {choices(k for k in instances if k != 'local')}",
            )
        ]
    else:
        problems = []
    if cluster.device == "cpu":
        if cluster.accelerator not in (None, "cpu"):
            problems.append(
                Problem(
                    "cluster.accelerator",
                    f"'{cluster.accelerator}' is a GPU but cluster.device is cpu; remove it or set device: cuda",
                )
            )
        return "cpu", problems
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
    return cluster.accelerator, problems


def _instance_problems(cluster: Cluster, instance: InstanceType) -> list[Problem]:
    """An ml.* instance type fixes the device, the GPU model and the processes per node."""
    key, accelerator_key = cluster.instance_type, instance.accelerator
    problems = []
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
    return problems


def _backend_problems(cluster: Cluster) -> list[Problem]:
    problems = []
    if cluster.backend == "local" and cluster.instance_count != 1:
        problems.append(
            Problem(
                "cluster.instance_count",
                f"the local backend runs on this one machine; use 1, not {cluster.instance_count}",
            )
        )
    if cluster.backend == "local" and cluster.instance_type != "local":
        problems.append(
            Problem(
                "cluster.instance_type",
                f"the local backend runs on this machine; use instance_type: local, not {cluster.instance_type}",
            )
        )
    return problems
