"""Check the memory estimator against torch.cuda on one GPU, for single-GPU configs.

    python scripts/estimator_gpu.py --prepare build/estimator-gpu   # here: configs + estimates
    python scripts/estimator_gpu.py --run build/estimator-gpu       # on the GPU: torch only

`--prepare` needs the launcher (it writes each config's resolved job and its estimate);
`--run` needs only torch, torchao and the entrypoints, as on a GPU machine. For each config it
trains two optimizer steps with the entrypoints' own code and train.py's accumulation loop
(world size 1: FSDP over one GPU, which keeps its fp32 masters and mixed precision), resets the
peak after the first, and compares `torch.cuda.max_memory_allocated` of the second with the
estimate's allocated bytes, and `max_memory_reserved` with allocated + fragmentation. It also
measures the CUDA context (device memory in use minus PyTorch's reserved pool) and which tensors
CUDA's fused RMSNorm saves, and lists the blocks alive at the second step's peak
(`alive_at_peak`). Results go to $OUT/estimator_gpu.json (else the prepare directory) and stdout;
scripts/estimator_table.py --gpu-results FILE puts them into docs/estimator.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GIB = 2**30
BASE = {
    "name": "gpu-memory",
    "training": {"seq_len": 8192, "global_batch_size": 2, "micro_batch_size": 1, "steps": 10},
    "precision": {"dtype": "bf16"},
    "cluster": {
        "backend": "local",
        "instance_type": "local",
        "nproc_per_node": 1,
        "device": "cuda",
        "accelerator": "h200-141gb",
    },
    "data": {"dtype": "uint32"},
}
# (name, changes): about 1B to 8B parameters, 4K to 32K tokens, each checkpointing mode,
# bf16 and both FP8 recipes; each fits one H200 with FSDP over one GPU (16 bytes/param).
CONFIGS = [
    # Two MoE blocks of Qwen3-30B-A3B (128 experts, top-8, its 152K vocabulary): experts on bf16
    # grouped GEMMs, and with precision.fp8_experts on torchao's FP8 grouped GEMMs over 16-row
    # padded groups.
    ("Qwen3-30B-A3B (2 layers) 8K none", {"model": {"base": "qwen3-30b-a3b", "num_layers": 2}}),
    (
        "Qwen3-30B-A3B (2 layers) 8K fp8 tensorwise, fp8 experts",
        {"model": {"base": "qwen3-30b-a3b", "num_layers": 2}, "precision": {"fp8": True, "fp8_experts": True}},
    ),
    ("1B 8K none", {"model": "llama3.2-1b"}),
    ("1B 8K selective", {"model": "llama3.2-1b", "parallel": {"activation_checkpointing": "selective"}}),
    (
        "1B 32K full",
        {"model": "llama3.2-1b", "training": {"seq_len": 32768}, "parallel": {"activation_checkpointing": "full"}},
    ),
    ("1B 8K fp8 tensorwise", {"model": "llama3.2-1b", "precision": {"fp8": True}}),
    (
        "3B 16K full fp8 rowwise",
        {
            "model": "llama3.2-3b",
            "training": {"seq_len": 16384},
            "precision": {"fp8": True, "fp8_recipe": "rowwise"},
            "parallel": {"activation_checkpointing": "full"},
        },
    ),
    (
        "8B (16 layers) 4K selective",
        {
            "model": {"base": "llama3.1-8b", "num_layers": 16},
            "training": {"seq_len": 4096},
            "parallel": {"activation_checkpointing": "selective"},
        },
    ),
]


def merged(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) and key != "model" else value
    return out


def prepare(directory: Path) -> None:
    from launcher import api
    from launcher.recipe import Recipe
    from launcher.resolve import resolve

    directory.mkdir(parents=True, exist_ok=True)
    prepared = []
    for name, changes in CONFIGS:
        recipe = Recipe.from_dict(merged(BASE, changes))
        estimate = api.estimate(recipe)
        # The concrete recipe's config: the accumulation mode the estimate describes is the one that runs.
        config = resolve(recipe).concrete.resolved().to_dict()
        prepared.append({"name": name, "resolved": config, "estimate": estimate.to_dict()})
    (directory / "configs.json").write_text(json.dumps(prepared, indent=1))
    print(f"estimator_gpu: {len(prepared)} configs written to {directory / 'configs.json'}")


def run(directory: Path, out: Path | None = None) -> dict:
    """Each config in its own process, so no config sees memory another left behind."""
    import subprocess

    import torch

    prepared = json.loads((directory / "configs.json").read_text())
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": [], "checks": {}}
    for index in range(len(prepared)):
        done = subprocess.run(
            [sys.executable, __file__, "--one", str(directory), str(index)], capture_output=True, text=True
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            result = {"name": prepared[index]["name"], "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            result = json.loads(lines[-1].removeprefix("RESULT "))
            report["checks"]["rms_norm_saves"] = result.pop("rms_norm_saves")
        report["runs"].append(result)
        print(summary_line(result), flush=True)
        if out is not None:  # after every config: a run stopped at its limit keeps what ran
            (out / "estimator_gpu.json").write_text(json.dumps(report, indent=1))
    return report


def run_one(directory: Path, index: int) -> dict:
    import torch

    from entrypoints.fp8 import after_optimizer_step, fp8_settings
    from entrypoints.model.init import materialize
    from entrypoints.optim import Optimizers, clip_grad_norm
    from entrypoints.parallel.accumulate import accumulate
    from entrypoints.parallel.mesh import build_mesh
    from entrypoints.parallel.parallelize import build_model_parts
    from entrypoints.parallel.process_group import process_group
    from launcher.contract.config import JobConfig

    item = json.loads((directory / "configs.json").read_text())[index]
    cfg = JobConfig.from_dict(item["resolved"])
    started = time.perf_counter()
    with process_group("cuda") as env:
        saves = rms_norm_saved(env.device)
        torch.cuda.empty_cache()
        fp8 = fp8_settings(cfg, device_type="cuda", backend=env.backend)
        mesh = build_mesh(cfg.parallel, "cuda")
        parts, _ = build_model_parts(cfg, mesh, fp8=fp8)
        model = parts[0]
        materialize(model, env.device, seed=0)
        optimizers = Optimizers(parts, cfg.training.optimizer, total_steps=cfg.training.steps)
        vocab, seq = cfg.model.vocab_size, cfg.training.seq_len
        micro, accum = cfg.training.micro_batch_size, cfg.parallel.grad_accum_steps
        for step in range(2):
            if step == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                baseline = torch.cuda.memory_allocated()
                recording = record_history(torch)
            # train.py's loop: parallel.grad_accumulation sets FSDP's gradient sync and
            # resharding per micro-batch, which the estimate prices.
            batches = []
            for _ in range(accum):
                tokens = torch.randint(0, vocab, (micro, seq), device=env.device)
                batches.append((tokens, torch.roll(tokens, -1, 1), None))
            accumulate(model, batches, cfg.parallel.grad_accumulation)
            del batches
            clip_grad_norm(parts, cfg.training.grad_clip, mesh["pp"])
            optimizers.step()
            after_optimizer_step(parts, fp8)
            optimizers.zero_grad()
        torch.cuda.synchronize()
        at_peak = peak_from_history(torch, recording, env.device.index or 0, baseline)
        free, total = torch.cuda.mem_get_info()
        estimate = item["estimate"]
        return {
            "name": item["name"],
            "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
            "context": (total - free) - torch.cuda.memory_reserved(),
            "seconds": round(time.perf_counter() - started, 1),
            "estimated_allocated": estimate["allocated_bytes"],
            "estimated_fragmentation": estimate["breakdown"]["fragmentation"],
            "estimated_peak": estimate["per_gpu_peak_bytes"],
            "estimated_phase": estimate["peak_phase"],
            "rms_norm_saves": saves,
            "at_peak": at_peak,
        }


def record_history(torch) -> str | None:
    """Start the allocator's event history for the measured step; why not, if it cannot (a private
    API: a failure must not cost the config's measurement)."""
    try:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=HISTORY_ENTRIES)
    except Exception as err:  # noqa: BLE001 (any failure of the private API is reported, not raised)
        return f"{type(err).__name__}: {err}"
    return None


