"""Training batches: seeded synthetic tokens, or tokenized shards read from disk.

    loader = DataLoader.from_config(cfg, dp_rank=..., cp_rank=..., device=...)
    for tokens, targets, documents in loader.next_step(): ...   # grad_accum_steps micro-batches
    loader.state_dict() / loader.load_state_dict(...)      # {"samples_seen": int}

A dataset is a sequence of samples of seq_len + 1 tokens (inputs and the targets shifted by one).
Step k uses samples [k·G, (k+1)·G) for global batch G, whatever the layout:
- data-parallel rank r (of dp = data_replicate x data_shard) takes the r-th contiguous slice
  of G/dp samples and cuts it into micro-batches in order, so one process with grad_accum
  G/micro_batch sees exactly the same micro-batches, in the same order;
- every tensor-parallel rank of a group gets the same batch (replicated parameters would
  otherwise silently diverge);
- each context-parallel rank keeps its two zigzag chunks of every sequence (parallel/context.py);
- with data.document_masking, `documents` holds the document ids of every WHOLE input sequence
  (model/documents.py), computed before the zigzag split and given to every cp rank, since
  attention masks and RoPE positions need them for keys of the whole sequence; else None.
The position (samples seen) is checkpointed, so a resumed job continues with the next sample.

Sources:
- "synthetic": every sequence is start + cumulative sums of steps drawn from {1, 2, 3, 4},
  modulo the vocabulary, from a generator seeded by (seed, sample index). Random enough to
  exercise everything, learnable enough that the loss falls from log V towards log 4. With
  document masking, documents of 1 to seq_len/4 tokens (lengths from the same generator) each
  end with the separator token (launcher.contract.config.SYNTHETIC_DOCUMENT_SEPARATOR).
- a directory of `*.bin` files (sorted by name) or one file: raw little-endian uint16/uint32
  token ids, read as one concatenated stream. A directory `launcher data prepare` wrote holds a
  manifest.json (launcher/contract/dataset.py): its shards are read in the manifest's order, and
  its dtype and vocabulary are checked against the config first. Sample i is tokens [i·s, i·s + s + 1). The
  files are read with positioned reads (os.pread), one sample at a time, never loaded whole.
- an s3:// URI: SageMaker downloads the channel, so the files are read from $SM_CHANNEL_TRAIN.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from entrypoints.model.documents import document_ids
from entrypoints.parallel.context import shard_sequence
from launcher.contract.config import ConfigError, JobConfig
from launcher.contract.dataset import held_out_start, manifest_problem, read_manifest

TOKEN_DTYPES = {"uint16": (torch.uint16, 2), "uint32": (torch.uint32, 4)}


class SyntheticTokens:
    def __init__(self, *, vocab_size: int, seq_len: int, seed: int, separator: int | None = None):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.separator = separator

    def __len__(self) -> int:
        return 2**62

    def sample(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed((self.seed * 2_654_435_761 + index) & (2**63 - 1))
        start = torch.randint(self.vocab_size, (1,), generator=generator)
        steps = torch.randint(1, 5, (self.seq_len,), generator=generator)
        tokens = torch.cat([start, start + steps.cumsum(0)]) % self.vocab_size
        if self.separator is not None:
            lengths = torch.randint(1, max(2, self.seq_len // 4) + 1, (self.seq_len,), generator=generator)
            ends = lengths.cumsum(0) - 1
            tokens[ends[ends <= self.seq_len]] = self.separator
        return tokens


@dataclass(frozen=True)
class _Shard:
    path: Path
    first_token: int
    num_tokens: int


class TokenFiles:
    """A concatenated stream of token ids over several binary files."""

    def __init__(
        self,
        paths: list[Path],
        *,
        dtype: str,
        seq_len: int,
        vocab_size: int,
        span: tuple[int, int | None] = (0, None),
        key: str = "data.source",
    ):
        """`span`: the [first, end) tokens of the stream that samples are cut from (end None: all);
        a held-out validation share is the part of the stream training's span leaves out."""
        self.torch_dtype, self.itemsize = TOKEN_DTYPES[dtype]
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.shards: list[_Shard] = []
        total = 0
        for path in paths:
            size = path.stat().st_size
            if size % self.itemsize:
                raise ConfigError(f"data.dtype: {path} has {size} bytes, not a whole number of {dtype} tokens")
            self.shards.append(_Shard(path, total, size // self.itemsize))
            total += size // self.itemsize
        self.first_token = span[0]
        self.total_tokens = (total if span[1] is None else min(span[1], total)) - span[0]
        self.key = key
        if len(self) == 0:
            raise ConfigError(
                f"{key}: {self.total_tokens} tokens in {len(paths)} file(s) do not make one sample of {seq_len + 1} tokens"
            )
        self._fds: dict[Path, int] = {}

    def __len__(self) -> int:
        return max(0, (self.total_tokens - 1) // self.seq_len)

    def sample(self, index: int) -> torch.Tensor:
        start = self.first_token + (index % len(self)) * self.seq_len
        data = self._read(start, self.seq_len + 1)
        tokens = torch.frombuffer(bytearray(data), dtype=self.torch_dtype).to(torch.int64)
        top = int(tokens.max())
        if top >= self.vocab_size:
            raise ConfigError(f"{self.key}: token id {top} is outside the model's vocabulary of {self.vocab_size}")
        return tokens

    def _read(self, first: int, count: int) -> bytes:
        chunks = []
        for shard in self.shards:
            lo, hi = max(first, shard.first_token), min(first + count, shard.first_token + shard.num_tokens)
            if lo < hi:
                fd = self._fds.get(shard.path)
                if fd is None:
                    fd = self._fds[shard.path] = os.open(shard.path, os.O_RDONLY)
                offset = (lo - shard.first_token) * self.itemsize
                chunks.append(os.pread(fd, (hi - lo) * self.itemsize, offset))
        return b"".join(chunks)


def token_files(source: str, *, dtype: str | None = None, vocab_size: int | None = None) -> list[Path]:
    """The token files of a data.source that is a path or an s3:// URI; a prepared dataset's
    manifest, when there is one, names them and must agree with `dtype` and `vocab_size`."""
    if source.startswith("s3://"):
        channel = os.environ.get("SM_CHANNEL_TRAIN")
        if not channel:
            raise ConfigError(
                f"data.source: {source} is read from the SageMaker 'train' channel, but SM_CHANNEL_TRAIN is not set; "
                "outside SageMaker use a local path"
            )
        root = Path(channel)
    else:
        root = Path(source)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ConfigError(f"data.source: {root} does not exist; give a directory of *.bin token files or one file")
    try:
        manifest = read_manifest(root)
    except ValueError as error:
        raise ConfigError(f"data.source: {error}") from None
    if manifest is not None:
        problem = manifest_problem(manifest, dtype=dtype, vocab_size=vocab_size) if vocab_size else None
        if problem:
            raise ConfigError(problem)
        return [root / shard["name"] for shard in manifest["shards"]]
    files = sorted(p for p in root.rglob("*.bin") if p.is_file())
    if not files:
        raise ConfigError(f"data.source: {root} holds no *.bin token files")
    return files


class Batch(NamedTuple):
    tokens: torch.Tensor
    """[B, s/cp] input token ids (this rank's zigzag share)."""
    targets: torch.Tensor
    """[B, s/cp] the next token of each input."""
    documents: torch.Tensor | None
    """[B, s] document ids of the whole input sequences, with document masking; else None."""


class DataLoader:
    def __init__(
        self,
        dataset,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        cp_rank: int,
        cp_size: int,
        device: torch.device,
        document_separator: int | None = None,
    ):
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.device = device
        self.document_separator = document_separator
        self.samples_seen = 0

    @staticmethod
    def from_config(cfg: JobConfig, *, dp_rank: int, cp_rank: int, device: torch.device) -> DataLoader:
        t, m = cfg.training, cfg.model
        separator = cfg.data.document_separator if cfg.data.document_masking else None
        if cfg.data.source == "synthetic":
            dataset = SyntheticTokens(vocab_size=m.vocab_size, seq_len=t.seq_len, seed=t.seed, separator=separator)
        else:
            paths = token_files(cfg.data.source, dtype=cfg.data.dtype, vocab_size=m.vocab_size)
            split = held_out_split(cfg)
            span = (0, None) if split is None else (0, split)
            dataset = TokenFiles(paths, dtype=cfg.data.dtype, seq_len=t.seq_len, vocab_size=m.vocab_size, span=span)
        return DataLoader.over(dataset, cfg, dp_rank=dp_rank, cp_rank=cp_rank, device=device)

    @staticmethod
    def over(dataset, cfg: JobConfig, *, dp_rank: int, cp_rank: int, device: torch.device) -> DataLoader:
        """A loader of `dataset` cut into the job's batches for this rank."""
        t = cfg.training
        separator = cfg.data.document_separator if cfg.data.document_masking else None
        return DataLoader(
            dataset,
            global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size,
            dp_rank=dp_rank,
            dp_size=cfg.parallel.data_parallel,
            cp_rank=cp_rank,
            cp_size=cfg.parallel.context,
            device=device,
            document_separator=separator,
        )

    def rank_batch(self) -> Batch:
        """This rank's whole share of the next step, [G/dp, s/cp] tokens and targets; advances."""
        per_rank = self.global_batch_size // self.dp_size
        first = self.samples_seen + self.dp_rank * per_rank
        samples = torch.stack([self.dataset.sample(first + i) for i in range(per_rank)])
        self.samples_seen += self.global_batch_size
        tokens = shard_sequence(samples[:, :-1], 1, self.cp_rank, self.cp_size)
        targets = shard_sequence(samples[:, 1:], 1, self.cp_rank, self.cp_size)
        documents = None
        if self.document_separator is not None:
            documents = document_ids(samples[:, :-1], self.document_separator).to(self.device, non_blocking=True)
        return Batch(tokens.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True), documents)

    def next_step(self) -> Iterator[Batch]:
        """The micro-batches of the next step, in order."""
        tokens, targets, documents = self.rank_batch()
        size = self.micro_batch_size
        parts = [tokens.split(size), targets.split(size)]
        parts.append(documents.split(size) if documents is not None else [None] * len(parts[0]))
        return (Batch(*micro) for micro in zip(*parts, strict=True))

    def state_dict(self) -> dict:
        return {"samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict) -> None:
        self.samples_seen = int(state["samples_seen"])


def held_out_split(cfg: JobConfig) -> int | None:
    """With data.validation.fraction: the token where the held-out documents of data.source begin
    (training reads the tokens before it, validation those from it); else None."""
    validation = cfg.data.validation
    if validation is None or validation.fraction is None:
        return None
    root = (
        Path(os.environ.get("SM_CHANNEL_TRAIN") or "") if cfg.data.source.startswith("s3://") else Path(cfg.data.source)
    )
    try:
        manifest = read_manifest(root)
        if manifest is None:
            raise ValueError(f"{root} is not a prepared dataset (no manifest.json); give data.validation.source")
        return held_out_start(root, manifest, validation.fraction)[0]
    except ValueError as error:
        raise ConfigError(f"data.validation.fraction: {error}") from None
