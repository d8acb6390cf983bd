"""scripts/estimator_gpu.py's replay of the CUDA allocator's event history (the GPU's side of the
memory tracer): the events are torch's own, recorded here on the CPU by nothing, so the trace is
written out in the snapshot's format (torch/cuda/memory.py `_snapshot`, `TraceEntry`: alloc,
free_requested, free_completed, segment events; frames innermost first)."""

from __future__ import annotations

import pytest

from tests import load_script

MIB = 2**20


@pytest.fixture(scope="module")
def estimator_gpu():
    return load_script("estimator_gpu")


def frames(*where: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


TORCH_LINEAR = ("/usr/lib/python3/site-packages/torch/nn/modules/linear.py", 134, "forward")
OUR_MLP = ("/job/code/entrypoints/model/swiglu.py", 88, "forward")
OUR_LOOP = ("/job/code/entrypoints/parallel/accumulate.py", 57, "accumulate")


def trace() -> list[dict]:
    def event(action, addr, size, *where):
        return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames(*where)}

    return [
        event("segment_alloc", 0, 64 * MIB),
        event("alloc", 1, 8 * MIB, TORCH_LINEAR, OUR_MLP, OUR_LOOP),
        event("alloc", 2, 8 * MIB, TORCH_LINEAR, OUR_MLP, OUR_LOOP),
        event("free_requested", 99, 2 * MIB),  # a block from before the recording began
        event("alloc", 3, 4 * MIB, OUR_LOOP),
        event("alloc", 4, 1 * MIB),  # no Python frame: the autograd engine's thread
        # the peak: baseline 10 + 8 + 8 - 2 + 4 + 1 = 29 MiB
        event("free_requested", 2, 8 * MIB),
        event("free_completed", 2, 8 * MIB),  # the stream's use ends later: allocated fell above
        event("alloc", 5, 6 * MIB, TORCH_LINEAR, OUR_MLP, OUR_LOOP),  # 27 MiB: below the peak
    ]


def test_the_replay_finds_the_allocated_peak_and_what_was_alive_there(estimator_gpu):
    found = estimator_gpu.alive_at_peak(trace(), baseline=10 * MIB)
    assert found["replayed_peak"] == 29 * MIB and found["events"] == 9
    assert found["blocks"] == [
        {
            "bytes": 8 * MIB,
            "count": 2,
            "where": "entrypoints/model/swiglu.py:88 forward <- torch/nn/modules/linear.py:134 forward",
        },
        {"bytes": 4 * MIB, "count": 1, "where": "entrypoints/parallel/accumulate.py:57 accumulate"},
        {"bytes": 1 * MIB, "count": 1, "where": "(no Python frame)"},
    ]


def test_an_empty_history_leaves_the_baseline_as_the_peak(estimator_gpu):
    assert estimator_gpu.alive_at_peak([], baseline=5) == {"replayed_peak": 5, "baseline": 5, "events": 0, "blocks": []}
