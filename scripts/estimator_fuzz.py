"""Trace random layouts and set the estimate beside each: where the traced grid cannot look.

    .venv/bin/python scripts/estimator_fuzz.py --seed 1 --layouts 40
    .venv/bin/python scripts/estimator_fuzz.py --seed 1 --layouts 20 --family moe

The traced grid (tests/estimate/traced_configs.py) holds the layouts chosen by hand; this draws
them at random from what a recipe may say (Llama 3.1 8B and 70B shapes cut to 4-8 layers; TP,
CP, PP with 1F1B, GPipe or the interleaved schedule; every checkpointing and accumulation mode;
the shard or the gathered inputs saved; bf16 or fp32 gradient reduction; FP8 or not; with
--family, Qwen3 8B's shapes instead, or mixtures of experts under EP: `draw_moe`), traces one
rank of each with the entrypoints' own code (tests/estimate/memory_tracing.py) and prints the
estimate's error against it, the worst first. Layouts the recipe refuses are drawn again. It
exits 1 if any estimate is off by more than --bound (2%, the grid's), so each one found can
join the grid once it is explained. docs/estimator.md records what it found.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "estimate")]

GIB = 2**30


def draw(rng: random.Random):
    """One random layout as a TracedConfig, or None where its degrees do not fill the nodes."""
    from traced_configs import TracedConfig, llama8b, llama70b

    layers = rng.choice([4, 6, 8])
    model = llama70b(layers) if rng.random() < 0.6 else llama8b(layers)
    tensor, context, pipeline = rng.choice([1, 2, 4, 8]), rng.choice([1, 1, 2, 4]), rng.choice([1, 1, 2, 4])
    instances = rng.choice([1, 2, 4])
    world = 8 * instances
    if world % (tensor * context * pipeline):
        return None
    parallel = {
        "tensor": tensor,
        "context": context,
        "pipeline": pipeline,
        "activation_checkpointing": rng.choice(["none", "selective", "full"]),
        "tp_saved_inputs": rng.choice(["gathered", "shard"]) if tensor > 1 else "gathered",
    }
    if pipeline > 1:
        virtual = rng.choice([1, 2])
        parallel["virtual_stages"] = virtual
        parallel["pipeline_schedule"] = "interleaved_1f1b" if virtual > 1 else rng.choice(["1f1b", "gpipe"])
        parallel["grad_accumulation"] = rng.choice(["auto", "sync_each", "sync_last_gathered"])
        micro_batches = rng.choice([1, 2, 4, 8])
    else:
        parallel["grad_accumulation"] = rng.choice(["auto", "sync_each", "sync_last", "sync_last_gathered"])
        micro_batches = rng.choice([1, 2])
    if rng.random() < 0.3:
        parallel["reduce_dtype"] = "bf16"
    data = world // (tensor * context * pipeline)
    return TracedConfig(
        "random",
        model,
        rng.choice([4096, 8192, 16384]) * context,
        instances=instances,
        parallel=parallel,
        precision={"fp8": rng.random() < 0.4},
        global_batch_size=data * micro_batches,
        stage=rng.randrange(pipeline),
    )


def draw_qwen3(rng: random.Random):
    """As `draw`, on Qwen3 8B's shapes (q_norm and k_norm, 36 layers cut to 4-8)."""
    config = draw(rng)
    if config is None:
        return None
    return replace(config, model={"base": "qwen3-8b", "num_layers": config.model["num_layers"]})


