"""The Hugging Face checkpoint jobs of test_hf_weights.py, in the shared 4-rank launch.

Llama in every layout, Mistral and Qwen3 under FSDP 2 x TP 2, Qwen3-MoE under EP 2 over FSDP 4 and
under FSDP 2 x TP 2, Mixtral under EP 2 x TP 2; see test_hf_weights.py for what each proves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .entrypoint_jobs import Job, Planned, write_job
from .hf_models import MODELS, SEQ_LEN, save_hf_model

LAYOUTS = {  # 4 ranks each: the named parallelism, with the remaining factor of 2 replicating it
    "tp2": {"parallel.tensor": 2, "parallel.data_replicate": 2},
    "cp2": {"parallel.context": 2, "parallel.data_replicate": 2},
    "pp2": {"parallel.pipeline": 2, "parallel.data_replicate": 2},
    "fsdp2_tp2": {"parallel.tensor": 2, "parallel.data_shard": 2},
    # Experts split 2 ways and each half FSDP-sharded 2 ways (expert_fsdp 2): Qwen3-MoE's 3 experts
    # a rank are sharded on dim 1 (parallel/fsdp.py, expert_placement), so a rank reads a slice of
    # each of its experts; then the experts beside tensor-parallel attention.
    "ep2_fsdp4": {"parallel.data_shard": 4, "parallel.expert": 2},
    "ep2_tp2": {"parallel.tensor": 2, "parallel.data_shard": 2, "parallel.expert": 2},
}
# Llama in every layout; Mistral (tied embeddings, which the layout rules refuse to split over
# pipeline stages) where its weights differ: FSDP x TP splits the shared embedding both ways.
DENSE_LAYOUTS = ("tp2", "cp2", "pp2", "fsdp2_tp2")
CASES = [("llama", layout) for layout in DENSE_LAYOUTS] + [
    ("mistral", "fsdp2_tp2"),
    ("qwen3", "fsdp2_tp2"),
    ("qwen3_moe", "ep2_fsdp4"),
    ("qwen3_moe", "fsdp2_tp2"),  # without EP: the 6 experts FSDP-sharded on dim 0, 3 a rank
    ("mixtral", "ep2_tp2"),
]
# These train 3 steps for real; their step-1 loss is still the loaded model's.
ROUND_TRIPS = (("llama", "fsdp2_tp2"), ("qwen3_moe", "ep2_fsdp4"))
BASE = {
    "training.seq_len": SEQ_LEN,
    "training.global_batch_size": 8,
    "training.micro_batch_size": 2,
    "training.optimizer.warmup_steps": 0,
    "parallel.tensor": 1,
    "checkpoint.every_steps": 0,
    "checkpoint.export_hf": True,
}


def model_ref(directory: Path) -> dict:
    return {"model": {"hf_config": str(directory / "config.json"), "init_from": str(directory)}}


@dataclass
class HFRuns:
    checkpoints: dict[str, Path]
    models: dict
    layouts: dict[tuple[str, str], Job]
    round_trips: dict[str, Job]
    """Model kind -> its job that trained 3 steps."""


def plan_hf(root: Path) -> Planned:
    """Tiny Hugging Face checkpoints saved by transformers, and one job per case on 4 ranks."""
    root.mkdir(parents=True)
    checkpoints = {kind: root / f"hf-{kind}" for kind in MODELS}
    models = {kind: save_hf_model(kind, path) for kind, path in checkpoints.items()}
    # Tokenizer files beside the weights go into every export (no tokenizer is needed to test that).
    (checkpoints["llama"] / "tokenizer_config.json").write_text('{"model_max_length": 1024}\n')
    layouts = {}
    for kind, layout in CASES:
        overrides = {**BASE, **model_ref(checkpoints[kind]), **LAYOUTS[layout], "training.steps": 3}
        if (kind, layout) not in ROUND_TRIPS:
            overrides.update({"training.steps": 1, "training.optimizer.lr": 1e-30, "training.optimizer.min_lr": 0.0})
        layouts[kind, layout] = write_job(root, f"{kind}-{layout}", overrides, procs=4)
    plan = [{"kind": "train", "config": str(job.config), "result": str(job.result)} for job in layouts.values()]
    seed_an_earlier_save(layouts["llama", "fsdp2_tp2"].output_dir / "hf", checkpoints["llama"])

    def finish(stdout: dict[int, str]) -> HFRuns:
        trips = {kind: layouts[kind, layout] for kind, layout in ROUND_TRIPS}
        return HFRuns(checkpoints=checkpoints, models=models, layouts=layouts, round_trips=trips)

    return Planned(jobs={4: plan}, finish=finish)


EARLIER_SAVE = ("model.safetensors", "model-00004-of-00009.safetensors")


def seed_an_earlier_save(export: Path, original: Path) -> None:
    """What an earlier save left in a round trip's export directory: the untrained weights as one
    model.safetensors (which transformers' from_pretrained reads before an index), a shard of
    another split, and a file of the user's. The export removes the first two, keeps the third."""
    from safetensors.torch import load_file, save_file

    export.mkdir(parents=True)
    tensors = {name: t for shard in sorted(original.glob("*.safetensors")) for name, t in load_file(shard).items()}
    save_file(tensors, export / EARLIER_SAVE[0], metadata={"format": "pt"})
    save_file({"stale": tensors[next(iter(tensors))]}, export / EARLIER_SAVE[1], metadata={"format": "pt"})
    (export / "notes.txt").write_text("the user's\n")
