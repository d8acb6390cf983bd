"""The fsdp estimate against the program it describes: the entrypoints' own model, parallelize
and optimizer code, traced under fake tensors (memory_tracing.py), on real Llama 3.1 8B and
70B shapes with TP, CP, PP, every checkpointing mode, FP8 and each gradient accumulation mode
(traced_configs.py), within 2%. No config sets training.compile: under an active fake mode
torch.compile falls back to eager (tried with torch 2.13: dynamo compiles nothing and the ops
run unfused), so such a trace would show the eager program. A compiled block's memory is left
to a GPU measurement.

Each trace runs in its own interpreter and takes 1 to 15 seconds, beside the serial tests (traced.py).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from launcher import api
from launcher.estimate import fsdp

from .memory_tracing import LiveStorages, pipeline_actions
from .traced import work_name
from .traced_configs import CONFIGS

TOLERANCE = 0.02
GIB = 2**30


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_estimate_is_within_2_percent_of_the_traced_peak(config, _background):
    traced = _background.result(work_name(config))  # traced beside the serial tests (traced.py)
    estimated = api.estimate(config.recipe()).stages[config.stage].allocated_bytes
    error = estimated / traced.peak_bytes - 1
    assert abs(error) <= TOLERANCE, (
        f"{config.name}: estimated {estimated / GIB:.2f} GiB, traced {traced.peak_bytes / GIB:.2f} GiB "
        f"({error:+.1%}); the trace peaked at {traced.phase}"
    )


def test_traced_configs_span_tp_cp_pp_checkpointing_fp8_accumulation_modes_and_both_model_sizes():
    recipes = [c.recipe() for c in CONFIGS]
    assert len(CONFIGS) >= 12
    assert any(r.layout.tensor > 1 for r in recipes)
    assert any(r.layout.context > 1 for r in recipes)
    assert any(r.layout.pipeline > 1 for r in recipes)
    assert any(r.layout.virtual_stages > 1 for r in recipes)
    assert {r.parallel.activation_checkpointing for r in recipes} == {"none", "selective", "full"}
    assert {r.precision.fp8_recipe for r in recipes if r.precision.fp8} == {"tensorwise", "rowwise"}
    assert {r.arch.hidden_size for r in recipes} >= {4096, 8192}
    accumulating = [r for r in recipes if r.grad_accum_steps > 1 and r.layout.pipeline == 1]
    assert {r.grad_accumulation() for r in accumulating} == {"sync_each", "sync_last", "sync_last_gathered"}
    assert any(r.parallel.reduce_dtype == "bf16" for r in accumulating)
    assert max(r.training.seq_len for r in recipes) == 131072
    experts = [r for r in recipes if r.arch.moe is not None]
    assert {r.layout.expert > 1 for r in experts} == {True, False}
    assert any(r.layout.expert > 1 and r.layout.tensor > 1 and r.layout.context > 1 for r in experts)
    assert {r.parallel.activation_checkpointing for r in experts} == {"none", "selective", "full"}


def test_live_storages_counts_each_storage_once_while_it_lives():
    with FakeTensorMode():
        tracker = LiveStorages()
        with tracker:
            a = torch.empty(1024, dtype=torch.float32)  # 4 KiB
            view = a[:10]  # same storage: not counted again
            b = torch.empty(512, dtype=torch.bfloat16)  # 1 KiB
            assert tracker.live == 5 * 1024
            del a, view
            assert tracker.live == 1024
            b.untyped_storage().resize_(0)  # FSDP frees unsharded parameters this way
            assert tracker.live == 0
            b.untyped_storage().resize_(4096)
            assert tracker.live == 4096
    assert tracker.peak.bytes == 5 * 1024


def test_1f1b_replay_matches_torch_warmup_and_alternation():
    # Schedule1F1B on rank 1 of 4 with 6 micro-batches: 3 warm-up forwards, then B/F pairs.
    actions = pipeline_actions(1, 4, 1, 6, "1f1b")
    kinds = "".join(action for action, _, _ in actions)
    assert kinds == "FFFBFBFBFBBB"
    assert [mb for action, _, mb in actions if action == "B"] == list(range(6))


def test_interleaved_replay_holds_the_published_number_of_chunks_on_rank_0():
    # p 4, v 2, 8 micro-batches: rank 0 holds p*v + p - 1 = 11 chunks before its first backward.
    actions = pipeline_actions(0, 4, 2, 8, "interleaved_1f1b")
    kinds = "".join(action for action, _, _ in actions)
    assert kinds.index("B") == 11
    assert sorted({stage for _, stage, _ in actions}) == [0, 4]


def test_estimator_constants_match_the_entrypoints():
    from entrypoints.model import loss
    from launcher.contract import loss as contract_loss
    from launcher.contract.layout import Layout, checkpointed_layers
    from launcher.plan import throughput

    for mode in ("none", "selective", "full"):
        for layers in (1, 7, 32, 126):
            chosen = checkpointed_layers(mode, layers, Layout())
            assert fsdp._checkpointed_below(mode, layers) == len(chosen)
            assert all(fsdp._checkpointed_below(mode, i + 1) > fsdp._checkpointed_below(mode, i) for i in chosen)
    # The loss's chunking: the entrypoints, the estimator and the throughput model run one rule.
    assert loss.chunk_tokens is fsdp.chunk_tokens is throughput.chunk_tokens is contract_loss.chunk_tokens
    for tokens, hidden, vocab in ((8192, 4096, 128256), (16384, 8192, 64128), (256, 128, 512), (4096, 2048, 151936)):
        chunk = contract_loss.chunk_tokens(tokens, hidden, vocab)
        assert chunk == max(-(-tokens // -(-vocab // hidden)), min(tokens, 1024))
