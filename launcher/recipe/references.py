"""What a recipe's names and paths point at: catalog models and their overrides, a Hugging Face
config.json (hf_config.py reads it), a local model.init_from, and a prepared dataset's manifest."""

from __future__ import annotations

from pathlib import Path

from launcher import catalog
from launcher.catalog import ModelArch, choices, suggest
from launcher.contract.dataset import read_manifest
from launcher.contract.hf_checkpoint import architecture_mismatch, sliding_window_problem
from launcher.errors import Problem
from launcher.recipe.hf_config import checked_arch, read_hf_config, read_hf_json
from launcher.recipe.schema import HFConfigModel, ModelOverride


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
        return checked_arch(arch, "model")
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


def init_from_problems(ref, arch: ModelArch, seq_len: int) -> list[Problem]:
    """A local model.init_from checked against the recipe's architecture now; an s3:// one is
    checked by the entrypoints (hf_weights.py) with the same message once SageMaker downloaded it."""
    init_from = getattr(ref, "init_from", None)
    if not init_from or init_from.startswith("s3://"):
        return []
    path = Path(init_from) / "config.json"
    config, unreadable = read_hf_json(path)
    if config is None:
        return [Problem("model.init_from", f"{unreadable}; give a Hugging Face checkpoint directory")]
    ours = arch.model_dump(mode="json")
    problem = architecture_mismatch(ours, config, str(path)) or sliding_window_problem(config, seq_len, str(path))
    return [Problem("model.init_from", problem)] if problem else []
