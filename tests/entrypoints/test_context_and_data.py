"""Zigzag context-parallel sharding and the data loader's split of each step, in one process."""

from __future__ import annotations

import array

import pytest
import torch
import torch.nn.functional as F

from entrypoints.data import DataLoader, SyntheticTokens, TokenFiles, token_files
from entrypoints.parallel.context import shard_sequence, unshard_sequence, zigzag_attention_masked, zigzag_positions
from launcher.contract.config import ConfigError


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_positions_cover_the_sequence_once_with_equal_causal_work(cp):
    positions = [zigzag_positions(64, r, cp) for r in range(cp)]
    assert sorted(torch.cat(positions).tolist()) == list(range(64))
    work = {int((p + 1).sum()) for p in positions}  # keys each rank's queries attend to
    assert len(work) == 1
    assert positions[0][:8].tolist() == list(range(64 // (2 * cp)))[:8]


def test_shard_and_unshard_round_trip():
    x = torch.arange(2 * 48).view(2, 48)
    parts = [shard_sequence(x, 1, r, 3) for r in range(3)]
    assert torch.equal(parts[1], x[:, torch.cat([torch.arange(8, 16), torch.arange(32, 40)])])
    assert torch.equal(unshard_sequence(parts, 1), x)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("cp", [2, 3])
def test_zigzag_attention_of_each_rank_equals_its_rows_of_full_attention(heads, kv_heads, cp):
    generator = torch.Generator().manual_seed(heads + cp)
    q = torch.randn(2, heads, 12 * cp, 8, generator=generator)
    k, v = (torch.randn(2, kv_heads, 12 * cp, 8, generator=generator) for _ in range(2))
    gqa = heads != kv_heads
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    for rank in range(cp):
        got = zigzag_attention_masked(shard_sequence(q, 2, rank, cp), k, v, rank, cp, enable_gqa=gqa)
        torch.testing.assert_close(got, shard_sequence(full, 2, rank, cp), atol=1e-6, rtol=1e-5)


def test_synthetic_tokens_are_seeded_in_vocabulary_and_learnable():
    data = SyntheticTokens(vocab_size=50, seq_len=32, seed=3)
    a, b = data.sample(7), data.sample(7)
    assert torch.equal(a, b) and a.shape == (33,)
    assert not torch.equal(a, data.sample(8))
    assert not torch.equal(a, SyntheticTokens(vocab_size=50, seq_len=32, seed=4).sample(7))
    assert int(a.max()) < 50 and set(((a[1:] - a[:-1]) % 50).tolist()) <= {1, 2, 3, 4}


def loader(dataset, *, dp_rank=0, dp_size=1, cp_rank=0, cp_size=1, micro=2, batch=8) -> DataLoader:
    return DataLoader(
        dataset,
        global_batch_size=batch,
        micro_batch_size=micro,
        dp_rank=dp_rank,
        dp_size=dp_size,
        cp_rank=cp_rank,
        cp_size=cp_size,
        device=torch.device("cpu"),
    )


def test_data_parallel_ranks_split_each_step_like_one_process_in_order():
    data = SyntheticTokens(vocab_size=97, seq_len=16, seed=0)
    single = loader(data)
    ranks = [loader(data, dp_rank=r, dp_size=4) for r in range(4)]
    for _ in range(2):
        want = [mb for mb in single.next_step()]
        got = [mb for rank in ranks for mb in rank.next_step()]
        assert len(want) == len(got) == 4
        for (wt, wy, _), (gt, gy, _) in zip(want, got, strict=True):
            assert torch.equal(wt, gt) and torch.equal(wy, gy)
            assert torch.equal(wt[:, 1:], wy[:, :-1])  # targets are the inputs shifted by one


def test_context_parallel_ranks_hold_their_zigzag_chunks_of_the_same_samples():
    data = SyntheticTokens(vocab_size=97, seq_len=16, seed=0)
    tokens, targets, _ = loader(data).rank_batch()
    shards = [loader(data, cp_rank=r, cp_size=2).rank_batch() for r in range(2)]
    assert torch.equal(unshard_sequence([s[0] for s in shards], 1), tokens)
    assert torch.equal(unshard_sequence([s[1] for s in shards], 1), targets)


def test_data_position_resumes_with_the_next_sample():
    data = SyntheticTokens(vocab_size=97, seq_len=16, seed=0)
    first = loader(data)
    first.rank_batch()
    expected = first.rank_batch()
    resumed = loader(data)
    resumed.load_state_dict({"samples_seen": 8})
    assert all(torch.equal(a, b) for a, b in zip(resumed.rank_batch()[:2], expected[:2], strict=True))
    assert resumed.state_dict() == {"samples_seen": 16}


def write_tokens(path, values, dtype):
    """Raw little-endian token ids, as a tokenizer script writes them."""
    path.write_bytes(array.array("H" if dtype == "uint16" else "I", values).tobytes())


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_files_read_as_one_stream_across_file_boundaries(tmp_path, dtype):
    write_tokens(tmp_path / "a.bin", list(range(0, 10)), dtype)
    write_tokens(tmp_path / "b.bin", list(range(10, 25)), dtype)
    files = TokenFiles(token_files(str(tmp_path)), dtype=dtype, seq_len=8, vocab_size=70000)
    assert len(files) == 3  # (25 - 1) // 8
    assert files.sample(1).tolist() == list(range(8, 17))
    assert files.sample(4).tolist() == list(range(8, 17))  # wraps around


def test_token_files_refuse_ids_outside_the_vocabulary(tmp_path):
    write_tokens(tmp_path / "a.bin", [1, 2, 99, 3, 4], "uint16")
    files = TokenFiles([tmp_path / "a.bin"], dtype="uint16", seq_len=4, vocab_size=50)
    with pytest.raises(ConfigError, match="token id 99 is outside the model's vocabulary of 50"):
        files.sample(0)


def test_token_files_refuse_a_size_that_is_not_whole_tokens(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ConfigError, match="7 bytes, not a whole number of uint16 tokens"):
        TokenFiles([tmp_path / "a.bin"], dtype="uint16", seq_len=2, vocab_size=50)


def test_s3_data_is_read_from_the_sagemaker_channel(tmp_path, monkeypatch):
    monkeypatch.delenv("SM_CHANNEL_TRAIN", raising=False)
    with pytest.raises(ConfigError, match="SM_CHANNEL_TRAIN is not set"):
        token_files("s3://bucket/tokens/")
    write_tokens(tmp_path / "part-0.bin", list(range(20)), "uint16")
    monkeypatch.setenv("SM_CHANNEL_TRAIN", str(tmp_path))
    assert token_files("s3://bucket/tokens/") == [tmp_path / "part-0.bin"]


def test_missing_data_path_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        token_files(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="holds no \\*.bin token files"):
        token_files(str(tmp_path))
