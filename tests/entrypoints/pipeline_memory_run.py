"""What torch.distributed.pipelining keeps alive, and what entrypoints/parallel/pipeline.py keeps.

    torchrun --standalone --nproc_per_node 2 tests/entrypoints/pipeline_memory_run.py RESULT.json

On gloo, two ranks, the interleaved schedule over 4 stages (2 per rank) and 8 micro-batches of a
toy stage (a linear layer): every receive buffer torch makes (`_make_tensor_from_meta`) and every
tensor a rank sends is followed by a weak reference, and how many are still alive
is sampled at each allocation, send and stage forward. Run once with torch's PipelineStage and
schedule as they are, and once with the entrypoints' Pipeline. Each rank writes its counts.
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.pipelining.schedules as schedules  # noqa: E402
import torch.distributed.pipelining.stage as torch_stage  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B  # noqa: E402

import entrypoints.parallel.pipeline as pipeline  # noqa: E402
from launcher.contract.config import ParallelConfig  # noqa: E402

MICRO_BATCHES, WIDTH = 8, 16


class ToyStage(torch.nn.Module):
    def __init__(self, index: int, last: bool):
        super().__init__()
        torch.manual_seed(index)
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.last = last

    def forward(self, x, targets=None):
        h = torch.tanh(self.linear(x))
        return ((h - targets) ** 2).mean() if self.last else h


class Followed:
    """Weak references to every tensor handed to `record`, and the most alive at once."""

    def __init__(self):
        self.refs: list = []
        self.peak = 0

    def record(self, tensor):
        self.refs.append(weakref.ref(tensor))
        self.sample()

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.refs)

    def sample(self, *_):
        self.peak = max(self.peak, self.alive())


def follow(followed: Followed) -> None:
    """Wrap where the runtime makes buffers and where sends leave: torch's `_batch_p2p` and the
    entrypoints' `_SendsInFlight.issue`."""
    make, batch_p2p, issue = torch_stage._make_tensor_from_meta, schedules._batch_p2p, pipeline._SendsInFlight.issue

    def making(meta, device):
        tensor = make(meta, device)
        followed.record(tensor)
        return tensor

    def batching(ops, *args, **kwargs):
        for op in ops:
            if op.op is dist.isend:
                followed.record(op.tensor)
        return batch_p2p(ops, *args, **kwargs)

    def issuing(self, kind, stage, microbatch, ops):
        for op in ops:
            followed.record(op.tensor)
        return issue(self, kind, stage, microbatch, ops)

    torch_stage._make_tensor_from_meta = pipeline._make_tensor_from_meta = making
    schedules._batch_p2p = batching
    pipeline._SendsInFlight.issue = issuing


def parts_of(rank: int, parallel) -> tuple[list, list[int]]:
    ids = [rank + parallel.pipeline * v for v in range(parallel.virtual_stages)]
    parts = [ToyStage(i, i == parallel.num_stages - 1) for i in ids]
    for part in parts:
        part.register_forward_pre_hook(lambda module, args: followed.sample())
    return parts, ids


def batch():
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(MICRO_BATCHES, 4, WIDTH, generator=generator),
            torch.randn(MICRO_BATCHES, 4, WIDTH, generator=generator))  # fmt: skip


def run_torch(rank, parallel, mesh) -> dict:
    parts, ids = parts_of(rank, parallel)
    group, cpu = mesh.get_group(), torch.device("cpu")
    stages = [PipelineStage(p, i, parallel.num_stages, cpu, group=group) for p, i in zip(parts, ids, strict=True)]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES, loss_fn=pipeline._pass_loss)
    tokens, targets = batch()
    losses = []
    schedule.step(
        *((tokens,) if rank == 0 else ()), target=targets, losses=losses, return_outputs=False, targets=targets
    )
    loss = float(torch.stack(losses).mean()) if losses else None  # as Pipeline.step reduces them
    return {"peak": followed.peak, "after_step": followed.alive(), "micro_batches": len(losses), "loss": loss,
            "grads": grads_of(parts, ids)}  # fmt: skip


def grads_of(parts, ids) -> dict:
    return {f"{i}.{name}": p.grad.tolist() for part, i in zip(parts, ids, strict=True)
            for name, p in part.named_parameters()}  # fmt: skip


