"""FP8 training of the linear layers with torchao's float8 (tensorwise or rowwise scaling).

    settings = fp8_settings(cfg, device_type="cuda", backend="nccl")   # checks the hardware
    convert_to_float8(model, settings)                                 # on the meta model, first

Runs before any parallelism, on the meta model (as torchtitan does). Every nn.Linear in the
blocks becomes a Float8Linear; the output projection stays in the compute dtype (the fused
loss reads its weight directly), as do a mixture of experts' routers and layers whose
dimensions are not multiples of 16. With
precision.fp8_experts a mixture-of-experts block's grouped experts run FP8 grouped GEMMs,
rowwise (model/fp8_experts.py), where the kernel exists.

- tensorwise: one scale per tensor. Where the collective backend has float8 collectives
  (nccl), FSDP all-gathers the weights in float8 (half the bytes of bf16) and TP uses torchao's
  Float8 Colwise/Rowwise styles; gloo cannot all-gather float8 tensors, so there both stay off
  (`launcher.contract.fp8.float8_all_gather`, which the memory and speed estimators read too).
- rowwise: one scale per row; more accurate, no float8 all-gather (torchao's recipe).
- Without float8 collectives (gloo, or rowwise), a tensor-parallel linear scales this rank's
  shards by their own amax instead of the whole tensor's, which took one all-reduce per cast
  (four per linear and micro-batch): parallel/float8_shards.py.

A CUDA device needs FP8 tensor cores (compute capability 8.9: Ada, Hopper); anything older
is refused with the reason. `runtime.device: cpu` (for tests) runs torchao's emulated matmul
(`Float8LinearConfig.emulate`): the same float8 casts and scales, the product of the dequantised
operands in fp32. torch's CPU `_scaled_mm` is a reference kernel, about 1.7 s for one
1024x256x512 product on this project's 2-core test machines, which made a 4-step tiny CPU job
take two minutes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from launcher.contract.config import ConfigError, JobConfig
from launcher.contract.fp8 import float8_all_gather, fp8_experts


@dataclass(frozen=True)
class Fp8Settings:
    recipe: str
    float8_all_gather: bool
    """FSDP all-gathers float8 weights and TP uses float8 styles (tensorwise on nccl only)."""
    emulate: bool = False
    """Multiply the dequantised float8 operands in fp32 instead of calling `_scaled_mm` (no FP8 GEMMs: CPU)."""
    experts: bool = False
    """precision.fp8_experts, and the experts' FP8 grouped GEMM has a kernel here: torch's
    `_scaled_grouped_mm` runs on compute capability 9.0 and 10.0 (Hopper, Blackwell), not on
    Ada's 8.9, where the experts stay in the compute dtype; on the CPU they are emulated with the rest."""


def fp8_settings(cfg: JobConfig, *, device_type: str, backend: str) -> Fp8Settings | None:
    """What FP8 does for this job, or None when precision.fp8 is off. Refuses hardware without FP8."""
    if not cfg.precision.fp8:
        return None
    if device_type == "cuda":
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            name = torch.cuda.get_device_name()
            raise ConfigError(
                f"precision.fp8: {name} (compute capability {capability[0]}.{capability[1]}) has no FP8 tensor "
                "cores; FP8 needs 8.9 or newer (H100, H200, L40S), or set precision.fp8: false"
            )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError("precision.fp8: torchao is not installed in this image; pip install torchao") from None
    precision = cfg.precision
    gather = float8_all_gather(fp8=precision.fp8, fp8_recipe=precision.fp8_recipe, backend=backend)
    grouped_kernel = device_type != "cuda" or torch.cuda.get_device_capability()[0] in (9, 10)
    return Fp8Settings(
        recipe=precision.fp8_recipe,
        float8_all_gather=gather,
        emulate=device_type != "cuda",
        experts=precision.fp8_experts and grouped_kernel,
    )


def _convertible(module: torch.nn.Module, fqn: str) -> bool:
    # The output projection, and a mixture of experts' router, whose top-k choice float8
    # rounding of its logits would shift: torchtitan's MoE configs filter both
    # (torchtitan/models/deepseek_v3/train_configs/deepseek_v3_16b.py: filter_fqns
    # ["output", "router.gate"]).
    if fqn.rpartition(".")[2] in ("output", "router"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8(model: torch.nn.Module, settings: Fp8Settings) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if settings.recipe == "rowwise":
        config = Float8LinearConfig.from_recipe_name("rowwise")
    else:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=settings.float8_all_gather)
    config = replace(config, emulate=settings.emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=_convertible)
    _convert_experts(model, settings)
    if not settings.float8_all_gather:
        # Without float8 collectives, tensor-parallel linears scale their own shards: no
        # amax all-reduce per cast (parallel/float8_shards.py). Without TP nothing changes.
        from entrypoints.parallel.float8_shards import use_shard_scales

        use_shard_scales(model)


def _convert_experts(model: torch.nn.Module, settings: Fp8Settings) -> None:
    """With precision.fp8_experts, the MoE blocks' grouped experts run FP8 grouped GEMMs
    (model/fp8_experts.py), rowwise."""
    from entrypoints.model.moe import GroupedExperts

    for module in model.modules():
        if isinstance(module, GroupedExperts):
            _, ffn, hidden = module.w1.shape
            if fp8_experts(fp8=True, fp8_experts=settings.experts, hidden_size=hidden, expert_ffn_hidden_size=ffn):
                module.fp8_emulate = settings.emulate


def experts_run_fp8(model_parts: list[torch.nn.Module]) -> bool:
    """Whether _convert_experts put any grouped experts on FP8 grouped GEMMs."""
    from entrypoints.model.moe import GroupedExperts

    return any(
        isinstance(m, GroupedExperts) and m.fp8_emulate is not None for part in model_parts for m in part.modules()
    )


def after_optimizer_step(model_parts: list[torch.nn.Module], settings: Fp8Settings | None) -> None:
    """With float8 all-gather, compute every weight's scale in one all-reduce instead of one each."""
    if settings is not None and settings.float8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
