"""Run several checks in one torchrun launch (each launch costs seconds of process start-up).

    torchrun --standalone --nproc_per_node 4 tests/entrypoints/multirun.py plan.json
    python tests/entrypoints/multirun.py plan.json          # one process

plan.json: {"jobs": [{"kind": "train", "config": PATH, "result": PATH},
                     {"kind": "train_refused", "config": PATH, "result": PATH},
                     {"kind": "cp_attention", "cases": [[heads, kv_heads], ...], "result": PATH},
                     {"kind": "vocab_parallel_loss", "result": PATH},
                     {"kind": "fp8_collectives", "configs": {"fp32": PATH, "fp8": PATH}, "result": PATH},
                     {"kind": "attention_paths", "train": [{"name": ..., "config": PATH}], "result": PATH}]}
Rank 0 writes each job's result as JSON; the tests assert on those files. Before each job rank 0
prints `multirun: job RESULT_PATH`, so that each test module reads only its own jobs' output.
Jobs of one mesh shape share one mesh and its process groups (`SharedMeshes`).
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from entrypoints.garbage_collection import imports_done, pause_during_startup  # noqa: E402

pause_during_startup()  # as entrypoints/train.py starts its processes
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from entrypoints.parallel.context import ContextParallelAttention, shard_sequence  # noqa: E402
from entrypoints.parallel.process_group import process_group  # noqa: E402
from entrypoints.train import train  # noqa: E402
from launcher.contract.config import load_config  # noqa: E402


def run_train(job: dict, env) -> dict:
    return train(load_config(job["config"]), env)


def run_train_refused(job: dict, env) -> dict:
    """A training job expected to stop with a ConfigError on every rank: its one line, or None."""
    from launcher.contract.config import ConfigError

    try:
        train(load_config(job["config"]), env)
    except ConfigError as error:
        return {"refused": str(error)}
    return {"refused": None}


def run_cp_attention(job: dict, env) -> dict:
    """Zigzag context-parallel attention vs full causal attention, forward and backward, with the
    K/V regathered in backward and kept gathered; and the bytes each way saves for backward."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("cp",))
    size = mesh.size()
    errors, saved = {}, {}
    for heads, kv_heads in job["cases"]:
        batch, seq, dim = 2, 8 * size * 3, 16
        generator = torch.Generator().manual_seed(heads * 100 + kv_heads)
        q, k, v, grad_out = (
            torch.randn(shape, generator=generator)
            for shape in [(batch, heads, seq, dim), *[(batch, kv_heads, seq, dim)] * 2, (batch, heads, seq, dim)]
        )
        gqa = heads != kv_heads
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=gqa)
        reference.backward(grad_out)
        for regather in (True, False):
            cp = ContextParallelAttention(mesh["cp"], regather=regather)
            case, saved[f"{heads}/{kv_heads} regather={regather}"] = _cp_case(cp, full, reference, grad_out, gqa)
            worst = torch.tensor(list(case.values()))
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            errors[f"{heads}/{kv_heads} regather={regather}"] = dict(zip(case, worst.tolist(), strict=True))
    return {"cp": size, "max_abs_error": errors, "saved_bytes": saved}


