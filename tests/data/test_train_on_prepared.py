"""The issue's done-when: a recipe names a local JSONL corpus and a tokenizer, `launcher submit
--backend local --wait` prepares it (cached by content hash) and a real one-process job trains
on the shards, its loss falling."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from launcher import api
from launcher.backends.sagemaker.backend import METRIC_DEFINITIONS
from tests.backends.helpers import REPO

pytestmark = [pytest.mark.torchrun, pytest.mark.engines]


def test_submit_prepares_raw_jsonl_once_and_a_local_job_trains_on_it(corpus, tokenizer_file, tmp_path):
    recipe = tmp_path / "prepared.yaml"
    recipe.write_text(
        f"extends: {REPO / 'recipes' / 'tiny-cpu.yaml'}\n"
        "name: tiny-prepared\n"
        "training: {steps: 10, seq_len: 128, global_batch_size: 4, micro_batch_size: 2}\n"
        "parallel: {tensor: 1}\n"
        "cluster: {nproc_per_node: 1}\n"
        "checkpoint: {every_steps: 0}\n"
        f"data: {{source: corpus/*.jsonl, tokenizer: {tokenizer_file}, format: jsonl,\n"
        "       validation: {fraction: 0.1, every_steps: 5}}\n"
    )
    home = tmp_path / "home"
    env = {**os.environ, "LAUNCHER_HOME": str(home)}
    command = [sys.executable, "-m", "launcher", "submit", str(recipe), "--backend", "local", "--wait"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    (cached,) = (home / "datasets").iterdir()
    assert re.fullmatch(r"[0-9a-f]{64}", cached.name) and (cached / "manifest.json").is_file()
    assert f"data: {cached}: " in result.stderr
    losses = [
        float(re.search(METRIC_DEFINITIONS[1]["Regex"], line).group(1))
        for line in result.stdout.splitlines()
        if line.startswith("metrics ")
    ]
    assert len(losses) == 10 and losses[-1] < losses[0] - 1.0, losses
    # The last 12 of the 120 documents are held out and evaluated after steps 5 and 10, which
    # `launcher metrics` and the --wait result line show.
    evaluated = [int(m.group(1)) for m in re.finditer(r"^metrics step=(\d+) .* val_loss=[\d.]+ ", result.stdout, re.M)]
    assert evaluated == [5, 10]
    name, _, outcome = next(line for line in result.stdout.splitlines() if ": Completed." in line).partition(": ")
    assert re.search(r"loss [\d.]+, validation loss [\d.]+, ", outcome), outcome
    table = subprocess.run(
        [sys.executable, "-m", "launcher", "metrics", name], cwd=REPO, env=env, capture_output=True, text=True
    )
    header, *rows = table.stdout.splitlines()
    assert header.split()[:4] == ["STEP", "LOSS", "VAL_LOSS", "VAL_PPL"], table.stdout + table.stderr
    assert [len(row.split()) for row in rows].count(len(header.split()) - 1) == 2  # MFU blank on a CPU

    # The same inputs, tokenizer and settings find the same directory: a later submit reuses it.
    told = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAUNCHER_HOME", str(home))
        again = api.prepare_recipe_data(api.load(recipe), dry_run=True, tell=lambda stage, line: told.append(line))
    assert told == [f"data: {cached}: prepared earlier"]
    assert (again.data.source, again.data.tokenizer, again.data.dtype) == (str(cached), None, "uint16")
