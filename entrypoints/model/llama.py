"""One decoder for Llama, Mistral (without sliding window), Qwen3 and Qwen3-MoE/Mixtral: RMSNorm,
RoPE (Llama 3.1 or YaRN scaling), GQA, and a SwiGLU or mixture-of-experts MLP.

The families differ only by the architecture's fields (launcher.contract.config.ModelConfig),
never by name: `head_dim` (independent of hidden / heads), `qk_norm` (RMSNorm per head of q and
k before RoPE), `attention_bias`, `tie_embeddings`, `rope_theta`/`rope_scaling`, and `moe` (the
MLP of every block is then model/moe.py's MoE, and the loss adds its auxiliary losses).

    model = Transformer(cfg.model, seq_len=cfg.training.seq_len)   # any device, meta included
    loss = model(tokens, targets=targets)                           # mean cross-entropy
    logits = model(tokens)                                          # [B, S, V]; small models only

Build it on the meta device, `parallelize` it, then `materialize(model, device, seed)`
(model/init.py) allocates and initialises the shards. Layers live in a ModuleDict keyed by
their global index, so pipeline stages keep the names of the full model and checkpoints
reshard across layouts.

Memory-relevant choices (the estimator reads these):
- RMSNorm is `nn.RMSNorm` -> `F.rms_norm`, a fused kernel on CUDA (on CPU it decomposes).
- Attention is `F.scaled_dot_product_attention(..., enable_gqa=True)` in a fixed CUDA backend
  order (model/sdpa.py): K/V are never expanded to the query head count; flash kernels save
  the output and an fp32 log-sum-exp, no s x s.
- RoPE tables are one fp32 buffer [2, s_local, head_dim/2] per model (cos, sin), cast once per
  forward to the activation dtype and shared by every layer. Each layer's rotation saves the
  un-rotated q and k for backward.
- The loss never builds full logits (model/loss.py): the last stage saves only h and an fp32
  log-sum-exp per token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from entrypoints.model.documents import DocumentMask, document_positions
from entrypoints.model.loss import linear_cross_entropy
from entrypoints.model.moe import MoE, router_losses
from entrypoints.model.sdpa import causal_attention
from entrypoints.model.swiglu import product_recomputed, swiglu
from launcher.contract.config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotary inverse frequencies (float64), with Llama 3.1 "llama3" or YaRN scaling if given."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    low_wavelen = scaling.original_max_context / scaling.low_freq_factor
    high_wavelen = scaling.original_max_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between blended.
    smooth = (scaling.original_max_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as transformers' `_compute_yarn_parameters` (truncate on): dimensions
    turning more than beta_fast times over the original context keep their frequency, those
    turning fewer than beta_slow times are interpolated by `factor`, with a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(scaling.original_max_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast or 32.0)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow or 1.0)), head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """YaRN scales cos and sin (so both q and k) by 0.1 ln(factor) + 1; other kinds by 1."""
    if scaling is None or scaling.type != "yarn" or scaling.factor <= 1:
        return 1.0
    return 0.1 * math.log(scaling.factor) + 1.0


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """[2, *positions.shape, head_dim/2] fp32: cos and sin of position x frequency, times `scale`."""
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device)
    return (torch.stack([angles.cos(), angles.sin()]) * scale).float()


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by the table rope [2, S, D/2] or [2, B, S, D/2] (per-sample positions),
    halves layout as Hugging Face's."""
    cos, sin = rope[0].unsqueeze(-2), rope[1].unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.gqa = cfg.num_heads != cfg.num_kv_heads
        bias = cfg.attention_bias
        self.wq = nn.Linear(cfg.hidden_size, cfg.q_dim, bias=bias)
        self.wk = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=bias)
        self.wv = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.hidden_size, bias=bias)
        # Qwen3: RMSNorm over each head's dimensions of q and k, before RoPE.
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        # Set by apply_context_parallel: a callable (q, k, v) -> out over the cp group.
        self.context_parallel = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, documents: DocumentMask | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1: the heads this rank holds (all of them, or 1/tp under tensor parallel).
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, rope[..., :seq, :]), apply_rotary(k, rope[..., :seq, :])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.context_parallel is not None:
            out = self.context_parallel(q, k, v, enable_gqa=self.gqa, documents=documents)
        elif documents is not None:
            out = documents.attend(q, k, v, q_start=0, enable_gqa=self.gqa)
        else:
            out = causal_attention(q, k, v, enable_gqa=self.gqa)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), the gating saving its inputs only and w2 no copy of the
    product, which backward makes again from them (swiglu.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.recompute_product = True
        """False in checkpointed and compiled blocks (parallel/activation.py `keep_product`): w2 keeps the product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        product = swiglu(gate, up)
        if not self.recompute_product:
            return self.w2(product)
        with product_recomputed(product, gate, up):
            return self.w2(product)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.moe else FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, documents: DocumentMask | None = None) -> torch.Tensor:
        # A keyword: the tensor-parallel plan prepares the positional inputs (x, rope) only.
        h = x + self.attention(self.attention_norm(x), rope, documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (parts it does not hold are None)."""

    def __init__(self, cfg: ModelConfig, *, seq_len: int, document_positions: str = "restart"):
        super().__init__()
        self.cfg = cfg
        self.seq_len = seq_len
        # With documents given to forward: RoPE positions "restart" in each document, or stay "global".
        self.document_positions = document_positions
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, cfg) for i in range(cfg.num_layers)})
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Set by apply_tensor_parallel: the loss then gathers the sequence and reduces over vocab shards.
        self.loss_tp_mesh = None
        self.set_positions(torch.arange(seq_len, device="cpu"))

    def set_positions(self, positions: torch.Tensor) -> None:
        """The global positions of the tokens this rank holds (zigzag under context parallel)."""
        self.positions = positions
        device = self.rope.device if hasattr(self, "rope") else None  # None: the current default
        shape = (2, len(positions), self.cfg.head_dim // 2)
        self.register_buffer("rope", torch.empty(shape, device=device), persistent=False)

    def init_rope(self) -> None:
        """Fill the RoPE table (after the model is materialised on its device)."""
        inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
        with torch.no_grad():
            self.rope.copy_(rope_table(self.positions, inv_freq, rope_attention_factor(self.cfg.rope_scaling)))

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.cfg.tie_embeddings else self.output.weight

    def document_rope(self, documents: torch.Tensor) -> torch.Tensor:
        """[2, B, s_local, head_dim/2]: RoPE at each token's position within its document."""
        within = document_positions(documents)[:, self.positions.to(documents.device)]
        scaling = self.cfg.rope_scaling
        inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, scaling)
        return rope_table(within, inv_freq, rope_attention_factor(scaling))

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [B, S] on the first stage, hidden states [B, S, D] on later ones; documents
        [B, seq_len]: the document ids of the WHOLE sequence (model/documents.py), for document
        masking, on every rank and stage.

        Returns the loss (the last stage, with targets), the logits (last stage, no targets), or
        the hidden states for the next stage.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        mask = None if documents is None else DocumentMask(documents)
        if mask is not None and self.document_positions == "restart":
            rope = self.document_rope(documents).to(h.dtype)
        else:
            rope = self.rope.to(h.dtype)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        if self.norm is None:
            # A first pipeline stage without layers (launcher.contract.layout.stage_layer_counts)
            # hands on the embedding's output, under TP a view of the redistributed tensor
            # (DTensor.to_local). FSDP warns on a module returning a view, since an in-place op
            # on it would skip the pre-backward hook; a copy has no base to keep alive either.
            return h.clone() if h._is_view() else h
        h = self.norm(h)
        if targets is None:
            return F.linear(h, self.output_weight)
        loss = linear_cross_entropy(h, self.output_weight, targets, tp_mesh=self.loss_tp_mesh)
        return loss + self.router_loss() if self.cfg.moe else loss

    def router_loss(self) -> torch.Tensor:
        """The weighted load-balancing and z-losses of the last forward's MoE layers (model/moe.py)."""
        moe = self.cfg.moe
        balance, z_loss = router_losses([layer.feed_forward for layer in self.layers.values()], moe)
        return moe.aux_loss_coef * balance + moe.z_loss_coef * z_loss


def build_model(
    cfg: ModelConfig, *, seq_len: int, device: str | torch.device = "meta", document_positions: str = "restart"
) -> Transformer:
    """The model with uninitialised parameters on `device` (meta by default)."""
    with torch.device(device):
        return Transformer(cfg, seq_len=seq_len, document_positions=document_positions)
