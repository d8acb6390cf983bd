"""Training entry point: resolved config -> mesh -> model -> parallelize -> train loop.

    torchrun --nproc_per_node 8 entrypoints/train.py --config resolved.json   # from the bundle root
    python entrypoints/train.py --config resolved.json                        # one process, no torchrun

Reads only the resolved config (and SM_CHANNEL_TRAIN for s3 data). Outputs:
- metrics: stdout lines and <output_dir>/metrics.jsonl (metrics.py); output_dir is
  runtime.output_dir, else $SM_OUTPUT_DATA_DIR, else ./output;
- checkpoints: checkpoint.dir, else /opt/ml/checkpoints on SageMaker (SM_TRAINING_ENV set),
  else ./checkpoints (checkpoint.py);
- a Hugging Face checkpoint after the last step with checkpoint.export_hf (export_hf.py).
A fresh run with model.init_from starts from that Hugging Face checkpoint (hf_weights.py).
Exit status: 0 when every step ran, 2 for a config it cannot run (one line on stderr), 3 when
the loss or the gradient norm stopped being finite (one line on stderr; nothing is saved after
the last finite step), 4 when a checkpoint could not be written (one line on stderr naming the
file and the OS error, e.g. ENOSPC; the newest complete checkpoint is kept), 143 after SIGTERM (a final checkpoint is written first when it fits in runtime.stop_budget_s; spot
interruptions end this way). A failure's message goes to torchrun's TORCHELASTIC_ERROR_FILE
(failure.py), with the time it was raised, so the launcher can name the first failing rank.

Checkpoints are saved every `checkpoint.every_steps` steps and every `checkpoint.every_minutes`
minutes (by rank 0's clock, shared in the per-step all-reduce so all ranks save at the same step),
at the last step, and after SIGTERM.

`train(cfg, env)` runs one job inside an existing process group and returns its summary, so
tests can run several jobs in one torchrun launch.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from contextlib import closing, contextmanager
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `entrypoints` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":  # a training process: no collections while torch is imported
    from entrypoints.garbage_collection import pause_during_startup

    pause_during_startup()

import torch
import torch.distributed as dist

from entrypoints import failure, tracking
from entrypoints.checkpoint import Checkpointer, CheckpointWriteFailed, RankHosts, step_dir_name
from entrypoints.data import DataLoader
from entrypoints.evaluate import Evaluator
from entrypoints.export_hf import ExportFailed, export_directory, export_hf
from entrypoints.fp8 import after_optimizer_step, experts_run_fp8, fp8_settings
from entrypoints.garbage_collection import GarbageCollection, imports_done
from entrypoints.hf_weights import load_hf_weights
from entrypoints.metrics import MetricsLogger, flops_per_token
from entrypoints.model.init import materialize
from entrypoints.optim import Optimizers, clip_grad_norm
from entrypoints.parallel.accumulate import accumulate
from entrypoints.parallel.mesh import build_mesh
from entrypoints.parallel.parallelize import build_model_parts
from entrypoints.parallel.pipeline import Pipeline
from entrypoints.parallel.process_group import DistEnv, process_group
from entrypoints.watchdog import Watchdog, speed_causes
from launcher.contract.config import ConfigError, JobConfig, load_config

EXIT_CONFIG = 2
EXIT_DIVERGED = 3
EXIT_WRITE_FAILED = 4  # a checkpoint, its copy to S3, or the Hugging Face export
EXIT_SIGTERM = 128 + signal.SIGTERM
# After SIGTERM the engine sends SIGKILL after its grace (SageMaker: about 120 s); the final save
# is skipped when the pending save plus the last measured save time would not fit in the
# budget, runtime.stop_budget_s (the job's grace less torchrun's exit, set by the launcher).


def output_dir(cfg: JobConfig) -> Path:
    return Path(cfg.runtime.output_dir or os.environ.get("SM_OUTPUT_DATA_DIR") or "output")


def checkpoint_dir(cfg: JobConfig) -> Path:
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir)
    return Path("/opt/ml/checkpoints" if "SM_TRAINING_ENV" in os.environ else "checkpoints")


@contextmanager
def sigterm_flag():
    """A list whose first element turns True on SIGTERM (the loop checks it between steps)."""
    flag = [False, 0.0]  # [received, time.monotonic() when received]

    def handler(signum, frame):
        if not flag[0]:
            flag[1] = time.monotonic()
        flag[0] = True

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGTERM, previous)


class TrainingDiverged(Exception):
    """The loss or the gradient norm is not finite: the job fails rather than completes."""


def train(cfg: JobConfig, env: DistEnv) -> dict:
    """Run the job in the current process group; returns the summary (plus "interrupted")."""
    torch.manual_seed(cfg.training.seed)
    par, t = cfg.parallel, cfg.training
    if par.world_size != env.world_size:
        raise ConfigError(
            f"parallel.world_size: the config is for {par.world_size} processes, but {env.world_size} run"
        )

    fp8 = fp8_settings(cfg, device_type=env.device.type, backend=env.backend)
    mesh = build_mesh(par, env.device.type)
    parts, stage_ids = build_model_parts(cfg, mesh, fp8=fp8)
    for part in parts:
        materialize(part, env.device, seed=t.seed)
        part.train()
    pipeline = Pipeline(parts, stage_ids, mesh["pp"], par, env.device) if par.pipeline > 1 else None
    optimizers = Optimizers(parts, t.optimizer, total_steps=t.steps)
    data = DataLoader.from_config(
        cfg, dp_rank=mesh["dp"].get_local_rank(), cp_rank=mesh["cp"].get_local_rank(), device=env.device
    )
    evaluator = Evaluator.from_config(cfg, parts=parts, pipeline=pipeline, mesh=mesh, device=env.device)
    checkpoints = Checkpointer(
        checkpoint_dir(cfg),
        cfg.checkpoint,
        parts=parts,
        optimizers=optimizers,
        data=data,
        rank_hosts=RankHosts.from_env(env.rank, env.world_size),
    )
    start = _first_step_after(checkpoints, t.steps, env.rank)
    load_hf_weights(parts, cfg, fresh_start=start == 0)
    metrics = _metrics_logger(cfg, env)
    # Each step's loss is summed over the world from the ranks that hold a distinct share of it:
    # the last pipeline stage, tensor-parallel rank 0, every data/context-parallel rank.
    holds_loss = (pipeline is None or pipeline.has_last) and mesh["tp"].get_local_rank() == 0
    loss_share = 1.0 / (par.data_parallel * par.context)
    if env.rank == 0:
        _announce(cfg, env, parts, fp8, start)

    interrupted = False
    began = time.perf_counter()
    watchdog = _watchdog(cfg, env)
    with sigterm_flag() as sigterm, closing(watchdog), GarbageCollection(t.gc_every_steps) as collector:
        for step in range(start + 1, t.steps + 1):
            step_start = time.perf_counter()
            watchdog.step_began()
            loss, data_wait = _forward_backward(parts, pipeline, data, par)
            grad_norm = clip_grad_norm(parts, t.grad_clip, mesh["pp"])
            lr = optimizers.lr
            optimizers.step()
            after_optimizer_step(parts, fp8)
            optimizers.zero_grad()

            share = loss * loss_share if holds_loss else None
            global_loss, stop, time_due, written, norms = _share_step(env, share, grad_norm, sigterm[0], checkpoints)
            step_time = time.perf_counter() - step_start
            watchdog.step_done(step, step_time)
            watchdog.straggler(step, env.device)
            diverged = divergence(step, global_loss, norms, resumed_from=start)
            with watchdog.paused():
                val_loss = None if diverged or stop else _validate(evaluator, step)

            if step % t.log_every == 0 or step == t.steps or diverged or val_loss is not None:
                values = {"loss": global_loss, "grad_norm": grad_norm.item(), "lr": lr, "step_time_s": step_time}
                causes = speed_causes(data_wait, step_time, watchdog.named_straggler)
                metrics.log(step=step, **values, val_loss=val_loss, causes=causes)
            _stop_if(diverged, checkpoints)
            with watchdog.paused():  # saves are slow and not steps: the watchdog holds them to its long limit
                interrupted = _save_if_due(cfg, env, checkpoints, step, written, time_due, sigterm if stop else None)
            if interrupted:
                break
            collector.after_step(step)  # outside the step's time, the watchdog's and the save's
    checkpoints.close()
    if cfg.checkpoint.export_hf and not interrupted:
        _export(parts, stage_ids, mesh, cfg, checkpoints)
    # A restart that only finished what came after the last step trained nothing to sum up.
    summary = metrics.summary(time.perf_counter() - began) if start < t.steps else {}
    metrics.close(interrupted=interrupted)
    summary["interrupted"] = interrupted
    return summary


def _save_if_due(cfg: JobConfig, env: DistEnv, checkpoints: Checkpointer, step: int, written, time_due, sigterm):
    """After `step`: finish the pending save once every rank has written it, then save, either
    the final one after SIGTERM (`sigterm`: the flag, when any rank got it; returns True) or a
    periodic or last one when due."""
    if written == env.world_size:
        checkpoints.finish_pending()
    if sigterm is not None:
        _save_after_sigterm(checkpoints, step, env, sigterm[1] or time.monotonic(), cfg.runtime.stop_budget_s)
        return True
    if checkpoints.due(step) or time_due > 0 or step == cfg.training.steps:
        checkpoints.save(step, blocking=step == cfg.training.steps)
    return False


def _forward_backward(parts, pipeline: Pipeline | None, data: DataLoader, par) -> tuple[torch.Tensor, float]:
    """The step's loss, gradients accumulated, and the seconds it waited for its batch."""
    began = time.perf_counter()
    batch = list(data.next_step()) if pipeline is None else data.rank_batch()
    data_wait = time.perf_counter() - began
    if pipeline is None:
        return accumulate(parts[0], batch, par.grad_accumulation), data_wait
    return pipeline.step(*batch), data_wait


