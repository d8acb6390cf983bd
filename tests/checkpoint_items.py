"""What a DCP checkpoint stores whole rather than as a shard, read from its `.metadata`."""

from __future__ import annotations

from pathlib import Path


def whole_items(checkpoint: Path, file: str) -> tuple[int, int]:
    """(bytes, count) of the items in `file` that are not a shard: bytes objects, and tensors stored whole.
    DCP writes each such item once, in the file of the rank its balanced dedup picks, and every
    rank that holds it reads it from there (torch/distributed/checkpoint/_dedup_save_plans.py)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    total = count = 0
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata[index.fqn]
        sharded = isinstance(entry, TensorStorageMetadata) and any(
            chunk.offsets == index.offset and tuple(chunk.sizes) != tuple(entry.size) for chunk in entry.chunks
        )
        if info.relative_path == file and not sharded:
            total += info.length
            count += 1
    return total, count
