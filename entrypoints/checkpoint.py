"""Checkpoints with torch.distributed.checkpoint (DCP): save, keep the newest K, resume, reshard.

    checkpoints = Checkpointer(directory, cfg.checkpoint, parts=..., optimizers=..., data=..., rank_hosts=...)
    step = checkpoints.resume()          # 0 when starting fresh
    checkpoints.save(step)               # starts an asynchronous save where DCP supports it
    checkpoints.finish_pending()         # collective: once every rank's save is written (train.py asks)

A checkpoint is a directory `step-00000120/` holding
- the DCP shards of {"model": ..., "optimizer": ...} from get_state_dict (sharded DTensors keyed
  by parameter name, so a checkpoint written by one layout loads into any other: world size,
  FSDP/TP/CP/PP degrees and activation checkpointing may all change), and DCP's `.metadata`;
- train_state.json (rank 0): step, data position (samples seen), learning-rate schedule step,
  and the job that saved it (a restart of that job after its last step exports again);
- rng/rank-<r>.pt: each rank's torch RNG states, restored when the world size is unchanged;
- COMPLETE.node-<k>-of-<n>, one per host, written by the host's first rank once every rank's
  files are written and fsync'd, with the size and SHA-256 of each of the host's files (taken
  as DCP wrote them: checkpoint_digests.py). Only directories with all n markers count; a job
  killed mid-save leaves a directory that is ignored and later removed. checkpoint_files.py says which
  host owns which file and why only the owner writes or deletes it (SageMaker's per-host sync).
After each checkpoint is complete every host deletes its own files of all but the newest `keep`
complete checkpoints (and of incomplete ones), then empty directories are removed.

Saving does not stall training: `dcp.async_save` copies the state to CPU memory (staging) and
writes it from a background thread on a separate gloo process group (DCP's own collectives must
not interleave with the training loop's on the default group). Measured on torch 2.13: this works
on CPU/gloo as well as on CUDA/nccl, so it is used everywhere. The loop's per-step all-reduce
tells every rank when all ranks' writes have finished; then the markers are written and old
checkpoints pruned, at the same step on every rank. The last step's save and the save after
SIGTERM are synchronous, because the process exits right after them.

Resume: "auto" takes the newest complete checkpoint in the directory (none: a fresh start),
"never" ignores them, any other value is the path of the checkpoint directory to load.
Rank 0 decides and every rank follows its decision. Loading verifies every file it reads
against its host's recorded SHA-256 first; one that differs (on any host) makes every rank skip
the checkpoint and take the previous one, as a torn one is skipped. With the S3 mirror
(checkpoint_mirror.py) a host holds only the checkpoint it restored: the previous one is
restored from S3 when the newest fails to load.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from entrypoints.checkpoint_digests import DigestingWriter, VerifyingReader
from entrypoints.checkpoint_files import (
    LEASE_RENEW_S,
    CheckpointDamaged,
    RankHosts,
    acquire_lease,
    checkpoint_fault,
    digest_fault,
    marker_content,
    missing_markers,
    own_file_sizes,
    recorded_digests,
    release_lease,
    remove_empty_dirs,
    remove_own_files,
    write_durable,
    write_lease,
)
from entrypoints.checkpoint_mirror import MirrorFailed, S3Mirror
from launcher.contract.checkpoint_dirs import STEP_DIR, complete_checkpoints, is_complete, step_dir_name, step_dirs
from launcher.contract.config import CheckpointConfig, ConfigError

__all__ = [
    "CheckpointWriteFailed",
    "Checkpointer",
    "RankHosts",
    "complete_checkpoints",
    "is_complete",
    "step_dir_name",
]


class CheckpointWriteFailed(Exception):
    """A checkpoint could not be written (a full disk, say): the job fails; the one line says
    which file, the OS error, and that the newest complete checkpoint is kept."""


class Checkpointer:
    def __init__(self, directory: Path, cfg: CheckpointConfig, *, parts, optimizers, data, rank_hosts: RankHosts):
        self.directory, self.cfg = directory, cfg
        self.parts, self.optimizers, self.data = parts, optimizers, data
        self.rank_hosts = rank_hosts
        self.rank, self.world_size = rank_hosts.rank, rank_hosts.world_size
        self.last_saved_step: int | None = None
        self.complete_steps: list[int] = []  # complete on every host, as every rank knows it
        self.last_save_s: float | None = None  # how long the last save took to become durable
        self._last_save_started = time.monotonic()
        self._pending: tuple | None = None  # (step, started, future, small files' digests, writer)
        self._group = None
        # The lease keeps two jobs from writing one directory. The engine names the job; SageMaker
        # gives every job hosts of its own, so it turns the lease off (LAUNCHER_CHECKPOINT_LEASE=0).
        self.owner = os.environ.get("LAUNCHER_JOB_NAME") or f"{socket.gethostname()}:{os.getppid()}"
        self.job = os.environ.get("LAUNCHER_JOB_NAME")  # recorded in train_state.json: who saved it
        self.resumed_job: str | None = None
        self.leased = self.rank == 0 and os.environ.get("LAUNCHER_CHECKPOINT_LEASE", "1") != "0"
        self._lease_renewed = 0.0
        # With LAUNCHER_CHECKPOINT_S3 each host copies its own files to S3 and back itself
        # (checkpoint_mirror.py) instead of SageMaker's CheckpointConfig copying every file.
        self.mirror = S3Mirror.from_env(rank_hosts)

    # --- what goes into a checkpoint -----------------------------------------------------

    def _state(self) -> dict:
        model = {}
        for part in self.parts:
            model.update(get_model_state_dict(part))
        return {"model": model, "optimizer": self.optimizers.state_dict()}

    def _load_state(self, state: dict) -> None:
        # Each pipeline part takes the keys it holds from the merged state.
        for part in self.parts:
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        self.optimizers.load_state_dict(state["optimizer"])

    # --- when to save ------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    def time_due_vote(self) -> float:
        """1.0 on rank 0 when every_minutes have passed since the last save started, else 0.0.

        Only rank 0's clock counts: the vote travels in the loop's all-reduce, so every rank
        sees the same decision at the same step.
        """
        minutes = self.cfg.every_minutes
        if self.rank != 0 or not minutes:
            return 0.0
        return float(time.monotonic() - self._last_save_started >= minutes * 60)

    # --- save --------------------------------------------------------------------------------

    def save(self, step: int, *, blocking: bool = False) -> Path:
        """Write checkpoint `step` from every rank (collective). Returns its directory.

        Non-blocking: the state is staged and written in the background; `finish_pending`
        completes it. Blocking: it is complete (all markers, pruned) when this returns.
        """
        self.finish_pending()
        if self.mirror is not None and self.rank_hosts.is_node_leader and self.complete_steps:
            # One checkpoint's copy to S3 at a time: the previous one is in S3 on every host (the
            # barrier below) before any host writes the next, which a restore may then fall back on.
            with self._mirroring(self.complete_steps[-1]):
                self.mirror.wait()
        path = self.directory / step_dir_name(step)
        self._last_save_started = started = time.monotonic()
        if self.rank_hosts.is_node_leader:
            path.mkdir(parents=True, exist_ok=True)
            # A killed attempt's files at this step: this host's marker goes first, then its files.
            remove_own_files(path, self.rank_hosts)
        dist.barrier()  # nobody writes before every host has withdrawn its old part
        writer = DigestingWriter(path)  # DCP's own writer, hashing each file as it writes it
        with self._writing(step, writer):
            digests = self._write_small_files(path, step)
            if blocking:
                dcp.save(self._state(), checkpoint_id=str(path), storage_writer=writer)
        if blocking:
            self._complete(step, started, {**digests, **writer.digests})
        else:
            future = dcp.async_save(
                self._state(), checkpoint_id=str(path), storage_writer=writer, process_group=self._save_group()
            )
            self._pending = (step, started, future, digests, writer)
        self.last_saved_step = step
        return path

    def _write_small_files(self, path: Path, step: int) -> dict[str, str]:
        """Write this rank's RNG state (and rank 0's train_state.json); returns their digests."""
        (path / "rng").mkdir(exist_ok=True)
        buffer = io.BytesIO()
        torch.save(_rng_state(), buffer)
        rng = f"rng/rank-{self.rank:05d}.pt"
        digests = {rng: write_durable(path / rng, buffer.getvalue())}
        if self.rank == 0:
            train_state = {
                "step": step,
                "data": self.data.state_dict(),
                "lr_schedule": {"step": self.optimizers.step_count},
                "world_size": self.world_size,
                "job": self.job,
            }
            text = json.dumps(train_state, indent=2) + "\n"
            digests["train_state.json"] = write_durable(path / "train_state.json", text.encode())
        return digests

    def _save_group(self):
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def pending_written(self) -> bool:
        """This rank's part of the pending save is on disk (False when none is pending)."""
        return self._pending is not None and self._pending[2].done()

    def finish_pending(self) -> None:
        """Collective: wait for the pending save, then mark it complete and prune. No-op if none."""
        if self._pending is None:
            return
        step, started, future, digests, writer = self._pending
        self._pending = None
        with self._writing(step, writer):
            future.result()  # the background save's failure surfaces here, on the training thread
        self._complete(step, started, {**digests, **writer.digests})

    @contextmanager
    def _writing(self, step: int, writer: DigestingWriter | None = None):
        """Turn a failed write of checkpoint `step` into CheckpointWriteFailed, in one line."""
        try:
            yield
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException
            raise CheckpointWriteFailed(self._write_failure(step, error, writer)) from None

    def _write_failure(self, step: int, error: BaseException, writer: DigestingWriter | None) -> str:
        path = self.directory / step_dir_name(step)
        cause = _os_error(error, writer)
        if cause is None:
            what = _read_failure(error)
        else:
            name = errno.errorcode.get(cause.errno, "OSError")
            what = f"{name} ({cause.strerror or cause}) writing {cause.filename or path}"
        complete = [earlier for earlier in self.complete_steps if earlier < step]
        kept = (
            f"the newest complete checkpoint, {self.directory / step_dir_name(complete[-1])}, is kept"
            if complete
            else "no complete checkpoint was written before it"
        )
        remedy = "free space in" if cause is not None and cause.errno in (errno.ENOSPC, errno.EDQUOT) else "fix"
        return (
            f"checkpoint: step {step} could not be written to {path}: {what}; it has no COMPLETE marker, so a "
            f"resume skips it; {kept}; {remedy} {self.directory} and rerun to resume"
        )

    def _complete(self, step: int, started: float, digests: dict[str, str]) -> None:
        """Collective: each host's marker records its files' sizes and `digests` (this rank's files')."""
        # DCP's save ends with a collective after every rank's write (fsync'd): all data is durable.
        # Gathering the digests is also the barrier after it: each host's first rank needs its ranks'.
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, digests, group=self._save_group())
        path = self.directory / step_dir_name(step)
        if self.rank_hosts.is_node_leader:
            sizes = own_file_sizes(path, self.rank_hosts)
            written = {relative: digest for part in everyone for relative, digest in part.items()}
            mine = {relative: written[relative] for relative in sizes if relative in written}
            with self._writing(step):
                write_durable(path / self.rank_hosts.marker, marker_content(step, sizes, mine))
        dist.barrier()  # every host's marker is on disk: the checkpoint is complete everywhere
        self.last_save_s = time.monotonic() - started
        if self.rank == 0:
            # The measured save time: what launcher/catalog/instances.yaml's checkpoint bandwidths model.
            print(f"checkpoint step={step} written_s={self.last_save_s:.3f} dir={path}", flush=True)
        self.complete_steps = sorted({*self.complete_steps, step})
        if self.mirror is not None and self.rank_hosts.is_node_leader:
            with self._mirroring(step):
                self.mirror.wait()  # the previous copy to S3 reads files the pruning may remove
        self._prune()
        if self.mirror is not None and self.rank_hosts.is_node_leader:
            with self._mirroring(step):
                self.mirror.push(path, step, keep=set(self.complete_steps))

    def _prune(self) -> None:
        """Every host deletes its own files of checkpoints outside the newest `keep` complete ones."""
        keep = set(self.complete_steps[-self.cfg.keep :])
        doomed = [path for step, path in step_dirs(self.directory) if step not in keep]
        if self.rank_hosts.is_node_leader:
            for path in doomed:
                remove_own_files(path, self.rank_hosts)
        dist.barrier()  # on a shared directory, every host's files are gone before rmdir
        if self.rank_hosts.is_node_leader:
            for path in doomed:
                remove_empty_dirs(path)
        self.complete_steps = sorted(keep)

    def keep_lease(self) -> None:
        """Renew this job's lease on the directory (rank 0, every LEASE_RENEW_S; cheap otherwise)."""
        now = time.time()
        if self.leased and now - self._lease_renewed >= LEASE_RENEW_S:
            write_lease(self.directory, self.owner, now)
            self._lease_renewed = now

    @contextmanager
    def _mirroring(self, step: int):
        """A failed copy to S3 fails the job in one line; the local checkpoints stay."""
        try:
            yield
        except MirrorFailed as error:
            raise CheckpointWriteFailed(
                f"{error}; checkpoint {step_dir_name(step)} is complete in {self.directory} but not in S3, so a "
                "restart on new instances resumes from the newest one every host finished uploading"
            ) from None

    def saved_last_step_before(self, steps: int) -> bool:
        """The checkpoint resumed from is of the last step, saved by this job's earlier attempt:
        it trained to the end and failed after (the export), and torchrun restarted it, or its
        engine reran it. Every rank reads the same verified train_state.json, so all agree."""
        return self.job is not None and self.resumed_job == self.job and self.last_saved_step == steps

    def close(self) -> None:
        """Finish a pending save and its copy to S3, release the save process group (collective)
        and the lease."""
        self.finish_pending()
        if self.mirror is not None and self.rank_hosts.is_node_leader:
            with self._mirroring(self.last_saved_step or 0):
                self.mirror.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
        if self.leased:
            release_lease(self.directory, self.owner)

    # --- resume ------------------------------------------------------------------------------

    @property
    def _only_host(self) -> RankHosts | None:
        """With the S3 mirror a host holds only its own files and the shared ones."""
        return self.rank_hosts if self.mirror is not None else None

    def _resume_plan(self) -> list:
        """Rank 0's decision: [refusal or None, checkpoint paths to try in order, complete steps]."""
        complete = complete_checkpoints(self.directory)
        steps = [step for step, _ in complete]
        if self.leased:
            refusal = acquire_lease(self.directory, self.owner, time.time())
            self._lease_renewed = time.time()
            if refusal:
                return [refusal, [], steps]
        resume = self.cfg.resume
        if resume == "never":
            return [None, [], steps]
        if resume != "auto":
            path = Path(resume)
            if not is_complete(path):
                return [
                    f"checkpoint.resume: {path} is not a complete checkpoint (not every host's COMPLETE.node-* marker)",
                    [],
                    steps,
                ]
            fault = checkpoint_fault(path, self._only_host)
            return [f"checkpoint.resume: {path} is damaged: {fault}" if fault else None, [str(path)], steps]
        return self._auto_candidates(complete, steps)

    def _auto_candidates(self, complete: list, steps: list[int]) -> list:
        newest = steps[-1] if steps else -1
        for step, path in step_dirs(self.directory):
            if step > newest and not is_complete(path):
                print(f"warning: checkpoint {path.name} is incomplete ({missing_markers(path)}); skipped", flush=True)
        candidates = []
        for _, path in reversed(complete):
            fault = checkpoint_fault(path, self._only_host)
            if fault:
                print(f"warning: checkpoint {path.name} is damaged ({fault}); skipped", flush=True)
            else:
                candidates.append(str(path))
        if complete and not candidates and self.mirror is None:  # with it, resume() looks for an older one in S3
            refusal = (
                f"checkpoint: every complete checkpoint in {self.directory} is damaged; remove them, or set "
                "checkpoint.resume: never to start over"
            )
            return [refusal, [], steps]
        return [None, candidates, steps]

    def resume(self) -> int:
        """Load the newest sound checkpoint, if any; returns the step it was taken at (0: none).

        Rank 0 checks the candidates (every host's marker, every recorded file at its recorded
        size) and every rank follows its decision. Loading verifies the digests of the files it
        reads; a file that differs, or a checkpoint that fails to load, fails on every rank alike
        (DCP's collectives, or `_agree`), and the checkpoint gives way to the previous one with a
        warning naming why. With the S3 mirror the previous one is restored from S3 when it is
        needed: a host holds only the checkpoint it restored (and those it wrote since)."""
        from_s3 = self.mirror is not None and self.cfg.resume == "auto"
        named = self._named_step()
        if named is not None:
            self._restore_from_s3(exactly=named)
        below, failure = None, None  # the step of a restored checkpoint that failed, and why
        while True:
            restored = self._restore_from_s3(below=below) if from_s3 else None
            candidates = [path for path in self._agreed_candidates() if below is None or _step_of(path) < below]
            if not candidates and restored is not None:  # rank 0's check of its files' sizes skipped it
                self._discard_restored(self.directory / step_dir_name(restored))
                below = restored
                failure = f"checkpoint: every complete checkpoint in {self.mirror.uri} is damaged; remove them, or set "
                failure += "checkpoint.resume: never to start over"
                continue
            if not candidates:
                if failure:
                    raise ConfigError(failure)
                return 0
            step, failed, failure = self._load_newest_sound(candidates, older_in_s3=from_s3)
            if failed is None:
                return step
            if not from_s3:
                raise ConfigError(failure)
            self._discard_restored(self._own_copy(Path(failed)))
            below = _step_of(failed)

    def _discard_restored(self, path: Path) -> None:
        """Collective: each host drops its copy of a checkpoint restored from S3 that it cannot
        use. Left there, the other hosts' markers in it would stand beside the files of a later
        save of the same step (a save withdraws only its own host's part)."""
        if self.rank_hosts.is_node_leader:
            shutil.rmtree(path, ignore_errors=True)
        if self.world_size > 1:
            dist.barrier()

    def _agreed_candidates(self) -> list[str]:
        """Collective: rank 0's checkpoints to try, newest first, on every rank."""
        decision = self._resume_plan() if self.rank == 0 else None
        if self.world_size > 1:
            box = [decision]
            dist.broadcast_object_list(box, src=0)
            decision = box[0]
        refusal, candidates, self.complete_steps = decision
        if refusal:
            raise ConfigError(refusal)
        return candidates

    def _load_newest_sound(self, candidates: list[str], *, older_in_s3: bool) -> tuple[int, str | None, str]:
        """(step, None, "") for the first of `candidates` that loads; else (0, the last one tried,
        why it failed). Each failure but the last one's without S3 warns on rank 0."""
        for index, chosen in enumerate(candidates):
            try:
                step = self._load(self._own_copy(Path(chosen)))
                self._report_downloads()
                return step, None, ""
            except (Exception, CheckpointException) as error:  # DCP's is a BaseException
                damage = _damage(error)
                what = f"is damaged ({damage})" if damage else f"cannot be read ({_read_failure(error)})"
                last = index + 1 == len(candidates)
                if last and not older_in_s3:
                    break
                if self.rank == 0:
                    then = "skipped" if damage else f"resuming from {Path(candidates[index + 1]).name} instead"
                    then = f"skipped; looking for an older one in {self.mirror.uri}" if last else then
                    print(f"warning: checkpoint {Path(chosen).name} {what}; {then}", flush=True)
        where = f" here or in {self.mirror.uri}" if older_in_s3 else ""
        failure = (
            f"checkpoint: {chosen} {what}; no older checkpoint is left{where}; remove it, or set "
            "checkpoint.resume: never to start over"
        )
        return 0, chosen, failure

    def _named_step(self) -> int | None:
        """With the S3 mirror, the step of a `checkpoint.resume: <checkpoint.dir>/step-N`: on new
        hosts the directory is empty, so the checkpoint is restored from S3 first."""
        if self.mirror is None or self.cfg.resume in ("auto", "never"):
            return None
        path = Path(os.path.normpath(self.cfg.resume))
        match = STEP_DIR.match(path.name)
        return int(match.group(1)) if match and path.parent == Path(os.path.normpath(self.directory)) else None

    def _restore_from_s3(self, *, below: int | None = None, exactly: int | None = None) -> int | None:
        """Collective: rank 0 picks the newest checkpoint every host finished uploading (older
        than `below`, one found damaged), or step `exactly`; each host's first rank downloads
        what its host reads of it (checkpoint_mirror.py). Returns its step (None: none in S3)."""
        decision = [None, None, {}]  # [failure, step, {file: size}]
        if self.rank == 0:
            try:
                listing = self.mirror.listing()
                step = self.mirror.newest_complete(listing, below=below) if exactly is None else exactly
                decision = [None, step, listing.get(step, {})]
                if exactly is not None and exactly not in self.mirror.complete_steps(listing):
                    there = ", ".join(map(str, self.mirror.complete_steps(listing))) or "none"
                    decision[0] = (
                        f"checkpoint.resume: {self.cfg.resume}: step {exactly} is not a complete checkpoint in "
                        f"{self.mirror.uri} (the complete steps there: {there})"
                    )
            except MirrorFailed as error:
                decision = [str(error), None, {}]
        if self.world_size > 1:
            box = [decision]
            dist.broadcast_object_list(box, src=0)
            decision = box[0]
        failure, step, files = decision
        if failure is None and step is not None and self.rank_hosts.is_node_leader:
            try:
                got = self.mirror.restore(self.directory, step, files)
                print(
                    f"checkpoint: restored {step_dir_name(step)} from {self.mirror.uri}: {got} bytes to host "
                    f"{self.rank_hosts.node} of {sum(files.values())} in the checkpoint",
                    flush=True,
                )
            except MirrorFailed as error:
                failure = str(error)
        failure = self._agree(failure)
        if failure:
            raise ConfigError(f"{failure}; nothing was resumed")
        return step

    def _own_copy(self, chosen: Path) -> Path:
        """Rank 0 names a checkpoint in its own directory; with the S3 mirror each host reads the
        copy in its own (the same path on SageMaker, where every host has /opt/ml/checkpoints)."""
        if self.mirror is not None and (self.cfg.resume == "auto" or self._named_step() is not None):
            return self.directory / chosen.name
        return chosen

    def _report_downloads(self) -> None:
        """Collective: rank 0 prints what each host read from S3 to resume (restore and ranges)."""
        if self.mirror is None:
            return
        counts = [self.mirror.downloaded_bytes] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(counts, self.mirror.downloaded_bytes)
        per_host = [0] * self.rank_hosts.instance_count
        for rank, count in enumerate(counts):
            per_host[self.rank_hosts.node_of(rank)] += count
        if self.rank == 0:
            read = " ".join(f"host{node}={count}" for node, count in enumerate(per_host))
            print(f"checkpoint: read from S3 to resume (bytes): {read}", flush=True)

    def _load(self, path: Path) -> int:
        recorded = self._verify_small_files(path)
        state = self._state()
        read_range = None
        if self.mirror is not None:
            step = _step_of(path)
            read_range = lambda relative, offset, length: self.mirror.read_range(step, relative, offset, length)  # noqa: E731
        reader = VerifyingReader(path, self.rank_hosts, recorded, read_range=read_range)
        dcp.load(state, checkpoint_id=str(path), storage_reader=reader)
        self._load_state(state)
        train_state = json.loads((path / "train_state.json").read_text())
        self.data.load_state_dict(train_state["data"])
        self.optimizers.step_count = train_state["lr_schedule"]["step"]
        self.optimizers.set_lr()
        rng = path / "rng" / f"rank-{self.rank:05d}.pt"
        if train_state["world_size"] == self.world_size and rng.is_file():
            _set_rng_state(torch.load(rng, weights_only=False))
        self.last_saved_step = train_state["step"]
        self.resumed_job = train_state.get("job")
        return train_state["step"]

    def _verify_small_files(self, path: Path) -> dict[str, tuple[str, str]]:
        """Collective: check the markers and the files every rank reads whole (.metadata,
        train_state.json, its RNG state) before any is parsed; returns the recorded digests.
        Raises CheckpointDamaged on every rank when one rank's host sees a fault."""
        recorded, fault = recorded_digests(path)
        rng = f"rng/rank-{self.rank:05d}.pt"
        for relative in [".metadata", "train_state.json", *([rng] if (path / rng).is_file() else [])]:
            fault = fault or digest_fault(path, relative, recorded, self.rank_hosts.node)
        fault = self._agree(fault)
        if fault:
            raise CheckpointDamaged(fault)
        return recorded

    def _agree(self, fault: str | None) -> str | None:
        """The first rank's fault, on every rank (None when no rank has one)."""
        if self.world_size == 1:
            return fault
        faults = [None] * self.world_size
        dist.all_gather_object(faults, fault)
        return next((found for found in faults if found), None)


def _step_of(path: str | Path) -> int:
    return int(Path(path).name.removeprefix("step-"))


def _damage(error: BaseException) -> str | None:
    """The reason, when a load failed because a file differs from its marker (on any rank)."""
    if isinstance(error, CheckpointDamaged):
        return str(error)
    for _, wrapped in sorted((getattr(error, "failures", None) or {}).items()):
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(cause, CheckpointDamaged):
            return str(cause)
    return None


def _os_error(error: BaseException, writer: DigestingWriter | None) -> OSError | None:
    """The OSError behind a failed save: this rank's writer saw it (torch.save hides it behind
    "unexpected pos"), it was raised directly, or DCP carries it from a failing rank."""
    if writer is not None and writer.write_error is not None:
        return writer.write_error
    causes = [error, *(w[0] if isinstance(w, tuple) else w for _, w in sorted(getattr(error, "failures", {}).items()))]
    return next((cause for cause in causes if isinstance(cause, OSError)), None)


def _read_failure(error: BaseException) -> str:
    """One line for a failed load: DCP's exception carries each failing rank's own exception."""
    failures = getattr(error, "failures", None)
    if failures:
        rank, wrapped = min(failures.items())
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        return f"rank {rank}: {type(cause).__name__}: {text}"[:300]
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
