"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

    apply_activation_checkpointing(model, "selective" | "full")

- full: every block keeps only its input for backward and recomputes the rest.
- selective: every other block (odd layer ids) is checkpointed; the others keep everything.
  About half the activation memory of none, and half the recompute of full.
The wrapper's name is stripped from state-dict keys, so checkpoints load across settings.
"""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def checkpointed_layers(mode: str, layer_ids: list[int]) -> list[int]:
    if mode == "full":
        return list(layer_ids)
    if mode == "selective":
        return [i for i in layer_ids if i % 2 == 1]
    return []


def apply_activation_checkpointing(model, mode: str) -> None:
    chosen = set(checkpointed_layers(mode, [int(k) for k in model.layers]))
    for key in list(model.layers):
        if int(key) in chosen:
            model.layers[key] = checkpoint_wrapper(model.layers[key], preserve_rng_state=False)
