"""Generate the tables of docs/estimator.md: traced vs estimated, the shipped recipes, the GPU.

    .venv/bin/python scripts/estimator_table.py            # trace every config (2-3 minutes), rewrite the doc
    .venv/bin/python scripts/estimator_table.py --no-trace # only the recipe and GPU tables

Each table sits between `<!-- generated: NAME -->` and `<!-- end generated -->` in the doc;
everything else there is written by hand. The traced configs are tests/estimate/
traced_configs.py, traced with the entrypoints' own code by tests/estimate/memory_tracing.py
(the test suite asserts the same 2% bound). The GPU table compares the current estimate with
docs/estimator_gpu_h200.json, which scripts/estimator_gpu.py measured on an H200.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "estimate"), str(REPO / "scripts")]

DOC = REPO / "docs" / "estimator.md"
GPU_RESULTS = REPO / "docs" / "estimator_gpu_h200.json"
GIB = 2**30


def gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def traced_table() -> str:
    from memory_tracing import trace_in_subprocess
    from traced_configs import CONFIGS

    from launcher import api
    from launcher.resolve import resolve

    rows = [
        "| config | layout | traced GiB | estimated GiB | difference MiB | error | traced peak at | estimated peak at |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    worst = 0.0
    for config in CONFIGS:
        recipe = config.recipe()
        traced = trace_in_subprocess(resolve(recipe).concrete.resolved().to_dict(), stage=config.stage)
        stage = api.estimate(recipe).stages[config.stage]
        error = stage.allocated_bytes / traced.peak_bytes - 1
        worst = max(worst, abs(error))
        where = traced.phase.replace(".default", "")
        name = config.name.replace("|", "\\|")  # a table cell
        print(
            f"{config.name:50s} traced {gib(traced.peak_bytes):>7} estimated {gib(stage.allocated_bytes):>7} {error:+.1%}"
        )
        rows.append(
            f"| {name} | {recipe.layout} | {gib(traced.peak_bytes)} | {gib(stage.allocated_bytes)} "
            f"| {(stage.allocated_bytes - traced.peak_bytes) / 2**20:+,.1f} | {error:+.2%} | {where} | {stage.phase} |"
        )
    rows.append("")
    rows.append(f"Largest error: {worst:.1%} over {len(CONFIGS)} configs (the test bound is 2%).")
    return "\n".join(rows)


def recipes_table() -> str:
    from launcher import api
    from launcher.recipe import Recipe

    rows = [
        "| recipe | layout | fsdp peak GiB | of GPU | verdict | largest component | peaks at | megatron mode GiB |",
        "|---|---|---:|---:|---|---|---|---:|",
    ]
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        recipe = Recipe.load(path)
        estimate = api.estimate(recipe)
        # Fujii et al.'s accounting covers dense decoders only.
        megatron = "-" if recipe.arch.moe else gib(api.estimate(recipe, mode="megatron").per_gpu_peak_bytes)
        rows.append(
            f"| {path.name} | {recipe.layout} | {gib(estimate.per_gpu_peak_bytes)} | {estimate.utilization:.0%} "
            f"| {estimate.verdict} | {estimate.largest_component} | {estimate.peak_phase} | {megatron} |"
        )
    return "\n".join(rows)


def gpu_table() -> str:
    from estimator_gpu import BASE, CONFIGS, merged

    from launcher import api
    from launcher.recipe import Recipe

    measured = json.loads(GPU_RESULTS.read_text())
    changes = dict(CONFIGS)
    rows = [
        f"Measured on one {measured['device']}, torch {measured['torch']}, expandable segments on.",
        "",
        "| config | max allocated GiB | estimated allocated GiB | error | max reserved GiB | reserved / allocated |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run in measured["runs"]:
        if "error" in run:
            rows.append(f"| {run['name']} | {run['error']} | | | | |")
            continue
        # These runs predate parallel.grad_accumulation: every one ran sync_each.
        measured_mode = {"parallel": {"grad_accumulation": "sync_each"}}
        estimate = api.estimate(Recipe.from_dict(merged(merged(BASE, changes[run["name"]]), measured_mode)))
        allocated = run["max_allocated"]
        rows.append(
            f"| {run['name']} | {gib(allocated)} | {gib(estimate.allocated_bytes)} "
            f"| {estimate.allocated_bytes / allocated - 1:+.1%} | {gib(run['max_reserved'])} "
            f"| {run['max_reserved'] / allocated:.3f} |"
        )
    context = {run["context"] for run in measured["runs"] if "context" in run}
    rows.append("")
    rows.append(
        f"Device memory in use outside PyTorch's pool (CUDA context and libraries): "
        f"{', '.join(f'{c / 2**20:.0f} MiB' for c in sorted(context))}. "
        f"What CUDA's fused RMSNorm saves for backward: {', '.join(measured['checks']['rms_norm_saves'])} "
        "(input, weight, fp32 rstd)."
    )
    return "\n".join(rows)


def replace_section(text: str, name: str, body: str, *, doc: Path = DOC) -> str:
    """`text` (of `doc`) with the body of its `<!-- generated: NAME -->` section replaced."""
    pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end generated -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{doc}: no '<!-- generated: {name} -->' section")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-trace", action="store_true", help="keep the traced table as it is")
    args = parser.parse_args()
    traced = None if args.no_trace else traced_table()  # minutes: the doc is read after it
    text = DOC.read_text()
    if traced is not None:
        text = replace_section(text, "traced", traced)
    text = replace_section(text, "recipes", recipes_table())
    text = replace_section(text, "gpu", gpu_table())
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
