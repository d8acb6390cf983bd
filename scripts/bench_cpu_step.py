"""Measure CPU step times, fit launcher/catalog/host_cpu.yaml to them, and check the fit on held-out layouts.

    .venv/bin/python scripts/bench_cpu_step.py --measure   # run every layout (about 20 minutes on 2 cores)
    .venv/bin/python scripts/bench_cpu_step.py             # fit, rewrite the catalog and docs/monitoring.md's table
    .venv/bin/python scripts/bench_cpu_step.py --check     # both already match the stored measurements

Each layout is recipes/tiny-cpu.yaml with a few `--set` changes, run as a user runs it
(`launcher submit ... --wait`, the local backend, 12 steps, no checkpoint); its step time is the
median `step_time_s` of steps 4 to 12 (the first steps warm up). The measurements go to
docs/cpu_step_measured.json with the host they ran on. The rates are fitted (non-negative least
squares on relative error) to the layouts marked "fit" only; the "held-out" ones try layouts the
fit never saw (TP 4, CP 4, PP 4, PP with TP, CP at 1024 tokens, EP within a larger FSDP group, EP
with CP, EP spanning TP and FSDP, an MoE under TP without EP), so their errors say how far the
shipped rates can be trusted. MoE layouts train qwen3-moe-tiny (8 experts, top-2).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from estimator_table import replace_section  # noqa: E402

from launcher import api, catalog  # noqa: E402
from launcher.catalog import HOST_CPU_WORK  # noqa: E402
from launcher.estimate.workload import Workload  # noqa: E402
from launcher.plan.host_cpu import core_share, cpu_step_seconds, cpu_work  # noqa: E402

MEASURED = REPO / "docs" / "cpu_step_measured.json"
RATES = REPO / "launcher" / "catalog" / "host_cpu.yaml"
DOC = REPO / "docs" / "monitoring.md"
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
RUN = ("training.steps=12", "checkpoint.every_steps=0")
FIRST_TIMED_STEP = 4

H512 = "model={base: llama-tiny, hidden_size: 512, ffn_hidden_size: 1408}"
MOE = "model=qwen3-moe-tiny"
ONE, TWO = ("cluster.nproc_per_node=1", "parallel.tensor=1"), ("cluster.nproc_per_node=2",)
FIT = {
    "1 rank": ONE,
    "1 rank, micro-batch 8": (*ONE, "training.micro_batch_size=8"),
    "1 rank, micro-batch 1": (*ONE, "training.micro_batch_size=1"),
    "1 rank, 2 layers": (*ONE, "model={base: llama-tiny, num_layers: 2}"),
    "1 rank, 8 layers": (*ONE, "model={base: llama-tiny, num_layers: 8}"),
    "1 rank, hidden 256": (*ONE, "model={base: llama-tiny, hidden_size: 256, ffn_hidden_size: 704}"),
    "1 rank, hidden 512": (*ONE, H512),
    "1 rank, sequence 512": (*ONE, "training.seq_len=512"),
    "1 rank, sequence 1024": (*ONE, "training.seq_len=1024"),
    "1 rank, batch 16": (*ONE, "training.global_batch_size=16"),
    "fsdp 2": (*TWO, "parallel.tensor=1"),
    "fsdp 2, 8 layers": (*TWO, "parallel.tensor=1", "model={base: llama-tiny, num_layers: 8}"),
    "fsdp 2, hidden 512": (*TWO, "parallel.tensor=1", H512),
    "fsdp 2, sequence 1024": (*TWO, "parallel.tensor=1", "training.seq_len=1024"),
    "fsdp 2, batch 16": (*TWO, "parallel.tensor=1", "training.global_batch_size=16"),
    "tp 2": (*TWO, "parallel.tensor=2"),
    "tp 2, micro-batch 8": (*TWO, "parallel.tensor=2", "training.micro_batch_size=8"),
    "tp 2, hidden 512": (*TWO, "parallel.tensor=2", H512),
    "cp 2": (*TWO, "parallel.tensor=1", "parallel.context=2"),
    "pp 2": (*TWO, "parallel.tensor=1", "parallel.pipeline=2"),
    "tp 2 x fsdp 2 (the recipe)": (),
    "tp 2 x fsdp 2, micro-batch 1": ("training.micro_batch_size=1",),
    "tp 2 x fsdp 2, micro-batch 4": ("training.micro_batch_size=4",),
    "tp 2 x fsdp 2, 8 layers": ("model={base: llama-tiny, num_layers: 8}",),
    "tp 2 x fsdp 2, hidden 512": (H512,),
    "tp 2 x fsdp 2, sequence 1024": ("training.seq_len=1024",),
    "tp 2 x fsdp 2, batch 16": ("training.global_batch_size=16",),
    "tp 2 x cp 2": ("parallel.context=2",),
    "fsdp 4": ("parallel.tensor=1",),
    "fsdp 4, micro-batch 1": ("parallel.tensor=1", "training.micro_batch_size=1"),
    "fsdp 4, 8 layers": ("parallel.tensor=1", "model={base: llama-tiny, num_layers: 8}"),
    "fsdp 4, hidden 512": ("parallel.tensor=1", H512),
    "fsdp 4, sequence 1024": ("parallel.tensor=1", "training.seq_len=1024"),
    "tp 4": ("parallel.tensor=4",),
    "cp 2 x fsdp 2": ("parallel.tensor=1", "parallel.context=2"),
    "pp 2 x fsdp 2": ("parallel.tensor=1", "parallel.pipeline=2"),
    "replicate 2": (*TWO, "parallel.tensor=1", "parallel.data_replicate=2"),
    "replicate 2 x fsdp 2": ("parallel.tensor=1", "parallel.data_replicate=2"),
    "replicate 2 x tp 2": ("parallel.data_replicate=2",),
    "moe: 1 rank": (*ONE, MOE),
    "moe: 1 rank, micro-batch 8": (*ONE, MOE, "training.micro_batch_size=8"),
    "moe: 1 rank, sequence 1024": (*ONE, MOE, "training.seq_len=1024"),
    "moe: fsdp 2": (*TWO, "parallel.tensor=1", MOE),
    "moe: fsdp 2 x ep 2": (*TWO, "parallel.tensor=1", MOE, "parallel.expert=2"),
    "moe: fsdp 4": ("parallel.tensor=1", MOE),
    "moe: fsdp 4 x ep 4": ("parallel.tensor=1", MOE, "parallel.expert=4"),
    "moe: tp 2 x fsdp 2 x ep 2": (MOE, "parallel.expert=2"),
}
HELD_OUT = {
    "tp 4, micro-batch 8": ("parallel.tensor=4", "training.micro_batch_size=8"),
    "tp 4, hidden 512": ("parallel.tensor=4", H512),
    "cp 4": ("parallel.tensor=1", "parallel.context=4"),
    "cp 2 x fsdp 2, micro-batch 1": ("parallel.tensor=1", "parallel.context=2", "training.micro_batch_size=1"),
    "cp 2 x fsdp 2, sequence 1024": ("parallel.tensor=1", "parallel.context=2", "training.seq_len=1024"),
    "pp 2 x fsdp 2, micro-batch 1": ("parallel.tensor=1", "parallel.pipeline=2", "training.micro_batch_size=1"),
    "pp 4": ("parallel.tensor=1", "parallel.pipeline=4", "training.micro_batch_size=1"),
    "pp 2 x tp 2": ("parallel.pipeline=2", "training.micro_batch_size=1"),
    "tp 2, sequence 1024": (*TWO, "parallel.tensor=2", "training.seq_len=1024"),
    "replicate 4": ("parallel.tensor=1", "parallel.data_replicate=4"),
    "moe: replicate 2 x fsdp 2 x ep 2": ("parallel.tensor=1", MOE, "parallel.data_replicate=2", "parallel.expert=2"),
    "moe: fsdp 4 x ep 2": ("parallel.tensor=1", MOE, "parallel.expert=2"),
    "moe: fsdp 4 x ep 4, micro-batch 1": ("parallel.tensor=1", MOE, "parallel.expert=4", "training.micro_batch_size=1"),
    "moe: cp 2 x fsdp 2 x ep 4": ("parallel.tensor=1", MOE, "parallel.context=2", "parallel.expert=4"),
    "moe: tp 2 x fsdp 2 x ep 4": (MOE, "parallel.expert=4"),
    "moe: tp 2 x fsdp 2": (MOE,),
}


def measure_one(changes: tuple[str, ...]) -> list[float]:
    command = [sys.executable, "-m", "launcher", "submit", str(RECIPE), "--wait", "--yes"]
    for change in (*RUN, *changes):
        command += ["--set", change]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False)
    times = {
        int(match.group(1)): float(match.group(2))
        for match in re.finditer(r"metrics step=(\d+) .*?step_time_s=([\d.]+)", done.stdout + done.stderr)
    }
    timed = [times[step] for step in sorted(times) if step >= FIRST_TIMED_STEP]
    if done.returncode or not timed:
        raise SystemExit(f"{' '.join(changes) or 'the recipe'}: the job failed:\n{(done.stdout + done.stderr)[-2000:]}")
    return timed


def measure(*, new_only: bool) -> None:
    import torch

    stored = json.loads(MEASURED.read_text()) if new_only else {"layouts": {}}
    if new_only and stored["host"]["cpu"] != _cpu_model():
        # One fit, one host: the same 2-core size has run tiny-cpu's step 1.4x slower on another CPU.
        raise SystemExit(
            f"error: --new: {MEASURED.name} was measured on {stored['host']['cpu']!r} and this host is "
            f"{_cpu_model()!r}; measure every layout here (--measure without --new)"
        )
    layouts = {}
    for role, group in (("fit", FIT), ("held-out", HELD_OUT)):
        for name, changes in group.items():
            if name in stored["layouts"]:
                layouts[name] = stored["layouts"][name]
                continue
            times = measure_one(changes)
            layouts[name] = {"role": role, "set": list(changes), "step_time_s": times, "date": _today()}
            print(f"{name:36s} {statistics.median(times):.3f} s", flush=True)
    host = stored.get("host") or {
        "cpu": _cpu_model(),
        "cores": catalog.host_cores(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": _today(),  # the first measurement's; each layout carries its own
    }
    MEASURED.write_text(json.dumps({"host": host, "layouts": layouts}, indent=1) + "\n")


def _today() -> str:
    return datetime.date.today().isoformat()


def measured_dates(measured: dict) -> str:
    """When the stored layouts were measured: one date, or the first and the last (a layout
    measured again, or added, with `--measure --new`, carries its own date)."""
    dates = sorted({layout.get("date", measured["host"]["date"]) for layout in measured["layouts"].values()})
    return dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"


def _cpu_model() -> str:
    """The CPU's model name with its family, model and stepping: under a hypervisor a name can
    hide the generation (two CI hosts of 2026-12-07 were both "AMD EPYC", and ran the suite in
    16 to 18 and in 11 minutes)."""
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line.strip():
            break  # the first processor's block
    name = fields.get("model name") or platform.processor() or "unknown"
    ids = [f"{key} {fields[key]}" for key in ("cpu family", "model", "stepping") if fields.get(key)]
    return f"{name} ({', '.join(ids)})" if ids else name


def workload_of(changes: list[str]) -> Workload:
    return Workload.from_recipe(api.load(RECIPE, set_options=[*changes, *RUN]))


def fit(measured: dict) -> dict[str, float]:
    """Seconds per unit of each kind of work: non-negative least squares on relative error."""
    cores = measured["host"]["cores"]
    rows, targets = [], []
    for layout in measured["layouts"].values():
        if layout["role"] != "fit":
            continue
        workload = workload_of(layout["set"])
        share = core_share(workload, cores)
        work = cpu_work(workload)
        rows.append([share * work.get(kind, 0.0) for kind in HOST_CPU_WORK])
        targets.append(statistics.median(layout["step_time_s"]))
    y = np.array(targets)
    rates = nonnegative_least_squares(np.array(rows) / y[:, None], np.ones_like(y))
    return {kind: float(f"{rate:.4g}") for kind, rate in zip(HOST_CPU_WORK, rates, strict=True)}


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| with x >= 0: Lawson and Hanson's active-set method (Solving Least Squares
    Problems, 1974, chapter 23), which scipy.optimize.nnls also implements."""
    x = np.zeros(a.shape[1])
    free = np.zeros(a.shape[1], dtype=bool)
    for _ in range(3 * a.shape[1]):
        gradient = a.T @ (b - a @ x)
        if free.all() or gradient[~free].max(initial=0.0) <= 1e-12:
            break
        free[np.where(~free, gradient, -np.inf).argmax()] = True
        while True:
            z = np.zeros_like(x)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            shrinking = free & (z <= 0)
            alpha = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
            x = x + alpha * (z - x)
            free &= x > 1e-15
    return x