def _cp_case(cp, full, reference, grad_out, gqa) -> tuple[dict, int]:
    """(max abs errors of out, dq, dk, dv on this rank, bytes autograd saved for the backward)."""
    rank, size = cp.rank, cp.size
    local = [shard_sequence(t.detach(), 2, rank, size).requires_grad_() for t in full]
    stored: dict[int, int] = {}

    def pack(tensor):
        stored[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = cp(*local, enable_gqa=gqa)
    out.backward(shard_sequence(grad_out, 2, rank, size))

    def err(mine, theirs):
        return (mine - shard_sequence(theirs, 2, rank, size)).abs().max().item()

    case = {
        "out": err(out.detach(), reference.detach()),
        **{
            name: err(mine.grad, theirs.grad)
            for name, mine, theirs in zip(("dq", "dk", "dv"), local, full, strict=True)
        },
    }
    return case, sum(stored.values())


def run_vocab_parallel_loss(job: dict, env) -> dict:
    """The fused loss with the output weight split over the vocabulary (tp = world), vs unfused;
    and the vocabulary-parallel embedding vs nn.Embedding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from entrypoints.model.loss import linear_cross_entropy

    tp = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("tp",))["tp"]
    rank, size = tp.get_local_rank(), tp.size()
    generator = torch.Generator().manual_seed(0)
    batch, seq, dim, vocab = 2, 6 * size, 8, 37  # 37 rows: uneven vocab shards
    h = torch.randn(batch, seq, dim, generator=generator)
    weight = torch.randn(vocab, dim, generator=generator)
    targets = torch.randint(vocab, (batch, seq), generator=generator)

    full_h, full_w = h.clone().requires_grad_(), weight.clone().requires_grad_()
    reference = F.cross_entropy((full_h @ full_w.t()).flatten(0, 1), targets.flatten())
    reference.backward()

    # Sequence parallel: this rank holds a contiguous slice of the sequence of h.
    local_h = h.chunk(size, dim=1)[rank].clone().requires_grad_()
    sharded_w = torch.nn.Parameter(distribute_tensor(weight, tp, [Shard(0)]))
    loss = linear_cross_entropy(local_h, sharded_w, targets, tp_mesh=tp, min_chunk_tokens=5)
    loss.backward()
    errors = torch.tensor(
        [
            abs(loss.item() - reference.item()),
            (local_h.grad - full_h.grad.chunk(size, dim=1)[rank]).abs().max().item(),
            (sharded_w.grad.full_tensor() - full_w.grad).abs().max().item(),
        ]
    )
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    embedding_errors, rows_held = _vocab_parallel_embedding(tp, weight, generator)
    return {
        "tp": size,
        "max_abs_error": dict(zip(["loss", "dh", "dweight"], errors.tolist(), strict=True)),
        "embedding_max_abs_error": embedding_errors,
        "embedding_grad_rows": rows_held,
    }


def _vocab_parallel_embedding(tp, weight: torch.Tensor, generator) -> tuple[dict, list[int]]:
    """VocabParallelEmbedding (uneven rows: 37 over tp) vs nn.Embedding: the rank's sequence slice
    of the output, the whole weight gradient, and how many rows each rank's gradient storage holds."""
    from entrypoints.parallel.tensor import VocabParallelEmbedding

    rank, size = tp.get_local_rank(), tp.size()
    vocab, dim = weight.shape
    tokens = torch.randint(vocab, (2, 6 * size), generator=generator)
    grad_out = torch.randn(2, 6 * size, dim, generator=generator)
    reference = torch.nn.Embedding(vocab, dim)
    parallel = torch.nn.Embedding(vocab, dim)
    with torch.no_grad():
        reference.weight.copy_(weight)
        parallel.weight.copy_(weight)
    reference(tokens).backward(grad_out)
    expected = F.embedding(tokens, weight).chunk(size, dim=1)[rank]
    parallel = VocabParallelEmbedding(parallel, tp)
    out = parallel(tokens)
    out.backward(grad_out.chunk(size, dim=1)[rank])
    errors = torch.tensor(
        [
            (out - expected).abs().max().item(),
            (parallel.weight.grad.full_tensor() - reference.weight.grad).abs().max().item(),
        ]
    )
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    local = parallel.weight.grad.to_local()
    rows = torch.tensor([local.untyped_storage().nbytes() // (dim * local.element_size())])
    held = [torch.zeros_like(rows) for _ in range(size)]
    dist.all_gather(held, rows, group=tp.get_group())
    return dict(zip(["out", "dweight"], errors.tolist(), strict=True)), [int(r) for r in held]


def run_fp8_collectives(job: dict, env) -> dict:
    """Collectives and float8 matmuls in one forward and backward of each config (same layout)."""
    from torch.profiler import ProfilerActivity, profile

    from entrypoints.fp8 import fp8_settings
    from entrypoints.model.init import materialize
    from entrypoints.parallel.accumulate import accumulate
    from entrypoints.parallel.mesh import build_mesh
    from entrypoints.parallel.parallelize import build_model_parts

    counted = ("gloo:all_reduce", "gloo:all_gather", "gloo:reduce_scatter")
    found = {}
    for name, path in job["configs"].items():
        cfg = load_config(path)
        mesh = build_mesh(cfg.parallel, "cpu")
        parts, _ = build_model_parts(cfg, mesh, fp8=fp8_settings(cfg, device_type="cpu", backend=env.backend))
        materialize(parts[0], env.device, seed=0)
        generator = torch.Generator().manual_seed(0)
        tokens, targets = torch.randint(0, cfg.model.vocab_size, (2, 2, cfg.training.seq_len), generator=generator)
        with profile(activities=[ProfilerActivity.CPU]) as prof, _float8_matmuls() as matmuls:
            loss = accumulate(parts[0], [(tokens, targets, None)], "sync_each")
        calls = {event.key: event.count for event in prof.key_averages() if event.key in counted}
        found[name] = {"loss": loss.item(), **{key: calls.get(key, 0) for key in counted}, **matmuls}
    return found


@contextlib.contextmanager
def _float8_matmuls():
    """Counts the matmuls torchao's Float8TrainingTensor dispatches (its FLOAT8_OPS_TABLE, in
    torchao/float8/float8_ops.py): on CPU they are emulated, so `aten::_scaled_mm` never runs."""
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE

    counts = {"float8_matmuls": 0, "float8_matmul_operands": set()}
    saved = {op: FLOAT8_OPS_TABLE[op] for op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)}

    def counting(implementation):
        def run(aten_op, args, kwargs=None):
            counts["float8_matmuls"] += 1
            counts["float8_matmul_operands"].update(str(arg._data.dtype) for arg in args if hasattr(arg, "_data"))
            return implementation(aten_op, args, kwargs)

        return run

    FLOAT8_OPS_TABLE.update({op: counting(implementation) for op, implementation in saved.items()})
    try:
        yield counts
    finally:
        FLOAT8_OPS_TABLE.update(saved)
        counts["float8_matmul_operands"] = sorted(counts["float8_matmul_operands"])


def run_attention_paths(job: dict, env) -> dict:
    """attention_paths_run.py's checks (test_attention_paths.py)."""
    from tests.entrypoints.attention_paths_run import run_checks

    return run_checks(job, env)


def run_float8_regather(job: dict, env) -> dict:
    """What parallel/regather.py makes of a saved float8 sequence-parallel input on a 1-rank tp
    mesh: its view, its DTensor and float8 wrappers and its scale, rebuilt over the gathered data
    again (gloo runs no float8 collectives, so this is the float8 path's one run on real data)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    from entrypoints.parallel.regather import _Gather, _packer, _plain, _Token, _unpack

    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("tp",))
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    shard = hp_tensor_to_float8_dynamic(
        DTensor.from_local(x, mesh, [Shard(1)], run_check=False),
        torch.float8_e4m3fn,
        LinearMMConfig(),
        gemm_input_role=GemmInputRole.INPUT,
    )
    gathered = shard.redistribute(placements=[Replicate()])
    pack = _packer([_Gather(shard, _plain(gathered))])
    saved = gathered.view(-1, 16)
    token = pack(saved)
    other = pack(x)  # a tensor of another storage passes through
    rebuilt = _unpack(token)
    local, original = rebuilt.to_local(), saved.to_local()
    return {
        "tokenised": isinstance(token, _Token),
        "other_passed_through": other is x,
        "types": [type(rebuilt).__name__, type(local).__name__],
        "placements": [type(p).__name__ for p in rebuilt.placements],
        "shape": list(rebuilt.shape),
        "same_scale": bool(torch.equal(local._scale, original._scale)),
        "same_bytes": bool(torch.equal(local._data.view(torch.uint8), original._data.view(torch.uint8))),
        "max_abs_error": (local.to_original_precision() - original.to_original_precision()).abs().max().item(),
    }


KINDS = {
    "train": run_train,
    "train_refused": run_train_refused,
    "float8_regather": run_float8_regather,
    "cp_attention": run_cp_attention,
    "vocab_parallel_loss": run_vocab_parallel_loss,
    "fp8_collectives": run_fp8_collectives,
    "attention_paths": run_attention_paths,
}


class SharedMeshes:
    """One mesh per shape for the whole launch, and no other group kept from one job to the next.

    Each gloo group holds 3 threads: 2 workers and its device's loop, which wakes every 10 ms
    (gloo/transport/tcp/loop.cc) even when idle. A process runs one job, but this one runs dozens,
    and each job's `build_mesh` and `build_expert_mesh` made new groups, and its checkpointer a
    new world group (entrypoints/checkpoint.py): the 4-rank launch's ranks held 900 threads each
    by its end (load averages of 100 to 200 on 2 cores), whose wake-ups took CPU from every
    process on the machine (the launch alone: 125 of its 360 CPU s in the kernel).

    The meshes are shared rather than destroyed after each job because torch already hands a
    job the meshes of earlier ones: DeviceMesh equality ignores its groups, so the sharding
    propagation caches return the output specs of an earlier job's equal mesh (destroying them
    meant clearing those caches too, and cost more CPU than it saved). The four modules that use
    these launches, alone with `-n 0`: 526 CPU s (183 in the kernel) before, 362 (64) after."""

    def __init__(self) -> None:
        import entrypoints.parallel.expert as expert
        import entrypoints.parallel.mesh as mesh

        self._made: dict[tuple, object] = {}
        for module in (mesh, expert):
            module.init_device_mesh = self._shared(module.init_device_mesh)

    def _shared(self, init_device_mesh):
        def shared(device_type, shape, *, mesh_dim_names=None):
            key = (init_device_mesh, device_type, tuple(shape), tuple(mesh_dim_names or ()))
            if key not in self._made:
                self._made[key] = init_device_mesh(device_type, shape, mesh_dim_names=mesh_dim_names)
            return self._made[key]

        return shared

    def release_others(self) -> None:
        """Destroy every group but the meshes' (theirs, and their flattened dims', are in their
        `_pg_registry`) and the world's, as the job's process would at exit. The barrier
        first: a peer may still be reading what this rank has sent (process_group.py)."""
        import gc

        dist.barrier()
        kept = {id(group) for mesh in self._made.values() for group in mesh._pg_registry.values()}
        world = dist.distributed_c10d._world
        for group in list(world.pg_map):
            if group is not dist.GroupMember.WORLD and id(group) not in kept:
                dist.destroy_process_group(group)
        gc.collect()  # the job's objects hold its groups in cycles


def main(plan_path: str) -> int:
    imports_done()
    plan = json.loads(Path(plan_path).read_text())
    meshes = SharedMeshes()
    with process_group("cpu") as env:
        for job in plan["jobs"]:
            if env.rank == 0:
                print(f"multirun: job {job['result']}", flush=True)
            try:
                result = KINDS[job["kind"]](job, env)
            except Exception:
                result = {"error": traceback.format_exc()}
                if env.rank == 0:
                    Path(job["result"]).write_text(json.dumps(result))
                raise
            if env.rank == 0:
                Path(job["result"]).write_text(json.dumps(result, default=str))
            meshes.release_others()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
