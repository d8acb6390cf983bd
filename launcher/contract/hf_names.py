"""Hugging Face tensor names of our parameters, per model family, standard library only.

    HF_FAMILIES["mixtral"].architecture                        # "MixtralForCausalLM"
    hf_tensors("layers.3.attention.wq.weight", "llama", (64, 64))
        # -> [HFTensor("model.layers.3.self_attn.q_proj.weight", (64, 64), None)]
    hf_tensors("layers.0.feed_forward.experts.w1", "mixtral", (4, 24, 32))
        # -> one HFTensor per expert: model.layers.0.block_sparse_moe.experts.{e}.w1.weight, (24, 32), e

Our model (entrypoints/model/llama.py) is one decoder whose families differ by fields; their
checkpoints differ by names. The names are those of the published checkpoints and of what
transformers 5 `save_pretrained` writes (checked by tests/entrypoints/test_hf_weights.py):

- Llama, Mistral, Qwen3 (modeling_llama.py, modeling_mistral.py, modeling_qwen3.py):
  `model.layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}`, Qwen3's `self_attn.{q,k}_norm.weight`,
  the dense SwiGLU `mlp.{gate,up,down}_proj.weight`.
- Qwen3-MoE (modeling_qwen3_moe.py, `Qwen3MoeSparseMoeBlock`): the router `mlp.gate.weight` and
  one SwiGLU per expert, `mlp.experts.E.{gate,up,down}_proj.weight`.
- Mixtral (modeling_mixtral.py, `MixtralSparseMoeBlock`): the router
  `block_sparse_moe.gate.weight` and `block_sparse_moe.experts.E.{w1,w3,w2}.weight` (w1 the
  gate, w3 the up projection, w2 the down projection, as ours).

transformers 5 holds the experts fused in memory (`gate_up_proj` [E, 2F, D]) but reads and
writes this per-expert layout on disk (its conversion_mapping.py); ours are [E, F, D] weights
w1, w3 and [E, D, F] w2, so expert e of ours is the checkpoint's expert e, no transpose.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

# Our parameter name inside a block -> the checkpoint's, in every family.
_ATTENTION_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_DENSE_MLP_NAMES = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^feed_forward\.experts\.(w1|w2|w3)$")


@dataclass(frozen=True)
class HFFamily:
    """One config.json `model_type`: its transformers class, and where its experts are."""

    architecture: str
    moe_block: str | None = None
    """The module holding the router (`gate`) and the experts; None for a dense family."""
    expert_names: dict[str, str] = field(default_factory=dict)
    """Our grouped weight (w1 gate, w3 up, w2 down) -> the checkpoint's per-expert linear."""
    normalizes_top_k: bool | None = None
    """What a config.json without norm_topk_prob means: Qwen3MoeConfig's default is False;
    Mixtral has no such field because its router always renormalises (MixtralTopKRouter)."""
    experts_key: str = "num_experts"
    expert_width_key: str = "moe_intermediate_size"
    """config.json's keys for the expert count and one expert's width (Mixtral: num_local_experts
    and intermediate_size, having no dense MLP)."""
    config_extras: dict = field(default_factory=dict)
    """Keys an exported config.json sets for this family (each configuration_*.py's meaning):
    the model here attends to the whole sequence and puts experts in every layer."""


_QWEN3_WINDOW = {"sliding_window": None, "use_sliding_window": False}
HF_FAMILIES = {
    "llama": HFFamily("LlamaForCausalLM", config_extras={"mlp_bias": False}),
    "mistral": HFFamily("MistralForCausalLM", config_extras={"sliding_window": None}),
    "qwen3": HFFamily("Qwen3ForCausalLM", config_extras=_QWEN3_WINDOW),
    "qwen3_moe": HFFamily(
        "Qwen3MoeForCausalLM",
        moe_block="mlp",
        expert_names={"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
        normalizes_top_k=False,
        config_extras={**_QWEN3_WINDOW, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
    "mixtral": HFFamily(
        "MixtralForCausalLM",
        moe_block="block_sparse_moe",
        expert_names={"w1": "w1", "w2": "w2", "w3": "w3"},
        normalizes_top_k=True,
        experts_key="num_local_experts",
        expert_width_key="intermediate_size",
        config_extras={"sliding_window": None},
    ),
}


class HFTensor(NamedTuple):
    """One tensor of a checkpoint holding (part of) one of our parameters."""

    name: str
    shape: tuple[int, ...]
    expert: int | None
    """None: the whole parameter; else the index along our parameter's expert dim (0)."""


def hf_tensors(name: str, family: str, shape: tuple[int, ...]) -> list[HFTensor]:
    """The checkpoint tensors of our (canonical) parameter `name` of full `shape`."""
    if name in _TOP_NAMES:
        return [HFTensor(_TOP_NAMES[name], shape, None)]
    match = _LAYER.match(name)
    inner = match.group(2) if match else ""
    layer = f"model.layers.{match.group(1)}." if match else ""
    moe = HF_FAMILIES[family] if family in HF_FAMILIES else None
    if inner in _ATTENTION_NAMES:
        return [HFTensor(layer + _ATTENTION_NAMES[inner], shape, None)]
    if moe is not None and moe.moe_block is None and inner in _DENSE_MLP_NAMES:
        return [HFTensor(layer + _DENSE_MLP_NAMES[inner], shape, None)]
    if moe is not None and moe.moe_block is not None:
        if inner == "feed_forward.router.weight":
            return [HFTensor(f"{layer}{moe.moe_block}.gate.weight", shape, None)]
        expert = _EXPERT.match(inner)
        if expert:
            linear = moe.expert_names[expert.group(1)]
            return [
                HFTensor(f"{layer}{moe.moe_block}.experts.{e}.{linear}.weight", tuple(shape[1:]), e)
                for e in range(shape[0])
            ]
    raise KeyError(f"{name} has no Hugging Face name in a {family} checkpoint")


def hf_layout_problem(model: dict) -> str | None:
    """Why a model (our field names) has no Hugging Face checkpoint layout, or None.

    transformers' MoE classes route with a softmax and have no ungated shared experts, so a
    recipe that changed either would load or export weights that compute something else."""
    family = model.get("family")
    if family not in HF_FAMILIES:
        return f"Hugging Face checkpoints cover {', '.join(HF_FAMILIES)} models, not {family}"
    spec, moe = HF_FAMILIES[family], model.get("moe")
    if bool(moe) != (spec.moe_block is not None):
        kind = "mixture-of-experts" if spec.moe_block else "dense"
        return f"a {family} checkpoint is {kind}, but the recipe's model {'is dense' if not moe else 'has experts'}"
    if not moe:
        return None
    if moe.get("shared_experts"):
        return f"a {family} checkpoint has no shared experts; use model.moe.shared_experts: 0"
    if moe.get("router_score") != "softmax":
        return f"a {family} checkpoint routes with a softmax; use model.moe.router_score: softmax"
    if spec.normalizes_top_k and not moe.get("normalize_top_k"):
        return f"a {family} checkpoint always renormalises its top-k weights; use model.moe.normalize_top_k: true"
    return None
