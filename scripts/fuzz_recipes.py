"""The long fuzz run of the recipe loader: `python scripts/fuzz_recipes.py --examples 10000`.

Runs the strategies of tests/recipe/test_fuzz.py (generated recipes with `--set` overrides, and
hostile YAML) through load -> estimate -> plan with fresh random inputs, and prints the figures
docs/reliability.md records: examples, wall time, the slowest input, peak memory, and failures.
A failure is any exception that is not a LauncherError, or an input over the 2 s deadline; the
first one found is printed with its input and the run exits 1.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.recipe.test_fuzz import (  # noqa: E402  (the repository root is on the path only now)
    TIMES,
    drive_api,
    gpu_budgets,
    hostile_texts,
    recipe_texts,
    set_options,
    within_deadline,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10_000, help="inputs to try (default 10000)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="fuzz-recipes-"))
    inputs = st.one_of(
        st.tuples(recipe_texts(), set_options(), gpu_budgets),
        st.tuples(hostile_texts(), st.just([]), st.none()),
    )

    @settings(max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=inputs)
    def fuzz(case):
        text, options, gpus = case
        path = workdir / "input.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        within_deadline(drive_api, path, options, gpus)

    if args.seed is not None:
        fuzz = __import__("hypothesis").seed(args.seed)(fuzz)
    drive_api(Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml", [], None)  # imports
    TIMES.clear()
    start = time.perf_counter()
    failed = False
    try:
        fuzz()
    except Exception as error:  # hypothesis raises the shrunk failure after printing its input
        failed = True
        print(f"FAILED: {type(error).__name__}: {error}", file=sys.stderr)
    elapsed = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(
        f"{len(TIMES)} inputs in {elapsed:.0f} s ({time.process_time():.0f} s CPU); slowest {max(TIMES, default=0):.2f} s; "
        f"peak memory {peak_mib} MiB; non-LauncherError failures: {int(failed)}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