def _watchdog(cfg: JobConfig, env: DistEnv) -> Watchdog:
    """This rank's watchdog (training.watchdog); before the first step the collective timeout
    bounds a stall, since that step compiles and may follow a long model load."""
    return Watchdog.start(
        cfg.training.watchdog,
        rank=env.rank,
        world_size=env.world_size,
        stacks_dir=output_dir(cfg) / "stacks",
        first_step_limit_s=cfg.runtime.collective_timeout_s,
    )


def _validate(evaluator: Evaluator | None, step: int) -> float | None:
    """The validation loss after `step` when data.validation asks for one then (every rank
    decides alike: the step and the config are the same everywhere); else None."""
    return evaluator.evaluate() if evaluator is not None and evaluator.due(step) else None


def _metrics_logger(cfg: JobConfig, env: DistEnv) -> MetricsLogger:
    t = cfg.training
    return MetricsLogger(
        output_dir(cfg),
        enabled=env.rank == 0,
        tokens_per_step=t.global_batch_size * t.seq_len,
        world_size=env.world_size,
        flops_per_token=flops_per_token(cfg.model, t.seq_len),
        peak_flops=cfg.runtime.peak_flops.bf16,
        sinks=tracking.sinks(cfg, output_dir(cfg)) if env.rank == 0 else (),
    )


