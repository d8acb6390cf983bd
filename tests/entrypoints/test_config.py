"""The resolved config: every shipped recipe parses; bad files fail with one line naming the key."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from entrypoints import train
from launcher.contract.config import ConfigError, JobConfig, load_config
from launcher.recipe import Recipe
from launcher.resolve import resolve

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def resolved() -> dict:
    return resolve(Recipe.load(REPO / "recipes" / "tiny-cpu.yaml")).concrete.resolved().to_dict()


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_recipe_resolves_to_a_config_the_entrypoints_read(path):
    recipe = Recipe.load(path)
    concrete = resolve(recipe).concrete
    cfg = concrete.resolved()
    # to_dict() is the resolved.json the launcher writes: every key, in order, and it reads back.
    assert json.dumps(cfg.to_dict()) == json.dumps(concrete._job_config_data(None, None))
    assert JobConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.parallel.world_size == recipe.world_size
    assert cfg.model.head_dim == recipe.arch.head_dim
    assert cfg.parallel.grad_accum_steps == recipe.grad_accum_steps


def test_rejects_another_format(resolved):
    with pytest.raises(ConfigError, match=r"^format: 2 is not a resolved config format .* expected 1"):
        JobConfig.from_dict({**resolved, "format": 2})


def test_rejects_a_missing_key_by_its_path(resolved):
    broken = copy.deepcopy(resolved)
    del broken["training"]["seq_len"]
    with pytest.raises(ConfigError, match=r"^training\.seq_len: missing from the resolved config$"):
        JobConfig.from_dict(broken)


def test_rejects_a_wrong_type_by_its_path(resolved):
    broken = copy.deepcopy(resolved)
    broken["training"]["optimizer"]["betas"] = [0.9]
    with pytest.raises(ConfigError, match=r"^training\.optimizer\.betas: expected a list of 2 numbers"):
        JobConfig.from_dict(broken)
    broken = copy.deepcopy(resolved)
    broken["parallel"]["tensor"] = "2"
    with pytest.raises(ConfigError, match=r'^parallel\.tensor: expected an integer, got "2"'):
        JobConfig.from_dict(broken)


def test_rejects_a_layout_that_does_not_multiply_to_the_world_size(resolved):
    broken = copy.deepcopy(resolved)
    broken["parallel"]["world_size"] = 8
    with pytest.raises(ConfigError, match=r"^parallel: .* = 4, but world_size is 8"):
        JobConfig.from_dict(broken)


def test_rejects_tied_embeddings_split_into_pipeline_stages(resolved):
    broken = copy.deepcopy(resolved)
    broken["model"]["tie_embeddings"] = True
    broken["parallel"].update(tensor=1, pipeline=2, grad_accum_steps=2)
    with pytest.raises(ConfigError, match=r"^parallel\.pipeline: 2 splits a model with tied embeddings over stages"):
        JobConfig.from_dict(broken)


def test_allows_unknown_keys_and_says_so(resolved, capsys):
    JobConfig.from_dict({**resolved, "runtime": {**resolved["runtime"], "future_knob": 1}})
    assert "ignoring unknown keys runtime.future_knob" in capsys.readouterr().err


def test_train_main_reports_a_bad_config_in_one_line_and_exits_2(tmp_path, capsys, resolved):
    path = tmp_path / "resolved.json"
    path.write_text(json.dumps({**resolved, "format": 7}))
    assert train.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: format: 7 is not a resolved config format")


def test_load_config_points_at_broken_json(tmp_path):
    path = tmp_path / "resolved.json"
    path.write_text('{"format": 1,\n  "name": }')
    with pytest.raises(ConfigError, match=r"resolved\.json:2: not valid JSON"):
        load_config(path)