def draw_moe(rng: random.Random):
    """A mixture-of-experts layout: Qwen3-30B-A3B's shapes (128 experts of 768, top 8, q 4096 on
    h 2048) cut to 4-8 layers, or to 4 from a config.json without the auxiliary loss under PP
    (the contract refuses PP with auxiliary losses), or Mixtral 8x7B's (8 of 14336, top 2)
    without PP; EP over any divisor of dp x cp x tp that divides the experts; FP8 with or without
    the FP8 experts; routing as learned or round-robin."""
    from traced_configs import QWEN3_MOE_NO_AUX_LOSS, TracedConfig

    mixtral = rng.random() < 0.3
    layers = rng.choice([4, 6, 8])
    tensor, context = rng.choice([1, 1, 2, 4]), rng.choice([1, 1, 2, 4])
    pipeline = 1 if mixtral else rng.choice([1, 1, 2])
    instances = rng.choice([1, 2])
    world = 8 * instances
    if world % (tensor * context * pipeline):
        return None
    data = world // (tensor * context * pipeline)
    experts = 8 if mixtral else 128
    expert = rng.choice([e for e in (1, 2, 4, 8, 16) if (data * context * tensor) % e == 0 and experts % e == 0])
    if mixtral:
        model = {"base": "mixtral-8x7b", "num_layers": layers}
    elif pipeline > 1:
        model = {"hf_config": str(QWEN3_MOE_NO_AUX_LOSS)}
    else:
        model = {"base": "qwen3-30b-a3b", "num_layers": layers}
    parallel = {
        "tensor": tensor,
        "context": context,
        "pipeline": pipeline,
        "expert": expert,
        "activation_checkpointing": rng.choice(["none", "selective", "full"]),
        "grad_accumulation": rng.choice(["auto", "sync_each", "sync_last_gathered"]),
    }
    micro_batches = rng.choice([1, 2, 4])
    if pipeline > 1:
        parallel["virtual_stages"] = rng.choice([1, 2])
        parallel["pipeline_schedule"] = "interleaved_1f1b" if parallel["virtual_stages"] > 1 else "1f1b"
    fp8 = rng.random() < 0.4
    precision = {"fp8": fp8, "fp8_experts": fp8 and rng.random() < 0.5}
    return TracedConfig(
        "random",
        model,
        rng.choice([4096, 8192]) * context,
        instances=instances,
        parallel=parallel,
        precision=precision,
        global_batch_size=data * micro_batches,
        stage=rng.randrange(pipeline),
        training={"moe_force_load_balance": rng.random() < 0.3},
    )


FAMILIES = {"llama": draw, "qwen3": draw_qwen3, "moe": draw_moe}


def describe(config) -> str:
    if isinstance(config.model, str):
        model = config.model
    elif "hf_config" in config.model:
        model = Path(config.model["hf_config"]).name
    else:
        model = f"{config.model['base']} x{config.model['num_layers']}"
    settings = " ".join(f"{k}={v}" for k, v in config.parallel.items())
    fp8 = " fp8" if config.precision.get("fp8") else ""
    fp8 += " fp8_experts" if config.precision.get("fp8_experts") else ""
    fp8 += " round-robin" if config.training.get("moe_force_load_balance") else ""
    return (
        f"{model} seq {config.seq_len} on {config.instances} p5, {settings}{fp8}, "
        f"batch {config.global_batch_size}, stage {config.stage}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--layouts", type=int, default=40, help="layouts to trace (default 40)")
    parser.add_argument("--bound", type=float, default=0.02, help="largest error allowed (default 0.02)")
    parser.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        default="llama",
        help="the shapes drawn: Llama 3.1 8B and 70B (default), Qwen3 8B, or mixtures of experts",
    )
    args = parser.parse_args()

    from memory_tracing import trace_in_subprocess

    from launcher import api
    from launcher.errors import LauncherError
    from launcher.resolve import resolve

    rng = random.Random(args.seed)
    found: list[tuple[float, str]] = []
    started = time.monotonic()
    while len(found) < args.layouts:
        config = FAMILIES[args.family](rng)
        if config is None:
            continue
        try:
            recipe = config.recipe()
            resolved = resolve(recipe).concrete.resolved().to_dict()
            stage = api.estimate(recipe).stages[config.stage]
        except LauncherError:
            continue  # a layout the recipe refuses: draw another
        traced = trace_in_subprocess(resolved, stage=config.stage)
        error = stage.allocated_bytes / traced.peak_bytes - 1
        line = (
            f"{error:+6.1%}  traced {traced.peak_bytes / GIB:6.2f} GiB at {traced.phase}, "
            f"estimated {stage.allocated_bytes / GIB:6.2f} at {stage.phase}: {describe(config)}"
        )
        print(line, flush=True)
        found.append((error, line))
    worst = sorted(found, key=lambda item: -abs(item[0]))
    over = [line for error, line in worst if abs(error) > args.bound]
    print(f"\n{len(found)} layouts, seed {args.seed}, {args.family}, {time.monotonic() - started:.0f} s")
    print(
        f"{len(over)} beyond {args.bound:.0%}; median |error| {sorted(abs(e) for e, _ in found)[len(found) // 2]:.2%}"
    )
    for line in over:
        print("  " + line)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
