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
        f"data: {{source: corpus/*.jsonl, tokenizer: {tokenizer_file}, format: jsonl}}\n"
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

    # The same inputs, tokenizer and settings find the same directory: a later submit reuses it.
    told = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAUNCHER_HOME", str(home))
        again = api.prepare_recipe_data(api.load(recipe), dry_run=True, tell=lambda stage, line: told.append(line))
    assert told == [f"data: {cached}: prepared earlier"]
    assert (again.data.source, again.data.tokenizer, again.data.dtype) == (str(cached), None, "uint16")
