"""How long one memory estimate takes: the planner calls `estimate_memory` thousands of times.

    .venv/bin/python scripts/bench_estimate.py           # print the table
    .venv/bin/python scripts/bench_estimate.py --write   # also put it into docs/estimator.md

Times `estimate_memory` (no suggestion search) on layouts from one stage to 16 interleaved
pipeline stages, and `launcher.api.estimate` for a recipe that fits (no search) and one that
does not (the suggestion is the planner's search). Best of 5 repeats.
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launcher import api  # noqa: E402
from launcher.catalog import models  # noqa: E402
from launcher.contract.layout import Layout  # noqa: E402
from launcher.estimate import Workload, estimate_memory  # noqa: E402
from launcher.recipe import Recipe  # noqa: E402
from launcher.recipe.hardware import hardware_for  # noqa: E402

H100, H200 = hardware_for("ml.p5.48xlarge"), hardware_for("ml.p5en.48xlarge")
CASES = [
    ("8B, 8K, FSDP 8", "llama3.1-8b", Layout(data_shard=8), 8192, "selective", "1f1b", 1, H100),
    ("70B, 128K, TP 2 x CP 16, FP8", "llama3.1-70b", Layout(tensor=2, context=16), 131072, "full", "1f1b", 1, H200),
    ("405B, 128K, PP 8 x TP 8 x CP 4, 1F1B", "llama3.1-405b", Layout(pipeline=8, tensor=8, context=4, data_shard=4),
     131072, "full", "1f1b", 16, H200),
    ("405B, 128K, PP 16 x v2 x TP 8 x CP 4, interleaved", "llama3.1-405b",
     Layout(pipeline=16, virtual_stages=2, tensor=8, context=4, data_shard=2), 131072, "full", "interleaved_1f1b", 32, H200),
]  # fmt: skip


def best_of(function, number: int) -> float:
    return min(timeit.repeat(function, number=number, repeat=5)) / number


def run() -> list[tuple[str, float]]:
    results = []
    for name, model, layout, seq_len, ac, schedule, accum, gpu in CASES:
        workload = Workload(
            arch=models()[model],
            layout=layout,
            seq_len=seq_len,
            micro_batch_size=1,
            grad_accum_steps=accum,
            fp8="FP8" in name,
            activation_checkpointing=ac,
            pipeline_schedule=schedule,
        )
        call = functools.partial(estimate_memory, workload, gpu)
        results.append((f"estimate_memory: {name}", best_of(call, 500)))
    fits = Recipe.load(REPO / "recipes" / "llama3-8b-8k.yaml")
    results.append(("api.estimate: llama3-8b-8k (fits, no search)", best_of(lambda: api.estimate(fits), 200)))
    oom = fits.with_changes({"parallel.activation_checkpointing": "none", "training.seq_len": 32768})
    results.append(
        ("api.estimate: the same at 32K, no AC (oom, suggestion search)", best_of(lambda: api.estimate(oom), 20))
    )
    return results


def table(results: list[tuple[str, float]]) -> str:
    rows = [
        f"Measured with scripts/bench_estimate.py on this project's CI-like machine ({platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}; shared with other work), best of 5 repeats.",
        "",
        "| call | time per call |",
        "|---|---:|",
    ]
    rows += [f"| {name} | {seconds * 1e6:,.0f} µs |" for name, seconds in results]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update the benchmark section of docs/estimator.md")
    args = parser.parse_args()
    results = run()
    for name, seconds in results:
        print(f"{seconds * 1e6:10,.0f} us  {name}")
    if args.write:
        from estimator_table import DOC, replace_section

        DOC.write_text(replace_section(DOC.read_text(), "benchmark", table(results)))
        print(f"wrote {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
