"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

    apply_activation_checkpointing(model, checkpointed_layers(mode, num_layers, layout))

- full: every block keeps only its input for backward and recomputes the rest.
- selective: every other block of each pipeline rank is checkpointed; the others keep
  everything. About half the activation memory of none, and half the recompute of full.
Which layers is `launcher.contract.layout.checkpointed_layers`, which the memory estimator and
the planner read too. The wrapper's name is stripped from state-dict keys, so checkpoints load
across settings.
"""

from __future__ import annotations

from collections.abc import Set

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(model, chosen: Set[int]) -> None:
    """Wrap the blocks of `model` (a whole model or one pipeline stage) whose layer id is chosen.
    They keep their SwiGLU product (`keep_product`)."""
    for key in list(model.layers):
        if int(key) in chosen:
            keep_product(model.layers[key])
            model.layers[key] = checkpoint_wrapper(model.layers[key], preserve_rng_state=False)


def keep_product(block) -> None:
    """Let a dense block's w2 keep the SwiGLU product instead of making it again in backward
    (model/swiglu.py `product_recomputed`): under a checkpoint, whose own saved-tensor hooks must
    stay the innermost and whose recomputation makes the product anyway, or inside a compiled
    graph."""
    if hasattr(block.feed_forward, "recompute_product"):
        block.feed_forward.recompute_product = False
