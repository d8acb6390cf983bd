"""The configs the estimator is checked against by tracing the entrypoints (test_traced.py,
scripts/estimator_table.py): TP, CP, PP, each activation-checkpointing mode, FP8 and each
gradient accumulation mode (with a bf16 reduce), on real Llama 3.1 8B and 70B shapes at 8K to
128K tokens. None is compiled: under fake tensors torch.compile runs eager (test_traced.py).

70B configs keep the real shapes (h 8192, f 28672, 64/8 heads, V 128256) with 4 to 8 of the
80 layers, so a trace takes seconds. Nothing is scaled: the estimate is computed for the same
truncated model, and every per-layer term (activations, gathered blocks, reduce-scatter
buffers) already appears several times, so the comparison exercises all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROLE = "arn:aws:iam::111122223333:role/SageMakerTrainingRole"
QWEN3_MOE_NO_AUX_LOSS = Path(__file__).with_name("qwen3_moe_4_layers_no_aux_loss.json")


@dataclass(frozen=True)
class TracedConfig:
    name: str
    model: str | dict
    seq_len: int
    instances: int = 1
    instance_type: str = "ml.p5.48xlarge"
    parallel: dict[str, Any] = field(default_factory=dict)
    precision: dict[str, Any] = field(default_factory=dict)
    global_batch_size: int = 8
    micro_batch_size: int = 1
    stage: int = 0  # the pipeline stage to trace
    optimizer: dict[str, Any] = field(default_factory=dict)  # training.optimizer
    training: dict[str, Any] = field(default_factory=dict)  # other training keys

    def recipe_dict(self) -> dict:
        return {
            "name": "traced",
            "model": self.model,
            "training": {
                "seq_len": self.seq_len,
                "global_batch_size": self.global_batch_size,
                "micro_batch_size": self.micro_batch_size,
                "steps": 100,
                "optimizer": self.optimizer,
                **self.training,
            },
            "precision": {"dtype": "bf16", **self.precision},
            "parallel": self.parallel,
            "cluster": {
                "backend": "sagemaker",
                "instance_type": self.instance_type,
                "instance_count": self.instances,
            },
            "sagemaker": {"role_arn": ROLE},
            "data": {"dtype": "uint32"},
        }

    def recipe(self):
        from launcher.recipe import Recipe

        return Recipe.from_dict(self.recipe_dict())


def llama70b(layers: int) -> dict:
    return {"base": "llama3.1-70b", "num_layers": layers}


def llama8b(layers: int = 32) -> str | dict:
    return "llama3.1-8b" if layers == 32 else {"base": "llama3.1-8b", "num_layers": layers}


def pp4_v2(accumulation: str, checkpointing: str, **parallel) -> dict:
    """`parallel` of an interleaved PP 4 x 2 layout."""
    return {
        "pipeline": 4,
        "virtual_stages": 2,
        "pipeline_schedule": "interleaved_1f1b",
        "activation_checkpointing": checkpointing,
        "grad_accumulation": accumulation,
        **parallel,
    }


def qwen3_moe(layers: int) -> dict:
    return {"base": "qwen3-30b-a3b", "num_layers": layers}


def pipelined_moe(what: str, **changes) -> TracedConfig:
    """Qwen3-30B-A3B's shapes without auxiliary losses at 4K, PP 2 x 2 interleaved, EP 8, 64 sequences."""
    return TracedConfig(
        f"Qwen3-30B-A3B 4K pp2 v2 ep8 none, {what}",
        {"hf_config": str(QWEN3_MOE_NO_AUX_LOSS)},
        4096,
        instances=2,
        parallel={"pipeline": 2, "virtual_stages": 2, "pipeline_schedule": "interleaved_1f1b", "expert": 8},
        global_batch_size=64,
        **changes,
    )


# global_batch_size is the data-parallel size times the micro-batches wanted: 1 for most
# (a trace costs a forward and backward per micro-batch), 2 where gradient accumulation
# matters, and at least the pipeline degree under PP.
PP4_INTERLEAVED_TP2 = {
    "pipeline": 4,
    "virtual_stages": 2,
    "pipeline_schedule": "interleaved_1f1b",
    "tensor": 2,
    "activation_checkpointing": "selective",
}

# Megatron-Bridge's Llama 3 70B H100 layout: TP 4, interleaved PP, no recomputation, bf16 gradients.
MEGATRON_BRIDGE_70B = {
    "pipeline": 4,
    "virtual_stages": 2,
    "pipeline_schedule": "interleaved_1f1b",
    "tensor": 4,
    "reduce_dtype": "bf16",
    "activation_checkpointing": "none",
}

MEGATRON_BRIDGE_70B_SCALED = TracedConfig(
    "70B 8K pp4 v2 tp4 dp2 fp8 none, bf16 reduce, 8 micro-batches (8 layers)",
    llama70b(8),
    8192,
    instances=4,
    parallel=MEGATRON_BRIDGE_70B,
    precision={"fp8": True},
    global_batch_size=16,
)

TP2_8B = TracedConfig("8B 8K dp4 tp2 (8 layers)", llama8b(8), 8192, parallel={"tensor": 2}, global_batch_size=4)
PP4_70B_SELECTIVE = TracedConfig(
    "70B 32K pp4 v2 tp2 dp4 selective (8 layers)",
    llama70b(8),
    32768,
    instances=4,
    instance_type="ml.p5e.48xlarge",
    parallel=PP4_INTERLEAVED_TP2,
    global_batch_size=16,
)


def llama3_paper_split(*, tensor: int, rank: int) -> TracedConfig:
    """The Llama 3 paper's 405B split scaled down to 14 layers over 4 x 4 stages: 0 | 1 x 14 | 0,
    the shard saved, no recomputation, 8 micro-batches, on 4 p5 nodes."""
    return TracedConfig(
        f"70B 8K pp4 v4 tp{tensor} dp{32 // 4 // tensor} shard-saved none, end stages without layers "
        f"(14 layers), rank {rank}",
        llama70b(14),
        8192,
        instances=4,
        parallel={
            "pipeline": 4,
            "virtual_stages": 4,
            "pipeline_schedule": "interleaved_1f1b",
            "tensor": tensor,
            "tp_saved_inputs": "shard",
            "activation_checkpointing": "none",
        },
        global_batch_size=8,
        stage=rank,
    )


def shard_saved(config: TracedConfig) -> TracedConfig:
    """`config` under parallel.tp_saved_inputs shard (parallel/regather.py)."""
    return replace(config, name=f"{config.name}, shard saved", parallel={**config.parallel, "tp_saved_inputs": "shard"})


PP2_V2_70B_SYNC_EACH = TracedConfig(
    "70B 4K pp2 v2 dp8 fp8 selective, sync_each (8 layers)",
    llama70b(8),
    4096,
    instances=2,
    parallel={
        "pipeline": 2,
        "virtual_stages": 2,
        "pipeline_schedule": "interleaved_1f1b",
        "activation_checkpointing": "selective",
        "grad_accumulation": "sync_each",
    },
    precision={"fp8": True},
    global_batch_size=16,
)


