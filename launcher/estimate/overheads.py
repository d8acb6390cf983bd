"""Memory a GPU loses outside the tensors PyTorch allocates: documented constants with sources.

These are the three components `torch.cuda.max_memory_allocated` does not see. They apply to
CUDA devices only; a CPU run has none of them.
"""

from __future__ import annotations

from launcher.contract.layout import Layout

GIB = 2**30
MIB = 2**20

# CUDA context, module images and library handles (cuBLAS/cuBLASLt, flash-attention kernels)
# of one training process: device memory in use (cudaMemGetInfo) minus
# `torch.cuda.memory_reserved()` after two training steps of the entrypoints on one H200,
# torch 2.11 + CUDA 13: 1327 MiB in every run (docs/estimator.md, "Measured on a GPU";
# docs/estimator_gpu_h200.json). Rounded up to 64 MiB.
CUDA_CONTEXT_BYTES = 1344 * MIB

# One NCCL communicator's buffers intra-node over NVLink. NVIDIA/nccl#964 measured 544 MB for
# a 2-GPU and 688 MB for a 4-GPU group on A100 NVLink with default settings; NCCL sizes them
# by channel count, which grows with NVLink bandwidth (NVIDIA/nccl#986). We take 688 MiB.
NCCL_BYTES_PER_COMMUNICATOR = 688 * MIB

# The caching allocator reserves more than it hands out: max_memory_reserved exceeded
# max_memory_allocated by 3.4% to 5.7% in the H200 runs above, with expandable segments,
# which launcher/spec.py sets for every job. Without them the entrypoints' own GPU check
# measured 7.5% (docs/gpu_check_h200.md).
FRAGMENTATION_FRACTION = 0.06


def communicators(layout: Layout) -> int:
    """NCCL communicators one rank of the entrypoints creates.

    The default (world) group, one per mesh dimension that communicates (FSDP over
    dp_shard x cp, HSDP's dp_replicate, tp, cp), and two point-to-point communicators per
    pipeline rank (previous and next stage), which NCCL creates lazily for send/recv.
    """
    groups = 1
    groups += layout.fsdp_shard > 1
    groups += layout.data_replicate > 1
    groups += layout.tensor > 1
    groups += layout.context > 1
    groups += 2 * (layout.pipeline > 1)
    return groups


def device_overheads(layout: Layout, allocated_bytes: int, device: str) -> dict[str, int]:
    if device != "cuda":
        return {"cuda_context": 0, "nccl": 0, "fragmentation": 0}
    nccl = (communicators(layout) if layout.world_size > 1 else 0) * NCCL_BYTES_PER_COMMUNICATOR
    return {
        "cuda_context": CUDA_CONTEXT_BYTES,
        "nccl": nccl,
        "fragmentation": round(FRAGMENTATION_FRACTION * allocated_bytes),
    }
