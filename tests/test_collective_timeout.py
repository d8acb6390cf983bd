"""Collective timeouts come from the predicted step (issue 25, part 4): RESOLVE settles
cluster.collective_timeout, the job config carries it as runtime.collective_timeout_s, and the
trainer's process group fails a collective after that long rather than torch's 10 or 30 minutes."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

from launcher.recipe import Recipe
from launcher.resolve import resolve

REPO = Path(__file__).resolve().parents[1]


def test_a_gpu_job_waits_four_times_its_predicted_step_and_save_in_a_collective(home):
    """70B on 4 p5e under Slurm: a ~276.2 s step and a ~53 s save, 4 x 329.3 -> 1317 s."""
    recipe = Recipe.load(REPO / "recipes" / "llama70b-128k.yaml", {"cluster.backend": "slurm"})
    resolved = resolve(recipe)
    assert resolved.settled["cluster.collective_timeout"] == 1317
    assert resolved.concrete.resolved().runtime.collective_timeout_s == 1317.0


def test_a_short_step_gets_the_ten_minute_floor_and_a_named_timeout_is_kept(home):
    recipe = Recipe.load(REPO / "recipes" / "llama3-8b-8k.yaml", {"cluster.backend": "slurm"})
    assert resolve(recipe).concrete.resolved().runtime.collective_timeout_s == 600.0
    named = Recipe.load(REPO / "recipes" / "llama3-8b-8k.yaml", {"cluster.collective_timeout": "25m"})
    resolved = resolve(named)
    assert "cluster.collective_timeout" not in resolved.settled
    assert resolved.concrete.resolved().runtime.collective_timeout_s == 1500.0


def test_a_cpu_job_gets_the_ten_minute_floor_from_its_predicted_step():
    resolved = resolve(Recipe.load(REPO / "recipes" / "tiny-cpu.yaml"))
    assert resolved.settled["cluster.collective_timeout"] == 600
    assert resolved.concrete.resolved().runtime.collective_timeout_s == 600.0


def test_train_opens_its_process_group_with_the_job_configs_collective_timeout(home, tmp_path, monkeypatch):
    """entrypoints/train.py's main, one process and no torchrun, on the 70B job's settled timeout;
    `train` itself is replaced by a reader of the group it is given."""
    import torch

    from entrypoints import train

    for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    gpu = Recipe.load(REPO / "recipes" / "llama70b-128k.yaml", {"cluster.backend": "slurm"})
    timeout_s = resolve(gpu).concrete.resolved().runtime.collective_timeout_s
    config = resolve(Recipe.load(REPO / "recipes" / "tiny-cpu.yaml")).concrete.resolved().to_dict()
    config["runtime"]["collective_timeout_s"] = timeout_s
    (tmp_path / "resolved.json").write_text(json.dumps(config))
    seen = []

    def read_the_group(cfg, env):
        seen.append(torch.distributed.group.WORLD._get_backend(torch.device("cpu")).options._timeout)
        return {"interrupted": False}

    monkeypatch.setattr(train, "train", read_the_group)
    assert train.main(["--config", str(tmp_path / "resolved.json")]) == 0
    assert seen == [timedelta(seconds=1317)]
