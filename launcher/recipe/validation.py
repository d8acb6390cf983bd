"""The rules of data.validation: one held-out source, reachable by the job, that fits the model.

The entrypoints (entrypoints/evaluate.py) read the same data and check it again; here a recipe
learns what is wrong before anything is submitted, with every other problem of the recipe.
"""

from __future__ import annotations

from launcher.catalog import ModelArch
from launcher.catalog.engines import capabilities
from launcher.contract.dataset import held_out_start, manifest_problem
from launcher.errors import Problem
from launcher.recipe.references import dataset_manifest
from launcher.recipe.schema import RecipeSpec


def validation_problems(spec: RecipeSpec, arch: ModelArch) -> list[Problem]:
    validation = spec.data.validation
    if validation is None:
        return []
    if (validation.source is None) == (validation.fraction is None):
        given = "both" if validation.source is not None else "neither"
        return [
            Problem(
                "data.validation",
                f"{given} of source and fraction given; give one: source (held-out token files) or "
                "fraction (a share of data.source's documents, e.g. 0.01)",
            )
        ]
    if validation.source is not None:
        return _source_problems(spec, arch, validation.source)
    return _fraction_problems(spec, validation.fraction)


def _source_problems(spec: RecipeSpec, arch: ModelArch, source: str) -> list[Problem]:
    key = "data.validation.source"
    if source == "synthetic":
        return []
    if "://" in source:
        return [
            Problem(
                key,
                f"{source}: remote validation data is not staged to the job; hold out a share of data.source "
                "with data.validation.fraction, or give a local directory on a backend that reads local paths",
            )
        ]
    engine = capabilities(spec.cluster.backend)
    if not engine.reads_local_paths:
        return [
            Problem(
                key,
                f"a local path ({source}) cannot reach a {engine.title} job; hold out a share of data.source "
                "with data.validation.fraction",
            )
        ]
    manifest, problem = dataset_manifest(source)
    if problem is not None:
        return [Problem(key, problem.message)]
    line = manifest_problem(manifest, dtype=spec.data.dtype, vocab_size=arch.vocab_size) if manifest else None
    return [Problem(key, line.partition(": ")[2])] if line else []


def _fraction_problems(spec: RecipeSpec, fraction: float) -> list[Problem]:
    key, source = "data.validation.fraction", spec.data.source
    if source == "synthetic":
        return [
            Problem(
                key,
                "holds out whole documents of a prepared dataset, but data.source is synthetic; "
                "use data.validation.source: synthetic",
            )
        ]
    if spec.data.tokenizer is not None or "://" in source:
        return []  # prepared at submit, or read on the cluster: the entrypoints check the split
    manifest, problem = dataset_manifest(source)
    if problem is not None:
        return []  # data.source's own rule reports the damaged manifest
    if manifest is None:
        return [
            Problem(
                key,
                f"{source} is not a prepared dataset (no manifest.json), so it has no documents to hold out; "
                "prepare it with `launcher data prepare`, or give data.validation.source",
            )
        ]
    try:
        start, held = held_out_start(source, manifest, fraction)
    except ValueError as error:
        return [Problem(key, str(error))]
    sample = spec.training.seq_len + 1
    total = sum(shard["tokens"] for shard in manifest["shards"])
    for what, tokens in (("held-out", total - start), ("training", start)):
        if tokens < sample:
            return [
                Problem(
                    key,
                    f"{fraction} of the documents ({held} held out) leaves {tokens} {what} tokens, fewer than one "
                    f"sample of training.seq_len + 1 = {sample}; change the fraction",
                )
            ]
    return []
