"""Hugging Face checkpoints out: config.json, sharded safetensors + index, tokenizer files.

    export_hf(parts, stage_ids, mesh, cfg, out)    # in training, after the last step (collective)
    python entrypoints/export_hf.py --config resolved.json [--step N] --out DIR   # from a DCP checkpoint

The files are planned from the config alone (every rank computes the same plan): one or more
safetensors files per pipeline stage, never larger than MAX_FILE_BYTES, named
model-0000k-of-0000n.safetensors as transformers names them, each of our grouped experts
[E, F, D] as E tensors, one per expert, as published MoE checkpoints hold them
(launcher.contract.hf_names). During training every rank of a
stage gathers each parameter in turn (`DTensor.full_tensor()`, a collective over the stage's
data/context/tensor-parallel ranks) and the stage's first rank streams it to its file, so no
rank holds more than one full parameter beyond its shards. Rank 0 writes config.json and the
index, and copies the tokenizer files (checkpoint.export_tokenizer, else those beside a local
model.init_from). The dtype is the one trained in (precision.dtype: bf16 or fp32).

Under pipeline parallelism each stage's files are written on the host that holds the stage:
export to a file system every host shares (the outputs of a multi-node job otherwise end up
split between hosts).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import json
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `entrypoints` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from entrypoints.hf_weights import DTYPE_NAMES, INDEX, SINGLE, checkpoint_directory
from entrypoints.model.init import canonical_name
from entrypoints.model.llama import build_model
from launcher.contract.config import ConfigError, JobConfig, load_config
from launcher.contract.hf_checkpoint import export_out_problem, hf_config_json
from launcher.contract.hf_names import hf_layout_problem, hf_tensors
from launcher.contract.layout import stage_layers

MAX_FILE_BYTES = 5 * 10**9  # transformers' default max_shard_size
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


@dataclass(frozen=True)
class FilePlan:
    name: str
    stage: int
    tensors: list[tuple[str, tuple[int, ...]]]
    """(our canonical parameter name, full shape), in file order."""


def export_plan(cfg: JobConfig, *, max_file_bytes: int = MAX_FILE_BYTES) -> list[FilePlan]:
    """Which parameter goes into which file: files follow pipeline stages, then size."""
    problem = hf_layout_problem(dataclasses.asdict(cfg.model))
    if problem:
        raise ConfigError(f"checkpoint.export_hf: {problem}")
    model = build_model(cfg.model, seq_len=cfg.training.seq_len, device="meta")
    num_stages = cfg.parallel.num_stages
    itemsize = EXPORT_DTYPES[cfg.precision.dtype].itemsize
    stage_of_layer = {
        layer: stage for stage in range(num_stages) for layer in stage_layers(cfg.model.num_layers, cfg.parallel, stage)
    }
    files: list[tuple[int, list]] = []  # (stage, [(name, shape), ...])
    file_bytes = 0
    for name, param in model.named_parameters():
        if name.startswith("layers."):
            stage = stage_of_layer[int(name.split(".")[1])]
        else:
            stage = 0 if name.startswith("tok_embeddings") else num_stages - 1
        size = param.numel() * itemsize
        if not files or files[-1][0] != stage or file_bytes + size > max_file_bytes:
            files.append((stage, []))
            file_bytes = 0
        files[-1][1].append((name, tuple(param.shape)))
        file_bytes += size
    count = len(files)
    return [
        FilePlan(f"model-{i + 1:05d}-of-{count:05d}.safetensors", stage, tensors)
        for i, (stage, tensors) in enumerate(files)
    ]


def write_safetensors(
    path: Path | None, tensors: list[tuple[str, tuple[int, ...]]], family: str, dtype: torch.dtype, full: Callable
) -> OSError | None:
    """Stream `full(name)` for each tensor into a safetensors file (path None: gather only, as a
    rank that helps the stage's writer gather but writes nothing).

    A write that fails (a full disk) removes the partial file and returns the error, and the
    remaining tensors are still gathered: `full` may be a collective the stage's other ranks
    are in, so a writer that stopped early would leave them waiting."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        for tensor in hf_tensors(name, family, shape):
            size = dtype.itemsize * int(torch.Size(tensor.shape).numel())
            header[tensor.name] = {
                "dtype": DTYPE_NAMES[dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header with spaces to 8 bytes
    file = _FailureKeepingFile(path)
    file.write(len(encoded).to_bytes(8, "little") + encoded)
    for name, shape in tensors:
        whole = full(name)
        if not file.writable:
            continue
        whole = whole.detach().to("cpu", dtype)
        for tensor in hf_tensors(name, family, shape):
            data = (whole if tensor.expert is None else whole[tensor.expert]).contiguous()
            file.write(ctypes.string_at(data.data_ptr(), data.numel() * data.element_size()))
    return file.close()


class _FailureKeepingFile:
    """A file written to the end or not at all: the first OSError (a full disk) is kept, the
    partial file removed (its header promises data it lacks), and later writes are dropped.
    Path None: nothing is written. A name that cannot be opened (a directory) is left alone."""

    def __init__(self, path: Path | None):
        self.path, self.file, self.failure = path, None, None
        if path is not None:
            try:
                self.file = open(path, "wb")
            except OSError as error:
                self.failure = error

    @property
    def writable(self) -> bool:
        return self.file is not None

    def write(self, data: bytes) -> None:
        if self.file is not None:
            try:
                self.file.write(data)
            except OSError as error:
                self._give_up(error)

    def close(self) -> OSError | None:
        """The first error, or None when the file is whole."""
        if self.file is not None:
            try:
                self.file.close()  # a full disk may show only here, when the buffer is flushed
                self.file = None
            except OSError as error:
                self._give_up(error)
        return self.failure

    def _give_up(self, error: OSError) -> None:
        try:
            self.file.close()
        except OSError:
            pass  # the buffered rest cannot be written either: the file goes
        self.file = None
        self.path.unlink(missing_ok=True)
        if error.filename is None:
            error.filename = str(self.path)
        self.failure = error


def write_metadata(cfg: JobConfig, out: Path, plan: list[FilePlan], itemsize: int) -> None:
    """config.json, the index, and the tokenizer files; an earlier save's weight files go first."""
    removed = remove_earlier_weight_files(out, {file.name for file in plan})
    if removed:
        print(f"export: removed the weight files of an earlier save from {out}: {', '.join(removed)}", flush=True)
    config = hf_config_json(dataclasses.asdict(cfg.model), dtype=cfg.precision.dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    family = cfg.model.family
    weight_map = {
        tensor.name: f.name for f in plan for name, shape in f.tensors for tensor in hf_tensors(name, family, shape)
    }
    total = sum(itemsize * int(torch.Size(shape).numel()) for f in plan for _, shape in f.tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for source in tokenizer_files(cfg):
        shutil.copy2(source, out / source.name)


SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def remove_earlier_weight_files(out: Path, kept: set[str]) -> list[str]:
    """Remove what an earlier save into `out` (a resumed lineage's export, another tool's) left
    that would be read in place of, or beside, these files: shards this plan does not write, as
    transformers' save_pretrained removes them ("Clean the folder from a previous save",
    modeling_utils.py), and a single model.safetensors, which from_pretrained reads before the
    index (`_get_resolved_checkpoint_files`). Returns the names removed; other files stay."""
    removed = []
    for path in sorted(out.iterdir()):
        earlier = path.name == SINGLE or (SHARD_NAME.fullmatch(path.name) and path.name not in kept)
        if earlier and (path.is_symlink() or path.is_file()):  # a link goes, never what it names
            path.unlink()
            removed.append(path.name)
    return removed


def tokenizer_files(cfg: JobConfig) -> list[Path]:
    """checkpoint.export_tokenizer (a file or a directory), else the tokenizer beside init_from."""
    given = cfg.checkpoint.export_tokenizer
    if given:
        path = Path(given)
        if path.is_file():
            return [path]
        if not path.is_dir():
            raise ConfigError(f"checkpoint.export_tokenizer: {path} does not exist; give a tokenizer file or directory")
        return [path / n for n in TOKENIZER_FILES if (path / n).is_file()]
    if cfg.model.init_from:
        directory = checkpoint_directory(cfg.model.init_from)
        return [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]
    return []


def export_directory(cfg: JobConfig, output_dir: Path) -> Path:
    """checkpoint.export_hf as a directory; a relative one is under the job's output directory."""
    path = Path(cfg.checkpoint.export_hf)
    return path if path.is_absolute() else output_dir / path


class ExportFailed(Exception):
    """The Hugging Face export could not be written; in training every rank raises it."""


@torch.no_grad()
def export_hf(parts, stage_ids: list[int], mesh, cfg: JobConfig, out: Path) -> None:
    """Write the model as a Hugging Face checkpoint into `out` (a collective: every rank calls it).

    The index and config.json come last, once every writer's files are whole: a directory
    without them is not taken for a checkpoint. A write that fails raises ExportFailed on every
    rank with the first writer's error, after every rank's gathers are done."""
    plan = export_plan(cfg)
    dtype = EXPORT_DTYPES[cfg.precision.dtype]
    params = {canonical_name(fqn): p for part in parts for fqn, p in part.named_parameters()}
    # The stage's first rank writes: the one at coordinate 0 of every dim but the pipeline's.
    writes = all(mesh[dim].get_local_rank() == 0 for dim in ("dp_replicate", "dp_shard", "cp", "tp"))
    failure = None
    if writes:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            failure = error

    def full(name: str) -> torch.Tensor:
        param = params[name]
        return param.full_tensor() if isinstance(param, DTensor) else param

    for file in plan:
        if file.stage in stage_ids:
            path = out / file.name if writes and failure is None else None
            failure = write_safetensors(path, file.tensors, cfg.model.family, dtype, full) or failure
    problem = _agreed_problem(failure)
    if problem is None and dist.get_rank() == 0:
        try:
            write_metadata(cfg, out, plan, dtype.itemsize)
        except OSError as error:
            failure = error
    problem = _agreed_problem(failure)
    if problem:
        raise ExportFailed(problem)
    if dist.get_rank() == 0:
        print(f"exported a Hugging Face checkpoint to {out} ({len(plan)} safetensors files)", flush=True)


def _agreed_problem(failure: OSError | None) -> str | None:
    """Collective: the first failing rank's error as one line, on every rank (None: none failed)."""
    mine = None
    if failure is not None:
        name = errno.errorcode.get(failure.errno, "OSError") if failure.errno else type(failure).__name__
        mine = f"checkpoint.export_hf: {name} ({failure.strerror or failure}) writing {failure.filename}"
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return next((problem for problem in everyone if problem), None)


def export_from_dcp(cfg: JobConfig, checkpoint: Path, out: Path) -> None:
    """One process: read the model of a DCP checkpoint into full tensors and write it out."""
    import torch.distributed.checkpoint as dcp

    model = build_model(cfg.model, seq_len=cfg.training.seq_len, device="meta")
    model.to_empty(device="cpu")
    state = {"model": dict(model.named_parameters())}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    out.mkdir(parents=True, exist_ok=True)
    plan = export_plan(cfg)
    dtype = EXPORT_DTYPES[cfg.precision.dtype]
    for file in plan:
        failure = write_safetensors(out / file.name, file.tensors, cfg.model.family, dtype, lambda n: state["model"][n])
        if failure is not None:
            raise failure
    write_metadata(cfg, out, plan, dtype.itemsize)


def find_checkpoint(cfg: JobConfig, step: int | None, directory: str | None) -> Path:
    from launcher.contract.checkpoint_dirs import complete_checkpoints

    root = Path(directory or cfg.checkpoint.dir or "checkpoints")
    found = dict(complete_checkpoints(root))
    if not found:
        raise ConfigError(f"checkpoint.dir: no complete checkpoint in {root}")
    if step is None:
        return found[max(found)]
    if step not in found:
        raise ConfigError(f"--step: no complete checkpoint of step {step} in {root}; there are steps {sorted(found)}")
    return found[step]


def checked_out_directory(out: Path) -> Path:
    """--out, made: a new or empty directory (export_out_problem)."""
    problem = export_out_problem(out)
    if problem:
        raise ConfigError(problem)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--out {out}: cannot make the directory: {error.strerror}") from None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export a DCP checkpoint of a job as a Hugging Face checkpoint.")
    parser.add_argument("--config", required=True, help="the job's resolved config JSON")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the newest complete one)")
    parser.add_argument("--checkpoint-dir", help="where the job's checkpoints are (default: checkpoint.dir)")
    parser.add_argument("--out", required=True, help="the directory to write")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        checkpoint = find_checkpoint(cfg, args.step, args.checkpoint_dir)
        export_from_dcp(cfg, checkpoint, checked_out_directory(Path(args.out)))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk or a directory taken away while writing
        print(f"error: --out {args.out}: writing the export failed: {err.strerror or err}", file=sys.stderr)
        return 2
    print(f"exported {checkpoint} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
