"""The training jobs of test_attention_paths.py and its checks, in the shared 2-rank launch.

One plan entry of kind "attention_paths" (multirun.py runs attention_paths_run.py's checks):
Ulysses against full causal attention, document masking at cp 2 over both paths, and these
training jobs, each with its one-process step-1 loss.
"""

from __future__ import annotations

import json
from pathlib import Path

from .entrypoint_jobs import Planned, write_job

# Small jobs: 2 steps, seq 64, documents of 1 to 16 tokens from synthetic data.
DOCUMENT_JOB = {
    "training.seq_len": 64,
    "training.global_batch_size": 4,
    "training.steps": 2,
    "data.document_masking": True,
}
TRAIN_JOBS = {
    # Full checkpointing: the recomputed blocks must reuse the forward's document masks.
    "cp2_ulysses_documents_full_ac": {
        **DOCUMENT_JOB,
        "parallel.context": 2,
        "parallel.cp_attention": "ulysses",
        "parallel.activation_checkpointing": "full",
    },
    "pp2_documents_global_positions": {
        **DOCUMENT_JOB,
        "parallel.pipeline": 2,
        "data.document_positions": "global",
    },
}


def plan_attention(root: Path) -> Planned:
    root.mkdir(parents=True)
    jobs = {name: write_job(root, name, changes, procs=2) for name, changes in TRAIN_JOBS.items()}
    entry = {
        "kind": "attention_paths",
        "result": str(root / "result.json"),
        "train": [{"name": name, "config": str(job.config)} for name, job in jobs.items()],
    }

    def finish(stdout: dict[int, str]) -> dict:
        found = json.loads((root / "result.json").read_text())
        for name, job in jobs.items():
            found["train"][name]["losses"] = job.losses()
        return found

    return Planned(jobs={2: [entry]}, finish=finish)
