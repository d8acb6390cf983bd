"""Document masking in one process: a packed sequence trains exactly as its documents on their own.

The context-parallel paths (all-gather and Ulysses at cp 2) are checked against the same
single-process results in one torchrun launch: test_attention_paths.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from entrypoints.data import DataLoader, SyntheticTokens
from entrypoints.model.documents import DocumentMask, document_ids, document_positions
from entrypoints.model.init import materialize
from entrypoints.model.llama import build_model
from entrypoints.parallel.context import shard_sequence
from tests.entrypoints.tiny_models import LLAMA31_SCALING, tiny

SEPARATOR = 0


def test_a_separator_ends_its_document_and_positions_restart_after_it():
    tokens = torch.tensor([[5, 0, 7, 8, 0, 0, 3], [1, 2, 3, 4, 5, 6, 7]])
    documents = document_ids(tokens, SEPARATOR)
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0] * 7]
    assert document_positions(documents).tolist() == [[0, 1, 0, 1, 2, 0, 0], list(range(7))]


def packed_model(seq_len: int, document_positions: str = "restart"):
    # Llama 3.1 RoPE scaling and GQA: the parts whose positions and heads the masking must respect.
    cfg = tiny(num_heads=4, num_kv_heads=2, rope_scaling=LLAMA31_SCALING)
    model = build_model(cfg, seq_len=seq_len, document_positions=document_positions)
    materialize(model, torch.device("cpu"), seed=3)
    return model


def split_into_documents(tokens: torch.Tensor) -> list[torch.Tensor]:
    ends = (tokens == SEPARATOR).nonzero().flatten().tolist()
    bounds = [0] + [e + 1 for e in ends if e + 1 < len(tokens)] + [len(tokens)]
    return [tokens[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def loss_and_grads(model, logits: torch.Tensor, targets: torch.Tensor):
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss, grads


def assert_close(mine: torch.Tensor, theirs: torch.Tensor, what: str):
    error = ((mine - theirs).abs().max() / theirs.abs().max()).item()
    assert error <= 1e-5, f"{what}: relative error {error:.2e}"


@pytest.mark.parametrize("positions", ["restart", "global"])
def test_packed_sequence_matches_each_document_run_on_its_own(positions):
    # "global" positions rotate q and k of a document by a shared offset; RoPE scores depend only
    # on the difference of positions, so the result is the same up to rounding.
    seq_len = 32
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 61, (2, seq_len + 1), generator=generator)
    tokens[0, [4, 5, 17, 30]] = SEPARATOR  # documents of 5, 1, 12, 13 and 2 tokens; sample 1 is one
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = packed_model(seq_len, positions)

    packed = model(inputs, documents=document_ids(inputs, SEPARATOR))
    alone = torch.stack([torch.cat([model(doc[None])[0] for doc in split_into_documents(row)]) for row in inputs])
    assert_close(packed, alone, "logits")
    packed_loss, packed_grads = loss_and_grads(model, packed, targets)
    alone_loss, alone_grads = loss_and_grads(model, alone, targets)
    assert_close(packed_loss, alone_loss, "loss")
    for (name, _), mine, theirs in zip(model.named_parameters(), packed_grads, alone_grads, strict=True):
        assert_close(mine, theirs, name)
    # And the mask changes something: without it the later documents see the earlier ones.
    assert (model(inputs) - alone).abs().max() > 1e-3


def test_flex_attention_block_mask_equals_the_boolean_mask():
    # The CUDA kernel's mask function, run eagerly on the CPU, against the explicit masks, for
    # the three query ranges the attention paths use (whole sequence and both zigzag chunks).
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 5, (2, 64), generator=generator)
    documents = document_ids(tokens, SEPARATOR)
    q = torch.randn(2, 4, 64, 8, generator=generator)
    k, v = torch.randn(2, 2, 64, 8, generator=generator), torch.randn(2, 2, 64, 8, generator=generator)
    for q_start, q_len in [(0, 64), (16, 16), (48, 16)]:
        k_len = q_start + q_len
        args = (q[:, :, q_start:k_len], k[:, :, :k_len], v[:, :, :k_len])
        flex = DocumentMask(documents, kernel="flex").attend(*args, q_start=q_start, enable_gqa=True)
        sdpa = DocumentMask(documents, kernel="sdpa").attend(*args, q_start=q_start, enable_gqa=True)
        assert_close(flex, sdpa, f"queries {q_start}..{k_len}")


def test_synthetic_documents_reach_every_context_parallel_rank_whole():
    data = SyntheticTokens(vocab_size=97, seq_len=32, seed=0, separator=SEPARATOR)

    def batch(cp_rank: int, cp_size: int):
        loader = DataLoader(
            data,
            global_batch_size=4,
            micro_batch_size=2,
            dp_rank=0,
            dp_size=1,
            cp_rank=cp_rank,
            cp_size=cp_size,
            device=torch.device("cpu"),
            document_separator=SEPARATOR,
        )
        return loader.rank_batch()

    whole = batch(0, 1)
    assert torch.equal(whole.documents, document_ids(whole.tokens, SEPARATOR))
    counts = whole.documents.max(dim=1).values + 1
    assert counts.min() >= 3, counts  # documents of 1 to 8 tokens: several per sequence
    for rank in range(2):
        share = batch(rank, 2)
        assert torch.equal(share.documents, whole.documents)
        assert torch.equal(share.tokens, shard_sequence(whole.tokens, 1, rank, 2))


def test_without_document_masking_batches_carry_no_documents_and_data_is_unchanged():
    plain = SyntheticTokens(vocab_size=97, seq_len=32, seed=0)
    masked = SyntheticTokens(vocab_size=97, seq_len=32, seed=0, separator=SEPARATOR)
    kept = masked.sample(0) != SEPARATOR
    assert torch.equal(plain.sample(0)[kept], masked.sample(0)[kept])