def rates_yaml(rates: dict[str, float], measured: dict) -> str:
    host = measured["host"]
    fitted = sum(layout["role"] == "fit" for layout in measured["layouts"].values())
    document = {
        "seconds_per_unit": rates,
        "measured_on": f"{host['cpu']}, {host['cores']} cores, torch {host['torch']}, {measured_dates(measured)}",
        "source": (
            f"scripts/bench_cpu_step.py: median step times of {fitted} layouts of recipes/tiny-cpu.yaml "
            "(docs/cpu_step_measured.json), fitted by non-negative least squares on relative error; "
            "held-out layouts and their errors in docs/monitoring.md"
        ),
    }
    head = (
        "# Seconds per unit of each kind of work in a CPU (gloo) training step, one thread per rank:\n"
        "# launcher/plan/host_cpu.py prices a CPU job's step with them. Written by\n"
        "# scripts/bench_cpu_step.py; rerun it (--measure, then without) on another host to refit.\n"
    )
    return head + yaml.safe_dump(document, sort_keys=False, width=100)


def table(measured: dict, rates: dict[str, float]) -> tuple[str, dict[str, list[float]]]:
    from launcher.catalog import HostCpuRates

    shipped = HostCpuRates(seconds_per_unit=rates, measured_on="", source="")
    cores = measured["host"]["cores"]
    lines = ["| layout | role | measured s | predicted s | error |", "|---|---|---:|---:|---:|"]
    errors: dict[str, list[float]] = {"fit": [], "held-out": []}
    for name, layout in measured["layouts"].items():
        step = statistics.median(layout["step_time_s"])
        predicted = sum(cpu_step_seconds(workload_of(layout["set"]), shipped, cores=cores).values())
        errors[layout["role"]].append(predicted / step - 1)
        lines.append(f"| {name} | {layout['role']} | {step:.3f} | {predicted:.3f} | {predicted / step - 1:+.0%} |")
    summary = [
        f"{role}: {len(errs)} layouts, median |error| {statistics.median(abs(e) for e in errs):.0%}, "
        f"largest {max(abs(e) for e in errs):.0%}"
        for role, errs in errors.items()
    ]
    return "\n".join([*lines, "", "; ".join(summary) + "."]), errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="run every layout first (about 15 minutes)")
    parser.add_argument("--new", action="store_true", help="with --measure: only layouts not yet measured (same host)")
    parser.add_argument("--check", action="store_true", help="fail if the catalog or the doc is not the fit")
    args = parser.parse_args()
    if args.measure:
        measure(new_only=args.new)
    measured = json.loads(MEASURED.read_text())
    rates = fit(measured)
    body, errors = table(measured, rates)
    print(body)
    expected = {RATES: rates_yaml(rates, measured), DOC: replace_section(DOC.read_text(), "cpu-step", body, doc=DOC)}
    for path, text in expected.items():
        if args.check and path.read_text() != text:
            raise SystemExit(f"{path.relative_to(REPO)} is not what the stored measurements give; rerun {__file__}")
        if not args.check:
            path.write_text(text)


if __name__ == "__main__":
    main()
