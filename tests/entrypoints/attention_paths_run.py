"""The context-parallel attention paths against one process, in one torchrun launch of 2 ranks.

    torchrun --standalone --nproc_per_node 2 tests/entrypoints/attention_paths_run.py plan.json

plan.json: {"result": PATH, "train": [{"name": ..., "config": PATH}, ...]}. Checks, in order:
- "ulysses": Ulysses attention (cp 2) vs full causal SDPA, forward and backward, MHA and GQA;
- "documents": a tiny Llama with document masking, cp 2 over the all-gather and the Ulysses
  path, vs the same model in one process: loss and every parameter gradient;
- "train": whole training jobs (entrypoints.train.train, the data loader's documents included);
  each job's reference is its first step's loss computed here in one process, so the test
  compares it with the job's logged step-1 loss.
Rank 0 writes every relative error (the largest over ranks) to the result file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from entrypoints.data import DataLoader  # noqa: E402
from entrypoints.model.documents import document_ids  # noqa: E402
from entrypoints.model.init import materialize  # noqa: E402
from entrypoints.model.llama import build_model  # noqa: E402
from entrypoints.parallel.context import apply_context_parallel, shard_sequence  # noqa: E402
from entrypoints.parallel.process_group import process_group  # noqa: E402
from entrypoints.parallel.ulysses import UlyssesAttention  # noqa: E402
from entrypoints.train import train  # noqa: E402
from launcher.contract.config import RopeScaling, load_config  # noqa: E402
from tests.entrypoints.tiny_models import tiny  # noqa: E402

ULYSSES_CASES = [[4, 4], [4, 2], [8, 2], [6, 2]]  # heads / kv heads: MHA, GQA, 3 query heads per rank
SEPARATOR = 0


def relative(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest relative error over the cp ranks."""
    error = torch.tensor((mine - theirs).abs().max().item() / max(theirs.abs().max().item(), 1e-30))
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return error.item()


def check_ulysses(cp_mesh) -> dict:
    ulysses = UlyssesAttention(cp_mesh)
    rank, size = ulysses.rank, ulysses.size
    errors = {}
    for heads, kv_heads in ULYSSES_CASES:
        generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
        batch, seq, dim = 2, 4 * size * 3, 8
        shapes = [(batch, heads, seq, dim), (batch, kv_heads, seq, dim), (batch, kv_heads, seq, dim)]
        q, k, v = (torch.randn(shape, generator=generator) for shape in shapes)
        grad_out = torch.randn(batch, heads, seq, dim, generator=generator)
        gqa = heads != kv_heads
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=gqa).backward(grad_out)
        reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        local = [shard_sequence(x, 2, rank, size).requires_grad_() for x in (q, k, v)]
        out = ulysses(*local, enable_gqa=gqa)
        out.backward(shard_sequence(grad_out, 2, rank, size))
        errors[f"{heads}/{kv_heads}"] = {
            "out": relative(out.detach(), shard_sequence(reference, 2, rank, size)),
            **{
                name: relative(mine.grad, shard_sequence(theirs.grad, 2, rank, size))
                for name, mine, theirs in zip(("dq", "dk", "dv"), local, full, strict=True)
            },
        }
    return errors


def tiny_model(seq_len: int):
    """test_model.py's tiny config, with Llama 3.1 RoPE scaling."""
    cfg = tiny(
        rope_scaling=RopeScaling(
            type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_context=16
        )
    )
    model = build_model(cfg, seq_len=seq_len)
    materialize(model, torch.device("cpu"), seed=3)
    return model


def check_documents(cp_mesh) -> dict:
    """Packed sequences with document masking: cp 2 (each path) vs one process."""
    rank, size, seq_len = cp_mesh.get_local_rank(), cp_mesh.size(), 32
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 61, (2, seq_len + 1), generator=generator)
    tokens[0, [4, 5, 17, 30]] = SEPARATOR  # documents across both zigzag chunks of both ranks
    tokens[1, [9, 22]] = SEPARATOR
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    documents = document_ids(inputs, SEPARATOR)

    reference = tiny_model(seq_len)
    reference_loss = reference(inputs, targets=targets, documents=documents)
    reference_grads = torch.autograd.grad(reference_loss, list(reference.parameters()))

    errors = {}
    for path in ("allgather", "ulysses"):
        model = tiny_model(seq_len)
        apply_context_parallel(model, cp_mesh, UlyssesAttention(cp_mesh) if path == "ulysses" else None)
        local_inputs, local_targets = (shard_sequence(x, 1, rank, size) for x in (inputs, targets))
        loss = model(local_inputs, targets=local_targets, documents=documents)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        # The job's loss is the mean over ranks (each holds s/cp tokens); so are its gradients.
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        errors[path] = {"loss": relative(mean_loss / size, reference_loss.detach())}
        for (name, _), grad, expected in zip(model.named_parameters(), grads, reference_grads, strict=True):
            summed = grad.clone()
            dist.all_reduce(summed)
            errors[path][name] = relative(summed / size, expected)
    return errors


def first_step_loss(config_path: str, *, masked: bool = True) -> float:
    """A job's step-1 loss in this process alone: the same model, data and documents, no layout
    (with masked=False, the same tokens without document masking)."""
    cfg = load_config(config_path)
    model = build_model(cfg.model, seq_len=cfg.training.seq_len, document_positions=cfg.data.document_positions)
    materialize(model, torch.device("cpu"), seed=cfg.training.seed)
    job_loader = DataLoader.from_config(cfg, dp_rank=0, cp_rank=0, device=torch.device("cpu"))
    loader = DataLoader(  # the same data, the whole step in this one process
        job_loader.dataset,
        global_batch_size=cfg.training.global_batch_size,
        micro_batch_size=cfg.training.micro_batch_size,
        dp_rank=0,
        dp_size=1,
        cp_rank=0,
        cp_size=1,
        device=torch.device("cpu"),
        document_separator=job_loader.document_separator,
    )
    losses = [model(t, targets=y, documents=d if masked else None).item() for t, y, d in loader.next_step()]
    return sum(losses) / len(losses)


def run_checks(plan: dict, env) -> dict:
    """Every check of the plan in the current process group (also multirun.py's "attention_paths")."""
    cp_mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("cp",))["cp"]
    result = {"ulysses": check_ulysses(cp_mesh), "documents": check_documents(cp_mesh), "train": {}}
    for job in plan["train"]:
        summary = train(load_config(job["config"]), env)
        result["train"][job["name"]] = {
            "reference_loss": first_step_loss(job["config"]),
            "unmasked_loss": first_step_loss(job["config"], masked=False),
            "steps": summary,
        }
    return result


def main(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    with process_group("cpu") as env:
        result = run_checks(plan, env)
        if env.rank == 0:
            Path(plan["result"]).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