def divergence(step: int, loss: float, grad_norm: float, *, resumed_from: int) -> str | None:
    """Why training cannot go on after `step` (a loss or gradient norm that is not finite), or None.

    Checked at every step, not only after a resume: parameters that saw a NaN are lost, and a
    job whose loss is NaN has not completed. After a resume the likely cause is the checkpoint."""
    values = {"loss": loss, "gradient norm": grad_norm}
    broken = [f"the {name} is {value}" for name, value in values.items() if not math.isfinite(value)]
    if not broken:
        return None
    if resumed_from:
        cause = (
            f"{step - resumed_from} step(s) after resuming from checkpoint {step_dir_name(resumed_from)}, which may "
            "hold damaged values; resume from an older one (checkpoint.resume: <checkpoint.dir>/step-N)"
        )
    else:
        cause = "lower training.optimizer.lr or training.grad_clip"
    return f"training: {' and '.join(broken)} at step {step}; {cause}; step {step} was not saved"


def _stop_if(diverged: str | None, checkpoints: Checkpointer) -> None:
    if diverged:
        checkpoints.close()  # the pending save holds an earlier, finite step: keep it
        raise TrainingDiverged(diverged)


def _first_step_after(checkpoints: Checkpointer, steps: int, rank: int) -> int:
    """The step to resume after (0: a fresh start); refuses a checkpoint that leaves nothing to
    train, unless this job saved it: then only what follows the last step runs again."""
    resumed = checkpoints.resume()
    if checkpoints.saved_last_step_before(steps):
        if rank == 0:
            print(
                f"checkpoint: this job's earlier attempt trained to step {steps} and saved it; running what follows "
                "the last step again",
                flush=True,
            )
        return resumed
    return _steps_left_after(resumed, steps)


