"""`parallelize`: every parallelism applied to one model (or one pipeline stage), in order.

    mesh = build_mesh(cfg.parallel, "cpu")
    parts = build_model_parts(cfg, mesh)          # meta model -> fp8 -> pipeline split -> parallelize
                                                  # (and the expert mesh: `Layout.experts_apart`)
    parallelize(model, mesh, cfg)                 # the same steps for a model you built yourself

Both work under FakeTensorMode with a fake process group (the memory estimator traces them);
nothing here allocates real memory before `model/init.py:materialize`.
"""

from __future__ import annotations

import torch

from entrypoints.fp8 import Fp8Settings, convert_to_float8
from entrypoints.model.llama import Transformer, build_model
from entrypoints.model.moe import force_load_balance
from entrypoints.parallel.activation import apply_activation_checkpointing, keep_product
from entrypoints.parallel.context import apply_context_parallel
from entrypoints.parallel.expert import apply_expert_parallel, apply_routing_group, build_expert_mesh, expert_fsdp_mesh
from entrypoints.parallel.fsdp import apply_fsdp
from entrypoints.parallel.mesh import fsdp_mesh
from entrypoints.parallel.pipeline import split_model
from entrypoints.parallel.tensor import apply_tensor_parallel
from entrypoints.parallel.ulysses import UlyssesAttention
from launcher.contract.config import JobConfig
from launcher.contract.layout import checkpointed_layers, rank_stages

PARAM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
REDUCE_DTYPES = PARAM_DTYPES


def parallelize(model: Transformer, mesh, cfg: JobConfig, *, fp8: Fp8Settings | None = None, expert_mesh=None) -> None:
    """Apply TP -> CP -> EP -> AC -> compile -> FSDP to `model` in place (torchtitan's order;
    `expert_mesh`: build_expert_mesh's, where a MoE model's experts are a unit of their own)."""
    par = cfg.parallel
    held = {int(key) for key in model.layers}
    checkpointed = held & checkpointed_layers(par.activation_checkpointing, cfg.model.num_layers, par)
    regathering = set() if par.tensor == 1 or par.tp_saved_inputs != "shard" else {int(k) for k in model.layers}
    regathering -= checkpointed

    # 1. Tensor + sequence parallel first: it turns weights into TP-sharded DTensors, which
    #    FSDP below shards again (2-D), and it addresses submodules by their plain names.
    if par.tensor > 1:
        apply_tensor_parallel(
            model,
            mesh["tp"],
            float8_styles=fp8 is not None and fp8.float8_all_gather,
            saved_inputs=par.tp_saved_inputs,
            checkpointed=checkpointed,
        )

    # 2. Context parallel: zigzag RoPE positions, and attention over the cp group by the K/V
    #    all-gather or Ulysses' all-to-alls. Touches no parameter; FSDP shards over cp as well.
    if par.context > 1:
        ulysses = UlyssesAttention(mesh["cp"]) if par.cp_attention == "ulysses" else None
        apply_context_parallel(model, mesh["cp"], ulysses, checkpointed=checkpointed)

    # 3. Expert parallel after TP (which leaves the experts whole) and before AC and FSDP, as
    #    torchtitan's llama4 parallelize_llama does: experts become ep-sharded DTensors, which
    #    FSDP shards again over expert_fsdp. MoE layers pool routing statistics over cp x tp.
    if expert_mesh is not None:
        apply_expert_parallel(model, expert_mesh, par.tensor)
    if par.context * par.tensor > 1:
        apply_routing_group(model, mesh["cp_tp"], par.tensor)

    # 4. Activation checkpointing wraps whole blocks, after TP/CP have edited their insides.
    if checkpointed:
        apply_activation_checkpointing(model, checkpointed)

    # 5. Compile each block after AC, so the recomputation is compiled with it, and before
    #    FSDP, so FSDP's all-gather/reduce-scatter hooks stay outside the compiled graphs.
    if cfg.training.compile:
        compile_blocks(model, regathering)

    # 6. FSDP last: it shards whatever the steps above left, block by block, then the root.
    #    Under pipeline parallelism and sync_last_gathered, blocks stay gathered after forward
    #    (the last micro-batch's backward reshards them: accumulate.py; under PP with sync_each
    #    every backward does, pipeline.py).
    apply_fsdp(
        model,
        fsdp_mesh(mesh),
        param_dtype=PARAM_DTYPES[cfg.precision.dtype],
        reshard_after_forward=par.pipeline == 1 and par.grad_accumulation != "sync_last_gathered",
        reduce_dtype=REDUCE_DTYPES[par.reduce_dtype],
        expert_mesh=None if expert_mesh is None else expert_fsdp_mesh(expert_mesh),
        pipelined=par.pipeline > 1,
    )


def compile_blocks(model: Transformer, regathering: set[int]) -> None:
    """torch.compile every block whole, but in the blocks that regather their sequence-parallel
    inputs (parallel/regather.py) only the attention's and the MLP's forward: their input
    preparation and saved-tensor hooks must run eagerly around the compiled graphs, whose saves
    they then see (compiling them into the block gave wrong gradients on torch 2.13; eager
    hooks around compiled forwards matched the eager run, gloo, TP 2). A compiled block keeps its
    SwiGLU product (model/swiglu.py): its hooks would run inside the graph."""
    for key, block in model.layers.items():
        keep_product(block)
        if int(key) in regathering:
            for module in (block.attention, block.feed_forward):
                module.forward = torch.compile(module.forward)
        else:
            block.compile()


def build_model_parts(cfg: JobConfig, mesh, *, fp8: Fp8Settings | None = None) -> tuple[list[Transformer], list[int]]:
    """This rank's parallelised meta model parts and their pipeline stage ids ([model], [0] without PP)."""
    model = build_model(
        cfg.model, seq_len=cfg.training.seq_len, device="meta", document_positions=cfg.data.document_positions
    )
    if cfg.training.moe_force_load_balance:
        force_load_balance(model)
    # FP8 conversion runs first, on the whole meta model, so every stage gets Float8Linear layers.
    if fp8 is not None:
        convert_to_float8(model, fp8)
    par = cfg.parallel
    experts_apart = cfg.model.moe is not None and par.experts_apart
    expert_mesh = build_expert_mesh(par, mesh.device_type) if experts_apart else None
    if par.pipeline > 1:
        ids = rank_stages(mesh["pp"].get_local_rank(), par)
        parts = [split_model(model, i, par) for i in ids]
    else:
        ids, parts = [0], [model]
    for part in parts:
        parallelize(part, mesh, cfg, fp8=fp8, expert_mesh=expert_mesh)
    return parts, ids
