"""What the context-parallel attention path and document masking add to the fsdp estimate, on
hand-computed values: llama-tiny (8 heads, 4 KV heads, kv_dim 64) at s 256, b 1, bf16. The
comment beside each number is its arithmetic."""

from __future__ import annotations

from dataclasses import replace

from launcher.contract.layout import Layout
from launcher.estimate import fsdp

from .test_fsdp import workload

LAYER = "backward of layer 3"


def test_ulysses_keeps_no_gathered_k_and_v():
    allgather = workload(layout=Layout(context=2), cp_attention="allgather", document_masking=True)
    ulysses = replace(allgather, cp_attention="ulysses")
    assert ulysses.cp_attention_path == "ulysses"
    gathered, alone = fsdp.moments(allgather)[LAYER], fsdp.moments(ulysses)[LAYER]
    # Document masking's masked path keeps the gathered K/V in every layer.
    assert gathered["cp_buffers"] == 4 * 2 * 128 * 2 * 64  # 4 layers x K and V of the other 128 tokens
    assert alone["cp_buffers"] == 0


def test_the_all_gather_path_keeps_gathered_k_and_v_only_where_a_layer_is_recomputed():
    kept = workload(layout=Layout(context=2), cp_attention="allgather")
    assert fsdp.moments(kept)[LAYER]["cp_buffers"] == 0  # every layer regathers K/V in its backward
    full = replace(kept, activation_checkpointing="full")
    assert fsdp.moments(full)[LAYER]["cp_buffers"] == 2 * 128 * 2 * 64  # layer 3's recomputation: K and V
    # Without the gathered K/V each layer saves what Ulysses' SDPA saves, the same number of
    # values; Ulysses' wo saves a copy of the attention output besides (parallel/ulysses.py).
    ulysses = replace(kept, cp_attention="ulysses")
    block, ulysses_block = (
        fsdp._Block(kept, 2, float8_all_gather=False),
        fsdp._Block(ulysses, 2, float8_all_gather=False),
    )
    tokens = kept.micro_batch_size * kept.seq_len / kept.layout.context
    assert ulysses_block.saved == block.saved + 2 * tokens * kept.arch.q_dim / kept.layout.tensor


def test_auto_picks_ulysses_only_where_it_moves_fewer_bytes():
    # 8 heads / 4 KV heads: per pass Ulysses sends (8 + 4)/c head-widths per token, one all-gather 4.
    # Every layer checkpointed: 3 all-gather collectives against 3 Ulysses passes.
    full = workload(layout=Layout(context=2), activation_checkpointing="full")
    assert full.cp_attention_path == "allgather"  # 3 x 6 > 3 x 4
    assert replace(full, layout=Layout(context=4)).cp_attention_path == "ulysses"  # 3 x 3 < 3 x 4
    # Every layer kept: the all-gather path regathers (3 collectives), Ulysses runs 2 passes.
    kept = replace(full, activation_checkpointing="none")
    assert kept.cp_attention_path == "ulysses"  # 2 x 6 <= 3 x 4
    # Document masking keeps the gathered K/V: 2 collectives against 2 passes.
    assert replace(kept, document_masking=True).cp_attention_path == "allgather"  # 2 x 6 > 2 x 4
    # Selective: half the layers each way, 6 collectives against 5 passes per two layers.
    assert replace(full, activation_checkpointing="selective").cp_attention_path == "allgather"  # 5 x 6 > 6 x 4


def test_document_masking_on_the_cpu_keeps_one_additive_mask_per_query_range():
    plain = workload(document_masking=True)
    extra = fsdp.moments(plain, device="cpu")[LAYER]["activations"]
    extra -= fsdp.moments(replace(plain, document_masking=False), device="cpu")[LAYER]["activations"]
    assert extra == 4 * 256 + 2 * 256 * 256  # int32 ids + a bf16 [256 x 256] mask shared by the layers

    # Before the blocks' backward: in it the kept blocks regather K/V without masking and peak
    # in the attention's backward instead, with less of the block saved.
    zigzag = workload(layout=Layout(context=2), document_masking=True, cp_attention="allgather")
    extra = fsdp.moments(zigzag, device="cpu")["loss backward"]["activations"]
    extra -= fsdp.moments(replace(zigzag, document_masking=False), device="cpu")["loss backward"]["activations"]
    # chunks of 64 tokens: rank 0's chunks 0 and 3 see 64 and 256 keys = 5 chunk pairs
    assert extra == 4 * 256 + 2 * 64 * 64 * 5


def test_document_masking_on_cuda_costs_only_the_block_tables():
    w = workload(document_masking=True, seq_len=131072)
    extra = (
        fsdp.moments(w)[LAYER]["activations"] - fsdp.moments(replace(w, document_masking=False))[LAYER]["activations"]
    )
    assert extra == 4 * 131072 + 16 * 1024 * 1024  # ids + four int32 tables of 1024 x 1024 blocks
