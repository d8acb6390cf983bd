"""The layout enumeration: exactly the layouts the recipe rules accept, each once."""

from __future__ import annotations

import itertools

import pytest

from launcher import catalog
from launcher.contract.layout import Layout, divisors
from launcher.plan.candidates import MAX_VIRTUAL_STAGES, shapes
from launcher.recipe.rules import layout_problems

TINY = catalog.models()["llama-tiny"]  # 8 heads, 4 KV heads, 4 layers


def brute_force(arch, *, world_size, gpus_per_node, seq_len, global_batch_size):
    """Every (layout, micro batch) in the full product of degrees that the rules accept."""
    found = set()
    degrees = range(1, world_size + 1)
    for t, c, p, r in itertools.product(degrees, repeat=4):
        if world_size % (t * c * p * r):
            continue
        shard = world_size // (t * c * p * r)
        # Every stage but the end ones needs a layer, so the rules reject v above the layer count
        # plus 2; leaving those out keeps the product small.
        for v in range(1, min(MAX_VIRTUAL_STAGES, arch.num_layers + 2) + 1):
            for b in range(1, global_batch_size + 1):
                layout = Layout(tensor=t, context=c, pipeline=p, data_replicate=r, data_shard=shard, virtual_stages=v)
                schedule = "interleaved_1f1b" if v > 1 else "1f1b"
                problems = layout_problems(
                    layout,
                    arch,
                    seq_len=seq_len,
                    global_batch_size=global_batch_size,
                    micro_batch_size=b,
                    gpus_per_node=gpus_per_node,
                    schedule=schedule,
                )
                if not problems:
                    found.add((layout, b))
    return found


@pytest.mark.parametrize(
    ("world_size", "seq_len", "global_batch_size"),
    [(8, 256, 16), (16, 512, 32), (12, 384, 24)],
)
def test_enumeration_equals_the_rule_filtered_product(world_size, seq_len, global_batch_size):
    kw = dict(world_size=world_size, gpus_per_node=4, seq_len=seq_len, global_batch_size=global_batch_size)
    enumerated = [(s.layout, s.micro_batch_size) for s in shapes(TINY, schedule="1f1b", **kw)]
    assert len(enumerated) == len(set(enumerated)), "a layout was produced twice"
    assert set(enumerated) == brute_force(TINY, **kw)


def test_every_shape_carries_its_micro_batches_and_schedule():
    for shape in shapes(TINY, world_size=8, gpus_per_node=8, seq_len=256, global_batch_size=16, schedule="gpipe"):
        layout = shape.layout
        assert shape.micro_batch_size * shape.grad_accum_steps * layout.data_parallel == 16
        expected = "interleaved_1f1b" if layout.virtual_stages > 1 else "gpipe"
        assert shape.pipeline_schedule == expected


def test_tensor_parallel_stays_inside_a_node_and_divides_the_kv_heads():
    degrees = {
        s.layout.tensor
        for s in shapes(TINY, world_size=16, gpus_per_node=2, seq_len=512, global_batch_size=16, schedule="1f1b")
    }
    assert degrees == {1, 2}
    kv = TINY.num_kv_heads
    assert {t for t in divisors(kv)} >= degrees
