"""training.optimizer.state_dtype bf16: AdamWBf16Moments against torch's AdamW, in one process.

Multi-process (FSDP2 shards as DTensors, a DCP checkpoint resumed): test_multiprocess.py.
"""

from __future__ import annotations

import pytest
import torch

import entrypoints.optim as optim
from entrypoints.optim import AdamWBf16Moments, Optimizers
from launcher.contract.config import OptimizerConfig

SETTINGS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _train(optimizer_class, start: torch.Tensor, grads: list[torch.Tensor], **options):
    param = torch.nn.Parameter(start.clone())
    optimizer = optimizer_class([param], **SETTINGS, **options)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach(), optimizer.state[param]


def _grads(n: int, steps: int = 20) -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=generator)
    return start, [torch.randn(n, generator=generator) + 0.5 for _ in range(steps)]


def test_bf16_moments_follow_torch_adamw_within_bf16_rounding():
    start, grads = _grads(200_000)
    reference, _ = _train(torch.optim.AdamW, start, grads, foreach=True)
    ours, state = _train(AdamWBf16Moments, start, grads)
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert state["step"].item() == 20.0
    # Each step's update is torch's up to the moments' bf16 rounding (2^-9 relative): after 20
    # steps the displacement from the start differs by a few tenths of a percent, not more.
    moved, ours_moved = reference - start, ours - start
    error = ((ours_moved - moved).norm() / moved.norm()).item()
    assert 1e-5 < error < 5e-3


def test_the_first_step_is_torch_adamw_exactly_where_the_moments_round_to_themselves():
    # Gradients of +-1 round exactly: m = 0.1 g, v = 0.05 are rounded, but the step's own update
    # uses the fp32 values, so step 1 matches torch to fp32 rounding.
    start = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    grad = torch.where(torch.arange(4096) % 2 == 0, 1.0, -1.0)
    reference, _ = _train(torch.optim.AdamW, start, [grad], foreach=True)
    ours, _ = _train(AdamWBf16Moments, start, [grad])
    assert torch.allclose(ours, reference, rtol=0, atol=1e-7)


def test_a_shard_larger_than_a_chunk_is_updated_chunk_by_chunk_as_if_whole(monkeypatch):
    start, grads = _grads(10_001, steps=3)
    whole, whole_state = _train(AdamWBf16Moments, start, grads)
    monkeypatch.setattr(optim, "BF16_MOMENTS_CHUNK", 1000)  # 11 chunks, the last of 1 element
    chunked, chunked_state = _train(AdamWBf16Moments, start, grads)
    assert torch.equal(chunked, whole)
    assert torch.equal(chunked_state["exp_avg_sq"], whole_state["exp_avg_sq"])


def test_the_recipe_setting_picks_the_optimizer_and_torch_adamw_stays_the_default():
    part = torch.nn.Linear(8, 8)
    default = Optimizers([part], OptimizerConfig(), total_steps=10)
    bf16 = Optimizers([part], OptimizerConfig(state_dtype="bf16"), total_steps=10)
    assert type(default.optimizers[0]) is torch.optim.AdamW
    assert type(bf16.optimizers[0]) is AdamWBf16Moments
    with pytest.raises(ValueError, match="takes no closure"):
        bf16.optimizers[0].step(lambda: 0.0)


def test_loading_a_state_dict_keeps_the_moments_in_bf16():
    # torch's Optimizer.load_state_dict casts floating state to the parameter's dtype (fp32).
    start, grads = _grads(64, steps=1)
    param = torch.nn.Parameter(start.clone())
    fp32 = torch.optim.AdamW([param], **SETTINGS)
    param.grad = grads[0]
    fp32.step()
    ours = AdamWBf16Moments([param], **SETTINGS)
    ours.load_state_dict(fp32.state_dict())
    state = ours.state[param]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(state["exp_avg"], fp32.state[param]["exp_avg"].to(torch.bfloat16))
