"""The run modes issue #11 adds to recipes, read by the planner before the Workload carries them.

`parallel.grad_accumulation`, `parallel.reduce_dtype` and `parallel.cp_attention` are being added
to the recipe schema and to `launcher.estimate.Workload` in other changes. The throughput model
and the candidate search read them through `mode()`, which falls back to what the entrypoints run
without them, and set them through `with_modes()`, which carries a value on a small Workload
subclass for any field the Workload does not have yet. Once the fields land, `with_modes` is a
plain `dataclasses.replace` and the subclass is never built.
"""

from __future__ import annotations

from dataclasses import field, fields, make_dataclass, replace
from functools import cache

from launcher.estimate import Workload

GRAD_ACCUMULATION_MODES = ("sync_each", "sync_last", "sync_last_gathered")
"""What FSDP does between micro-batches of one step, most traffic (and least memory) first:
sync_each all-gathers parameters twice and reduce-scatters gradients every micro-batch;
sync_last skips the reduce-scatter until the last micro-batch (unsharded gradients meanwhile);
sync_last_gathered also keeps the parameters gathered (one all-gather per step)."""

MODE_DEFAULTS = {
    "grad_accumulation": "sync_each",
    "reduce_dtype": "fp32",
    # Without parallel.cp_attention the entrypoints run their two-SDPA zigzag kernel.
    "cp_attention": "zigzag_sdpa",
}


def mode(workload: Workload, name: str) -> str:
    """The workload's `name` mode; "auto" accumulation counts as sync_each (needs no extra memory)."""
    value = getattr(workload, name, None) or MODE_DEFAULTS[name]
    return MODE_DEFAULTS[name] if value == "auto" else value


def with_modes(workload: Workload, **modes: str) -> Workload:
    """`workload` with the given modes, on a subclass that carries those Workload lacks."""
    missing = tuple(sorted(set(modes) - {f.name for f in fields(workload)}))
    if missing:
        current = {f.name: getattr(workload, f.name) for f in fields(workload)}
        workload = _carrier(type(workload), missing)(**current)
    return replace(workload, **modes)


@cache
def _carrier(base: type, names: tuple[str, ...]) -> type:
    extra = [(name, str, field(default=MODE_DEFAULTS[name])) for name in names]
    return make_dataclass(f"{base.__name__}WithModes", extra, bases=(base,), frozen=True, slots=True, kw_only=True)


def estimator_counts_accumulation() -> bool:
    """Whether the memory estimator knows the accumulation modes: the change that adds
    `grad_accumulation` to the Workload adds the estimator's unsharded-gradient term with it."""
    return "grad_accumulation" in {f.name for f in fields(Workload)}


def accumulation_extra_bytes(workload: Workload) -> int:
    """Per-GPU memory sync_last (unsharded gradients) and sync_last_gathered (also unsharded bf16
    parameters) hold beyond sync_each, on the heaviest pipeline rank: its blocks and the output
    layer, this TP rank's shard. Only for estimators without the term (see above)."""
    accumulation = mode(workload, "grad_accumulation")
    if accumulation == "sync_each" or workload.layout.pipeline > 1 or estimator_counts_accumulation():
        return 0  # pipelining already keeps blocks gathered, and the estimator counts it there
    arch, layout = workload.arch, workload.layout
    params = (arch.num_layers * arch.block_params() + arch.embedding_params()) / layout.tensor
    grad_bytes = {"fp32": 4, "bf16": 2}[mode(workload, "reduce_dtype")]
    param_bytes = 2 if accumulation == "sync_last_gathered" else 0
    return int(params * (grad_bytes + param_bytes))
