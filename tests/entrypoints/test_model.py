"""The Llama model, its fused loss and its initialisation, in one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from entrypoints.model.init import canonical_name, init_std, materialize
from entrypoints.model.llama import apply_rotary, build_model, rope_inv_freq, rope_table
from entrypoints.model.loss import chunk_tokens, linear_cross_entropy
from launcher.contract.config import ModelConfig, RopeScaling

from .tiny_models import LLAMA31_SCALING, tiny


def built(cfg: ModelConfig, seq_len: int = 16, seed: int = 0):
    model = build_model(cfg, seq_len=seq_len)
    materialize(model, torch.device("cpu"), seed=seed)
    return model


def meta_reference_scaling(freqs: list[float], s: RopeScaling) -> list[float]:
    """Llama 3.1's reference `apply_scaling`, written out as Meta's code does it."""
    low_wavelen = s.original_max_context / s.low_freq_factor
    high_wavelen = s.original_max_context / s.high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / s.factor)
        else:
            smooth = (s.original_max_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * freq / s.factor + smooth * freq)
    return out


def test_llama31_rope_scaling_matches_the_reference_formula():
    plain = rope_inv_freq(128, 500000.0, None).tolist()
    scaled = rope_inv_freq(128, 500000.0, LLAMA31_SCALING).tolist()
    assert scaled == pytest.approx(meta_reference_scaling(plain, LLAMA31_SCALING), rel=1e-12)
    assert scaled[0] == plain[0]  # the highest frequency is untouched
    assert scaled[-1] == pytest.approx(plain[-1] / 8.0)  # the lowest is slowed by the factor


def test_rotary_scores_depend_only_on_the_distance_between_positions():
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=generator), torch.randn(1, 1, 1, 16, generator=generator)
    inv_freq = rope_inv_freq(16, 10000.0, None)

    def score(pq: int, pk: int) -> float:
        rq = apply_rotary(q, rope_table(torch.tensor([pq]), inv_freq))
        rk = apply_rotary(k, rope_table(torch.tensor([pk]), inv_freq))
        return (rq * rk).sum().item()

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-5)
    assert score(7, 3) != pytest.approx(score(40, 3), abs=1e-2)
    assert apply_rotary(q, rope_table(torch.tensor([5]), inv_freq)).norm() == pytest.approx(q.norm().item())


def test_attention_with_gqa_equals_attention_with_expanded_kv():
    model = built(tiny(num_heads=4, num_kv_heads=1))
    attention, rope = model.layers["0"].attention, model.rope
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    got = attention(x, rope)

    q = apply_rotary(attention.wq(x).view(2, 16, 4, 8), rope).transpose(1, 2)
    k = apply_rotary(attention.wk(x).view(2, 16, 1, 8), rope).transpose(1, 2).expand(2, 4, 16, 8)
    v = attention.wv(x).view(2, 16, 1, 8).transpose(1, 2).expand(2, 4, 16, 8)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    want = attention.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 16, 32))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_model_loss_equals_cross_entropy_of_the_logits_with_the_same_gradients(tied):
    cfg = tiny(tie_embeddings=tied)
    tokens = torch.randint(61, (3, 16), generator=torch.Generator().manual_seed(2))
    targets = torch.randint(61, (3, 16), generator=torch.Generator().manual_seed(3))
    fused, plain = built(cfg), built(cfg)
    loss = fused(tokens, targets=targets)
    reference = F.cross_entropy(plain(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), abs=1e-6)
    for (name, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert ("output.weight" in dict(fused.named_parameters())) is not tied


def test_linear_cross_entropy_in_many_chunks_matches_the_unfused_loss():
    generator = torch.Generator().manual_seed(4)
    h = torch.randn(2, 25, 8, generator=generator, requires_grad=True)
    weight = torch.randn(37, 8, generator=generator, requires_grad=True)
    targets = torch.randint(37, (2, 25), generator=generator)
    assert chunk_tokens(50, 8, 37, min_tokens=1) == 10  # 5 chunks
    loss = linear_cross_entropy(h, weight, targets, min_chunk_tokens=1)
    grads = torch.autograd.grad(loss * 3.0, (h, weight))
    reference = F.cross_entropy((h @ weight.t()).flatten(0, 1), targets.flatten())
    want = torch.autograd.grad(reference * 3.0, (h, weight))
    assert loss.item() == pytest.approx(reference.item(), abs=1e-6)
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_loss_chunks_hold_as_many_logits_as_h_but_at_least_1024_tokens():
    # Llama 3 8B at 32K local tokens: 32 chunks of 1024 tokens.
    assert chunk_tokens(32768, 4096, 128256) == 1024
    # Llama 3.2 1B at 8K: the 1024-token floor wins over 63 chunks of 131.
    assert chunk_tokens(8192, 2048, 128256) == 1024
    assert chunk_tokens(100, 2048, 128256) == 100


def test_initialisation_depends_on_the_seed_only():
    a, b, c = built(tiny(), seed=5), built(tiny(), seed=5), built(tiny(), seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_initialisation_scales():
    cfg = tiny(hidden_size=256, num_heads=4, num_kv_heads=4, vocab_size=4096, ffn_hidden_size=512, num_layers=4)
    model = built(cfg)
    params = dict(model.named_parameters())
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(1.0, rel=0.05)
    assert params["output.weight"].std().item() == pytest.approx(256**-0.5, rel=0.05)
    assert params["layers.0.attention.wq.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["layers.3.feed_forward.w2.weight"].std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    assert torch.equal(params["layers.1.ffn_norm.weight"], torch.ones(256))
    assert init_std(model, canonical_name("layers.1._checkpoint_wrapped_module.attention.wo.weight")) == pytest.approx(
        0.01
    )


def test_meta_model_holds_no_memory_and_materialises_on_cpu():
    model = build_model(tiny(), seq_len=16)
    assert all(p.is_meta for p in model.parameters())
    materialize(model, torch.device("cpu"), seed=0)
    assert not any(p.is_meta for p in model.parameters()) and not model.rope.is_meta
    assert model.rope.shape == (2, 16, 4)
