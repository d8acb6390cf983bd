"""The one differentiable collective the model code uses: an all-gather whose backward is a
reduce-scatter (sum).

It comes from `torch.distributed._functional_collectives`. `torch.distributed.nn.functional.
all_gather` gave wrong K/V gradients on gloo (non-contiguous incoming gradients), so it is not
used anywhere. torch 2.13 renamed `all_gather_tensor_autograd` to `all_gather_single_autograd`;
both are accepted so the entrypoints also run on the older torch of a training image.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def all_gather_autograd(x: torch.Tensor, *, dim: int, group) -> torch.Tensor:
    """Concatenate `x` from every rank of `group` (a ProcessGroup or 1-D DeviceMesh) along `dim`."""
    # The result waits for the collective on first use (an AsyncCollectiveTensor).
    return _gather(x.contiguous(), gather_dim=dim, group=group)