def _export(parts, stage_ids: list[int], mesh, cfg: JobConfig, checkpoints: Checkpointer) -> None:
    """checkpoint.export_hf after the last step; a failed write names the checkpoint that holds
    the same weights, from which `launcher export` writes them again."""
    try:
        export_hf(parts, stage_ids, mesh, cfg, export_directory(cfg, output_dir(cfg)))
    except ExportFailed as error:
        saved = checkpoints.last_saved_step
        if saved != cfg.training.steps:
            raise
        held = checkpoints.directory / step_dir_name(saved)
        raise ExportFailed(
            f"{error}; the complete checkpoint {held} holds the same weights: `launcher export "
            f"{checkpoints.job or 'JOB'} --out DIR` (or entrypoints/export_hf.py) writes them from it"
        ) from None


def _steps_left_after(start: int, steps: int) -> int:
    """The step to resume after; a checkpoint at or past the last step leaves nothing to train."""
    if start >= steps:
        raise ConfigError(
            f"checkpoint: the newest checkpoint is at step {start}, and training.steps is {steps}: nothing is left "
            "to train; raise training.steps, or set checkpoint.resume: never to start over"
        )
    return start


def _announce(cfg: JobConfig, env: DistEnv, parts, fp8, start: int) -> None:
    params = sum(p.numel() for part in parts for p in part.parameters())
    experts = " fp8_experts=rowwise" if fp8 is not None and experts_run_fp8(parts) else ""
    if cfg.training.moe_force_load_balance:
        experts += " routing=round_robin"
    print(
        f"start job={cfg.name} model={cfg.model.name} layout={cfg.parallel} world_size={env.world_size} "
        f"device={env.device.type} dtype={cfg.precision.dtype} fp8={fp8.recipe if fp8 else 'off'}{experts} "
        f"rank0_params={params} resumed_from_step={start}",
        flush=True,
    )
    if fp8 is not None and env.device.type == "cuda" and not cfg.training.compile:
        # Measured on an H200 (docs/gpu_check_h200.md): Llama 3.2 1B at 8K ran 1.8x slower than bf16.
        print("note: fp8 without training.compile casts to float8 in separate kernels; set compile: true", flush=True)


def _share_step(env: DistEnv, loss_share, grad_norm, sigterm: bool, checkpoints: Checkpointer) -> list[float]:
    """One all-reduce per step carries the global loss (from the ranks that hold a share of it),
    whether any rank got SIGTERM, rank 0's vote that a timed checkpoint is due, how many ranks
    have written the pending save, and the sum of the ranks' gradient norms (finite exactly when
    every rank's is: what `divergence` checks, with no sync of its own)."""
    report = torch.zeros(5, device=env.device)
    if loss_share is not None:
        report[0] = loss_share
    report[1] = float(sigterm)
    report[2] = checkpoints.time_due_vote()
    report[3] = float(checkpoints.pending_written())
    report[4] = grad_norm.detach()
    checkpoints.keep_lease()
    dist.all_reduce(report)
    return report.tolist()


def _save_after_sigterm(checkpoints: Checkpointer, step: int, env: DistEnv, sigterm_at: float, budget_s: float) -> None:
    """Finish the pending save, then save `step` if rank 0 judges that it fits in `budget_s`
    (runtime.stop_budget_s: the seconds after SIGTERM until torchrun SIGKILLs the workers).

    `sigterm_at`: when this rank got SIGTERM (now, if only another rank did); rank 0's counts.
    """
    checkpoints.finish_pending()
    saved = checkpoints.last_saved_step == step
    if not saved:
        left = budget_s - (time.monotonic() - sigterm_at)
        fits = torch.tensor(
            [float(checkpoints.last_save_s is None or checkpoints.last_save_s < left)], device=env.device
        )
        dist.broadcast(fits, src=0)
        if fits.item():
            checkpoints.save(step, blocking=True)
            saved = True
    if env.rank == 0:
        what = (
            "checkpoint saved" if saved else f"no time for a checkpoint; the last is step {checkpoints.last_saved_step}"
        )
        print(f"interrupted by SIGTERM after step {step}; {what}", flush=True)


@failure.record
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a Llama model from a resolved launcher config.")
    parser.add_argument("--config", required=True, help="path of the resolved config JSON")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        with process_group(cfg.runtime.device, cfg.runtime.collective_timeout_s) as env, failure.timed():
            summary = train(cfg, env)
    except (ConfigError, TrainingDiverged, CheckpointWriteFailed, ExportFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        failure.HANDLER.record_exception(err)  # so torchrun's failure report names it too
        if isinstance(err, ConfigError):
            return EXIT_CONFIG
        return EXIT_DIVERGED if isinstance(err, TrainingDiverged) else EXIT_WRITE_FAILED
    return EXIT_SIGTERM if summary["interrupted"] else 0


if __name__ == "__main__":
    imports_done()
    sys.exit(main())
