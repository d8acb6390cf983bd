"""Sequence parallel's gathered inputs kept as this rank's shard, and all-gathered again in backward.

    parallel.tp_saved_inputs: shard      # the contract's field; tensor.py picks the styles here

Under sequence parallel the attention's and the dense MLP's inputs are all-gathered along the
sequence (Shard(1) -> Replicate) before wq/wk/wv and w1/w3. Those linears save their input for
the weight gradient, so by default ("gathered", torchtitan's) every kept block holds the whole
sequence's input twice, tp times the shard. Megatron-Core keeps the shard instead and gathers
it again in backward, before the weight-gradient GEMM: `LinearWithGradAccumulationAndAsyncCommunication`
saves the un-gathered `input` and all-gathers it in its backward (megatron/core/tensor_parallel/
layers.py), and Transformer Engine's LayerNormLinear gathers `ln_out` again in its backward
(transformer_engine/pytorch/module/layernorm_linear.py). "shard" does the same here: one more
all-gather per gathered input in backward, (t - 1)/t of those bytes no longer kept.

How: the styles below are torch's PrepareModuleInput and torchao's PrepareFloat8ModuleInput with
the gather split from the cast, so the (float8) shard is at hand. While the module runs its
forward, saved-tensor hooks replace every tensor autograd saves that lives in the gathered
tensor's storage (the gathered DTensor, a view of it, its local tensor or a float8 tensor's data)
by a token holding the shard; unpacking the token in backward all-gathers the shard again (once
for all the module's linears) and rebuilds the saved view. Tensors from other storages pass
through. A block under activation checkpointing is not given these styles: its recomputation
gathers anew anyway, and the checkpoint's own saved-tensor hooks must stay the innermost.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

FLOAT8_MODULE = "torchao.float8.float8_training_tensor"


@functools.cache
def regathering(prepare_style: type) -> type:
    """`prepare_style` (PrepareModuleInput or PrepareFloat8ModuleInput) keeping the shard."""

    class RegatheringInput(prepare_style):
        def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
            if input_layout is None or desired_layout is None or input_layout == desired_layout:
                return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
            shard = super()._prepare_input_arg(input, mesh, input_layout, None)  # the cast, not the gather
            gathered = shard.redistribute(placements=(desired_layout,))
            self._gathered_now.append(_Gather(shard, _plain(gathered)))
            return gathered.to_local() if self.use_local_output else gathered

        def _apply(self, module, device_mesh):
            self._gathered_now: list[_Gather] = []
            super()._apply(module, device_mesh)
            # Registered after the prepare hook, so it runs after it and sees this call's gathers.
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit, always_call=True)
            return module

        def _enter(self, module, args):
            gathers, self._gathered_now = self._gathered_now, []
            hooks = torch.autograd.graph.saved_tensors_hooks(_packer(gathers), _unpack)
            hooks.__enter__()
            module._regather_hooks = hooks

        def _exit(self, module, args, output):
            hooks = module.__dict__.pop("_regather_hooks", None)
            if hooks is not None:
                hooks.__exit__(None, None, None)

    RegatheringInput.__name__ = RegatheringInput.__qualname__ = f"Regathering{prepare_style.__name__}"
    return RegatheringInput


class _Gather:
    """One all-gather of a module call: the shard it came from, the gathered storage's identity
    and geometry (its innermost plain tensor), and the regathered tensor once backward asks."""

    def __init__(self, shard: DTensor, gathered_plain: torch.Tensor):
        self.shard = shard
        self.storage = _storage_id(gathered_plain)
        self.shape = (tuple(gathered_plain.shape), gathered_plain.stride(), gathered_plain.storage_offset())
        self._again: DTensor | None = None

    def again(self) -> DTensor:
        """The shard all-gathered again (once; every token of this call shares it)."""
        if self._again is None:
            with torch.no_grad():
                self._again = self.shard.redistribute(placements=[Replicate()] * len(self.shard.placements))
            plain = _plain(self._again)
            found = (tuple(plain.shape), plain.stride(), plain.storage_offset())
            if found != self.shape:
                raise RuntimeError(f"parallel.tp_saved_inputs shard: the regathered input is {found}, not {self.shape}")
        return self._again


@dataclass(frozen=True)
class _Layer:
    """What wraps the plain tensor at one level of a saved tensor: a DTensor's spec, or a float8
    tensor's scale and configuration (never its data)."""

    kind: str  # "dtensor" or "float8"
    meta: tuple[Any, ...]


@dataclass(frozen=True)
class _Token:
    gather: _Gather
    layers: tuple[_Layer, ...]  # outermost first
    view: tuple[tuple[int, ...], tuple[int, ...], int]  # the plain tensor's size, stride, offset


def _packer(gathers: list[_Gather]):
    by_storage = {gather.storage: gather for gather in gathers}

    def pack(tensor):
        if not by_storage:
            return tensor
        layers, plain = _unwrap(tensor)
        gather = by_storage.get(_storage_id(plain)) if plain is not None else None
        if gather is None:
            return tensor
        return _Token(gather, layers, (tuple(plain.shape), plain.stride(), plain.storage_offset()))

    return pack


def _unpack(packed):
    if not isinstance(packed, _Token):
        return packed
    _, plain = _unwrap(packed.gather.again())
    tensor = plain.as_strided(*packed.view)
    for layer in reversed(packed.layers):
        tensor = _rewrap(layer, tensor)
    return tensor


def _unwrap(tensor) -> tuple[tuple[_Layer, ...], torch.Tensor | None]:
    """(the wrappers around `tensor`'s plain data, outermost first; that plain tensor, or None
    for a subclass this module does not know)."""
    layers = []
    while True:
        float8 = _float8_type()
        if isinstance(tensor, DTensor):
            layers.append(_Layer("dtensor", (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())))
            tensor = tensor._local_tensor
        elif float8 is not None and isinstance(tensor, float8):
            meta = (tensor._scale, tensor._orig_dtype, tensor._linear_mm_config, tensor._gemm_input_role)
            layers.append(_Layer("float8", (*meta, tensor._axiswise_dim)))
            tensor = tensor._data
        elif isinstance(tensor, torch.Tensor) and not is_traceable_wrapper_subclass(tensor):
            return tuple(layers), tensor  # a plain tensor (or a fake one, in the memory trace)
        else:
            return tuple(layers), None


def _rewrap(layer: _Layer, tensor: torch.Tensor):
    if layer.kind == "dtensor":
        mesh, placements, shape, stride = layer.meta
        return DTensor.from_local(tensor, mesh, placements, run_check=False, shape=shape, stride=stride)
    return _float8_type()(tensor, *layer.meta)


def _plain(tensor) -> torch.Tensor:
    _, plain = _unwrap(tensor)
    if plain is None:
        raise TypeError(f"parallel.tp_saved_inputs shard: cannot regather a {type(tensor).__name__}")
    return plain


def _float8_type() -> type | None:
    """torchao's float8 training tensor, where torchao is loaded (only then can one exist)."""
    module = sys.modules.get(FLOAT8_MODULE)
    return None if module is None else module.Float8TrainingTensor


def _storage_id(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata
