"""Validation: the loss on held-out data, forward-only, under the layout that trains.

    evaluator = Evaluator.from_config(cfg, parts=parts, pipeline=pipeline, mesh=mesh, device=device)
    if evaluator and evaluator.due(step):
        val_loss = evaluator.evaluate()        # the same number on every rank

As torchtitan's `components/validate.py` does, the pass runs the training model itself, with the
same FSDP/TP/CP sharding, in eval mode and under `torch.no_grad`, over a loader of its own; a
pipeline runs the schedule's forward-only `eval` (torch.distributed.pipelining's
`PipelineScheduleSingle.eval` / `PipelineScheduleMulti`: has_backward off, so every stage only runs
forward and the last one computes the loss). Every evaluation reads the same first
`data.validation.batches` global batches of the held-out data, so the numbers of one run compare
over its steps, and the global batch is cut as training's is (data.py): per data-parallel rank, per
context-parallel zigzag share, per micro-batch.

The loss is the mean over the evaluated micro-batches of each one's mean token loss, summed over
the ranks that hold a distinct share of it (as train.py sums the training loss), so it equals
the single-process value on any layout up to float rounding. Where the data comes from:
- data.validation.source "synthetic": the synthetic stream (data.py) from sample 2**61 on, which
  no training step reaches;
- data.validation.source a path: token files as data.source reads them (a prepared dataset's
  manifest is checked the same way);
- data.validation.fraction: the last whole documents of data.source's prepared dataset
  (`launcher.contract.dataset.held_out_start`); training's loader stops before them.
Memory: forward-only activations are freed layer by layer, and the gradients are already gone
(zero_grad(set_to_none) runs before), so the pass peaks below a training step
(launcher/estimate/memory.py checks this for the estimate).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from entrypoints.data import DataLoader, SyntheticTokens, TokenFiles, held_out_split, token_files
from launcher.contract.config import JobConfig

SYNTHETIC_HELD_OUT_FIRST_SAMPLE = 2**61
"""Where held-out synthetic samples start: training would need 2**61 / global batch steps to reach it."""


def validation_dataset(cfg: JobConfig):
    """The held-out samples of data.validation: a synthetic stream, token files, or data.source's tail."""
    validation, t, m = cfg.data.validation, cfg.training, cfg.model
    separator = cfg.data.document_separator if cfg.data.document_masking else None
    if validation.source == "synthetic":
        return _Offset(
            SyntheticTokens(vocab_size=m.vocab_size, seq_len=t.seq_len, seed=t.seed, separator=separator),
            SYNTHETIC_HELD_OUT_FIRST_SAMPLE,
        )
    if validation.source is not None:
        paths = token_files(validation.source, dtype=cfg.data.dtype, vocab_size=m.vocab_size)
        return TokenFiles(
            paths, dtype=cfg.data.dtype, seq_len=t.seq_len, vocab_size=m.vocab_size, key="data.validation.source"
        )
    paths = token_files(cfg.data.source, dtype=cfg.data.dtype, vocab_size=m.vocab_size)
    return TokenFiles(
        paths,
        dtype=cfg.data.dtype,
        seq_len=t.seq_len,
        vocab_size=m.vocab_size,
        span=(held_out_split(cfg), None),
        key="data.validation.fraction",
    )


class _Offset:
    """A dataset's samples from `first` on."""

    def __init__(self, dataset, first: int):
        self.dataset, self.first = dataset, first

    def sample(self, index: int) -> torch.Tensor:
        return self.dataset.sample(self.first + index)


class Evaluator:
    def __init__(self, cfg: JobConfig, *, parts: list, pipeline, mesh, loader: DataLoader):
        self.validation, self.last_step = cfg.data.validation, cfg.training.steps
        self.parts, self.pipeline, self.loader = parts, pipeline, loader
        par = cfg.parallel
        # Who holds a distinct share of the loss, and its weight: as train.py counts the training loss.
        self.holds_loss = (pipeline is None or pipeline.has_last) and mesh["tp"].get_local_rank() == 0
        self.share = 1.0 / (par.data_parallel * par.context)
        self.device = loader.device

    @staticmethod
    def from_config(cfg: JobConfig, *, parts: list, pipeline, mesh, device: torch.device) -> Evaluator | None:
        """The job's evaluator, or None without data.validation. Its data is opened (and checked) now."""
        if cfg.data.validation is None:
            return None
        dp_rank, cp_rank = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
        loader = DataLoader.over(validation_dataset(cfg), cfg, dp_rank=dp_rank, cp_rank=cp_rank, device=device)
        return Evaluator(cfg, parts=parts, pipeline=pipeline, mesh=mesh, loader=loader)

    def due(self, step: int) -> bool:
        return self.validation.due(step, self.last_step)

    def evaluate(self) -> float:
        """The global mean validation loss over data.validation.batches batches (one all-reduce)."""
        self.loader.samples_seen = 0  # the same held-out batches every time
        for part in self.parts:
            part.eval()
        try:
            with torch.no_grad():
                local = sum(self._batch_loss() for _ in range(self.validation.batches)) / self.validation.batches
        finally:
            for part in self.parts:
                part.train()
                _reshard(part)
        report = torch.zeros(1, device=self.device)
        if self.holds_loss:
            report[0] = local * self.share
        dist.all_reduce(report)
        return report.item()

    def _batch_loss(self) -> torch.Tensor:
        """This rank's mean loss of one global batch (0 on ranks that hold none of it)."""
        if self.pipeline is not None:
            loss = self.pipeline.evaluate(*self.loader.rank_batch())
            return loss if loss is not None else torch.zeros((), device=self.device)
        model, losses = self.parts[0], []
        for tokens, targets, documents in self.loader.next_step():
            losses.append(model(tokens, targets=targets, documents=documents))
        return torch.stack(losses).mean()


def _reshard(part) -> None:
    """Free the gathered parameters a forward without backward leaves behind (FSDP modules that
    do not reshard after forward, sync_last_gathered, reshard in backward, which eval never runs)."""
    for module in part.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
