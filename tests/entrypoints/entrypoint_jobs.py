"""Jobs for the entrypoint tests: resolved configs, torchrun launches, and their results.

Every job is a resolved config written by `launcher.recipe.Recipe` (as the backends do) and
run by `entrypoints.train.train`. To keep the suite to a few torchrun launches (each costs
seconds of start-up on two cores, most of it importing torch in every rank) the jobs of every
test module that needs one are batched by world size in `multirun.py`: `launch_together` runs
one launch per world size for all of them, beside the serial tests (tests/background.py). Each module's part is a
`Planned`:

- `plan_runs` (test_multiprocess.py): 1 process: the single-process references and a float8
  input rebuilt from its regathered shard (parallel/regather.py); 4 processes:
  every 4-rank layout (also the source of the checkpoint that is resumed; the reference and
  the VALIDATED layouts also evaluate held-out data after steps 2 and 3), FSDP's gradient
  accumulation modes, and context-parallel attention at cp 4; 2 processes: resume of the 4-rank
  checkpoint on 2 ranks (with torch's AdamW and with bf16 moments), FP8, tied embeddings under TP, compiled blocks keeping the TP shard
  (parallel.tp_saved_inputs shard), uneven pipeline stages, context-parallel
  attention at cp 2, the vocab-parallel fused loss, and the collectives of one FP8 and one fp32
  step under TP 2;
- `plan_hf` (test_hf_weights.py): 4 processes: Hugging Face checkpoints loaded and exported
  under each layout;
- `plan_attention` (test_attention_paths.py): 2 processes: Ulysses, document masking and the
  training jobs of attention_paths_run.py;
- `plan_experts` (test_expert_parallel.py, expert_jobs.py): 1 process: three tiny MoE references;
  4 processes: expert parallelism alone and with CP, TP and PP; 2 processes: an EP 2 checkpoint
  of experts sharded on dim 1, resumed with EP 2 and without.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
# The interpreter, read at import: these launches run in a background thread while the serial
# tests run, and a test may monkeypatch sys.executable meanwhile (test_render_snapshots.py does).
PYTHON = sys.executable
TORCHRUN = Path(PYTHON).parent / "torchrun"
MULTIRUN = REPO / "tests" / "entrypoints" / "multirun.py"

# Small enough for two shared cores, large enough that every parallelism has work to split:
# seq 128 = 2 x cp 2 x tp 2 x 16, 8 sequences per step, 4 layers for 2 x 2 pipeline stages.
BASE = {
    "model": "llama3.1-tiny",
    "training.seq_len": 128,
    "training.global_batch_size": 8,
    "training.micro_batch_size": 2,
    "training.steps": 3,
    "training.optimizer.warmup_steps": 1,
    "parallel.tensor": 1,
    # The layouts run sync_each: the runs each accumulation mode below must match.
    "parallel.grad_accumulation": "sync_each",
    "checkpoint.every_steps": 0,
}

# name -> overrides; each runs on 4 ranks and must match the single-process reference.
LAYOUTS = {
    "dp_shard2_tp2": {"parallel.tensor": 2, "checkpoint.every_steps": 2},
    "dp_shard2_cp2": {"parallel.context": 2, "parallel.activation_checkpointing": "selective"},
    "cp2_tp2": {"parallel.context": 2, "parallel.tensor": 2, "parallel.activation_checkpointing": "full"},
    "pp2_dp_shard2": {"parallel.pipeline": 2, "parallel.pipeline_schedule": "1f1b"},
    "data_replicate2_data_shard2": {"parallel.data_replicate": 2, "parallel.data_shard": 2},
    "pp2_tp2_interleaved": {
        "parallel.pipeline": 2,
        "parallel.tensor": 2,
        "parallel.virtual_stages": 2,
        "parallel.pipeline_schedule": "interleaved_1f1b",
    },
    "pp2_cp2_gpipe": {"parallel.pipeline": 2, "parallel.context": 2, "parallel.pipeline_schedule": "gpipe"},
    # Sequence parallel keeping only the shard of its gathered inputs (parallel/regather.py):
    # under the interleaved schedule, with several micro-batches' tokens pending at once, and
    # beside checkpointed blocks (odd layers), which keep what they gather.
    "pp2_tp2_interleaved_selective_shard_saved": {
        "parallel.pipeline": 2,
        "parallel.tensor": 2,
        "parallel.virtual_stages": 2,
        "parallel.pipeline_schedule": "interleaved_1f1b",
        "parallel.activation_checkpointing": "selective",
        "parallel.tp_saved_inputs": "shard",
    },
}
# Validation (entrypoints/evaluate.py) after steps 2 and 3 in the reference and these layouts: dp,
# tp, cp and pp (1F1B and the interleaved schedule) must give the reference's validation loss, and
# training after a mid-run evaluation must not change (the jobs without it compare to the reference).
VALIDATION = {"data.validation.source": "synthetic", "data.validation.every_steps": 2}
VALIDATED = ("dp_shard2_tp2", "dp_shard2_cp2", "pp2_dp_shard2", "pp2_tp2_interleaved")
# name -> overrides: FSDP's accumulation modes on 4 ranks, 2 micro-batches each; each must match
# the sync_each run of the same layout (and the single-process reference).
ACCUMULATION = {
    "dp_shard2_tp2_sync_last": {"parallel.tensor": 2, "parallel.grad_accumulation": "sync_last"},
    "dp_shard2_tp2_sync_last_gathered": {"parallel.tensor": 2, "parallel.grad_accumulation": "sync_last_gathered"},
    "hsdp_sync_last_gathered": {
        "parallel.data_replicate": 2,
        "parallel.data_shard": 2,
        "parallel.grad_accumulation": "sync_last_gathered",
        "training.micro_batch_size": 1,  # 8 sequences over 4 data-parallel ranks: 2 micro-batches
    },
    "dp_shard2_tp2_sync_last_bf16_reduce": {
        "parallel.tensor": 2,
        "parallel.grad_accumulation": "sync_last",
        "parallel.reduce_dtype": "bf16",
    },
    # Under pipeline parallelism the layouts above reduce-scatter every micro-batch (sync_each,
    # pipeline.py's _GradientSyncEachMicroBatch); these keep torch's unsharded accumulation.
    "pp2_dp_shard2_sync_last_gathered": {
        **LAYOUTS["pp2_dp_shard2"],
        "parallel.grad_accumulation": "sync_last_gathered",
    },
    "pp2_tp2_interleaved_sync_last_gathered": {
        **LAYOUTS["pp2_tp2_interleaved"],
        "parallel.grad_accumulation": "sync_last_gathered",
    },
}
TIED = {"model": {"base": "llama3.1-tiny", "tie_embeddings": True}}
FIVE_LAYERS = {"model": {"base": "llama3.1-tiny", "num_layers": 5}}
# name -> overrides of 5-layer models on 2 ranks, pp 2, that must match the 5-layer reference.
UNEVEN = {
    # Balanced: 2 | 3 (the first stage also holds the embedding).
    "pp2_5_layers": {**FIVE_LAYERS, "parallel.pipeline": 2},
    # An explicit split over 4 interleaved stages, 0 | 3 | 2 | 0: rank 0 holds stage 0 (only the
    # embedding) and stage 2 (2 layers), rank 1 stage 1 (3 layers) and stage 3 (only the output
    # layer and the loss), as the Llama 3 paper splits its 405B (launcher.contract.layout).
    "pp2_v2_5_layers_0_3_2_0": {
        **FIVE_LAYERS,
        "parallel.pipeline": 2,
        "parallel.virtual_stages": 2,
        "parallel.pipeline_schedule": "interleaved_1f1b",
        "parallel.pipeline_layers": [0, 3, 2, 0],
    },
}
FP8_STEPS = 12
COMPILED_SHARD_SAVED = {"parallel.tensor": 2, "parallel.tp_saved_inputs": "shard", "training.compile": True}
CP_CASES = [[4, 4], [6, 2], [3, 1], [5, 5], [8, 1]]  # heads / kv heads: MHA, GQA, odd counts, MQA


@dataclass
class Job:
    """One training job's config and where its results land."""

    name: str
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "resolved.json"

    @property
    def output_dir(self) -> Path:
        return self.root / "output"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def result(self) -> Path:
        return self.root / "result.json"

    def metrics(self) -> list[dict]:
        lines = (self.output_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics()]

    def final_model(self, step: int) -> dict:
        """The model tensors of checkpoint `step`, gathered into full tensors."""
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        saved = self.root / f"full-{step}.pt"
        if not saved.exists():
            dcp_to_torch_save(self.checkpoint_dir / f"step-{step:08d}", saved)
        return torch.load(saved, weights_only=False)["model"]


