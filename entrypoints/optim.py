"""AdamW per model part, the learning-rate schedule, and gradient clipping across the mesh.

    optimizers = Optimizers(parts, cfg.training.optimizer, total_steps=cfg.training.steps)
    norm = clip_grad_norm(parts, max_norm, pp_mesh)
    optimizers.step(); optimizers.zero_grad()

One AdamW per model part (pipeline stages of a rank have their own), stepped together, with one
parameter group per device mesh: under expert parallelism the experts' shards live on the
expert mesh and the rest on the main one, and DTensor's foreach kernels take one mesh at a time
(torchtitan's `_clip_grad_norm_with_ep`, torchtitan/distributed/utils.py, splits the norm the
same way). The
parameters are FSDP's fp32 shards, so the states are fp32 too: 8 bytes per parameter per
rank's shard (exp_avg, exp_avg_sq), plus the fp32 gradient shard. On CUDA the fused
implementation runs (no parameter-sized temporaries); on CPU the foreach one.

The learning rate warms up linearly over `warmup_steps` (step k of warmup uses (k+1)/(w+1)
of the peak), then decays to `min_lr` at the last step: cosine, linear or constant.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from launcher.contract.config import OptimizerConfig


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - 1 - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


# The gradient norm of 2-D (FSDP x TP) DTensors reduces over both mesh dims; DTensor logs a
# warning on every step that one flattened all-reduce would be faster. It is one scalar.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

# Flattened keys ("state.layers.0.attention.wq.weight.exp_avg") let the parts' state dicts
# merge into one, and reshard across pipeline layouts by parameter name.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Optimizers:
    def __init__(self, parts: list[torch.nn.Module], cfg: OptimizerConfig, *, total_steps: int):
        self.parts, self.cfg, self.total_steps = parts, cfg, total_steps
        fused = next(parts[0].parameters()).device.type == "cuda"
        self.optimizers = [
            torch.optim.AdamW(
                [{"params": group} for group in by_mesh(list(part.parameters()))],
                lr=lr_at(0, cfg, total_steps),
                betas=cfg.betas,
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                fused=fused,
                foreach=not fused,
            )
            for part in parts
        ]
        self.step_count = 0

    @property
    def lr(self) -> float:
        return self.optimizers[0].param_groups[0]["lr"]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()
        self.step_count += 1
        self.set_lr()

    def set_lr(self) -> None:
        lr = lr_at(self.step_count, self.cfg, self.total_steps)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        merged = {}
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            merged.update(get_optimizer_state_dict(part, opt, options=STATE_DICT_OPTIONS))
        return merged

    def load_state_dict(self, state: dict) -> None:
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            set_optimizer_state_dict(part, opt, state, options=STATE_DICT_OPTIONS)
        self.set_lr()


def by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` grouped by DTensor mesh (plain tensors together), in first-seen order."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(groups.values())


def _group_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    # Partial over the FSDP/TP (or expert) shards: full_tensor() all-reduces the squares.
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def clip_grad_norm(parts: list[torch.nn.Module], max_norm: float | None, pp_mesh) -> torch.Tensor:
    """The global L2 norm of all gradients (over every shard and stage); clips if max_norm is set."""
    params = [p for part in parts for p in part.parameters() if p.grad is not None]
    norms = [_group_norm(group) for group in by_mesh([p.grad for p in params])] or [torch.tensor(0.0)]
    norm = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    if pp_mesh.size() > 1:
        squared = norm**2
        dist.all_reduce(squared, group=pp_mesh.get_group())
        norm = squared.sqrt()
    if max_norm is not None:
        for group in by_mesh(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm
