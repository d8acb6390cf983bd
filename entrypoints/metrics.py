"""Per-step metrics: one stdout line for log scrapers (SageMaker MetricDefinitions) plus JSONL.

Every logged step rank 0 prints exactly one `metrics key=value ...` line and appends the same
fields as one JSON object to <output_dir>/metrics.jsonl; at the end it prints one
`summary key=value ...` line. The keys, the line format and the regexes that read the lines are
the launcher's contract (`launcher.contract.metrics`); this module measures the values.

- tokens_per_s_per_gpu: global tokens of the step / step wall time / world size.
- mfu: model FLOPs per token x tokens/s/GPU over the accelerator's dense bf16 peak from the
  resolved config (runtime.peak_flops.bf16; FP8 runs are also measured against bf16, as
  torchtitan does, so the numbers compare). nan when the peak is unknown (CPU).
- model FLOPs per token: 6 x the matmul parameters (attention, MLP and output projections;
  embedding lookups are free) + 6 x layers x hidden x seq_len for causal attention scores
  (forward QK^T and PV are 2·s·h each, halved by the mask; backward twice the forward).
  Recomputation from activation checkpointing and the fused loss is not counted.
- mem_*: torch.cuda.max_memory_allocated / max_memory_reserved since the start, in GiB (0 on CPU).
- val_loss, val_perplexity (exp of it): after a step that evaluated the held-out data
  (entrypoints/evaluate.py), on that step's line and record; the summary's final_val_loss is the last.
- data_wait_s, straggler_rank, straggler_above_median: what may slow the job, where measured
  (entrypoints/watchdog.py `speed_causes`); `launcher status` names the likely cause from them.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from launcher.contract.config import ModelConfig
from launcher.contract.metrics import METRICS_FILE, SPEED_CAUSE_KEYS, metrics_line, summary_line


def matmul_params(cfg: ModelConfig) -> int:
    """The matmul weights one token goes through: for MoE the router and its top-k (and shared) experts."""
    d, q, kv = cfg.hidden_size, cfg.q_dim, cfg.kv_dim
    mlp = 3 * d * (cfg.ffn_hidden_size if cfg.moe is None else cfg.moe.active_ffn_width())
    per_layer = 2 * d * q + 2 * d * kv + mlp
    return round(cfg.num_layers * per_layer + cfg.vocab_size * d)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 N + 6 L q s: attention's FLOPs scale with the query width q = num_heads x head_dim."""
    return 6.0 * matmul_params(cfg) + 6.0 * cfg.num_layers * cfg.q_dim * seq_len


def memory_gib() -> tuple[float, float]:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0.0, 0.0
    return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30


class MetricsLogger:
    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        tokens_per_step: int,
        world_size: int,
        flops_per_token: float,
        peak_flops: float | None,
        sinks: Sequence = (),
    ):
        """`sinks`: dashboards (entrypoints/tracking.py) that get every record metrics.jsonl gets."""
        self.enabled = enabled
        self.sinks = list(sinks)
        self.path = output_dir / METRICS_FILE
        self.tokens_per_step, self.world_size = tokens_per_step, world_size
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.records: list[dict] = []
        if enabled:
            output_dir.mkdir(parents=True, exist_ok=True)

    def log(
        self,
        *,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        step_time_s: float,
        val_loss: float | None = None,
        causes: dict | None = None,
    ) -> dict:
        """`causes`: what may slow the job (SPEED_CAUSE_KEYS, entrypoints/watchdog.speed_causes), appended."""
        tokens_per_s = self.tokens_per_step / step_time_s / self.world_size
        mfu = tokens_per_s * self.flops_per_token / self.peak_flops if self.peak_flops else math.nan
        alloc, reserved = memory_gib()
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s_per_gpu": tokens_per_s,
            "mfu": mfu,
            "step_time_s": step_time_s,
            "mem_alloc_gib": alloc,
            "mem_reserved_gib": reserved,
        }
        if val_loss is not None:
            record.update(val_loss=val_loss, val_perplexity=perplexity(val_loss))
        record.update({key: causes[key] for key in SPEED_CAUSE_KEYS if key in (causes or {})})
        self.records.append(record)
        if self.enabled:
            print(metrics_line(record), flush=True)
            self.write(record)
        return record

    def write(self, record: dict) -> None:
        """One line of metrics.jsonl, and the same record to every sink: the one place a record
        is kept, so whatever is logged here (training or validation) reaches the dashboards."""
        with self.path.open("a") as f:
            # NaN and Infinity are not JSON (Python writes them, strict readers refuse them); null
            # says "unknown" to every reader, and an infinite perplexity keeps its loss beside it.
            f.write(json.dumps({k: None if _not_finite(v) else v for k, v in record.items()}) + "\n")
        for sink in self.sinks:
            sink.add(record)

    def close(self, *, interrupted: bool) -> None:
        """End the sinks: the MLflow run is FINISHED, or KILLED after SIGTERM."""
        for sink in self.sinks:
            sink.close("KILLED" if interrupted else "FINISHED")

    def summary(self, total_time_s: float) -> dict:
        records = self.records
        # The first step pays for warm-up (allocator, compile, NCCL setup); leave it out when there are others.
        timed = records[1:] if len(records) > 1 else records
        summary = {
            "steps": len(records),
            "final_loss": records[-1]["loss"] if records else math.nan,
            "mean_tokens_per_s_per_gpu": _mean(r["tokens_per_s_per_gpu"] for r in timed),
            "mean_mfu": _mean(r["mfu"] for r in timed),
            "mean_step_time_s": _mean(r["step_time_s"] for r in timed),
            "peak_mem_alloc_gib": memory_gib()[0],
            "peak_mem_reserved_gib": memory_gib()[1],
            "total_time_s": total_time_s,
        }
        evaluated = [r["val_loss"] for r in records if "val_loss" in r]
        if evaluated:
            summary["final_val_loss"] = evaluated[-1]
        if self.enabled:
            print(summary_line(summary), flush=True)
            sys.stdout.flush()
        return summary


def perplexity(loss: float) -> float:
    """exp(loss): inf past what a float holds, nan for a nan loss."""
    return math.exp(loss) if not loss > 709 else math.inf


def _not_finite(value) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan
