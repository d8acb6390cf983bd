"""Properties every estimate must have, on random models, layouts and sequence lengths."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.catalog import models
from launcher.contract.layout import Layout
from launcher.estimate import COMPONENTS, Workload, estimate_memory, fsdp, megatron
from launcher.recipe.hardware import hardware_for

H200 = hardware_for("ml.p5en.48xlarge")  # 8 x h200-141gb
ARCHS = [models()[key] for key in ("llama3.1-8b", "llama3.1-70b", "mistral-7b", "llama3.2-1b", "llama-tiny")]
MODES = ("none", "selective", "full")
ACTIVATION_COMPONENTS = ("activations", "tp_buffers", "cp_buffers")


@st.composite
def workloads(draw, *, pipeline: bool = True) -> Workload:
    arch = draw(st.sampled_from(ARCHS))
    tensor = draw(st.sampled_from([t for t in (1, 2, 4, 8) if arch.num_kv_heads % t == 0]))
    context = draw(st.sampled_from([1, 2, 4, 8]))
    # Pipeline degrees that split the layers unevenly too (3 stages of 32 layers: 10 | 11 | 11).
    p = draw(st.sampled_from([1, 2, 3, 4] if pipeline else [1]))
    v = draw(st.sampled_from([v for v in (1, 2) if p * v <= arch.num_layers])) if p > 1 else 1
    seq_len = 2 * context * tensor * draw(st.sampled_from([64, 256, 1024, 4096]))
    return Workload(
        arch=arch,
        layout=Layout(
            tensor=tensor,
            context=context,
            pipeline=p,
            virtual_stages=v,
            data_shard=draw(st.sampled_from([1, 2, 8])),
            data_replicate=draw(st.sampled_from([1, 2])),
        ),
        seq_len=seq_len,
        micro_batch_size=draw(st.sampled_from([1, 2])),
        grad_accum_steps=draw(st.sampled_from([p, 2 * p, 4 * p])),
        fp8=draw(st.booleans()),
        fp8_recipe=draw(st.sampled_from(["tensorwise", "rowwise"])),
        activation_checkpointing=draw(st.sampled_from(MODES)),
        pipeline_schedule="interleaved_1f1b" if v > 1 else draw(st.sampled_from(["1f1b", "gpipe"])),
    )


def activation_bytes(w: Workload, mode: str) -> int:
    if mode == "megatron":
        return max(s.breakdown["activations"] + s.breakdown["working"] for s in megatron.stage_peaks(w))
    return max(fsdp.saved_activation_bytes(w, rank=rank) for rank in range(w.layout.pipeline))


def peak(w: Workload, mode: str = "fsdp") -> int:
    return estimate_memory(w, H200, mode=mode).per_gpu_peak_bytes


@settings(max_examples=150, deadline=None)
@given(workloads(), st.sampled_from(["fsdp", "megatron"]))
def test_more_context_parallelism_means_fewer_activation_bytes_per_gpu(w, mode):
    more = replace(w, layout=replace(w.layout, context=2 * w.layout.context), seq_len=w.seq_len)
    assert activation_bytes(more, mode) < activation_bytes(w, mode)


@settings(max_examples=150, deadline=None)
@given(workloads(), st.sampled_from(["fsdp", "megatron"]))
def test_more_tensor_parallelism_means_fewer_activation_bytes_per_gpu(w, mode):
    t = 2 * w.layout.tensor
    if w.arch.num_kv_heads % t:
        return
    more = replace(w, layout=replace(w.layout, tensor=t), seq_len=2 * w.seq_len)
    less = replace(w, seq_len=2 * w.seq_len)
    assert activation_bytes(more, mode) < activation_bytes(less, mode)


@settings(max_examples=150, deadline=None)
@given(workloads(), st.sampled_from(["fsdp", "megatron"]))
def test_longer_sequences_need_more_memory(w, mode):
    longer = replace(w, seq_len=2 * w.seq_len)
    assert activation_bytes(longer, mode) > activation_bytes(w, mode)
    assert peak(longer, mode) > peak(w, mode)


@settings(max_examples=150, deadline=None)
@given(workloads(), st.sampled_from(["fsdp", "megatron"]))
def test_full_checkpointing_needs_no_more_than_selective_which_needs_no_more_than_none(w, mode):
    none, selective, full = (replace(w, activation_checkpointing=m) for m in MODES)
    assert activation_bytes(full, mode) <= activation_bytes(selective, mode) <= activation_bytes(none, mode)
    # The peak may rise by up to one layer's gathered K/V: under context parallelism a recomputed
    # block holds them through its MLP's backward, where a kept block gathers them again only for
    # its attention's, once the MLP's saved set is gone (fsdp.py `in_backward`). Found by
    # hypothesis: Llama 3.1 70B at 256 tokens, CP 2, selective 0.55 MB above none; Mistral 7B at
    # 1K tokens, micro-batch 2, CP 2, 4.4 MB (0.012%), under the 8.4 MB of one layer's K and V.
    kv = 2 * 2 * w.micro_batch_size * w.seq_len * w.arch.kv_dim / w.layout.tensor if w.layout.context > 1 else 0
    # Under the Float8 TP styles a pipelined rank without checkpointing peaks at a steady
    # forward's w2 cast, and with it at a recomputation's w2 cast in backward: two moments that
    # the estimate prices from different terms, each within 1% of the trace but not exactly.
    # Found by hypothesis: llama-tiny, TP 2, PP 2 x 2, FP8, sync_each, 8 micro-batches: the
    # estimate puts selective 5.6 KB (0.08%) above none; traced (dp 2), selective is 0.5% below
    # none, and the estimates are within 0.8% of both. Then the same at micro-batch 2 and 256
    # tokens, interleaved: the estimate puts selective 110 KB above none, and the trace (dp 2)
    # has selective above none too, by 38 KB (0.47%): the recomputation holds w2's bf16 input
    # made again beside its float8 cast (fsdp.py `_eager_fp8_moments`), which the forward does
    # not. Allowed: w2's input in bf16 and in float8, 3 bytes per element.
    w2_elements = w.micro_batch_size * w.seq_len / w.layout.context * w.arch.ffn_hidden_size / w.layout.tensor
    float8_tp_styles = w.fp8 and w.fp8_recipe == "tensorwise" and w.layout.tensor > 1 and w.layout.pipeline > 1
    cast_slack = 3 * w2_elements if float8_tp_styles else 0
    # Each mode's peak is priced within 1% of its trace, their order not to the byte. Found by
    # hypothesis: Mistral 7B at 512 tokens, micro-batch 2, CP 4: the estimate puts selective
    # 4.5 MiB above none; traced (4 layers, dp 2), selective is 2 MiB below none, and both
    # estimates are within 0.63% of their traces. Allowed: 0.05% of the peak.
    noise = 0.0005 * peak(none, mode)
    assert peak(full, mode) <= peak(selective, mode) + kv + noise
    assert peak(selective, mode) <= peak(none, mode) + kv + cast_slack + noise


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_fp8_changes_only_float8_casts_gathered_weights_and_the_block_working_set(w):
    """FP8 linears save their inputs as given, bf16 ones, so states, activations, gathered
    sequences and the loss stay; what changes is the float8 cast, the float8 all-gather
    (tensorwise) and which moment of a block's backward is largest. Under TP, tensorwise FP8's
    Float8 TP styles hand the linears float8 inputs, which can only shrink what is saved."""
    bf16, fp8 = replace(w, fp8=False), replace(w, fp8=True)
    changeable = {"fp8", "fsdp_buffers", "working"}
    regathers_kv = w.layout.context > 1 and w.cp_attention_path == "allgather" and not w.document_masking
    if regathers_kv or w.arch.moe is None:
        # A dense block's backward ends where its attention input's gradients are summed, after
        # the MLP's saved set is freed (and a block regathering K/V has the attention's moment
        # too): the float8 cast can tip which of its moments is larger, and they keep different
        # shares of the block's saved and gathered tensors.
        changeable |= {"activations", "tp_buffers", "cp_buffers"}
    float8_inputs = w.layout.tensor > 1 and w.fp8_recipe == "tensorwise"  # nccl: fsdp.moments' cuda
    shrinkable = {"activations", "tp_buffers"} if float8_inputs else set()
    for rank in range(w.layout.pipeline):
        before, after = fsdp.moments(bf16, rank=rank), fsdp.moments(fp8, rank=rank)
        assert before.keys() == after.keys()
        for name in before:
            for component in COMPONENTS:
                if component in changeable:
                    continue
                if component in shrinkable:
                    assert after[name][component] <= before[name][component], (name, component)
                else:
                    assert before[name][component] == after[name][component], (name, component)
            assert before[name]["fp8"] == 0


@settings(max_examples=100, deadline=None)
@given(workloads())
def test_megatron_mode_ignores_fp8(w):
    assert peak(replace(w, fp8=True), "megatron") == peak(replace(w, fp8=False), "megatron")


@settings(max_examples=100, deadline=None)
@given(workloads())
def test_every_stage_reports_every_component_and_the_peak_is_the_heaviest_stage(w):
    estimate = estimate_memory(w, H200)
    assert len(estimate.stages) == w.layout.pipeline
    for stage in estimate.stages:
        assert tuple(stage.breakdown) == COMPONENTS
        assert all(value >= 0 for value in stage.breakdown.values())
    assert estimate.per_gpu_peak_bytes == max(s.peak_bytes for s in estimate.stages)
    assert estimate.breakdown == estimate.stages[estimate.peak_stage].breakdown