def peak_from_history(torch, failed: str | None, device_index: int, baseline: int) -> dict:
    """alive_at_peak over the recorded history, then the recording stopped; or why there is none."""
    if failed is not None:
        return {"error": failed}
    try:
        history = torch.cuda.memory._snapshot()["device_traces"][device_index]
        torch.cuda.memory._record_memory_history(enabled=None)
        return alive_at_peak(history, baseline)
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}"}


HISTORY_ENTRIES = 2_000_000
"""Allocator events kept for the measured step (torch.cuda.memory._record_memory_history): a
2-layer MoE step makes tens of thousands. Past the limit the oldest go: `events` then equals it
and the replayed peak no longer matches max_allocated, which the summary line prints beside it."""

PEAK_BLOCKS_LISTED = 40


def alive_at_peak(entries: list[dict], baseline: int) -> dict:
    """What was allocated at the step's peak, from the allocator's event history (the snapshot's
    device_traces, torch/cuda/memory.py `TraceEntry`). In pytorch/pytorch
    c10/cuda/CUDACachingAllocator.cpp, `malloc` records `alloc` with the requested size and
    raises `allocated_bytes` by the block's, and `free` lowers it and records `free_requested`
    before any stream use delays the block's return (`free_completed`). Replaying alloc and
    free_requested from `baseline` (memory_allocated when recording began) finds the peak that
    torch.cuda.max_memory_allocated reports, less the rounding of the blocks allocated since
    (sizes up to 512 B, a large block's unsplit tail up to 1 MiB). The blocks alive there are
    grouped by requested size and by the innermost frame in this repository's code (frames run
    innermost first, as torch/cuda/_memory_viz.py reads them), largest groups first: the GPU's
    side of what tests/estimate's memory tracer lists on the CPU."""
    peak_at, total, peak = -1, baseline, baseline
    sizes: dict[int, int] = {}
    for index, entry in enumerate(entries):
        if entry["action"] == "alloc":
            sizes[entry["addr"]] = entry["size"]
            total += entry["size"]
            if total > peak:
                peak, peak_at = total, index
        elif entry["action"] == "free_requested":
            total -= sizes.pop(entry["addr"], entry["size"])
    alive: dict[int, dict] = {}
    for entry in entries[: peak_at + 1]:
        if entry["action"] == "alloc":
            alive[entry["addr"]] = entry
        elif entry["action"] == "free_requested":
            alive.pop(entry["addr"], None)
    groups: dict[tuple[int, str], int] = {}
    for entry in alive.values():
        key = (entry["size"], _where(entry.get("frames", [])))
        groups[key] = groups.get(key, 0) + 1
    listed = sorted(groups.items(), key=lambda item: -item[0][0] * item[1])[:PEAK_BLOCKS_LISTED]
    return {
        "replayed_peak": peak,
        "baseline": baseline,
        "events": len(entries),
        "blocks": [{"bytes": size, "count": count, "where": where} for (size, where), count in listed],
    }