CONFIGS: list[TracedConfig] = [
    TracedConfig("8B 8K fsdp8", llama8b(), 8192, global_batch_size=8),
    TracedConfig(
        "8B 8K fsdp8 selective, 2 micro-batches",
        llama8b(),
        8192,
        parallel={"activation_checkpointing": "selective", "grad_accumulation": "sync_each"},
        global_batch_size=16,
    ),
    TP2_8B,
    TracedConfig(
        # Tensorwise FP8 on nccl: torchao's Float8 TP styles save the gathered inputs in float8.
        "8B 8K dp4 tp2 fp8 (8 layers)",
        llama8b(8),
        8192,
        parallel={"tensor": 2, "activation_checkpointing": "none"},
        precision={"fp8": True},
        global_batch_size=4,
    ),
    TracedConfig(
        # TP x CP keeping every activation, and an earlier micro-batch's embedding gradient
        # (V / tp rows, in the fp32 reduce dtype).
        "8B 8K tp2 cp2 dp2, 2 micro-batches (8 layers)",
        llama8b(8),
        8192,
        parallel={
            "tensor": 2,
            "context": 2,
            "cp_attention": "allgather",
            "activation_checkpointing": "none",
            "grad_accumulation": "sync_last_gathered",  # what auto picks
        },
        global_batch_size=4,
    ),
    TracedConfig(
        "8B 8K hsdp 2x4 full (8 layers)",
        llama8b(8),
        8192,
        parallel={"data_replicate": 2, "activation_checkpointing": "full"},
        global_batch_size=8,
    ),
    TracedConfig(
        # training.optimizer.state_dtype bf16: AdamWBf16Moments' bf16 moments and fp32 chunks.
        "8B 8K fsdp8 full, bf16 moments (8 layers)",
        llama8b(8),
        8192,
        parallel={"activation_checkpointing": "full"},
        optimizer={"state_dtype": "bf16"},
        global_batch_size=8,
    ),
    TracedConfig(
        "8B 8K fsdp8 fp8 selective (8 layers)",
        llama8b(8),
        8192,
        parallel={"activation_checkpointing": "selective"},
        precision={"fp8": True},
        global_batch_size=8,
    ),
    TracedConfig(
        "8B 32K dp4 cp2 full (8 layers)",
        llama8b(8),
        32768,
        parallel={"context": 2, "activation_checkpointing": "full"},
        global_batch_size=4,
    ),
    TracedConfig(
        # No recomputation: every layer keeps its K/V for backward, the rank's share only
        # (parallel/context.py regathers them in backward).
        "8B 64K cp8 none (4 layers)",
        llama8b(4),
        65536,
        parallel={"context": 8, "cp_attention": "allgather", "activation_checkpointing": "none"},
        global_batch_size=1,
    ),
    TracedConfig(
        # Ulysses without recomputation: wo saves its own copy of the attention output beside
        # SDPA's (parallel/ulysses.py). Fuzz seed 16: 2.8% under the trace before it was priced.
        "8B 64K tp2 cp4 ulysses none, shard saved, bf16 reduce (4 layers)",
        llama8b(4),
        65536,
        parallel={
            "tensor": 2,
            "context": 4,
            "cp_attention": "ulysses",
            "activation_checkpointing": "none",
            "tp_saved_inputs": "shard",
            "grad_accumulation": "sync_last",
            "reduce_dtype": "bf16",
        },
        global_batch_size=1,
    ),
    TracedConfig(
        # TP 8: w1's input gradient beside w3's outgrows w2's moment (f/t small beside h).
        # Fuzz seed 21: 2.3% under the trace before it was priced (`_mlp_input_gradient`).
        "70B 16K tp8 dp4 full, shard saved, bf16 reduce (6 layers)",
        llama70b(6),
        16384,
        instances=4,
        parallel={
            "tensor": 8,
            "activation_checkpointing": "full",
            "tp_saved_inputs": "shard",
            "reduce_dtype": "bf16",
        },
        global_batch_size=4,
    ),
    TracedConfig(
        # One layer a stage under selective: stage 1's kept chunks pile up while stage 5's
        # checkpointed ones go. Fuzz seed 20: rank 1 peaks in stage 5's fourth backward, 2.5%
        # under the trace before it was priced (`_heaviest_before_all_done`).
        "70B 32K cp2 pp4x2 selective sync_each, stage 1 (8 layers)",
        llama70b(8),
        32768,
        parallel={
            "context": 2,
            "pipeline": 4,
            "virtual_stages": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "activation_checkpointing": "selective",
            "grad_accumulation": "sync_each",
        },
        global_batch_size=8,
        stage=1,
    ),
    TracedConfig(
        "8B 128K cp8 full",
        llama8b(),
        131072,
        parallel={"context": 8, "activation_checkpointing": "full"},
        global_batch_size=1,
    ),
    TracedConfig(
        "8B 16K tp2 cp2 dp2 fp8 rowwise full (8 layers)",
        llama8b(8),
        16384,
        parallel={"tensor": 2, "context": 2, "activation_checkpointing": "full"},
        precision={"fp8": True, "fp8_recipe": "rowwise"},
        global_batch_size=2,
    ),
    TracedConfig("8B 8K pp2 dp4 1F1B (8 layers)", llama8b(8), 8192, parallel={"pipeline": 2}, global_batch_size=16),
    # parallel.grad_accumulation sync_each under PP: every micro-batch's gradients reduced into
    # their shards (pipeline.py's _GradientSyncEachMicroBatch), 4 micro-batches.
    TracedConfig(
        "8B 8K pp2 dp4 1F1B sync_each (8 layers)",
        llama8b(8),
        8192,
        parallel={"pipeline": 2, "grad_accumulation": "sync_each"},
        global_batch_size=16,
    ),
    TracedConfig(
        "8B 8K pp2 dp4 1F1B (8 layers), last stage",
        llama8b(8),
        8192,
        parallel={"pipeline": 2},
        global_batch_size=16,
        stage=1,
    ),
    TracedConfig(
        "8B 8K pp2 dp4 1F1B, uneven stages 3 | 4 (7 layers), last stage",
        llama8b(7),
        8192,
        parallel={"pipeline": 2},
        global_batch_size=16,
        stage=1,
    ),
    TracedConfig(
        "8B 8K pp4 dp2 gpipe selective (8 layers)",
        llama8b(8),
        8192,
        parallel={"pipeline": 4, "pipeline_schedule": "gpipe", "activation_checkpointing": "selective"},
        global_batch_size=8,
    ),
    TracedConfig(
        "70B 8K tp4 dp8 full (8 layers)",
        llama70b(8),
        8192,
        instances=4,
        parallel={"tensor": 4, "activation_checkpointing": "full"},
        global_batch_size=8,
    ),
    TracedConfig(
        "70B 128K tp2 cp16 fp8 full (8 layers)",
        llama70b(8),
        131072,
        instances=4,
        instance_type="ml.p5e.48xlarge",
        parallel={"tensor": 2, "context": 16, "activation_checkpointing": "full"},
        precision={"fp8": True},
        global_batch_size=1,
    ),
    PP4_70B_SELECTIVE,
    # The same with 8 micro-batches: the steady state reaches stage 0's second backward with
    # both stages' gradients accumulated and as many chunks in flight, its peak.
    TracedConfig(
        "70B 32K pp4 v2 tp2 dp4 selective, 8 micro-batches (8 layers)",
        llama70b(8),
        32768,
        instances=4,
        instance_type="ml.p5e.48xlarge",
        parallel=PP4_INTERLEAVED_TP2,
        global_batch_size=32,
    ),
    # Megatron-Bridge's 70B layout (TP 4, PP 8 x 5, FP8, no recomputation, bf16 gradients)
    # scaled down, one layer per chunk. Stage 0's embedding backward holds the micro-batch's
    # embedding gradient beside the accumulated one while 10 chunks are in flight; with
    # DTensor's RowwiseParallel both were dense V x h and this peaked there at 15.46 GiB
    # (VocabParallelEmbedding keeps V / tp rows: 12.98).
    MEGATRON_BRIDGE_70B_SCALED,
    # The Llama 3 paper's 405B split scaled down (arXiv 2407.21783, section 3.3.2: the first chunk
    # holds only the embedding, the last only the output layer and loss, one layer per other
    # chunk): 14 layers over 4 x 4 stages, 0 | 1 x 14 | 0, TP 4 saving the shard, no
    # recomputation, 8 micro-batches. Rank 1 holds the most layer-forwards (all its chunks have a
    # layer); each sent chunk output is let go (_release_sent_outputs).
    *(llama3_paper_split(tensor=4, rank=rank) for rank in (0, 1)),
    # The same at TP 8, as the paper ran it: with an eighth of the MLP per rank a block's backward
    # peaks last, where the attention input's three gradients are summed beside every weight
    # gradient but wq's (fsdp.py `_attention_input_gradient`; priced at the MLP's moment it was
    # 1.8% to 3.1% under the trace). Then TP 8 with selective checkpointing, whose recomputed
    # blocks keep the inputs they gather.
    llama3_paper_split(tensor=8, rank=1),
    TracedConfig(
        "70B 8K pp4 v2 tp8 shard-saved selective (8 layers)",
        llama70b(8),
        8192,
        instances=4,
        parallel={
            "pipeline": 4,
            "virtual_stages": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "tensor": 8,
            "tp_saved_inputs": "shard",
            "activation_checkpointing": "selective",
        },
        global_batch_size=8,
    ),
    # Its last rank: the loss stage's backward once both of the rank's stages hold gradients
    # (estimated 4.0% under the trace before the schedule replay named that moment).
    replace(MEGATRON_BRIDGE_70B_SCALED, name=f"{MEGATRON_BRIDGE_70B_SCALED.name}, last rank", stage=3),
    # parallel.tp_saved_inputs shard (parallel/regather.py, Megatron-Core's way): kept blocks hold
    # only their shard of the gathered inputs. Traced 0.97 GiB under the gathered run's 12.98;
    # in float8 (Float8 TP styles), in bf16, and with selective checkpointing, whose recomputed
    # blocks still keep what they gather.
    shard_saved(MEGATRON_BRIDGE_70B_SCALED),
    # The same with every micro-batch's gradients reduced into their bf16-reduced fp32 shards
    # (grad_accumulation sync_each under PP): rank 0, and the last rank, where the loss stage peaks.
    replace(
        MEGATRON_BRIDGE_70B_SCALED,
        name=f"{MEGATRON_BRIDGE_70B_SCALED.name}, sync_each",
        parallel={**MEGATRON_BRIDGE_70B, "grad_accumulation": "sync_each"},
    ),
    replace(
        MEGATRON_BRIDGE_70B_SCALED,
        name=f"{MEGATRON_BRIDGE_70B_SCALED.name}, sync_each, last rank",
        parallel={**MEGATRON_BRIDGE_70B, "grad_accumulation": "sync_each"},
        stage=3,
    ),
    # Found by tracing random layouts (scripts/estimator_fuzz.py). One layer per chunk at 4K under
    # sync_each: the rank peaks while FSDP reduces a block, its bf16 gradients beside the fp32
    # reduce-scatter input (fsdp.py `_pipelined_reduce_scatter`; 12.7% under the trace before).
    TracedConfig(
        "70B 4K pp4 v2 tp2 dp4 fp8 selective, sync_each, one layer per chunk (6 layers), rank 1",
        llama70b(6),
        4096,
        instances=4,
        parallel={**PP4_INTERLEAVED_TP2, "grad_accumulation": "sync_each"},
        precision={"fp8": True},
        global_batch_size=16,
        stage=1,
    ),
    # The loss stage's blocks run their backward beside the output weight's bf16 gradient, which
    # FSDP reduces once the stage is through (3.3% under the trace before); with a bf16 reduce
    # and the stage's gradients accumulating unsharded, it is the accumulated gradient itself.
    TracedConfig(
        "70B 4K pp4 tp4 dp2 selective shard-saved, sync_each, bf16 reduce (8 layers), last rank",
        llama70b(8),
        4096,
        instances=4,
        parallel={
            "pipeline": 4,
            "pipeline_schedule": "1f1b",
            "tensor": 4,
            "tp_saved_inputs": "shard",
            "activation_checkpointing": "selective",
            "grad_accumulation": "sync_each",
            "reduce_dtype": "bf16",
        },
        global_batch_size=16,
        stage=3,
    ),
    TracedConfig(
        "70B 4K pp2 tp2 dp4 full shard-saved, bf16 reduce (8 layers), last rank",
        llama70b(8),
        4096,
        instances=2,
        parallel={
            "pipeline": 2,
            "pipeline_schedule": "1f1b",
            "tensor": 2,
            "tp_saved_inputs": "shard",
            "activation_checkpointing": "full",
            "reduce_dtype": "bf16",
        },
        global_batch_size=8,
        stage=1,
    ),
    # Stage 0's root unit reduced after the embedding's backward under sync_each: the dense
    # embedding gradient beside the fp32 reduce-scatter input and its output (6.3% under before).
    TracedConfig(
        "8B 16K pp4 cp2 dp2 none, sync_each (6 layers)",
        llama8b(6),
        16384,
        instances=2,
        parallel={
            "pipeline": 4,
            "pipeline_schedule": "1f1b",
            "context": 2,
            "activation_checkpointing": "none",
            "grad_accumulation": "sync_each",
        },
        global_batch_size=8,
    ),
    # Interleaved, a later stage's steady backward: its second round holds one chunk of stage 2
    # and four of stage 0 beside both stages' gradients (14.3% under at the second backward).
    TracedConfig(
        "70B 16K cp2 pp2 v2 dp8 fp8 selective, bf16 reduce, 8 micro-batches (4 layers)",
        llama70b(4),
        16384,
        instances=4,
        parallel={
            "pipeline": 2,
            "virtual_stages": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "context": 2,
            "activation_checkpointing": "selective",
            "reduce_dtype": "bf16",
        },
        precision={"fp8": True},
        global_batch_size=64,
    ),
    # sync_each re-gathers a stage's blocks in each forward after its backward, and FSDP keeps the
    # all-gather's output through that forward: a middle rank peaks there (6.1% under before;
    # with the shard saved 7.2% then, 2.3% now: docs/estimator.md, "Random layouts").
    TracedConfig(
        "70B 32K tp2 cp4 pp4 fp8 none, sync_each (4 layers), rank 2",
        llama70b(4),
        32768,
        instances=4,
        parallel={
            "pipeline": 4,
            "pipeline_schedule": "1f1b",
            "tensor": 2,
            "context": 4,
            "activation_checkpointing": "none",
            "grad_accumulation": "sync_each",
        },
        precision={"fp8": True},
        global_batch_size=4,
        stage=2,
    ),
    # Found by tracing random layouts. Eager FP8's last MLP moment: the second of w1 and w3 casts
    # its output gradient again for its weight gradient, beside w2's and the first one's weight
    # gradients (fsdp.py `_gating_linear_cast`; 2.4% under the trace at w2's cast before).
    TracedConfig(
        "70B 8K cp2 dp16 fp8 full (6 layers)",
        llama70b(6),
        8192,
        instances=4,
        parallel={"context": 2, "activation_checkpointing": "full", "grad_accumulation": "sync_last_gathered"},
        precision={"fp8": True},
        global_batch_size=16,
    ),
    # And under sync_each in a pipeline chunk's second block, where FSDP's own backward prefetch
    # had gathered again the block resharded just before (parallel/fsdp.py
    # `chunk_backward_prefetch`): 5.8% under the trace before both.
    PP2_V2_70B_SYNC_EACH,
    # A bf16 reduce with the gradients unsynced over 2 micro-batches: by the blocks' backward the
    # output weight's gradient is the accumulated one (6.1% over the trace when counted twice).
    TracedConfig(
        "70B 16K tp4 cp4 dp2 selective, sync_last, bf16 reduce, 2 micro-batches (6 layers)",
        llama70b(6),
        16384,
        instances=4,
        parallel={
            "tensor": 4,
            "context": 4,
            "activation_checkpointing": "selective",
            "grad_accumulation": "sync_last",
            "reduce_dtype": "bf16",
        },
        global_batch_size=4,
    ),
    # GPipe, full AC, Float8 TP styles, sync_each (seed 1 of scripts/estimator_fuzz.py), rank 0 at
    # its second backward: the earlier micro-batch's output, still held by its send, and the
    # recomputation's float8-gathered incoming gradient and bf16 MLP input beside w2's cast
    # (`recomputed_cast`): 4.3% under the trace before.
    TracedConfig(
        "8B 16K tp2 pp2 gpipe fp8 full, sync_each, bf16 reduce (4 layers)",
        llama8b(4),
        16384,
        instances=4,
        parallel={
            "tensor": 2,
            "pipeline": 2,
            "pipeline_schedule": "gpipe",
            "activation_checkpointing": "full",
            "grad_accumulation": "sync_each",
            "reduce_dtype": "bf16",
        },
        precision={"fp8": True},
        global_batch_size=16,
    ),
    # Interleaved, sync_each, the loss stage's rank (seed 3): at its steady backward the other
    # stage's blocks are resharded after their own backward (`BackwardMoment.resharded`) and the
    # loss stage's chunk has let its head go: 4.9% over the trace before.
    replace(
        PP2_V2_70B_SYNC_EACH,
        name="70B 4K pp2 v2 fp8 full, sync_each, bf16 reduce (8 layers), last rank",
        parallel={**PP2_V2_70B_SYNC_EACH.parallel, "activation_checkpointing": "full", "reduce_dtype": "bf16"},
        global_batch_size=32,
        stage=1,
    ),
    # From random layouts (scripts/estimator_fuzz.py seeds 4, 5, 7, 9, 14 and 10), each a moment the
    # estimate had not priced, found in what the replay held at its peak:
    # the step-end reduce-scatter of stage 0's root with every unit still gathered and
    # accumulated (`_step_end_reduce_scatters`): 6.3% under the trace before;
    TracedConfig(
        "70B 8K pp4 v2 full, sync_last_gathered (6 layers)",
        llama70b(6),
        8192,
        parallel=pp4_v2("sync_last_gathered", "full"),
        global_batch_size=8,
    ),
    # a checkpointed block's first forward, FeedForward's locals kept (`_checkpointed_forward`): 5.5%;
    TracedConfig(
        "70B 8K tp2 pp4 v2 selective, sync_each (6 layers), rank 1",
        llama70b(6),
        8192,
        instances=2,
        parallel=pp4_v2("sync_each", "selective", tensor=2),
        global_batch_size=16,
        stage=1,
    ),
    # the root's reduce-scatter at the end of backward (`_root_reduce_scatter`): 2.5%;
    TracedConfig(
        "8B 8K dp8 cp2 fp8 selective, sync_each (4 layers)",
        llama8b(4),
        8192,
        instances=2,
        parallel={"context": 2, "activation_checkpointing": "selective", "grad_accumulation": "sync_each"},
        precision={"fp8": True},
        global_batch_size=8,
    ),
    # under sync_each the loss stage's root reduced at its chunk's end (`_output_reduce_scatter`): 6.7%;
    TracedConfig(
        "70B 4K tp2 pp4 v2 fp8 selective shard-saved, sync_each (6 layers), last rank",
        llama70b(6),
        4096,
        instances=2,
        parallel=pp4_v2("sync_each", "selective", tensor=2, tp_saved_inputs="shard"),
        precision={"fp8": True},
        global_batch_size=8,
        stage=3,
    ),
    # stage 0's first backward after four of stage 4, the embedding's gradient copied to fp32
    # beside itself (`_uncovered_stage_firsts`, "embedding accumulated"): 3.4%;
    TracedConfig(
        "70B 4K pp4 v2 none, sync_last_gathered, 8 micro-batches (8 layers)",
        llama70b(8),
        4096,
        instances=4,
        parallel=pp4_v2("sync_last_gathered", "none"),
        global_batch_size=32,
    ),
    # the loss stage's rank in its other stage's backward under sync_each, the output layer
    # resharded with the loss stage after that stage's backward (`_with_gradients`): 3.4% over;
    TracedConfig(
        "70B 8K tp2 pp2 v2 full, sync_each (6 layers), last rank",
        llama70b(6),
        8192,
        parallel={**PP2_V2_70B_SYNC_EACH.parallel, "tensor": 2, "activation_checkpointing": "full"},
        global_batch_size=16,
        stage=1,
    ),
    # and (seed 10) without pipelining, selective, the third block reached in backward: the first
    # recomputed one after a kept one, with two gradient shards done (`_unpipelined_moments`): 2.2%.
    TracedConfig(
        "70B 32K tp8 cp4 selective, one micro-batch (8 layers)",
        llama70b(8),
        32768,
        instances=4,
        parallel={
            "tensor": 8,
            "context": 4,
            "activation_checkpointing": "selective",
            "grad_accumulation": "sync_last_gathered",
        },
        global_batch_size=1,
    ),
    shard_saved(TP2_8B),
    shard_saved(PP4_70B_SELECTIVE),
    TracedConfig(
        "8B 8K fsdp8 sync_last_gathered selective, 2 micro-batches (4 layers)",
        llama8b(4),
        8192,
        parallel={"grad_accumulation": "sync_last_gathered", "activation_checkpointing": "selective"},
        global_batch_size=16,
    ),
    TracedConfig(
        "8B 8K dp4 tp2 sync_last, bf16 reduce, 2 micro-batches (4 layers)",
        llama8b(4),
        8192,
        parallel={"tensor": 2, "grad_accumulation": "sync_last", "reduce_dtype": "bf16"},
        global_batch_size=8,
    ),
    TracedConfig(  # Qwen3: q_norm and k_norm save the projections' outputs and an rstd per head
        "Qwen3 8B 16K fsdp8 (4 layers)",
        {"base": "qwen3-8b", "num_layers": 4},
        16384,
        global_batch_size=8,
    ),
    # Mixture of experts (launcher/estimate/moe.py): the experts in the block's FSDP unit, then split
    # over EP ranks with the traced rank receiving the routing bound's share of rows.
    TracedConfig("Qwen3-30B-A3B 8K fsdp8 (4 layers)", qwen3_moe(4), 8192, global_batch_size=8),
    TracedConfig(  # FP8 experts: torchao's grouped GEMM on 16-row padded groups (entrypoints/model/fp8_experts.py)
        "Qwen3-30B-A3B 16K fsdp8 ep8 fp8 experts selective (4 layers)",
        qwen3_moe(4),
        16384,
        parallel={"expert": 8, "activation_checkpointing": "selective"},
        precision={"fp8": True, "fp8_experts": True},
        global_batch_size=8,
    ),
    # Pipelined MoE: the contract refuses PP with auxiliary losses (they pool every layer's
    # routing), so Qwen3-30B-A3B's shapes come from a config.json with router_aux_loss_coef 0.
    # The last rank peaks in its loss backward once both its stages hold gradients (4.0% under
    # the trace before that moment was counted).
    pipelined_moe("8 micro-batches (4 layers, no aux loss), last rank", stage=1),
    # FP8 experts under interleaved 1F1B, which Megatron-Bridge's Qwen3-30B-A3B rows run: every
    # chunk in flight keeps the experts' rows and w2's input as float8 copies (fp8_experts.py).
    pipelined_moe(
        "FP8 experts, 8 micro-batches (4 layers, no aux loss), first rank", precision={"fp8": True, "fp8_experts": True}
    ),
    # Round-robin routing: each EP rank receives exactly the balanced share.
    pipelined_moe(
        "round-robin routing, 8 micro-batches (4 layers, no aux loss), first rank",
        training={"moe_force_load_balance": True},
    ),
    TracedConfig(
        "Qwen3-30B-A3B 32K dp4 cp2 ep8 full (4 layers)",
        qwen3_moe(4),
        32768,
        parallel={"context": 2, "expert": 8, "activation_checkpointing": "full"},
        global_batch_size=4,
    ),
    TracedConfig(
        "Mixtral 8x7B 8K dp4 tp2 (4 layers)",
        {"base": "mixtral-8x7b", "num_layers": 4},
        8192,
        parallel={"tensor": 2},
        global_batch_size=4,
    ),
    # Fewer experts a rank than shard ranks: FSDP shards their dim 1 (parallel/fsdp.py,
    # expert_placement). On dim 0 one rank held whole experts and another none: fuzz --family
    # moe seeds 1-2, Mixtral on 16 GPUs under EP 4 and 8, 26-40% under the trace before (these
    # two: 23.3 and 36.0 GiB traced then, against 16.8 and 21.2 estimated).
    TracedConfig(
        "Mixtral 8x7B 4K dp16 ep4 (4 layers), 2 experts a rank over 4 shards",
        {"base": "mixtral-8x7b", "num_layers": 4},
        4096,
        instances=2,
        parallel={"expert": 4, "activation_checkpointing": "full", "grad_accumulation": "sync_last_gathered"},
        global_batch_size=32,
    ),
    TracedConfig(
        "Mixtral 8x7B 4K dp16 (4 layers), 8 experts over 16 shards",
        {"base": "mixtral-8x7b", "num_layers": 4},
        4096,
        instances=2,
        global_batch_size=16,
    ),
    # Over one FSDP rank (dp 1) a steady forward under sync_each keeps no all-gather output: fuzz
    # seed 25, 2.1% over the trace before (launcher/estimate/fsdp.py `_chunk_forward`).
    TracedConfig(
        "Llama 3.1 8B 8K tp8 pp4 dp1 sync_each (8 layers), rank 1",
        {"base": "llama3.1-8b", "num_layers": 8},
        8192,
        instances=4,
        parallel={"tensor": 8, "pipeline": 4, "pipeline_schedule": "1f1b", "grad_accumulation": "sync_each"},
        global_batch_size=4,
        stage=1,
    ),
    # What FSDP holds of the experts in backward under EP (launcher/estimate/fsdp.py
    # `_gathered_in_backward`), from fuzz --family moe seeds 1 and 3: no other block's experts
    # beside the MLP's backward (+6.1% before); the SwiGLU's recomputed forward; the experts'
    # dim-1 copy-out through temporaries (-6.0% without it); their reduce-scatter over
    # expert_fsdp 1, unpipelined and pipelined (-3.7% and -3.6% without it).
    TracedConfig(
        "Mixtral 8x7B 4K dp16 ep4 full sync_each (4 layers), experts prefetched with their block",
        {"base": "mixtral-8x7b", "num_layers": 4},
        4096,
        instances=2,
        parallel={"expert": 4, "activation_checkpointing": "full", "grad_accumulation": "sync_each"},
        global_batch_size=32,
    ),
    TracedConfig(
        "Mixtral 8x7B 8K dp16 ep2 sync_each (4 layers), 4 experts a rank copied out of 8 dim-1 shards",
        {"base": "mixtral-8x7b", "num_layers": 4},
        8192,
        instances=2,
        parallel={"expert": 2, "grad_accumulation": "sync_each"},
        global_batch_size=32,
    ),
    # FSDP's reduce-scatter of experts sharded on dim 1: each gradient replaced by a copy laid out
    # by shard, all of them beside the input with the last original (`_reduce_scatter_transient`;
    # estimator_fuzz --family moe seed 31: -2.6% at 6 layers, -3.3% at 4 before).
    TracedConfig(
        "Mixtral 8x7B 4K dp16 ep2 selective sync_each round-robin (4 layers), dim-1 experts reduced",
        {"base": "mixtral-8x7b", "num_layers": 4},
        4096,
        instances=2,
        parallel={"expert": 2, "activation_checkpointing": "selective", "grad_accumulation": "sync_each"},
        global_batch_size=32,
        training={"moe_force_load_balance": True},
    ),
    TracedConfig(
        "Mixtral 8x7B 4K tp4 dp2 ep8 sync_each round-robin (4 layers), experts reduced over 1 rank",
        {"base": "mixtral-8x7b", "num_layers": 4},
        4096,
        parallel={"tensor": 4, "expert": 8, "grad_accumulation": "sync_each"},
        global_batch_size=4,
        training={"moe_force_load_balance": True},
    ),
    TracedConfig(
        "Qwen3-30B-A3B 8K tp4 pp2 dp2 ep2 fp8 selective sync_each round-robin (4 layers, no aux loss), last rank",
        {"hf_config": str(QWEN3_MOE_NO_AUX_LOSS)},
        8192,
        instances=2,
        parallel={
            "tensor": 4,
            "pipeline": 2,
            "expert": 2,
            "activation_checkpointing": "selective",
            "grad_accumulation": "sync_each",
            "pipeline_schedule": "1f1b",
        },
        precision={"fp8": True},
        global_batch_size=4,
        stage=1,
        training={"moe_force_load_balance": True},
    ),
    # Llama fuzz seeds 2, 3 and 26 (launcher/estimate/fsdp.py). Under a bf16 reduce with the
    # gradients unsynced, w2's gradient as its GEMM makes it, before autograd adds it in (-3.5%
    # before, `_Block._in_backward`).
    TracedConfig(
        "70B 4K tp4 pp4 dp2 selective, shard saved, sync_last_gathered, bf16 reduce (4 layers), rank 1",
        llama70b(4),
        4096,
        instances=4,
        parallel={
            "tensor": 4,
            "pipeline": 4,
            "pipeline_schedule": "1f1b",
            "activation_checkpointing": "selective",
            "tp_saved_inputs": "shard",
            "grad_accumulation": "sync_last_gathered",
            "reduce_dtype": "bf16",
        },
        global_batch_size=8,
        stage=1,
    ),
    # On a stage's first backward, the blocks done hold their accumulated fp32 gradients beside
    # the chunk's recomputed block (-4.5% before, `_chunk_moments`).
    TracedConfig(
        "8B 16K pp2 v2 dp4 selective, sync_last_gathered (6 layers), rank 0's first backward",
        llama8b(6),
        16384,
        parallel={
            "pipeline": 2,
            "virtual_stages": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "activation_checkpointing": "selective",
            "grad_accumulation": "sync_last_gathered",
        },
        global_batch_size=8,
    ),
    # Over one FSDP rank a backward prefetch holds nothing (+3.7% before, `_Block.prefetch_holds`).
    TracedConfig(
        "8B 8K tp4 pp4 dp1 gpipe selective, shard saved, sync_each, bf16 reduce (6 layers), rank 2",
        llama8b(6),
        8192,
        instances=2,
        parallel={
            "tensor": 4,
            "pipeline": 4,
            "pipeline_schedule": "gpipe",
            "activation_checkpointing": "selective",
            "tp_saved_inputs": "shard",
            "grad_accumulation": "sync_each",
            "reduce_dtype": "bf16",
        },
        global_batch_size=4,
        stage=2,
    ),
    # A kept block's attention backward under CP: the later chunk's prefix piece beside the
    # diagonal piece's gradients, and the MLP's weight gradients (-2.0% before,
    # `_context_parallel_kv`).
    TracedConfig(
        "70B 16K cp4 dp4 none, sync_each, bf16 reduce (4 layers)",
        llama70b(4),
        16384,
        instances=2,
        parallel={
            "context": 4,
            "activation_checkpointing": "none",
            "grad_accumulation": "sync_each",
            "reduce_dtype": "bf16",
        },
        global_batch_size=8,
    ),
    # And in a checkpointed block, over the K/V its recomputation kept (-2.6% before, fuzz seed 28).
    TracedConfig(
        "70B 16K cp4 pp2 v2 dp2 full, sync_each, bf16 reduce (4 layers), rank 0",
        llama70b(4),
        16384,
        instances=2,
        parallel={
            "context": 4,
            "pipeline": 2,
            "virtual_stages": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "activation_checkpointing": "full",
            "grad_accumulation": "sync_each",
            "reduce_dtype": "bf16",
        },
        global_batch_size=8,
    ),
    # Eager FP8's cast of w1's or w3's output gradient under the Float8 TP styles, beside w2's
    # weight gradient and the MLP's regathered input (-2.2% before, fuzz seed 30,
    # `_gating_linear_cast_tp`).
    TracedConfig(
        "70B 64K tp2 cp4 pp2 dp2 fp8 none, shard saved, sync_last_gathered (4 layers), last rank",
        llama70b(4),
        65536,
        instances=4,
        parallel={
            "tensor": 2,
            "context": 4,
            "pipeline": 2,
            "pipeline_schedule": "1f1b",
            "activation_checkpointing": "none",
            "tp_saved_inputs": "shard",
            "grad_accumulation": "sync_last_gathered",
        },
        precision={"fp8": True},
        global_batch_size=8,
        stage=1,
    ),
    # A checkpointed MoE block on a stage without the loss recomputes inside its combine's
    # backward, beside the incoming gradient copied into rows (-2.1% before, MoE fuzz seed 4,
    # `_Block._in_backward`).
    TracedConfig(
        "Qwen3-30B-A3B 4K pp2 ep8 full, FP8 experts (4 layers, no aux loss), first rank",
        {"hf_config": str(QWEN3_MOE_NO_AUX_LOSS)},
        4096,
        instances=2,
        parallel={"pipeline": 2, "pipeline_schedule": "1f1b", "expert": 8, "activation_checkpointing": "full"},
        precision={"fp8": True, "fp8_experts": True},
        global_batch_size=16,
    ),
    # Megatron-Bridge's Qwen3-235B-A22B H100 layout (TP 2, EP 32 with expert_tensor_parallel_size
    # 1: scripts/performance/configs/qwen/qwen3_workload_base_configs.py, v0.4.0) without its
    # pipeline: the tp ranks route their own tokens, and EP 32 spans tp 2 x dp_shard 16.
    TracedConfig(
        "Qwen3-235B-A22B 4K tp2 dp16 ep32 fp8 experts selective (4 layers), EP spanning tp",
        {"base": "qwen3-235b-a22b", "num_layers": 4},
        4096,
        instances=4,
        parallel={"tensor": 2, "expert": 32, "activation_checkpointing": "selective"},
        precision={"fp8": True, "fp8_experts": True},
        global_batch_size=16,
    ),
    TracedConfig(
        "Mixtral 8x7B 32K tp2 cp2 dp2 ep4 full (4 layers)",
        {"base": "mixtral-8x7b", "num_layers": 4},
        32768,
        parallel={"tensor": 2, "context": 2, "expert": 4, "activation_checkpointing": "full"},
        global_batch_size=2,
    ),
    TracedConfig(
        "Mistral 7B 32K dp4 cp2 fp8 selective (8 layers)",
        {"base": "mistral-7b", "num_layers": 8},
        32768,
        parallel={"context": 2, "activation_checkpointing": "selective"},
        precision={"fp8": True},
        global_batch_size=4,
    ),
]
