"""Checkpoints with torch.distributed.checkpoint (DCP): save, keep the newest K, resume, reshard.

    checkpoints = Checkpointer(directory, cfg.checkpoint, parts=..., optimizers=..., data=..., rank=...)
    step = checkpoints.resume()          # 0 when starting fresh
    checkpoints.save(step)

A checkpoint is a directory `step-00000120/` holding
- the DCP shards of {"model": ..., "optimizer": ...} from get_state_dict (sharded DTensors keyed
  by parameter name, so a checkpoint written by one layout loads into any other: world size,
  FSDP/TP/CP/PP degrees and activation checkpointing may all change);
- train_state.json (rank 0): step, data position (samples seen), learning-rate schedule step;
- rng/rank-<r>.pt: each rank's torch RNG states, restored when the world size is unchanged;
- COMPLETE, written by rank 0 after every rank has finished writing. Only directories with
  this marker count; a job killed mid-save leaves a directory that is ignored and later removed.
After each save rank 0 deletes all but the newest `keep` complete checkpoints.

Resume: "auto" takes the newest complete checkpoint in the directory (none: a fresh start),
"never" ignores them, any other value is the path of the checkpoint directory to load.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from launcher.contract.config import CheckpointConfig, ConfigError

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


class Checkpointer:
    def __init__(self, directory: Path, cfg: CheckpointConfig, *, parts, optimizers, data, rank: int, world_size: int):
        self.directory, self.cfg = directory, cfg
        self.parts, self.optimizers, self.data = parts, optimizers, data
        self.rank, self.world_size = rank, world_size
        self.last_saved_step: int | None = None

    # --- what goes into a checkpoint -----------------------------------------------------

    def _state(self) -> dict:
        model = {}
        for part in self.parts:
            model.update(get_model_state_dict(part))
        return {"model": model, "optimizer": self.optimizers.state_dict()}

    def _load_state(self, state: dict) -> None:
        # Each pipeline part takes the keys it holds from the merged state.
        for part in self.parts:
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        self.optimizers.load_state_dict(state["optimizer"])

    # --- save --------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    def save(self, step: int) -> Path:
        """Write checkpoint `step` from every rank; returns its directory once it is complete."""
        path = self.directory / step_dir_name(step)
        if self.rank == 0:
            if path.exists():  # an incomplete attempt at this step from a killed run
                shutil.rmtree(path)
            path.mkdir(parents=True)
        dist.barrier()
        dcp.save(self._state(), checkpoint_id=str(path))
        (path / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(), path / "rng" / f"rank-{self.rank:05d}.pt")
        if self.rank == 0:
            train_state = {
                "step": step,
                "data": self.data.state_dict(),
                "lr_schedule": {"step": self.optimizers.step_count},
                "world_size": self.world_size,
            }
            (path / "train_state.json").write_text(json.dumps(train_state, indent=2) + "\n")
        dist.barrier()
        if self.rank == 0:
            (path / MARKER).write_text(f"{step}\n")
            self._prune(keep_from=path)
        dist.barrier()
        self.last_saved_step = step
        return path

    def _prune(self, keep_from: Path) -> None:
        complete = complete_checkpoints(self.directory)
        for _, old in complete[: -self.cfg.keep]:
            shutil.rmtree(old, ignore_errors=True)
        newest = complete[-1][0]
        for path in self.directory.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and int(match.group(1)) < newest and not (path / MARKER).exists():
                shutil.rmtree(path, ignore_errors=True)

    # --- resume ------------------------------------------------------------------------------

    def to_resume(self) -> Path | None:
        resume = self.cfg.resume
        if resume == "never":
            return None
        if resume == "auto":
            complete = complete_checkpoints(self.directory)
            return complete[-1][1] if complete else None
        path = Path(resume)
        if not (path / MARKER).is_file():
            raise ConfigError(f"checkpoint.resume: {path} is not a complete checkpoint (no {MARKER} marker)")
        return path

    def resume(self) -> int:
        """Load the checkpoint to resume from, if any; returns the step it was taken at (0: none)."""
        path = self.to_resume()
        if path is None:
            return 0
        state = self._state()
        dcp.load(state, checkpoint_id=str(path))
        self._load_state(state)
        train_state = json.loads((path / "train_state.json").read_text())
        self.data.load_state_dict(train_state["data"])
        self.optimizers.step_count = train_state["lr_schedule"]["step"]
        self.optimizers.set_lr()
        rng = path / "rng" / f"rank-{self.rank:05d}.pt"
        if train_state["world_size"] == self.world_size and rng.is_file():
            _set_rng_state(torch.load(rng, weights_only=False))
        self.last_saved_step = train_state["step"]
        return train_state["step"]


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
