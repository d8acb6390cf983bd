"""A tensor autograd saves, seen through its DTensor and float8 wrappers: which storage its data
lives in, and how to rebuild the same wrappers around other data in backward.

    layers, plain = unwrap(saved)          # wrappers, outermost first; the plain tensor (or None)
    same = storage_id(plain) == storage_id(made)
    again = rewrap_view(layers, view_of(plain), recomputed)

Saved-tensor hooks that drop a tensor in forward and make it again in backward (parallel/regather.py
gathers a sequence-parallel input again; model/swiglu.py recomputes the SwiGLU's product) find the
tensors to drop by their storage: autograd may save the tensor itself, a view of it, the DTensor
tensor parallelism wraps around it, or torchao's float8 tensor over its data.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

FLOAT8_MODULE = "torchao.float8.float8_training_tensor"

View = tuple[tuple[int, ...], tuple[int, ...], int]
"""A plain tensor's size, stride and storage offset."""


@dataclass(frozen=True)
class Layer:
    """What wraps the plain tensor at one level of a saved tensor: a DTensor's spec, or a float8
    tensor's scale and configuration (never its data)."""

    kind: str  # "dtensor" or "float8"
    meta: tuple[Any, ...]


def unwrap(tensor) -> tuple[tuple[Layer, ...], torch.Tensor | None]:
    """(the wrappers around `tensor`'s plain data, outermost first; that plain tensor, or None
    for a subclass this module does not know)."""
    layers = []
    while True:
        float8 = _float8_type()
        if isinstance(tensor, DTensor):
            layers.append(Layer("dtensor", (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())))
            tensor = tensor._local_tensor
        elif float8 is not None and isinstance(tensor, float8):
            meta = (tensor._scale, tensor._orig_dtype, tensor._linear_mm_config, tensor._gemm_input_role)
            layers.append(Layer("float8", (*meta, tensor._axiswise_dim)))
            tensor = tensor._data
        elif isinstance(tensor, torch.Tensor) and not is_traceable_wrapper_subclass(tensor):
            return tuple(layers), tensor  # a plain tensor (or a fake one, in the memory trace)
        else:
            return tuple(layers), None


def view_of(plain: torch.Tensor) -> View:
    return tuple(plain.shape), plain.stride(), plain.storage_offset()


def rewrap_view(layers: tuple[Layer, ...], view: View, data: torch.Tensor):
    """The saved tensor again: `view` of `data`'s storage inside `layers`."""
    tensor = data.as_strided(*view)
    for layer in reversed(layers):
        tensor = _rewrap(layer, tensor)
    return tensor


def _rewrap(layer: Layer, tensor: torch.Tensor):
    if layer.kind == "dtensor":
        mesh, placements, shape, stride = layer.meta
        return DTensor.from_local(tensor, mesh, placements, run_check=False, shape=shape, stride=stride)
    return _float8_type()(tensor, *layer.meta)


def _float8_type() -> type | None:
    """torchao's float8 training tensor, where torchao is loaded (only then can one exist)."""
    module = sys.modules.get(FLOAT8_MODULE)
    return None if module is None else module.Float8TrainingTensor


def storage_id(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata
