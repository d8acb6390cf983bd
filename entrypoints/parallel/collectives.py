"""The collectives the model code calls itself: an all-gather whose backward is a
reduce-scatter (sum), and the same pair without autograd for code that writes its own backward.

They come from `torch.distributed._functional_collectives`. `torch.distributed.nn.functional.
all_gather` gave wrong K/V gradients on gloo (non-contiguous incoming gradients), so it is not
used anywhere. torch 2.13 renamed `all_gather_tensor[_autograd]` to `all_gather_single[_autograd]`
and `reduce_scatter_tensor` to `reduce_scatter_single`; both names are accepted so the
entrypoints also run on the older torch of a training image.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_gather_plain = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter_plain = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def all_gather_autograd(x: torch.Tensor, *, dim: int, group) -> torch.Tensor:
    """Concatenate `x` from every rank of `group` (a ProcessGroup or 1-D DeviceMesh) along `dim`."""
    # The result waits for the collective on first use (an AsyncCollectiveTensor).
    return _gather(x.contiguous(), gather_dim=dim, group=group)


def all_gather(x: torch.Tensor, *, dim: int, group) -> torch.Tensor:
    """`all_gather_autograd` outside autograd: for a backward that gathers again."""
    return _gather_plain(x.contiguous(), gather_dim=dim, group=group)


def reduce_scatter_sum(x: torch.Tensor, *, dim: int, group) -> torch.Tensor:
    """Sum `x` over `group` and keep this rank's 1/size slice along `dim` (no autograd)."""
    return _reduce_scatter_plain(x.contiguous(), "sum", scatter_dim=dim, group=group)
