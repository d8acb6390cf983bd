"""AdamW per model part, the learning-rate schedule, and gradient clipping across the mesh.

    optimizers = Optimizers(parts, cfg.training.optimizer, total_steps=cfg.training.steps)
    norm = clip_grad_norm(parts, max_norm, pp_mesh)
    optimizers.step(); optimizers.zero_grad()

One AdamW per model part (pipeline stages of a rank have their own), stepped together, with one
parameter group per device mesh: under expert parallelism the experts' shards live on the
expert mesh and the rest on the main one, and DTensor's foreach kernels take one mesh at a time
(torchtitan's `_clip_grad_norm_with_ep`, torchtitan/distributed/utils.py, splits the norm the
same way). The
parameters are FSDP's fp32 shards, so torch's AdamW keeps fp32 states too: 8 bytes per parameter
per rank's shard (exp_avg, exp_avg_sq), plus the fp32 gradient shard. On CUDA the fused
implementation runs (no parameter-sized temporaries); on CPU the foreach one. With
`training.optimizer.state_dtype: bf16`, `AdamWBf16Moments` keeps the two moments in bf16 (4 bytes
per parameter) and runs torch's AdamW update in fp32 on chunks of each shard.

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
from torch.optim.optimizer import Optimizer

from launcher.contract.config import BF16_MOMENTS_CHUNK, OptimizerConfig


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


class AdamWBf16Moments(Optimizer):
    """AdamW with exp_avg and exp_avg_sq stored in bf16, as Apex's DistributedFusedAdam stores its
    state in `dtype` (NeMo's optim.dtype: bf16). Each step is torch.optim.AdamW's update
    (decoupled weight decay, bias-corrected moments, eps outside the square root), computed in
    fp32 on the fp32 parameter and gradient, BF16_MOMENTS_CHUNK elements of a shard at a time, and
    the moments rounded to nearest bf16 on the way back. The state keys are torch's, so
    checkpoints reshard and resume alike (a checkpoint with fp32 moments loads, rounded).

    Elementwise and shard-local: a DTensor's local tensors are updated in place, so the moments
    stay DTensors placed as their parameter (what the checkpoint's sharded state dict needs)."""

    def __init__(self, params, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        # Optimizer.load_state_dict casts floating state to its parameter's dtype (fp32): back to bf16.
        self.register_load_state_dict_post_hook(_moments_to_bf16)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("AdamWBf16Moments.step takes no closure")
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)

    def _update(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        if not state:  # torch's AdamW keeps `step` as a CPU float tensor: the same in checkpoints
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
        state["step"] += 1
        step = state["step"].item()
        (beta1, beta2), lr = group["betas"], group["lr"]
        step_size = lr / (1 - beta1**step)
        root_correction = math.sqrt(1 - beta2**step)
        tensors = (param, param.grad, state["exp_avg"], state["exp_avg_sq"])
        flat = [(t.to_local() if isinstance(t, DTensor) else t).view(-1) for t in tensors]
        chunk = BF16_MOMENTS_CHUNK
        for start in range(0, flat[0].numel(), chunk):
            p, g, m, v = (t[start : start + chunk] for t in flat)
            g = g.float()  # the gradient itself when it is fp32 (FSDP's sharded gradients are)
            exp_avg = m.float().lerp_(g, 1 - beta1)
            exp_avg_sq = v.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
            m.copy_(exp_avg)
            v.copy_(exp_avg_sq)
            p.mul_(1 - lr * group["weight_decay"])
            # The denominator in exp_avg_sq's own storage: two fp32 temporaries per chunk.
            p.addcdiv_(exp_avg, exp_avg_sq.sqrt_().div_(root_correction).add_(group["eps"]), value=-step_size)


def _moments_to_bf16(optimizer: Optimizer) -> None:
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state and state[key].dtype != torch.bfloat16:
                state[key] = state[key].to(torch.bfloat16)


def adamw(params: list[dict], cfg: OptimizerConfig, *, lr: float, device_type: str) -> Optimizer:
    """The AdamW that keeps `cfg.state_dtype` moments: torch's (fused on CUDA, foreach on CPU) or ours."""
    settings = {"lr": lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if cfg.state_dtype == "bf16":
        return AdamWBf16Moments(params, **settings)
    fused = device_type == "cuda"
    return torch.optim.AdamW(params, **settings, fused=fused, foreach=not fused)


class Optimizers:
    def __init__(self, parts: list[torch.nn.Module], cfg: OptimizerConfig, *, total_steps: int):
        self.parts, self.cfg, self.total_steps = parts, cfg, total_steps
        device_type = next(parts[0].parameters()).device.type
        self.optimizers = [
            adamw(
                [{"params": group} for group in by_mesh(list(part.parameters()))],
                cfg,
                lr=lr_at(0, cfg, total_steps),
                device_type=device_type,
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
