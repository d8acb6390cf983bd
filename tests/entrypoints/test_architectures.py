"""Qwen3, Qwen3-MoE and Mixtral as data: our one decoder against transformers' own models.

Each case builds a tiny random fp32 transformers model, copies its weights into ours (built
from a ModelConfig whose fields say what the family differs in, never its name), and compares
the logits, the training loss with the load-balancing loss included, and every parameter's
gradient, to 1e-5 relative. One process, no launch: a few seconds in all.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from entrypoints.model.llama import build_model
from entrypoints.model.moe import MoE, force_load_balance, route
from launcher.contract.config import ConfigError, ModelConfig, MoeConfig, RopeScaling

from .tiny_models import tiny

RELATIVE = 1e-5
BATCH, SEQ = 2, 24
COMMON = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# name -> (transformers class, config keywords). head_dim 16 x 4 heads != hidden 32, as in
# Qwen3-0.6B; Qwen3 also with YaRN (its documented 128K extension) and attention biases; the
# MoE cases route 2 of 4 experts, with the auxiliary-loss coefficient large enough to matter.
CASES = {
    "qwen3": ("Qwen3ForCausalLM", {**COMMON, "head_dim": 16, "intermediate_size": 48, "rope_theta": 1e6}),
    "qwen3-yarn-bias-tied": (
        "Qwen3ForCausalLM",
        {
            **COMMON,
            "head_dim": 16,
            "intermediate_size": 48,
            "attention_bias": True,
            "tie_word_embeddings": True,
            "rope_theta": 1e6,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {
            **COMMON,
            "head_dim": 16,
            "intermediate_size": 48,
            "moe_intermediate_size": 24,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "router_aux_loss_coef": 0.1,
            "rope_theta": 1e6,
        },
    ),
    "qwen3_moe-unnormalised": (
        "Qwen3MoeForCausalLM",
        {
            **COMMON,
            "intermediate_size": 48,
            "moe_intermediate_size": 24,
            "num_experts": 4,
            "num_experts_per_tok": 3,
            "norm_topk_prob": False,
            "router_aux_loss_coef": 0.1,
        },
    ),
    "mixtral": (
        "MixtralForCausalLM",
        {
            **COMMON,
            "intermediate_size": 24,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.1,
            "rope_theta": 1e6,
        },
    ),
}


def hf_model(kind: str):
    import transformers

    class_name, kwargs = CASES[kind]
    config_class = getattr(transformers, class_name.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config_class(**kwargs, attn_implementation="eager"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Random norms (a swapped norm shows), and router weights large enough to route unevenly.
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.3 * torch.randn_like(param))
    return model.train(), kwargs


def our_config(kwargs: dict) -> ModelConfig:
    """The ModelConfig the catalog would hold for this config.json (models.yaml's header maps the names)."""
    experts = kwargs.get("num_experts") or kwargs.get("num_local_experts")
    scaling = kwargs.get("rope_scaling")
    return ModelConfig(
        name="t",
        family="any",  # the model code never reads it
        hidden_size=kwargs["hidden_size"],
        num_layers=kwargs["num_hidden_layers"],
        num_heads=kwargs["num_attention_heads"],
        num_kv_heads=kwargs["num_key_value_heads"],
        head_dim=kwargs.get("head_dim"),
        ffn_hidden_size=kwargs["intermediate_size"],
        vocab_size=kwargs["vocab_size"],
        max_context=kwargs["max_position_embeddings"],
        rope_theta=kwargs.get("rope_theta", 10000.0),
        rope_scaling=scaling
        and RopeScaling(
            type=scaling["rope_type"],
            factor=scaling["factor"],
            original_max_context=scaling["original_max_position_embeddings"],
        ),
        tie_embeddings=kwargs["tie_word_embeddings"],
        norm_eps=kwargs["rms_norm_eps"],
        qk_norm="head_dim" in kwargs or "moe_intermediate_size" in kwargs,  # the Qwen3 cases
        attention_bias=kwargs.get("attention_bias", False),
        moe=experts
        and MoeConfig(
            num_experts=experts,
            top_k=kwargs["num_experts_per_tok"],
            expert_ffn_hidden_size=kwargs.get("moe_intermediate_size", kwargs["intermediate_size"]),
            normalize_top_k=kwargs.get("norm_topk_prob", True),  # Mixtral's router always normalises
            aux_loss_coef=kwargs["router_aux_loss_coef"],
        ),
    )


_ATTENTION = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "q_norm": "q_norm", "k_norm": "k_norm"}
_DENSE = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_NORMS = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}


def hf_to_ours(hf_name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our parameters holding transformers' `hf_name` (fused gate_up_proj splits in two)."""
    top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
    if hf_name in top:
        return {top[hf_name]: tensor}
    if hf_name == "lm_head.weight":
        return {"output.weight": tensor}
    _, _, layer, module, *rest = hf_name.split(".")
    prefix = f"layers.{layer}"
    if module in _NORMS:
        return {f"{prefix}.{_NORMS[module]}.weight": tensor}
    if module == "self_attn":
        return {f"{prefix}.attention.{_ATTENTION[rest[0]]}.{rest[1]}": tensor}
    if rest[0] in _DENSE:
        return {f"{prefix}.feed_forward.{_DENSE[rest[0]]}.weight": tensor}
    if rest[0] == "gate":
        return {f"{prefix}.feed_forward.router.weight": tensor}
    if rest[1] == "gate_up_proj":  # [E, 2F, D]: gate rows first (Qwen3MoeExperts.forward's chunk)
        gate, up = tensor.chunk(2, dim=1)
        return {f"{prefix}.feed_forward.experts.w1": gate, f"{prefix}.feed_forward.experts.w3": up}
    assert rest[1] == "down_proj", hf_name
    return {f"{prefix}.feed_forward.experts.w2": tensor}


def our_model_from(hf, cfg: ModelConfig):
    model = build_model(cfg, seq_len=SEQ, device="cpu")
    model.init_rope()
    ours = dict(model.named_parameters())
    copied = set()
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            for our_name, value in hf_to_ours(name, tensor).items():
                ours[our_name].copy_(value)
                copied.add(our_name)
    assert copied == set(ours), set(ours) ^ copied
    return model


def hf_loss_with_aux(hf, kwargs: dict, tokens: torch.Tensor, targets: torch.Tensor):
    """transformers' training loss: mean cross-entropy, plus router_aux_loss_coef x aux_loss for MoE."""
    moe = "num_experts_per_tok" in kwargs
    out = hf(input_ids=tokens, output_router_logits=moe)
    loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    if moe:
        loss = loss + kwargs["router_aux_loss_coef"] * out.aux_loss
    return out.logits, loss


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.mark.parametrize("kind", CASES)
def test_logits_loss_with_aux_and_gradients_match_transformers(kind):
    hf, kwargs = hf_model(kind)
    model = our_model_from(hf, our_config(kwargs))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, kwargs["vocab_size"], (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, kwargs["vocab_size"], (BATCH, SEQ), generator=generator)

    their_logits, their_loss = hf_loss_with_aux(hf, kwargs, tokens, targets)
    their_loss.backward()
    our_loss = model(tokens, targets=targets)
    our_loss.backward()

    assert relative_error(model(tokens).detach(), their_logits.detach()) <= RELATIVE
    assert our_loss.item() == pytest.approx(their_loss.item(), rel=RELATIVE)
    ours = dict(model.named_parameters())
    for name, param in hf.named_parameters():
        for our_name, grad in hf_to_ours(name, param.grad).items():
            assert relative_error(ours[our_name].grad, grad) <= RELATIVE, our_name
    if "num_experts_per_tok" in kwargs:  # the aux loss is in there: without it the loss differs
        aux = our_loss.item() - F.cross_entropy(their_logits.flatten(0, 1), targets.flatten()).item()
        assert aux > 1e-3


def naive_moe(layer: MoE, x: torch.Tensor, *, force_balance: bool = False) -> torch.Tensor:
    """Token by token, expert by expert: the definition the grouped dispatch must equal."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, experts, _ = route(layer.router(tokens), layer.moe, force_balance=force_balance)
    e = layer.experts
    rows = []
    for t, token in enumerate(tokens):
        out = sum(
            w * (e.w2[i] @ (F.silu(e.w1[i] @ token) * (e.w3[i] @ token)))
            for w, i in zip(weights[t], experts[t].tolist(), strict=True)
        )
        if layer.shared_experts is not None:
            out = out + layer.shared_experts(token)
        rows.append(out)
    return torch.stack(rows).reshape(x.shape)


def test_sigmoid_router_with_shared_experts_equals_the_token_by_token_definition():
    cfg = tiny(
        moe=MoeConfig(
            num_experts=6, top_k=3, expert_ffn_hidden_size=20, shared_experts=2, router_score="sigmoid", z_loss_coef=0.5
        )
    )
    torch.manual_seed(0)
    layer = MoE(cfg)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(2, 5, cfg.hidden_size)
    assert relative_error(layer(x), naive_moe(layer, x)) <= RELATIVE
    logits = layer.router(x.reshape(-1, cfg.hidden_size))
    # z-loss: mean squared log-sum-exp of the router logits (ST-MoE eq. 5), as router_losses pools it.
    assert layer.routing.squared_logsumexp_sum.item() / layer.routing.tokens == pytest.approx(
        torch.logsumexp(logits, -1).square().mean().item(), rel=1e-6
    )
    assert layer.routing.tokens_per_expert.sum().item() == 10 * 3  # dropless: every copy reached an expert


def test_forced_balance_routes_round_robin_weighted_by_the_scores_and_the_layer_still_equals_its_definition():
    """training.moe_force_load_balance: copy i of the N x k goes to expert i mod E, as torchtitan's
    _debug_force_load_balance_routing; the weights are those experts' scores, renormalised, and
    the grouped dispatch still equals the token-by-token definition under that routing."""
    cfg = tiny(moe=MoeConfig(num_experts=4, top_k=3, expert_ffn_hidden_size=20, aux_loss_coef=0.1))
    torch.manual_seed(0)
    layer = MoE(cfg)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    force_load_balance(layer)
    x = torch.randn(2, 5, cfg.hidden_size)
    tokens = x.reshape(-1, cfg.hidden_size)
    weights, experts, probabilities = route(layer.router(tokens), layer.moe, force_balance=True)
    assert experts.flatten().tolist() == [i % 4 for i in range(10 * 3)]
    chosen = probabilities.gather(1, experts)
    assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True))
    assert relative_error(layer(x), naive_moe(layer, x, force_balance=True)) <= RELATIVE
    assert layer.routing.tokens_per_expert.tolist() == [8.0, 8.0, 7.0, 7.0]  # 30 copies over 4 experts


def test_moe_model_loss_adds_the_weighted_z_loss():
    moe = MoeConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=16, aux_loss_coef=0.0, z_loss_coef=0.25)
    model = build_model(tiny(moe=moe), seq_len=8, device="cpu")
    model.init_rope()
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2)
    tokens = torch.randint(0, 61, (2, 8))
    loss = model(tokens, targets=tokens)
    cross_entropy = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    routings = [layer.feed_forward.routing for layer in model.layers.values()]
    expected_z = sum(r.squared_logsumexp_sum for r in routings) / sum(r.tokens for r in routings)
    assert loss.item() == pytest.approx(cross_entropy.item() + 0.25 * expected_z.item(), rel=1e-6)
    assert expected_z.item() > 0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"num_experts": 4, "top_k": 5},
            "model.moe.top_k: 5 experts per token, but the model has 4; use 1 to 4",
        ),
        ({"num_experts": 4, "top_k": 2, "dropless": False}, "model.moe.dropless: false"),
        ({"num_experts": 4, "top_k": 2, "router_score": "relu"}, "model.moe.router_score: 'relu' is not one of"),
    ],
)
def test_contract_refuses_moe_fields_it_cannot_run_naming_the_key(changes, message):
    with pytest.raises(ConfigError, match=message):
        MoeConfig(expert_ffn_hidden_size=8, **changes)


def test_head_dim_is_hidden_over_heads_unless_given():
    assert tiny().head_dim == 8 and tiny(head_dim=16).q_dim == 64
    with pytest.raises(ConfigError, match="model: head_dim 7 is odd"):
        tiny(head_dim=7)


def test_an_moe_model_over_a_dense_checkpoint_is_refused_naming_the_moe_key():
    import dataclasses

    from launcher.contract.hf_checkpoint import architecture_mismatch

    ours = dataclasses.asdict(our_config(CASES["mixtral"][1]))
    dense = {**CASES["mixtral"][1], "model_type": "mistral", "num_local_experts": None}
    assert architecture_mismatch(ours, dense, "ckpt/config.json") == (
        "model.moe: the recipe's model routes each token to 2 of 4 experts, but ckpt/config.json is a dense "
        "checkpoint with no experts; use a dense model, or an MoE checkpoint"
    )


@pytest.mark.parametrize(
    ("kind", "change", "message"),
    [
        ("mixtral", {"num_experts_per_tok": 4}, "model.moe.top_k is 2 in the recipe but 4 in c.json"),
        ("qwen3_moe", {"num_experts": 8}, "model.moe.num_experts is 4 in the recipe but 8 in c.json"),
        ("qwen3_moe", {"moe_intermediate_size": 32}, "model.moe.expert_ffn_hidden_size is 24 in the recipe but 32"),
    ],
)
def test_config_json_experts_that_disagree_with_the_recipe_are_one_line_naming_the_key(kind, change, message):
    import dataclasses

    from launcher.contract.hf_checkpoint import moe_mismatch

    kwargs = CASES[kind][1]
    ours = dataclasses.asdict(our_config(kwargs))["moe"]
    assert moe_mismatch(ours, kwargs, "c.json") is None
    assert moe_mismatch(ours, {**kwargs, **change}, "c.json").startswith(message)


def test_initialisation_zeroes_biases_sets_qk_norms_to_one_and_draws_experts_by_role():
    from entrypoints.model.init import materialize

    moe = MoeConfig(num_experts=8, top_k=2, expert_ffn_hidden_size=64)
    cfg = tiny(hidden_size=64, head_dim=16, qk_norm=True, attention_bias=True, moe=moe)
    model = build_model(cfg, seq_len=8)
    materialize(model, torch.device("cpu"), seed=0)
    params = dict(model.named_parameters())
    assert all(params[f"layers.1.attention.{w}.bias"].eq(0).all() for w in ("wq", "wk", "wv", "wo"))
    assert (
        params["layers.1.attention.q_norm.weight"].eq(1).all()
        and params["layers.1.attention.k_norm.weight"].eq(1).all()
    )
    # An expert's w2 writes into the residual stream: 0.02 / sqrt(2 (layer + 1)), like wo and w2.
    assert params["layers.1.feed_forward.experts.w2"].std().item() == pytest.approx(0.01, rel=0.05)
    assert params["layers.1.feed_forward.experts.w1"].std().item() == pytest.approx(0.02, rel=0.05)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    assert torch.isfinite(model(tokens, targets=tokens))