def write_job(root: Path, name: str, overrides: dict, *, procs: int, resume: str | None = None) -> Job:
    from launcher.recipe import Recipe
    from launcher.resolve import resolve

    job = Job(name, root / name)
    job.root.mkdir(parents=True)
    changes = {**BASE, **overrides, "cluster.nproc_per_node": procs}
    if resume:
        changes["checkpoint.resume"] = resume
    recipe = resolve(Recipe.load(REPO / "recipes" / "tiny-cpu.yaml", changes)).concrete
    resolved = recipe.resolved(checkpoint_dir=str(job.checkpoint_dir), output_dir=str(job.output_dir))
    job.config.write_text(json.dumps(resolved.to_dict(), indent=2))
    return job


# How a launch is run: `subprocess.run`'s signature, less `check`; tests/background.py's
# `Background.run` runs it at low priority beside the serial tests.
Runner = Callable[..., subprocess.CompletedProcess]


def launch(plan: list[dict], root: Path, procs: int, name: str, run: Runner) -> subprocess.CompletedProcess:
    plan_path = root / f"plan-{name}.json"
    plan_path.write_text(json.dumps({"jobs": plan}))
    if procs == 1:
        cmd = [PYTHON, str(MULTIRUN), str(plan_path)]
    else:
        cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={procs}", str(MULTIRUN), str(plan_path)]
    proc = run(cmd, cwd=root, env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}, timeout=900)
    (root / f"log-{name}.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode:
        pytest.fail(f"{name} launch exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@dataclass
class Runs:
    reference: Job
    tied_reference: Job
    layouts: dict[str, Job]
    accumulation: dict[str, Job]
    resumed: Job
    resumed_bf16_moments: Job
    fp8: Job
    tied_tp: Job
    compiled_shard_saved: Job
    five_layers: Job
    uneven: dict[str, Job]
    cp_attention: dict[int, dict]
    vocab_parallel_loss: dict
    fp8_collectives: dict
    float8_regather: dict
    stdout: str


@dataclass
class Planned:
    """One module's part of the shared launches: plan entries by world size, and what to make of
    them once every launch has run (`finish` gets the stdout of these entries alone, by world size)."""

    jobs: dict[int, list[dict]]
    finish: Callable[[dict[int, str]], Any]


LAUNCH_ORDER = (1, 4, 2)  # the 2-rank resumes read checkpoints the 4-rank launch writes
_JOB_MARK = "multirun: job "  # multirun.py prints it on rank 0 before each plan entry


def plan_together(root: Path, planned: dict[str, Callable[[Path], Planned]]) -> dict[str, Planned]:
    """Plan every module's jobs, each in a directory of its own."""
    return {name: plan(root / name) for name, plan in planned.items()}


def launch_together(root: Path, parts: dict[str, Planned], run: Runner) -> dict[str, Any]:
    """Run one launch per world size holding every planned job, and return what each module's
    `finish` makes of its results."""
    stdout: dict[int, str] = {}
    for procs in LAUNCH_ORDER:
        entries = [entry for part in parts.values() for entry in part.jobs.get(procs, [])]
        if entries:
            stdout[procs] = launch(entries, root, procs, f"{procs}-rank", run).stdout
    results = {}
    for name, part in parts.items():
        own = {procs: {entry["result"] for entry in entries} for procs, entries in part.jobs.items()}
        results[name] = part.finish({procs: output_of(stdout[procs], own[procs]) for procs in own})
    return results


def output_of(stdout: str, results: set[str]) -> str:
    """The lines a launch printed while it ran the entries whose result paths are `results`."""
    kept, keep = [], False
    for line in stdout.splitlines(keepends=True):
        if line.startswith(_JOB_MARK):
            keep = line[len(_JOB_MARK) :].strip() in results
            continue
        if keep:
            kept.append(line)
    return "".join(kept)


def plan_runs(root: Path) -> Planned:
    """Write every job of test_multiprocess.py; its Runs once the launches have run."""
    root.mkdir(parents=True)

    def train(job: Job) -> dict:
        return {"kind": "train", "config": str(job.config), "result": str(job.result)}

    def cp_attention(tag: str) -> dict:
        return {"kind": "cp_attention", "cases": CP_CASES, "result": str(root / f"cp-attention-{tag}.json")}

    reference = write_job(root, "reference", VALIDATION, procs=1)
    tied_reference = write_job(root, "tied-reference", TIED, procs=1)
    five_layers = write_job(root, "five-layers", FIVE_LAYERS, procs=1)
    uneven = {name: write_job(root, name, overrides, procs=2) for name, overrides in UNEVEN.items()}
    layouts = {
        name: write_job(root, name, {**overrides, **(VALIDATION if name in VALIDATED else {})}, procs=4)
        for name, overrides in LAYOUTS.items()
    }
    accumulation = {name: write_job(root, name, overrides, procs=4) for name, overrides in ACCUMULATION.items()}
    source = layouts["dp_shard2_tp2"]
    resumed = write_job(
        root,
        "resumed-on-2",
        {"checkpoint.every_steps": 0},
        procs=2,
        resume=str(source.checkpoint_dir / "step-00000002"),
    )
    # The same checkpoint (fp32 moments) resumed by AdamWBf16Moments, which saves bf16 ones.
    resumed_bf16_moments = write_job(
        root,
        "resumed-on-2-bf16-moments",
        {"checkpoint.every_steps": 0, "training.optimizer.state_dtype": "bf16"},
        procs=2,
        resume=str(source.checkpoint_dir / "step-00000002"),
    )
    fp8 = write_job(
        root,
        "fp8",
        {"precision.fp8": True, "training.steps": FP8_STEPS, "training.optimizer.warmup_steps": 2},
        procs=2,
    )
    tied_tp = write_job(root, "tied-tp2", {**TIED, "parallel.tensor": 2}, procs=2)
    # torch.compile beside the regathering hooks (parallelize.compile_blocks).
    compiled_shard_saved = write_job(root, "tp2-shard-saved-compiled", COMPILED_SHARD_SAVED, procs=2)
    collectives = {
        name: str(write_job(root, f"collectives-{name}", {"parallel.tensor": 2, "precision.fp8": fp8}, procs=2).config)
        for name, fp8 in (("fp32", False), ("fp8", True))
    }
    loss_check = {"kind": "vocab_parallel_loss", "result": str(root / "vocab-parallel-loss.json")}
    float8_regather = {"kind": "float8_regather", "result": str(root / "float8-regather.json")}
    fp8_check = {"kind": "fp8_collectives", "configs": collectives, "result": str(root / "fp8-collectives.json")}
    jobs = {
        1: [train(reference), train(tied_reference), train(five_layers), float8_regather],
        4: [*(train(j) for j in [*layouts.values(), *accumulation.values()]), cp_attention("4")],
        2: [
            train(resumed),
            train(resumed_bf16_moments),
            train(fp8),
            train(tied_tp),
            train(compiled_shard_saved),
            *(train(job) for job in uneven.values()),
            cp_attention("2"),
            loss_check,
            fp8_check,
        ],
    }

    def finish(stdout: dict[int, str]) -> Runs:
        return Runs(
            reference=reference,
            tied_reference=tied_reference,
            layouts=layouts,
            accumulation=accumulation,
            resumed=resumed,
            resumed_bf16_moments=resumed_bf16_moments,
            fp8=fp8,
            tied_tp=tied_tp,
            compiled_shard_saved=compiled_shard_saved,
            five_layers=five_layers,
            uneven=uneven,
            cp_attention={n: json.loads((root / f"cp-attention-{n}.json").read_text()) for n in (2, 4)},
            vocab_parallel_loss=json.loads((root / "vocab-parallel-loss.json").read_text()),
            fp8_collectives=json.loads((root / "fp8-collectives.json").read_text()),
            float8_regather=json.loads((root / "float8-regather.json").read_text()),
            stdout=stdout[4] + stdout[2],
        )

    return Planned(jobs=jobs, finish=finish)
