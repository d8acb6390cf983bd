"""Which SDPA kernel runs attention on CUDA: one fixed preference order for every attention path.

Left to itself, torch picks per call and per version: on sm90 with torch >= 2.9 plain
`is_causal=True` SDPA prefers cuDNN (sdp_utils `check_prefer_cudnn_attention`), while a
lower-right `CausalBias` goes straight to FlashAttention-2. A comparison of context-parallel
attention against plain attention was then a comparison of two kernels. Both paths now choose
from `CUDA_BACKEND_ORDER`: the plain path through `sdpa_kernel(..., set_priority=True)`, the
context-parallel pieces (parallel/cp_attention.py) by asking `can_use_*` in the same order.
Narrowing the enabled set with `torch.nn.attention.sdpa_kernel([...])` around a call pins both
paths to one kernel (scripts/gpu_check.py does, to time each).

On the CPU torch has one fused kernel (`_scaled_dot_product_flash_attention_for_cpu`, chosen
deterministically from the inputs), so nothing is pinned there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Fastest first on H100/H200 (cuDNN's fused attention leads FlashAttention-2 on sm90); math last.
CUDA_BACKEND_ORDER = (
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


# A constant to torch.compile: dynamo cannot trace the enabled-flag getters (per-block compile
# would fail with fullgraph, or break the graph around attention), and they do not change
# inside a compiled block.
@torch.compiler.assume_constant_result
def enabled_cuda_backends() -> list[SDPBackend]:
    """CUDA_BACKEND_ORDER without the backends switched off (globally or by `sdpa_kernel`)."""
    switches = {
        SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
        SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
        SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
        SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,
    }
    return [backend for backend in CUDA_BACKEND_ORDER if switches[backend]()]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, enable_gqa: bool) -> torch.Tensor:
    """Causal SDPA of q [B, H, S, D] over k, v [B, Hkv, S, D], on CUDA in CUDA_BACKEND_ORDER."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    with sdpa_kernel(enabled_cuda_backends(), set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
