"""When the training loop lets Python's garbage collector run (entrypoints/garbage_collection.py)."""

from __future__ import annotations

import gc

import pytest

from entrypoints.garbage_collection import GarbageCollection
from launcher.contract.config import ConfigError, TrainingConfig


@pytest.fixture
def collections():
    """The generation of each collection that runs while the test does."""
    seen: list[int] = []

    def record(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    yield seen
    gc.callbacks.remove(record)


def test_collections_run_between_steps_every_n_steps_and_the_collector_is_restored(collections):
    assert gc.isenabled()
    with GarbageCollection(3) as collector:
        assert not gc.isenabled()
        assert collections == [1]  # what the set-up left, once
        for step in range(1, 8):
            for _ in range(20_000):  # garbage enough to start automatic collections, if they could
                cycle = []
                cycle.append(cycle)
            collector.after_step(step)
        assert collections == [1, 1, 1]  # after steps 3 and 6 only
    assert gc.isenabled()


def test_zero_leaves_the_automatic_collector_on_even_when_start_up_turned_it_off(collections):
    gc.disable()
    try:
        with GarbageCollection(0) as collector:
            assert gc.isenabled()
            before = len(collections)
            collector.after_step(50)
            assert len(collections) == before  # the policy forces none: Python decides
        assert not gc.isenabled()  # as it was found
    finally:
        gc.enable()


@pytest.mark.parametrize("value", [-1, True, 2.5])
def test_the_contract_refuses_what_is_not_a_step_count(value):
    with pytest.raises(ConfigError) as error:
        TrainingConfig(seq_len=8, global_batch_size=1, steps=1, gc_every_steps=value)
    assert str(error.value) == (f"training.gc_every_steps: {value!r}; use 0 (Python's own timing) or a number of steps")


def test_a_recipe_with_a_negative_interval_is_one_line_naming_the_field(cli, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\nmodel: llama-tiny\ntraining: {seq_len: 64, global_batch_size: 2, steps: 1, gc_every_steps: -1}\n"
        "precision: {dtype: fp32}\ncluster: {backend: local, instance_type: local, nproc_per_node: 1, device: cpu}\n"
    )
    result = cli("validate", str(recipe))
    assert result.code == 2
    assert result.err == f"{recipe}:3 training.gc_every_steps: expected at least 0, got -1\n"
