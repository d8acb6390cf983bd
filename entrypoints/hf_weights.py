"""Hugging Face safetensors checkpoints in: each rank reads only the bytes of its own shards.

    checkpoint = SafetensorsCheckpoint(directory)       # model.safetensors(.index.json)
    read = load_hf_weights(parts, cfg)                  # after materialize, on a fresh run only

Safetensors (the format, read here with the standard library and torch only): 8 bytes of
little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin,
end]}, "__metadata__": {...}}, then the raw little-endian tensor bytes, offsets counted from
the end of the header. A 2-D weight's row range is one contiguous byte range, so a rank reads
the rows of its shard with os.pread and cuts its columns (tensor-parallel row-wise layers) out
of them in memory; nothing maps or reads the whole file.

Which slice a rank holds comes from the DTensor itself (`compute_local_shape_and_global_offset`,
the same function model/init.py fills shards with), so every layout works without knowing how
it was made: FSDP, TP, both, pipeline stages (a stage holds only its layers, under their global
names), and context parallelism, which shards no parameters. Our grouped experts [E, F, D] are
E tensors in a checkpoint (launcher.contract.hf_names): a rank reads the experts its shard
covers (under expert parallelism, its own; under FSDP of the experts, its rows of them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from entrypoints.model.init import canonical_name
from launcher.contract.config import ConfigError, JobConfig, ModelConfig
from launcher.contract.hf_checkpoint import architecture_mismatch, sliding_window_problem
from launcher.contract.hf_names import HFTensor, hf_layout_problem, hf_tensors

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the tensor's data in the file."""


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset its data starts at."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ConfigError(f"model.init_from: {path} is not a safetensors file (shorter than 8 bytes)")
        length = int.from_bytes(prefix, "little")
        if length > _MAX_HEADER:
            raise ConfigError(f"model.init_from: {path} is not a safetensors file (header of {length} bytes)")
        try:
            return json.loads(f.read(length)), 8 + length
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(f"model.init_from: {path} is not a safetensors file (its header is not JSON)") from None


class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory: sharded (with the index) or one model.safetensors."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (directory / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise ConfigError(f"model.init_from: {directory} holds neither {INDEX} nor {SINGLE}")
        self.entries: dict[str, TensorEntry] = {}
        for name in files:
            self._add_file(directory / name)
        self.bytes_read = 0
        self._fds: dict[Path, int] = {}

    def _add_file(self, path: Path) -> None:
        header, data_start = read_header(path)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in DTYPES:
                raise ConfigError(
                    f"model.init_from: {name} in {path} is {info['dtype']}; only {', '.join(DTYPES)} weights load"
                )
            begin = info["data_offsets"][0]
            self.entries[name] = TensorEntry(path, DTYPES[info["dtype"]], tuple(info["shape"]), data_start + begin)

    def _pread(self, path: Path, size: int, offset: int) -> bytearray:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        buffer = bytearray(size)
        view, done = memoryview(buffer), 0
        while done < size:  # pread may return less than asked for on large reads
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise ConfigError(f"model.init_from: {path} ends before its tensors do (truncated download?)")
            done += got
        self.bytes_read += size
        return buffer

    def read_slice(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The block of tensor `name` starting at `offset` with `shape`, reading only its rows."""
        entry = self.entries[name]
        row_numel = math.prod(entry.shape[1:])
        itemsize = torch.empty((), dtype=entry.dtype).element_size()
        rows = shape[0]
        data = self._pread(entry.path, rows * row_numel * itemsize, entry.start + offset[0] * row_numel * itemsize)
        block = torch.frombuffer(data, dtype=entry.dtype).view(rows, *entry.shape[1:])
        inner = tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True))
        return block[(slice(None), *inner)]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def checkpoint_directory(init_from: str) -> Path:
    """Where an init_from checkpoint is on this machine: the path, or SageMaker's `model` channel."""
    if not init_from.startswith("s3://"):
        return Path(init_from)
    channel = os.environ.get("SM_CHANNEL_MODEL")
    if not channel:
        raise ConfigError(
            f"model.init_from: {init_from} is read from the SageMaker 'model' channel, but SM_CHANNEL_MODEL is not "
            "set; outside SageMaker use a local path (the local, docker and slurm backends stage it at submit)"
        )
    return Path(channel)


def check_checkpoint(model: ModelConfig, seq_len: int, directory: Path) -> None:
    """Refuse a model no checkpoint can hold, or a checkpoint whose config.json disagrees with
    the job's architecture (one line)."""
    ours = dataclasses.asdict(model)
    layout = hf_layout_problem(ours)
    if layout:
        raise ConfigError(f"model.init_from: {layout}")
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"model.init_from: cannot read {path} ({err})") from None
    where = f"{model.init_from.rstrip('/')}/config.json" if model.init_from.startswith("s3://") else str(path)
    problem = architecture_mismatch(ours, config, where) or sliding_window_problem(config, seq_len, where)
    if problem:
        raise ConfigError(f"model.init_from: {problem}")


def local_block(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's tensor, its shape, its offset in the full tensor) of a parameter."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), tuple(shape), tuple(offset)
    return param, tuple(param.shape), (0,) * param.dim()


def _checked_entry(checkpoint: SafetensorsCheckpoint, tensor: HFTensor) -> TensorEntry:
    entry = checkpoint.entries.get(tensor.name)
    if entry is None:
        raise ConfigError(f"model.init_from: {checkpoint.directory} has no tensor {tensor.name}")
    if entry.shape != tensor.shape:
        raise ConfigError(
            f"model.init_from: {tensor.name} is {list(entry.shape)} in {checkpoint.directory}, "
            f"but the model's is {list(tensor.shape)}"
        )
    return entry


def _load_parameter(checkpoint: SafetensorsCheckpoint, name: str, family: str, param: torch.Tensor) -> None:
    """This rank's block of one parameter, from its one tensor or from its experts' tensors."""
    tensors = hf_tensors(name, family, tuple(param.shape))
    for tensor in tensors:
        _checked_entry(checkpoint, tensor)
    local, shape, offset = local_block(param)
    if not local.numel():
        return
    if tensors[0].expert is None:
        local.copy_(checkpoint.read_slice(tensors[0].name, offset, shape))
        return
    for row in range(shape[0]):  # the experts this shard covers, each cut as the shard's other dims
        local[row].copy_(checkpoint.read_slice(tensors[offset[0] + row].name, offset[1:], shape[1:]))


@torch.no_grad()
def load_hf_weights(parts, cfg: JobConfig, *, fresh_start: bool = True) -> int:
    """Copy the init_from checkpoint into this rank's shards of `parts`; the bytes this rank read.

    Nothing happens without model.init_from, or when the run resumed (`fresh_start` False): a
    resumed run continues from its own checkpoint."""
    if not (cfg.model.init_from and fresh_start):
        return 0
    directory = checkpoint_directory(cfg.model.init_from)
    check_checkpoint(cfg.model, cfg.training.seq_len, directory)
    checkpoint = SafetensorsCheckpoint(directory)
    try:
        for part in parts:
            for fqn, param in part.named_parameters():
                _load_parameter(checkpoint, canonical_name(fqn), cfg.model.family, param)
    finally:
        checkpoint.close()
    return checkpoint.bytes_read
