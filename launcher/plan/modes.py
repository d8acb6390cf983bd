"""The run modes a recipe chooses, as the throughput model prices them.

`parallel.grad_accumulation`, `parallel.reduce_dtype` and `parallel.cp_attention` are Workload
fields; `mode()` names what the entrypoints really run for each:
- grad_accumulation: the mode as given; "auto" (the estimator's choice by memory, which
  launcher/resolve.py settles before a job is built) is priced as sync_each, the most traffic.
  `launcher plan` searches the concrete modes instead;
- reduce_dtype: fp32 or bf16;
- cp_attention: the layout's path (`Workload.cp_attention_path`: allgather or ulysses), and
  "zigzag_sdpa" where document masking sends the all-gather path to its masked kernel (the
  fused LSE pieces take no mask).

And the shares of a step's compute that activation checkpointing and evaluation run.
"""

from __future__ import annotations

from launcher.estimate import Workload

AC_RECOMPUTE = {"none": 0.0, "selective": 0.5, "full": 1.0}
"""Fraction of the blocks whose forward runs again in backward. selective = every other block."""
FORWARD_SHARE = 1 / 3
"""A forward pass's share of a training step's compute and communication (backward is twice it):
what evaluation runs, and what recomputation runs again."""

GRAD_ACCUMULATION_MODES = ("sync_each", "sync_last", "sync_last_gathered")
"""What FSDP does between micro-batches of one step, most traffic (and least memory) first:
sync_each all-gathers parameters twice and reduce-scatters gradients every micro-batch;
sync_last skips the reduce-scatter until the last micro-batch (unsharded gradients meanwhile);
sync_last_gathered also keeps the parameters gathered (one all-gather per step)."""
PIPELINED_ACCUMULATION_MODES = ("sync_each", "sync_last_gathered")
"""The same under pipeline parallelism, which never reshards blocks after forward: sync_each
gathers each block once and reduce-scatters its gradients every micro-batch; sync_last runs as
sync_last_gathered (Recipe.grad_accumulation)."""


def mode(workload: Workload, name: str) -> str:
    """The concrete `name` mode the throughput model prices for `workload` (see above)."""
    if name == "cp_attention":
        return priced_cp_attention(workload.cp_attention_path, document_masking=workload.document_masking)
    value = getattr(workload, name)
    return "sync_each" if name == "grad_accumulation" and value == "auto" else value


def priced_cp_attention(path: str, *, document_masking: bool) -> str:
    """The CP kernel priced for a layout's concrete path (`Workload.cp_attention_path`)."""
    return "zigzag_sdpa" if path == "allgather" and document_masking else path
