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
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate

from entrypoints.model.saved_views import Layer, View, rewrap_view, storage_id, unwrap, view_of


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
        self.storage = storage_id(gathered_plain)
        self.shape = view_of(gathered_plain)
        self._again: DTensor | None = None

    def again(self) -> DTensor:
        """The shard all-gathered again (once; every token of this call shares it)."""
        if self._again is None:
            with torch.no_grad():
                self._again = self.shard.redistribute(placements=[Replicate()] * len(self.shard.placements))
            found = view_of(_plain(self._again))
            if found != self.shape:
                raise RuntimeError(f"parallel.tp_saved_inputs shard: the regathered input is {found}, not {self.shape}")
        return self._again


@dataclass(frozen=True)
class _Token:
    gather: _Gather
    layers: tuple[Layer, ...]  # outermost first
    view: View  # the plain tensor's


def _packer(gathers: list[_Gather]):
    by_storage = {gather.storage: gather for gather in gathers}

    def pack(tensor):
        if not by_storage:
            return tensor
        layers, plain = unwrap(tensor)
        gather = by_storage.get(storage_id(plain)) if plain is not None else None
        if gather is None:
            return tensor
        return _Token(gather, layers, view_of(plain))

    return pack


def _unpack(packed):
    if not isinstance(packed, _Token):
        return packed
    _, plain = unwrap(packed.gather.again())
    return rewrap_view(packed.layers, packed.view, plain)


def _plain(tensor) -> torch.Tensor:
    _, plain = unwrap(tensor)
    if plain is None:
        raise TypeError(f"parallel.tp_saved_inputs shard: cannot regather a {type(tensor).__name__}")
    return plain