def _where(frames: list[dict]) -> str:
    """The innermost frame in entrypoints/ or scripts/, then (if another) the innermost of all."""
    if not frames:
        return "(no Python frame)"
    ours = next((f for f in frames if "/entrypoints/" in f["filename"] or "/scripts/" in f["filename"]), None)
    if ours is None:
        return _frame_text(frames[0])
    return _frame_text(ours) + ("" if ours is frames[0] else f" <- {_frame_text(frames[0])}")


def _frame_text(frame: dict) -> str:
    name = frame["filename"]
    for root in ("/entrypoints/", "/scripts/", "/torchao/", "/torch/"):
        if root in name:
            name = root.strip("/") + "/" + name.split(root, 1)[1]
            break
    return f"{name}:{frame['line']} {frame['name']}"


def rms_norm_saved(device) -> list[str]:
    """The dtypes and shapes autograd saves for nn.RMSNorm on this device (CUDA fuses it)."""
    import torch

    saved = []

    def pack(tensor):
        saved.append(f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}")
        return tensor

    norm = torch.nn.RMSNorm(256, device=device, dtype=torch.bfloat16)
    x = torch.randn(4, 64, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    return saved


def summary_line(result: dict) -> str:
    if "error" in result:
        return f"{result['name']:32s} {result['error']}"
    allocated, estimated = result["max_allocated"], result["estimated_allocated"]
    replayed = result["at_peak"].get("replayed_peak")
    return (
        f"{result['name']:32s} allocated {allocated / GIB:7.2f} GiB, estimated {estimated / GIB:7.2f} "
        f"({estimated / allocated - 1:+.1%}); reserved {result['max_reserved'] / GIB:7.2f}, "
        f"context {result['context'] / GIB:5.2f} GiB; {result['seconds']:.0f}s; "
        + (f"replayed peak {replayed / GIB:.2f} GiB" if replayed else f"no replay: {result['at_peak'].get('error')}")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--prepare", metavar="DIR", type=Path)
    group.add_argument("--run", metavar="DIR", type=Path)
    group.add_argument("--one", nargs=2, metavar=("DIR", "INDEX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return 0
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as launcher/spec.py sets
    if args.one:
        print("RESULT " + json.dumps(run_one(Path(args.one[0]), int(args.one[1]))), flush=True)
        return 0
    out = Path(os.environ.get("OUT") or args.run)
    report = run(args.run, out)
    (out / "estimator_gpu.json").write_text(json.dumps(report, indent=1))
    print(f"checks: {json.dumps(report['checks'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
