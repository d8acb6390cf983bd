"""What one planner search is asked: the GPU budget, how many layouts, what it varies, the memory
margin and the throughput model's constants. `launcher plan`'s flags, `api.plan`'s keywords and
`launcher.plan.search` all hold one `SearchOptions`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from launcher.estimate import DEFAULT_THRESHOLD
from launcher.plan.throughput import CONSTANTS, Constants


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    gpus: int | None = None
    """GPUs to plan for (a multiple of the node size); with `instances` unset, default: the recipe's own."""
    instances: int | None = None
    """Instances (nodes) to plan for, instead of `gpus`."""
    instance_type: str | None = None
    """Plan on this catalog instance type instead of the recipe's."""
    top: int = 10
    """How many of the fastest layouts that fit to return (1 or more)."""
    vary_fp8: bool = False
    """Also try the other precision.fp8 setting."""
    threshold: float = DEFAULT_THRESHOLD
    """The fraction of GPU memory a layout may use and still fit."""
    constants: Constants = CONSTANTS
    """The throughput model's constants, to ask what-if questions (what if context-parallel attention
    ran as fast as plain attention?)."""
    vary_accumulation: bool = True
    """Also search the `parallel.grad_accumulation` modes."""
    fixed: tuple[tuple[str, int], ...] = ()
    """Degrees the search holds, as (`Layout` field, value) pairs: (("context", 1),) searches the
    layouts without context parallelism."""

    def __repr__(self) -> str:
        """Only what differs from the defaults: `SearchOptions(gpus=64, top=5)`."""
        changed = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name != "constants" and getattr(self, f.name) != f.default
        ]
        if self.constants != CONSTANTS:
            changed.append("constants=<changed>")
        return f"SearchOptions({', '.join(changed)})"
