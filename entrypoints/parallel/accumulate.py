"""Gradient accumulation: forward and backward over one step's micro-batches, with FSDP's
gradient sync and resharding set per micro-batch by `parallel.grad_accumulation`.

    loss = accumulate(model, micro_batches, "sync_last")   # the mean loss; gradients are sharded after

train.py runs it for layouts without pipeline parallelism, and the memory tracer
(tests/estimate/memory_tracing.py) runs this same function, so the estimate is checked against
the loop that trains. The modes, per micro-batch but the last (traffic per micro-batch of an
N-parameter model on one rank, docs/estimator.md):
- sync_each: all-gather the parameters in forward and again in backward, reduce-scatter the
  gradients (FSDP's default);
- sync_last: all-gather in forward and backward, but no reduce-scatter: gradients accumulate
  unsharded in `reduce_dtype` (FSDP2's `unsharded_accumulated_grad`) and are reduce-scattered
  once, in the last micro-batch's backward;
- sync_last_gathered: also keep the parameters gathered after backward (and after forward:
  parallelize.py turns `reshard_after_forward` off), so they are all-gathered once per step;
  the last micro-batch's backward reshards them.
The pipeline path (pipeline.py) runs sync_last_gathered in torch's schedule, or sync_each with
FSDP's gradient sync left on for every micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

MODES = ("sync_each", "sync_last", "sync_last_gathered")


def accumulate(
    model,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    mode: str,
    *,
    phase: Callable[[str], None] = lambda name: None,
) -> torch.Tensor:
    """Forward and backward over `micro_batches` ((tokens, targets, documents), data.py's
    Batch: documents are the document ids with data.document_masking, else None); the mean loss.

    `model` is an FSDP-wrapped module (the root); `phase("forward"|"backward")` is called
    before each pass, so a tracer can label what it sees.
    """
    if mode not in MODES:
        raise ValueError(f"parallel.grad_accumulation: '{mode}' is not one of {', '.join(MODES)}")
    count = len(micro_batches)
    total = torch.zeros((), device=micro_batches[0][0].device)
    for index, (tokens, targets, documents) in enumerate(micro_batches):
        last = index == count - 1
        if mode != "sync_each":
            model.set_requires_gradient_sync(last)
        if mode == "sync_last_gathered":
            model.set_reshard_after_backward(last)
        phase("forward")
        loss = model(tokens, targets=targets, documents=documents)
        phase("backward")
        (loss / count).backward()
        total += loss.detach()
        del loss
    return total / count