def run_ours(rank, parallel, mesh) -> dict:
    parts, ids = parts_of(rank, parallel)
    pipe = pipeline.Pipeline(parts, ids, mesh, parallel, torch.device("cpu"))
    outputs = []  # each sent chunk output as its backward finds it in the stage's forward cache

    def looking(stage, original):
        def backward_one_chunk(chunk, *args, **kwargs):
            if not stage.is_last:
                [out] = stage.fwd_cache[chunk][0]
                outputs.append({"shape": list(out.shape), "storage_bytes": out.untyped_storage().nbytes()})
            return original(chunk, *args, **kwargs)

        return backward_one_chunk

    for stage in pipe.stages:
        stage.backward_one_chunk = looking(stage, stage.backward_one_chunk)
    loss = pipe.step(*batch())  # the entrypoints' own call, which finishes its sends
    return {"peak": followed.peak, "after_step": followed.alive(), "loss": None if loss is None else float(loss),
            "stage_class": type(pipe.stages[0]).__name__, "sent_outputs": outputs,
            "grads": grads_of(parts, ids)}  # fmt: skip


def run_fsdp(rank, parallel, mesh, sync_each: bool) -> dict:
    """The entrypoints' Pipeline on FSDP stages (a 1-rank shard mesh each, as a stage of dp_shard 1
    is): after each micro-batch's backward, whether the gradients are already in their shards or
    still unsharded (FSDP2's `unsharded_accumulated_grad`, or the unsharded parameter's .grad);
    and the step's gradients."""
    from dataclasses import replace

    from torch.distributed.fsdp import fully_shard

    parts, ids = parts_of(rank, parallel)
    for part in parts:
        fully_shard(part.linear, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(part, mesh=mesh["dp"], reshard_after_forward=False)
    modes = replace(parallel, grad_accumulation="sync_each" if sync_each else "sync_last_gathered")
    pipe = pipeline.Pipeline(parts, ids, mesh["pp"], modes, torch.device("cpu"))
    seen = []

    def recording(stage, original):
        def backward_one_chunk(*args, **kwargs):
            result = original(*args, **kwargs)
            part = stage.submod  # the stage whose backward just ran
            fsdp_params = fully_shard.state(part.linear)._fsdp_param_group.fsdp_params
            seen.append({
                "sharded": all(fp.sharded_param.grad is not None for fp in fsdp_params),
                "unsharded": any(fp.unsharded_accumulated_grad is not None or fp._unsharded_param.grad is not None
                                 for fp in fsdp_params),
            })  # fmt: skip
            return result

        return backward_one_chunk

    for stage in pipe.stages:
        stage.backward_one_chunk = recording(stage, stage.backward_one_chunk)
    pipe.step(*batch())
    grads = {f"{i}.{name}": p.grad.full_tensor().tolist() for part, i in zip(parts, ids, strict=True)
             for name, p in part.named_parameters()}  # fmt: skip
    return {"after_each_backward": seen[:-1], "grads": grads, "sync_each": pipe.stages[0].sync_each}


def sent_tensor_lifetime(rank: int) -> dict:
    """Whether a gloo send's Work keeps its tensor alive until the Work is dropped."""
    if rank == 1:
        buffer = torch.empty(1000)
        dist.irecv(buffer, 0).wait()
        dist.barrier()
        return {}
    tensor = torch.ones(1000)
    ref = weakref.ref(tensor)
    work = dist.isend(tensor, 1)
    del tensor
    work.wait()
    dist.barrier()
    held = ref() is not None
    del work
    return {"alive_after_wait_while_work_is_held": held, "alive_after_work_is_dropped": ref() is not None}


followed = Followed()

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    parallel = ParallelConfig(pipeline=2, virtual_stages=2, world_size=2, grad_accum_steps=MICRO_BATCHES,
                              pipeline_schedule="interleaved_1f1b")  # fmt: skip
    result = {"work": sent_tensor_lifetime(rank)}
    follow(followed)
    result["torch"] = run_torch(rank, parallel, mesh)
    followed.refs, followed.peak = [], 0
    dist.barrier()
    result["ours"] = run_ours(rank, parallel, mesh)
    two_d = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    result["fsdp"] = {mode: run_fsdp(rank, parallel, two_d, mode == "sync_each")
                      for mode in ("sync_each", "sync_last_gathered")}  # fmt: skip
    Path(sys.argv[1]).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
