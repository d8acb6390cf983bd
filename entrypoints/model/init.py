"""Materialise a (parallelised) meta model with the same initial weights on any layout.

    materialize(model, device, seed=cfg.training.seed)

Every parameter's full tensor is defined by the seed and its name alone: it is cut into blocks
of rows, and block b of parameter `name` is drawn from its own generator seeded from (seed,
name, b). A rank draws only the blocks that overlap its shard (whatever FSDP, TP or pipeline
split gave it) and copies its rows and columns out, so FSDP x TP x PP layouts start from
exactly the weights a single process has, without any rank holding a full tensor. Numbers
differ between CPU and CUDA generators, never between layouts on one device type.

Standard deviations follow torchtitan's Llama: 0.02 for the input projections, 0.02 /
sqrt(2·(layer+1)) for the projections that write into the residual stream (wo, w2), 1.0 for an
untied embedding, hidden^-0.5 for the output projection (and for a tied embedding), ones for
the norms (QK-norms included), zeros for biases; experts and the router as linears of their
role (an expert's w2 writes into the residual stream).
"""

from __future__ import annotations

import math
import zlib

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from entrypoints.model.llama import Transformer

_BLOCK_ELEMENTS = 1 << 22  # rows per generator block: about 4M values (16 MB in fp32)
_WRAPPER_NAMES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(fqn: str) -> str:
    """A parameter's name in the plain model, without activation-checkpoint/compile wrappers."""
    for wrapper in _WRAPPER_NAMES:
        fqn = fqn.replace(wrapper, "")
    return fqn


def init_std(model: Transformer, name: str) -> float | None:
    """Standard deviation of parameter `name` (canonical), or None for ones (norm weights)."""
    cfg = model.cfg
    parts = name.split(".")
    if parts[-2].endswith("norm"):
        return None
    if name == "tok_embeddings.weight":
        return cfg.hidden_size**-0.5 if cfg.tie_embeddings else 1.0
    if name == "output.weight":
        return cfg.hidden_size**-0.5
    if parts[-1] == "bias":
        return 0.0
    layer_id = int(parts[1])
    # Grouped experts are parameters named w1/w2/w3 themselves; linears hold a `weight`.
    projection = parts[-2] if parts[-1] == "weight" else parts[-1]
    if projection in ("wo", "w2"):
        return 0.02 / math.sqrt(2 * (layer_id + 1))
    return 0.02


def _seed(seed: int, name: str, block: int) -> int:
    return ((seed * 1_000_003 + zlib.crc32(name.encode())) * 1_000_003 + block) & (2**63 - 1)


@torch.no_grad()
def materialize(model: Transformer, device: torch.device, *, seed: int) -> None:
    """Allocate the model's shards on `device` and fill them deterministically from `seed`."""
    model.to_empty(device=device)
    for fqn, param in model.named_parameters():
        name = canonical_name(fqn)
        std = init_std(model, name)
        if std is None:
            param.fill_(1.0)
        else:
            fill_normal(param, std, seed=seed, name=name)
    model.init_rope()


def fill_normal(param: torch.Tensor, std: float, *, seed: int, name: str) -> None:
    """Fill `param` (a shard, as a DTensor, or a whole tensor) with its part of N(0, std^2)."""
    if isinstance(param, DTensor):
        local = param.to_local()
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        local, shape, offset = param, tuple(param.shape), (0,) * param.dim()
    if local.numel() == 0:
        return
    full_shape = tuple(param.shape)
    row_numel = math.prod(full_shape[1:])
    rows_per_block = max(1, _BLOCK_ELEMENTS // max(1, row_numel))
    row_start, row_end = offset[0], offset[0] + shape[0]
    # Columns (and further dims) of the shard, as slices of a block of full rows.
    inner = tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True))
    generator = torch.Generator(device=local.device)
    for block in range(row_start // rows_per_block, (row_end - 1) // rows_per_block + 1):
        block_start = block * rows_per_block
        block_rows = min(rows_per_block, full_shape[0] - block_start)
        generator.manual_seed(_seed(seed, name, block))
        values = torch.randn((block_rows, *full_shape[1:]), generator=generator, device=local.device)
        lo, hi = max(row_start, block_start), min(row_end, block_start + block_rows)
        local[lo - row_start : hi - row_start].copy_(values[(slice(lo - block_start, hi - block_start), *inner)] * std)
