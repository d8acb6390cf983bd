"""Checkpoint size, save time, and what an interruption can cost: pure arithmetic, no torch.

    est = estimate_checkpoint(params=70_553_706_496, instance_count=4, instance=instance_types()["ml.p5e.48xlarge"],
                              every_steps=200, every_minutes=0, step_time_s=402.0)
    est.line()        # 'checkpoint 847 GB (12 B/param), 212 GB per host: ~53 s to write, ~85 s to S3; every 200 steps (22.3 h)'
    est.warnings      # one line each: loss bound, stop grace, back-to-back saves

What the entrypoints save (entrypoints/checkpoint.py): the model's parameters and the AdamW
states, sharded over every rank. FSDP keeps fp32 master weights in its shards whatever the
compute dtype (entrypoints/parallel/fsdp.py), and AdamW keeps exp_avg and exp_avg_sq in the
parameters' dtype (entrypoints/optim.py), so a checkpoint holds 4 + 4 + 4 = 12 bytes per
parameter (FP8 training keeps fp32 master weights too). The per-rank step counters, RNG states
and train_state.json are kilobytes. Llama 3.1 70B: 70.55e9 x 12 B = 847 GB.

Time: every host writes its share (size / hosts) to its own checkpoint directory at the
instance's checkpoint_write_gb_per_s; on SageMaker the sync then uploads each file once it is
written, at checkpoint_upload_gb_per_s (both per host, launcher/catalog/instances.yaml, with
their source). A checkpoint is safe from the loss of the hosts once it is in S3, so

    durable_s = write_s + upload_s          (upload_s = 0 where nothing is uploaded)

An interruption loses the work since the last durable checkpoint: at worst one interval plus
the time the next one needs to become durable.

A stop (StopTrainingJob, a spot reclaim) is SIGTERM, then SIGKILL after the engine's grace
(SageMaker: 120 s). The entrypoint checks SIGTERM between steps (entrypoints/train.py), so a
save after a stop needs the step in progress and the save itself to fit in the grace; at 150 to
400 s a step they never do at the flagships' sizes, and a stop then loses what a failure loses.
The estimate says so once, as a fact of the run, rather than as a warning on every submit.

`checkpoint.every_minutes: auto` (`auto_every_minutes`) takes the interval that minimises the
expected time lost, to first order: Young's sqrt(2 * save * MTBF) (J. W. Young 1974, "A first
order approximation to the optimum checkpoint interval", CACM 17(9); J. T. Daly 2006, "A higher
order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3)). The MTBF is
that of the whole job: the per-host rate (failures, plus spot reclaims with managed spot;
launcher/catalog/instances.yaml, `interruptions`, with its source) times the hosts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from launcher.catalog.engines import DEFAULT_STOP_GRACE_S, STOP_EXIT_S, capabilities
from launcher.contract.config import checkpoint_bytes_per_param
from launcher.recipe.schema import MAX_DURATION_S

# SageMaker's SIGTERM-to-SIGKILL time (launcher/catalog/engines.yaml): the final save must be durable within it.
SAGEMAKER_STOP_GRACE_S = capabilities("sagemaker").stop_grace_s
# Without every_minutes, warn when an interruption can lose more than this much work.
LOSS_WARNING_S = 3600.0
# checkpoint.every_minutes: auto where no save time or interruption rate is known (this machine,
# CPU instances): hourly, which bounds the loss the way the shipped 8B recipes do.
UNMODELLED_AUTO_MINUTES = 60.0
MAX_AUTO_MINUTES = MAX_DURATION_S / 60  # the schema's bound on checkpoint.every_minutes


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointEstimate:
    size_bytes: int
    instance_count: int
    kept: int = 1  # complete checkpoints kept (checkpoint.keep)
    write_s: float | None  # per host, to its checkpoint directory; None: bandwidth unknown
    upload_s: float | None  # per host, to S3; None: no upload (not SageMaker) or unknown
    interval_s: float | None  # between checkpoint starts; None: only at the end and on SIGTERM
    interval_text: str
    worst_loss_s: float | None  # work an interruption can lose; None: unknown
    warnings: tuple[str, ...]
    stop_text: str | None = None  # what a stop (SIGTERM, then SIGKILL after the grace) loses
    restore_bytes_per_host: float | None = None  # copied to each host before every start; None: none
    restore_s: float | None = None  # how long that copy takes; None: bandwidth unknown
    bytes_per_param: int = checkpoint_bytes_per_param()  # master weight + AdamW's two moments

    def restore_line(self) -> str | None:
        """What every start, retry and spot restart copies to each host first, when the engine
        copies the whole checkpoint prefix (SageMaker's CheckpointConfig)."""
        if self.restore_bytes_per_host is None:
            return None
        took = f", ~{_duration(self.restore_s)}" if self.restore_s is not None else ""
        if self.restore_bytes_per_host < self.size_bytes:  # the host's own share (checkpoint_mirror.py)
            return (
                f"each start, retry or spot restart reads back {_gb(self.restore_bytes_per_host)} to each host: its "
                f"own files of the newest checkpoint{took} (CheckpointConfig would copy {self.kept} x "
                f"{_gb(self.size_bytes)} to every host)"
            )
        return (
            f"each start, retry or spot restart first copies at least {_gb(self.restore_bytes_per_host)} to every "
            f"host ({self.kept} x {_gb(self.size_bytes)}: CheckpointConfig restores the whole prefix{took})"
        )

    @property
    def bytes_per_host(self) -> float:
        return self.size_bytes / self.instance_count

    @property
    def durable_s(self) -> float | None:
        if self.write_s is None:
            return None
        return self.write_s + (self.upload_s or 0.0)

    def line(self) -> str:
        """One line for `submit`: size, save time, interval."""
        text = f"checkpoint {_gb(self.size_bytes)} ({self.bytes_per_param} B/param)"
        if self.instance_count > 1:
            text += f", {_gb(self.bytes_per_host)} per host"
        if self.write_s is not None:
            text += f": ~{self.write_s:.0f} s to write"
            if self.upload_s is not None:
                text += f", ~{self.upload_s:.0f} s to S3"
        return f"{text}; {self.interval_text}"


def checkpoint_bytes(num_params: int, state_dtype: str = "fp32") -> int:
    return num_params * checkpoint_bytes_per_param(state_dtype)


def estimate_checkpoint(
    *,
    params: int,
    instance_count: int,
    instance,
    every_steps: int,
    every_minutes: float,
    step_time_s: float | None,
    uploads_to_s3: bool = True,
    stop_grace_s: float | None = SAGEMAKER_STOP_GRACE_S,
    keep: int = 1,
    restores_whole_prefix: bool = False,
    restores_own_share: bool = False,
    state_dtype: str = "fp32",
) -> CheckpointEstimate:
    """Size and timing of one checkpoint of `params` parameters on `instance_count` x `instance`.

    `instance` is a catalog InstanceType; `step_time_s` the predicted step time (None when
    unknown, e.g. on a CPU). `uploads_to_s3`, `stop_grace_s` and `restores_whole_prefix` (every
    start first copies all `keep` checkpoints to every host) describe SageMaker's CheckpointConfig;
    other backends pass False, None and False. `restores_own_share`: each host reads back only
    its own files (entrypoints/checkpoint_mirror.py), where the engine's copy would be too big.
    `state_dtype`: training.optimizer.state_dtype, which sizes AdamW's moments.
    """
    size = checkpoint_bytes(params, state_dtype)
    write_s, upload_s = _save_times(size / instance_count, instance, uploads_to_s3=uploads_to_s3)
    interval_s, interval_text = _interval(every_steps, every_minutes, step_time_s)
    durable_s = None if write_s is None else write_s + (upload_s or 0.0)
    worst = None if interval_s is None or durable_s is None else interval_s + durable_s
    estimate = CheckpointEstimate(
        size_bytes=size,
        instance_count=instance_count,
        write_s=write_s,
        upload_s=upload_s,
        interval_s=interval_s,
        interval_text=interval_text,
        worst_loss_s=worst,
        warnings=(),
        bytes_per_param=checkpoint_bytes_per_param(state_dtype),
    )
    warnings = _warnings(estimate, every_minutes=every_minutes, step_time_s=step_time_s)
    stop = _stop_text(estimate, step_time_s=step_time_s, stop_grace_s=stop_grace_s)
    restore = size * keep if restores_whole_prefix else None
    if restores_own_share:  # each host reads back its own files (entrypoints/checkpoint_mirror.py)
        restore = size / instance_count
    # The copy back from S3 is taken at the upload bandwidth: AWS publishes neither.
    restore_s = None if restore is None else _seconds(restore, instance.checkpoint_upload_gb_per_s)
    return dataclasses.replace(
        estimate,
        kept=keep,
        warnings=tuple(warnings),
        stop_text=stop,
        restore_bytes_per_host=restore,
        restore_s=restore_s,
    )


def _save_times(per_host_bytes: float, instance, *, uploads_to_s3: bool) -> tuple[float | None, float | None]:
    """(write_s, upload_s) of one host's share; None where the bandwidth is not modelled."""
    write_s = _seconds(per_host_bytes, instance.checkpoint_write_gb_per_s)
    upload_s = _seconds(per_host_bytes, instance.checkpoint_upload_gb_per_s) if uploads_to_s3 else None
    return write_s, upload_s


def estimate_recipe_checkpoint(recipe, step_time_s: float | None) -> CheckpointEstimate:
    """`estimate_checkpoint` for a recipe's model, cluster and checkpoint settings (an auto
    interval as RESOLVE settles it)."""
    engine = capabilities(recipe.cluster.backend)
    per_host = engine.per_host_checkpoints(
        recipe.checkpoint_bytes, recipe.checkpoint.keep, recipe.sagemaker.checkpoint_copy
    )
    every_minutes = recipe.checkpoint.every_minutes
    if every_minutes == "auto":
        every_minutes = auto_every_minutes(recipe).minutes
    grace = engine.stop_grace(recipe.cluster.stop_grace) if engine.says_stop_grace() else None
    return estimate_checkpoint(
        params=recipe.arch.num_params(),
        instance_count=recipe.cluster.instance_count,
        instance=recipe.hardware.instance,
        every_steps=recipe.checkpoint.every_steps,
        every_minutes=every_minutes,
        step_time_s=step_time_s,
        uploads_to_s3=engine.uploads_checkpoints,
        stop_grace_s=grace,
        keep=recipe.checkpoint.keep,
        restores_whole_prefix=engine.restores_whole_checkpoint_prefix and not per_host,
        restores_own_share=per_host,
        state_dtype=recipe.training.optimizer.state_dtype,
    )


# The grace a job sets itself covers the step in progress and one save with this much to spare
# (both are predictions), plus what torchrun and the bootstrap need to exit.
STOP_GRACE_MARGIN = 1.25


@dataclass(frozen=True, slots=True, kw_only=True)
class StopGrace:
    """The seconds from SIGTERM to SIGKILL a job sets itself (cluster.stop_grace), and why."""

    grace_s: int
    step_s: float | None  # predicted; None: not modelled (a GPU without datasheet peaks)
    save_s: float | None  # until durable, per host; None: not modelled

    def line(self, engine_title: str) -> str:
        if self.step_s is None or self.save_s is None:
            unknown = " and ".join(name for name, s in (("step", self.step_s), ("save", self.save_s)) if s is None)
            return (
                f"cluster.stop_grace: {self.grace_s} s on {engine_title} (no predicted {unknown} time here; "
                f"torchrun --shutdown-timeout and the final-save budget {self.grace_s - STOP_EXIT_S} s)"
            )
        return (
            f"cluster.stop_grace: {self.grace_s} s on {engine_title} = {STOP_GRACE_MARGIN:g} x (step ~"
            f"{_duration(self.step_s)} + save ~{self.save_s:.0f} s) + {STOP_EXIT_S} s for torchrun to exit "
            f"(torchrun --shutdown-timeout and the final-save budget {self.grace_s - STOP_EXIT_S} s)"
        )


def needed_stop_grace(step_s: float | None, save_s: float | None) -> StopGrace:
    """The grace that fits the step in progress and a save (the trainer checks SIGTERM between
    steps, entrypoints/train.py), with STOP_GRACE_MARGIN and STOP_EXIT_S; DEFAULT_STOP_GRACE_S
    at least, and where either time is unknown."""
    if step_s is None or save_s is None:
        return StopGrace(grace_s=DEFAULT_STOP_GRACE_S, step_s=step_s, save_s=save_s)
    needed = math.ceil(STOP_GRACE_MARGIN * (step_s + save_s)) + STOP_EXIT_S
    return StopGrace(grace_s=max(DEFAULT_STOP_GRACE_S, needed), step_s=step_s, save_s=save_s)


def stop_fits(grace_s: float, step_s: float | None, save_s: float | None) -> bool:
    """Whether the step in progress and one save end inside the trainer's budget (the grace less
    STOP_EXIT_S); True where either is unknown (nothing to say)."""
    return step_s is None or save_s is None or step_s + save_s <= grace_s - STOP_EXIT_S


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoInterval:
    """What `checkpoint.every_minutes: auto` became, and the numbers it came from."""

    minutes: float
    save_s: float | None  # until durable, per host; None: not modelled
    mtbf_s: float | None  # of the whole job; None: no published rate for the instance type

    def line(self) -> str:
        if self.save_s is None or self.mtbf_s is None:
            return (
                f"checkpoint.every_minutes auto: {self.minutes:g} (no modelled save time or interruption rate "
                "for this instance type)"
            )
        return (
            f"checkpoint.every_minutes auto: {self.minutes:g} = sqrt(2 x {self.save_s:.0f} s to save x "
            f"{_duration(self.mtbf_s)} between interruptions) (Young 1974, Daly 2006; rates in "
            "launcher/catalog/instances.yaml)"
        )


def job_mtbf_s(instance, instance_count: int, *, spot: bool) -> float | None:
    """Mean time between interruptions of a job on `instance_count` hosts: each host's failures
    (and spot reclaims) end the whole job, so the rates add up. None: no published rate."""
    rates = instance.interruptions
    if rates is None:
        return None
    return 86400.0 / (rates.per_host_day(spot=spot) * instance_count)


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """The first-order optimum interval between checkpoint starts, sqrt(2 * save * MTBF)
    (Young 1974; Daly 2006 shows it within a few percent of the optimum while save << MTBF)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def auto_every_minutes(recipe) -> AutoInterval:
    """`checkpoint.every_minutes: auto` for a recipe: the Young/Daly interval from the predicted
    time until a save is durable and the job's MTBF, in whole minutes (UNMODELLED_AUTO_MINUTES
    where either is unknown)."""
    engine = capabilities(recipe.cluster.backend)
    instance, hosts = recipe.hardware.instance, recipe.cluster.instance_count
    per_host = recipe.checkpoint_bytes / hosts
    write_s, upload_s = _save_times(per_host, instance, uploads_to_s3=engine.uploads_checkpoints)
    save_s = None if write_s is None else write_s + (upload_s or 0.0)
    mtbf_s = job_mtbf_s(instance, hosts, spot=recipe.sagemaker.spot)
    if save_s is None or mtbf_s is None:
        return AutoInterval(minutes=UNMODELLED_AUTO_MINUTES, save_s=save_s, mtbf_s=mtbf_s)
    minutes = min(MAX_AUTO_MINUTES, max(1.0, math.ceil(young_daly_interval_s(save_s, mtbf_s) / 60)))
    return AutoInterval(minutes=minutes, save_s=save_s, mtbf_s=mtbf_s)


def _interval(every_steps: int, every_minutes: float, step_time_s: float | None) -> tuple[float | None, str]:
    """Seconds between checkpoint starts, and how to say it. Saves happen between steps."""
    by_steps = every_steps * step_time_s if every_steps and step_time_s else None
    by_minutes = None
    if every_minutes:
        # A timed save waits for the end of a step: at least one step apart.
        by_minutes = (
            every_minutes * 60
            if step_time_s is None
            else max(1, math.ceil(every_minutes * 60 / step_time_s)) * step_time_s
        )
    chosen = [s for s in (by_steps, by_minutes) if s is not None]
    parts = []
    if every_steps:
        parts.append(f"every {every_steps} steps" + (f" ({_duration(by_steps)})" if by_steps else ""))
    if every_minutes:
        parts.append(f"every {every_minutes:g} min" + (f" ({_duration(by_minutes)})" if step_time_s else ""))
    text = " or ".join(parts) if parts else "only at the end and on SIGTERM"
    return (min(chosen) if chosen else None), text


def _warnings(est: CheckpointEstimate, *, every_minutes: float, step_time_s: float | None) -> list[str]:
    out = []
    durable = est.durable_s
    if every_minutes and step_time_s and step_time_s > every_minutes * 60:
        out.append(
            f"checkpoint.every_minutes {every_minutes:g} is shorter than one step ({_duration(step_time_s)}): "
            "checkpoints are a step apart"
        )
    if est.interval_s is None and step_time_s is not None:
        out.append(
            "no periodic checkpoints (checkpoint.every_steps and every_minutes are 0): "
            "a host failure loses everything since the start; set checkpoint.every_minutes"
        )
    elif est.worst_loss_s is not None and not every_minutes and est.worst_loss_s > LOSS_WARNING_S:
        out.append(
            f"an interruption can lose up to {_duration(est.worst_loss_s)} of training "
            f"({est.interval_text} + {durable:.0f} s to save); set checkpoint.every_minutes, e.g. auto"
        )
    if durable is not None and est.interval_s is not None and durable > est.interval_s:
        out.append(
            f"saving takes ~{durable:.0f} s, longer than the {_duration(est.interval_s)} between checkpoints: "
            "each save waits for the previous one and stalls training"
        )
    return out


def _stop_text(est: CheckpointEstimate, *, step_time_s: float | None, stop_grace_s: float | None) -> str | None:
    """What a stop loses, said once: the entrypoint saves after SIGTERM only once the step in
    progress has ended (entrypoints/train.py), so the step and the save must fit in the grace."""
    durable = est.durable_s
    if stop_grace_s is None or durable is None:
        return None
    needed = durable + (step_time_s or 0.0)
    step = f"the step in progress (~{_duration(step_time_s)}) and " if step_time_s else ""
    if needed <= stop_grace_s:
        return f"a stop saves first: {step}a save (~{durable:.0f} s) fit in the {stop_grace_s:.0f} s stop grace"
    why = f"{step}a save (~{durable:.0f} s) do not fit in the {stop_grace_s:.0f} s between SIGTERM and SIGKILL"
    if est.worst_loss_s is None:
        return f"a stop keeps only the last periodic checkpoint: {why}"
    return (
        f"a stop or interruption loses at most {_duration(est.worst_loss_s)} ({est.interval_text} + "
        f"{durable:.0f} s to save): {why}, so the last periodic checkpoint counts"
    )


def _seconds(size_bytes: float, gb_per_s: float | None) -> float | None:
    return None if not gb_per_s else size_bytes / (gb_per_s * 1e9)


def _gb(size_bytes: float) -> str:
    return f"{size_bytes / 1e9:.0f} GB" if size_bytes >= 1e9 else f"{size_bytes / 1e6:.1f} MB"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"
