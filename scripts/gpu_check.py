"""One-shot check of the bundled entrypoints on a single NVIDIA GPU (H100/H200), in a few minutes.

    bash scripts/gpu_check.sh                          # on the GPU machine (launcher importable there)
    bash scripts/gpu_check.sh --prepare DIR            # on any machine with launcher: configs + estimates
    bash scripts/gpu_check.sh --prepared DIR           # on the GPU machine, torch (+ torchao) only
    bash scripts/gpu_check.sh --cpu-smoke              # every code path on the CPU with a tiny model

It
1. trains Llama 3.2 1B at 8K tokens for a few dozen steps in bf16, in FP8 (torchao,
   tensorwise) and in FP8 with per-block torch.compile, with entrypoints/train.py under
   torchrun on one GPU; then 4 layers of Llama 3.1 8B's shape in bf16 and in compiled FP8, and
   reports their tokens/s ratio (the goal: compiled FP8 >= 1.3x bf16);
2. reports tokens/s/GPU, MFU and peak memory (CUDA max allocated / reserved) next to the
   memory estimator's prediction (`launcher estimate RECIPE --json`), when the launcher is there;
3. runs the context-parallel attention kernel (parallel/context.py: zigzag chunks against the
   gathered K/V) at 32K tokens against full causal attention, forward and backward, for every
   rank of cp 2 and 4 in turn on this one GPU, and reports the largest errors and timings;
4. times one rank of the LSE-merged CP kernel (parallel/cp_attention.py) at cp 2, 4 and 8
   against plain causal SDPA over the whole sequence divided by cp, at 32K and 128K tokens,
   forward and backward in bf16, once per SDPA backend (cuDNN, flash), reporting TFLOP/s per
   rank, the ratio (the goal: >= 0.9) and the ops and kernels the profiler saw; and
   checks the hypothesis that by default plain causal SDPA runs cuDNN while the old
   lower-right-masked path runs FlashAttention-2 (the kernel names of each);
5. times an MoE layer (Qwen3-30B-A3B's, 8K tokens) against a dense SwiGLU of equal active
   FLOPs in bf16 and FP8, and the experts' grouped GEMMs in bf16 against torchao's FP8 rowwise
   grouped GEMM (scripts/gpu_moe_check.py);
6. prints a table and writes gpu_check.json to the output directory ($OUT, else ./out).

A part that cannot run (no torchao for FP8, no launcher for the estimate) is reported as
skipped with the reason; the others still run. Exit status 1 if any part failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import gpu_moe_check  # noqa: E402  (beside this script)

from launcher.contract.checkpoint_dirs import complete_checkpoints  # noqa: E402  (standard library only)

# One GPU: llama3.2-1b (1.24B parameters, tied embeddings) at 8K tokens, 4 sequences per step.
GPU_RECIPE = {
    "model": "llama3.2-1b",
    "training": {
        "seq_len": 8192,
        "global_batch_size": 4,
        "micro_batch_size": 1,
        "steps": 30,
        "optimizer": {"lr": 3.0e-4, "warmup_steps": 5, "min_lr": 3.0e-5},
    },
    "precision": {"dtype": "bf16"},
    "cluster": {
        "backend": "local",
        "instance_type": "local",
        "nproc_per_node": 1,
        "device": "cuda",
        "accelerator": "h200-141gb",
    },
    "data": {"dtype": "uint32"},
}
# The same code paths on a CPU in seconds.
SMOKE_RECIPE = {
    "model": "llama3.1-tiny",
    "training": {
        "seq_len": 128,
        "global_batch_size": 2,
        "micro_batch_size": 1,
        "steps": 3,
        "optimizer": {"lr": 3.0e-3, "warmup_steps": 1},
    },
    "precision": {"dtype": "fp32"},
    "cluster": {"backend": "local", "instance_type": "local", "nproc_per_node": 1, "device": "cpu"},
}
FP8 = {"precision": {"fp8": True, "fp8_recipe": "tensorwise"}}


def merged_into(base: dict, changes: dict) -> dict:
    """`base` with `changes` applied key by key (a dict replaces a plain value, e.g. the model)."""
    out = dict(base)
    for key, value in changes.items():
        inner = out.get(key)
        out[key] = merged_into(inner, value) if isinstance(value, dict) and isinstance(inner, dict) else value
    return out


# torchao's float8 casts are separate kernels in eager mode; compile fuses them.
# Issue 11's FP8 goal (compiled FP8 >= 1.3x bf16) on layers of Llama 3.1 8B's shape: 4 of its
# blocks with its 128K vocabulary, 12 steps each (about a minute per run with compile).
LAYERS_8B = {"model": {"base": "llama3.1-8b", "num_layers": 4}, "training": {"steps": 12}}
# Two MoE blocks of Qwen3-30B-A3B (128 experts, top-8) with its 152K vocabulary at 8K tokens: the
# experts on bf16 grouped GEMMs, under FP8 with the experts still bf16, and with
# precision.fp8_experts on torchao's FP8 grouped GEMMs (issue 24 part 4).
LAYERS_MOE = {"model": {"base": "qwen3-30b-a3b", "num_layers": 2}, "training": {"steps": 10}}
# In the order they run: what no GPU has measured yet first, so that a check cut short by its
# time budget (--budget-s) still brings those back.
RUNS = {
    "moe-bf16": LAYERS_MOE,
    "moe-fp8": merged_into(LAYERS_MOE, FP8),  # the experts bf16, as precision.fp8 alone runs them
    "moe-fp8-experts": merged_into(LAYERS_MOE, {"precision": {**FP8["precision"], "fp8_experts": True}}),
    "8b-bf16": LAYERS_8B,
    "8b-fp8-compile": merged_into(LAYERS_8B, {**FP8, "training": {"compile": True}}),
    "bf16": {},
    "fp8-compile": {**FP8, "training": {"compile": True}},
    "fp8": FP8,
}


def runs_for(smoke: bool) -> dict:
    """The runs to make; compiling on a CPU takes minutes and 8B-shaped layers are the GPU's
    question, so the smoke test leaves both out."""
    return {
        name: c for name, c in RUNS.items() if not (smoke and ("compile" in name or name.startswith(("8b", "moe"))))
    }


def fp8_speedup(training: dict) -> float | None:
    """Compiled FP8 over bf16 tokens/s on the 8B-shaped layers (the goal: >= 1.3)."""
    bf16, fp8 = training.get("8b-bf16", {}), training.get("8b-fp8-compile", {})
    if bf16.get("status") != "ok" or fp8.get("status") != "ok":
        return None
    return fp8["tokens_per_s_per_gpu"] / bf16["tokens_per_s_per_gpu"]


CP_SEQ, CP_SMOKE_SEQ = 32768, 512
RUN_TIMEOUT_S = 200


# --- prepare: resolved configs and the estimator's prediction (needs the launcher) ----------


def prepare(directory: Path, smoke: bool) -> None:
    from launcher.recipe import Recipe
    from launcher.resolve import resolve

    directory.mkdir(parents=True, exist_ok=True)
    for name, changes in runs_for(smoke).items():
        spec = merged_into(SMOKE_RECIPE if smoke else GPU_RECIPE, {"name": f"gpu-check-{name}", **changes})
        # The runs recorded in docs/gpu_check_h200.json trained with sync_each, where submit would
        # pick the estimator's mode: they keep it, so that they measure what was measured before.
        # The recipe carries it, so the estimate is of the program that runs (until 2026-12-05 it
        # was of the recipe's own mode, sync_last_gathered: docs/gpu_check_h100.md).
        recipe = Recipe.from_dict(spec).with_changes({"parallel.grad_accumulation": "sync_each"})
        (directory / f"{name}.recipe.yaml").write_text(recipe.to_yaml())
        measured = resolve(recipe).concrete
        (directory / f"{name}.json").write_text(json.dumps(measured.resolved().to_dict(), indent=2))
        (directory / f"{name}.estimate.json").write_text(json.dumps(estimate(directory / f"{name}.recipe.yaml")))


def estimate(recipe_yaml: Path) -> dict:
    """`launcher estimate RECIPE --json`, or why it is not available."""
    exe = Path(sys.executable).parent / "launcher"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "launcher"]
    try:
        proc = subprocess.run(
            [*command, "estimate", str(recipe_yaml), "--json"], capture_output=True, text=True, timeout=120, cwd=REPO
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"skipped": f"launcher estimate could not run: {err}"}
    if proc.returncode:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        return {"skipped": f"launcher estimate exited {proc.returncode}: {last}"}
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"skipped": f"launcher estimate printed no JSON: {proc.stdout[:200]!r}"}


# --- run: training under torchrun -------------------------------------------------------------


def run_training(name: str, config: Path, out: Path, smoke: bool) -> dict:
    resolved = json.loads(config.read_text())
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # The final checkpoint of a 1B model is ~15 GB (fp32 weights and Adam states): write it to
    # memory, check it is complete, and drop it.
    scratch = Path(tempfile.mkdtemp(prefix=f"gpu-check-{name}-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    resolved["runtime"]["output_dir"] = str(run_dir)
    resolved["checkpoint"]["dir"] = str(scratch)
    config_path = run_dir / "resolved.json"
    config_path.write_text(json.dumps(resolved, indent=2))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "entrypoints/train.py",
        "--config",
        str(config_path),
    ]
    began = time.perf_counter()
    try:
        proc = subprocess.run(
            command,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    except subprocess.TimeoutExpired as err:
        shutil.rmtree(scratch, ignore_errors=True)
        (run_dir / "log.txt").write_text(str(err.stdout or "") + str(err.stderr or ""))
        return {"status": "failed", "reason": f"timed out after {RUN_TIMEOUT_S} s"}
    wall = time.perf_counter() - began
    (run_dir / "log.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    checkpoint_complete = bool(complete_checkpoints(scratch))  # every host's marker, as resume reads them
    shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode:
        reason = _last_error(proc.stderr)
        status = "skipped" if "torchao is not installed" in reason else "failed"
        return {"status": status, "reason": reason, "exit_code": proc.returncode}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = _summary_line(proc.stdout)
    return {
        "status": "ok",
        "wall_s": wall,
        "steps": len(records),
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "tokens_per_s_per_gpu": summary.get("mean_tokens_per_s_per_gpu"),
        "mfu": summary.get("mean_mfu"),
        "step_time_s": summary.get("mean_step_time_s"),
        "peak_alloc_gib": summary.get("peak_mem_alloc_gib"),
        "peak_reserved_gib": summary.get("peak_mem_reserved_gib"),
        "checkpoint_complete": checkpoint_complete,
        "losses": [r["loss"] for r in records],
    }


def _summary_line(stdout: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("summary "):
            pairs = (field.split("=", 1) for field in line.split()[1:])
            return {k: float(v) for k, v in pairs}
    return {}


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        if "error:" in line.lower() or "Error" in line:
            return line.strip()[:400]
    return lines[-1][:400] if lines else "no output"


# --- the context-parallel attention kernel at 32K ----------------------------------------------


def cp_kernel_check(seq: int, device: str) -> dict:
    """zigzag_attention_masked for every rank of cp 2 and 4, against full causal SDPA, fwd + bwd."""
    import torch
    import torch.nn.functional as F

    from entrypoints.parallel.context import shard_sequence, zigzag_attention_masked

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    heads, kv_heads, head_dim = (32, 8, 64) if device == "cuda" else (4, 2, 16)
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    q, k, v = randn(1, heads, seq, head_dim), randn(1, kv_heads, seq, head_dim), randn(1, kv_heads, seq, head_dim)
    grad = randn(1, heads, seq, head_dim)

    def timed(fn):
        fn()  # warm-up
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        return result, time.perf_counter() - start

    def full():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        out.backward(grad)
        return out.detach(), [t.grad for t in leaves]

    (ref_out, ref_grads), full_s = timed(full)
    results = {"seq_len": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype)}
    results["full_fwd_bwd_ms"] = full_s * 1e3
    # Errors are reported relative to the largest magnitude of each reference tensor.
    scales = {
        name: t.float().abs().max().item()
        for name, t in zip(("out", "dq", "dk", "dv"), (ref_out, *ref_grads), strict=True)
    }
    for cp in (2, 4):
        worst = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
        rank_ms = []
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for rank in range(cp):

            def one_rank(rank=rank, cp=cp):
                q_local = shard_sequence(q, 2, rank, cp).detach().requires_grad_()
                k_full, v_full = k.detach().requires_grad_(), v.detach().requires_grad_()
                out = zigzag_attention_masked(q_local, k_full, v_full, rank, cp, enable_gqa=True)
                out.backward(shard_sequence(grad, 2, rank, cp))
                return out.detach(), q_local.grad, k_full.grad, v_full.grad

            (out, dq, dk_rank, dv_rank), seconds = timed(one_rank)
            rank_ms.append(seconds * 1e3)
            worst["out"] = max(worst["out"], _max_err(out, shard_sequence(ref_out, 2, rank, cp)))
            worst["dq"] = max(worst["dq"], _max_err(dq, shard_sequence(ref_grads[0], 2, rank, cp)))
            dk += dk_rank.float()
            dv += dv_rank.float()
        worst["dk"] = _max_err(dk, ref_grads[1])
        worst["dv"] = _max_err(dv, ref_grads[2])
        results[f"cp{cp}"] = {
            "max_abs_error": worst,
            "max_rel_error": {name: worst[name] / scales[name] for name in worst},
            "rank_fwd_bwd_ms": rank_ms,
            "balance": max(rank_ms) / (sum(rank_ms) / len(rank_ms)),
        }
    results["reference_max_abs"] = scales
    return results


# --- context-parallel attention speed against plain causal attention -------------------------
#
# Time on an H200 (estimated from 466 TFLOP/s for plain causal attention at 32K, and counting
# warm-up, two timed calls, one profiled call and cuDNN's plan builds): at 128K one full causal
# fwd+bwd of 32 heads x 128 dims is 7·s²·H·D = 4.9e14 FLOP, about 1.1 s; each backend times the
# reference 3 times and every cp degree's two ranks 3 times each (about 2 x 1.1 s per degree in
# all), so about 12 s per backend at 128K, under 1 s at 32K, plus ~15 s of hypothesis check,
# profiling and set-up: about 45 s in all, under a minute of gpu_check.sh's 8 minutes.

CP_SPEED_SEQS, CP_SPEED_SMOKE_SEQS = (32768, 131072), (256,)
CP_SPEED_DEGREES = (2, 4, 8)
CP_SPEED_REPEATS = 2


def attention_flop(seq: int, heads: int, head_dim: int) -> float:
    """Causal attention fwd + bwd: QK^T and PV are 2·s²·H·D each, halved by the mask; the
    backward is 2.5x the forward (five matrix products to two): 3.5 x 2·s²·H·D."""
    return 7.0 * seq * seq * heads * head_dim


def cp_speed_check(seqs: tuple[int, ...], device: str) -> dict:
    """One rank's LSE-merged CP kernel against plain causal SDPA over the whole sequence / cp,
    per SDPA backend, forward + backward, with the kernels each ran; and whether plain causal
    SDPA and the old lower-right-masked path go to different kernels by default."""
    import torch

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, kv_heads, head_dim = (32, 8, 128) if cuda else (4, 2, 16)
    shape = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype)}
    report = {**shape, "degrees": list(CP_SPEED_DEGREES), "runs": {}}
    report["hypothesis"] = _dispatch_hypothesis(_attention_inputs(seqs[0], shape, device), device)
    from torch.nn.attention import SDPBackend

    pins = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION]} if cuda else {"cpu": None}
    for seq in seqs:
        inputs = _attention_inputs(seq, shape, device)
        for backend, pin in pins.items():
            try:
                report["runs"][f"{seq}/{backend}"] = _cp_speed_one(inputs, backend, pin, device)
            except Exception as err:  # one backend failing leaves the others measured
                report["runs"][f"{seq}/{backend}"] = {"error": f"{type(err).__name__}: {err}"[:400]}
        del inputs
    return report


def _attention_inputs(seq: int, shape: dict, device: str) -> dict:
    import torch

    dtype = getattr(torch, shape["dtype"].removeprefix("torch."))
    generator = torch.Generator(device=device).manual_seed(seq)

    def randn(heads):
        return torch.randn(1, heads, seq, shape["head_dim"], generator=generator, device=device, dtype=dtype)

    return {"seq": seq, "q": randn(shape["heads"]), "k": randn(shape["kv_heads"]), "v": randn(shape["kv_heads"]),
            "grad": randn(shape["heads"])}  # fmt: skip


def _fwd_bwd(attention, q, k, v, grad):
    """A closure: attention(q, k, v) forward and backward on fresh leaves."""

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        attention(*leaves).backward(grad)

    return run


def _seconds(fn, device: str) -> float:
    fn()  # warm-up: cuDNN builds its execution plans on first use
    _sync(device)
    start = time.perf_counter()
    for _ in range(CP_SPEED_REPEATS):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / CP_SPEED_REPEATS


def _kernels(fn, device: str) -> dict:
    """The attention ops (aten::*scaled_dot_product* / *attention*) and the device kernels with
    the most time in one call of fn, by torch.profiler's key_averages names."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    events = prof.key_averages()
    ops = sorted({e.key for e in events if e.key.startswith("aten::") and "attention" in e.key})
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    on_device.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {"ops": ops, "kernels": [e.key[:160] for e in on_device[:4]]}


def _cp_speed_one(inputs: dict, backend: str, pin, device: str) -> dict:
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from entrypoints.parallel.context import shard_sequence, zigzag_attention
    from entrypoints.parallel.cp_attention import piece_backend

    seq, q, k, v, grad = (inputs[key] for key in ("seq", "q", "k", "v", "grad"))
    flop = attention_flop(seq, q.shape[1], q.shape[3])
    with sdpa_kernel(pin) if pin else contextlib.nullcontext():
        chosen = piece_backend(q)
        if chosen != backend:
            return {"skipped": f"the {backend} kernel does not take these inputs (the dispatcher chose {chosen})"}
        full = _fwd_bwd(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True), q, k, v, grad)
        entry = {"full_gqa": "native"}
        try:
            full_s = _seconds(full, device)
        except RuntimeError:  # a pinned kernel without GQA support: the same kernel on repeated K/V
            group = q.shape[1] // k.shape[1]
            k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            full = _fwd_bwd(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), q, k_rep, v_rep, grad)
            entry["full_gqa"] = "K/V repeated to the query heads (no GQA in this kernel)"
            full_s = _seconds(full, device)
        entry.update(full_ms=full_s * 1e3, full_tflops=flop / full_s / 1e12, full_kernels=_kernels(full, device))
        for cp in CP_SPEED_DEGREES:
            per_rank = []
            for rank in (0, cp - 1):  # zigzag ranks do equal work; 0 and cp-1 differ most in shape
                q_local, grad_local = (shard_sequence(t, 2, rank, cp) for t in (q, grad))
                one_rank = _fwd_bwd(
                    lambda a, b, c, rank=rank, cp=cp: zigzag_attention(a, b, c, rank, cp, enable_gqa=True),
                    q_local, k, v, grad_local,
                )  # fmt: skip
                per_rank.append(_seconds(one_rank, device))
            rank_s = sum(per_rank) / len(per_rank)
            entry[f"cp{cp}"] = {
                "rank_ms": [s * 1e3 for s in per_rank],
                "tflops_per_rank": flop / cp / rank_s / 1e12,
                "ratio_to_full": (full_s / cp) / rank_s,
            }
        entry["cp_kernels"] = _kernels(one_rank, device)  # the last rank of the largest degree
    return entry


def _dispatch_hypothesis(inputs: dict, device: str) -> dict:
    """Issue 11: plain is_causal SDPA prefers cuDNN on sm90 (torch >= 2.9), while the old
    lower-right CausalBias path goes to FlashAttention-2. Default dispatch, no pinning."""
    import torch.nn.functional as F

    from entrypoints.parallel.context import shard_sequence, zigzag_attention_masked

    q, k, v, grad = (inputs[key] for key in ("q", "k", "v", "grad"))
    cp, rank = 4, 1
    plain = _fwd_bwd(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True), q, k, v, grad)
    masked = _fwd_bwd(
        lambda a, b, c: zigzag_attention_masked(a, b, c, rank, cp, enable_gqa=True),
        shard_sequence(q, 2, rank, cp), k, v, shard_sequence(grad, 2, rank, cp),
    )  # fmt: skip
    result = {"seq_len": inputs["seq"], "plain": _kernels(plain, device), "masked_cp4_rank1": _kernels(masked, device)}
    plain_ops, masked_ops = " ".join(result["plain"]["ops"]), " ".join(result["masked_cp4_rank1"]["ops"])
    if device != "cuda":
        result["verdict"] = "not applicable: the CPU has one fused kernel"
    elif "cudnn" in plain_ops and "flash" in masked_ops and "cudnn" not in masked_ops:
        result["verdict"] = "confirmed: plain causal SDPA ran cuDNN, the lower-right mask FlashAttention-2"
    else:
        result["verdict"] = f"refuted: plain ran {plain_ops or 'no fused op'}; masked ran {masked_ops or 'no fused op'}"
    return result


def _max_err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# --- report --------------------------------------------------------------------------------------


def table(report: dict) -> str:
    lines = ["", "gpu_check: " + report["device"], ""]
    lines.append(
        f"{'run':11} {'status':8} {'tok/s/GPU':>10} {'MFU':>6} {'step s':>7} {'alloc GiB':>10} {'resv GiB':>9} "
        f"{'est. GiB':>9} {'est/resv':>8} {'loss first->last':>18}"
    )
    for name, run in report["training"].items():
        est = report["estimates"].get(name, {})
        est_gib = est.get("per_gpu_peak_bytes", math.nan) / 2**30 if "per_gpu_peak_bytes" in est else math.nan
        if run["status"] != "ok":
            lines.append(f"{name:11} {run['status']:8} {run.get('reason', '')}")
            continue
        ratio = est_gib / run["peak_reserved_gib"] if run["peak_reserved_gib"] else math.nan
        lines.append(
            f"{name:11} {'ok':8} {run['tokens_per_s_per_gpu']:10.0f} {run['mfu']:6.3f} {run['step_time_s']:7.3f} "
            f"{run['peak_alloc_gib']:10.2f} {run['peak_reserved_gib']:9.2f} {est_gib:9.2f} {ratio:8.2f} "
            f"{run['first_loss']:8.3f}->{run['final_loss']:.3f}"
        )
    for name, est in report["estimates"].items():
        if "skipped" in est:
            lines.append(f"estimate {name}: skipped ({est['skipped']})")
    cp = report["cp_attention"]
    if "error" in cp or "skipped" in cp:
        lines.append(f"cp attention: {cp.get('skipped') or 'failed (' + cp['error'] + ')'}")
    else:
        lines.append("")
        lines.append(
            f"cp attention at {cp['seq_len']} tokens ({cp['heads']}/{cp['kv_heads']} heads, {cp['dtype']}): "
            f"full causal fwd+bwd {cp['full_fwd_bwd_ms']:.1f} ms"
        )
        for degree in (2, 4):
            entry = cp[f"cp{degree}"]
            errors = " ".join(f"{k}={v:.1e}" for k, v in entry["max_rel_error"].items())
            ranks = ", ".join(f"{ms:.1f}" for ms in entry["rank_fwd_bwd_ms"])
            lines.append(
                f"  cp{degree}: per-rank ms [{ranks}] (max/mean {entry['balance']:.2f}); max abs error {errors}"
            )
    speedup = report.get("fp8_speedup_8b_layers")
    if speedup is not None:
        lines.append(f"\n8B-shaped layers: compiled FP8 / bf16 tokens/s = {speedup:.2f} (the goal: >= 1.3)")
    lines += cp_speed_table(report["cp_speed"])
    moe = report["moe_layer"]
    if "layers" in moe:
        lines += gpu_moe_check.table(moe)
    else:
        lines.append(f"moe layer: {moe.get('skipped') or 'failed (' + moe['error'] + ')'}")
    return "\n".join(lines)


def cp_speed_table(speed: dict) -> list[str]:
    if "error" in speed or "skipped" in speed:
        return [f"cp attention speed: {speed.get('skipped') or 'failed (' + speed['error'] + ')'}"]
    hypothesis = speed["hypothesis"]
    lines = ["", f"cp attention speed ({speed['heads']}/{speed['kv_heads']} heads x {speed['head_dim']}, "
             f"{speed['dtype']}, fwd+bwd): TFLOP/s per rank, and its ratio to full causal attention / cp"]  # fmt: skip
    degrees = speed["degrees"]
    lines.append(
        f"{'seq/backend':16} {'full ms':>9} {'full TF/s':>10} " + " ".join(f"{'cp' + str(d):>13}" for d in degrees)
    )
    for name, run in speed["runs"].items():
        if "error" in run or "skipped" in run:
            lines.append(f"{name:16} {run.get('error') or run['skipped']}")
            continue
        cells = " ".join(
            f"{run[f'cp{d}']['tflops_per_rank']:6.0f} ({run[f'cp{d}']['ratio_to_full']:.2f})" for d in degrees
        )
        lines.append(f"{name:16} {run['full_ms']:9.1f} {run['full_tflops']:10.0f} {cells}")
        lines.append(
            f"{'':16} full: {', '.join(run['full_kernels']['ops'])}; cp: {', '.join(run['cp_kernels']['ops'])}"
        )
    lines.append(f"dispatch at {hypothesis['seq_len']} tokens: {hypothesis['verdict']}")
    for path in ("plain", "masked_cp4_rank1"):
        kernels = hypothesis[path]["kernels"][:2] or hypothesis[path]["ops"]
        lines.append(f"  {path}: {'; '.join(kernels)}")
    return lines


def parts(device: str, smoke: bool, prepared: Path, out: Path, report: dict):
    """(name, run) of each part in the order they run: the MoE layer, the training runs (RUNS'
    order), then the CP kernel's errors and speed."""

    def moe_layer() -> None:
        report["moe_layer"] = gpu_moe_check.run(device, smoke)

    def training(name: str):
        def run() -> None:
            report["estimates"][name] = json.loads((prepared / f"{name}.estimate.json").read_text())
            report["training"][name] = run_training(name, prepared / f"{name}.json", out, smoke)
            print(f"gpu_check: {name}: {report['training'][name]['status']}", flush=True)

        return run

    def cp_attention() -> None:
        report["cp_attention"] = cp_kernel_check(CP_SMOKE_SEQ if smoke else CP_SEQ, device)

    def cp_speed() -> None:
        report["cp_speed"] = cp_speed_check(CP_SPEED_SMOKE_SEQS if smoke else CP_SPEED_SEQS, device)

    yield "moe_layer", moe_layer
    for name in runs_for(smoke):
        yield name, training(name)
    yield "cp_speed", cp_speed
    yield "cp_attention", cp_attention


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "out", help="output directory")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU: exercise every code path")
    parser.add_argument("--prepare", metavar="DIR", help="only write the configs and estimates into DIR")
    parser.add_argument("--prepared", metavar="DIR", help="use configs and estimates written by --prepare")
    parser.add_argument(
        "--budget-s", type=float, default=0, help="start no part after this many seconds (0: no budget)"
    )
    args = parser.parse_args(argv)

    if args.prepare:
        prepare(Path(args.prepare), args.cpu_smoke)
        print(f"gpu_check: configs and estimates written to {args.prepare}")
        return 0

    import torch

    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device (torch " + torch.__version__ + ")", file=sys.stderr)
        return 1
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    prepared = Path(args.prepared) if args.prepared else out / "prepared"
    if not args.prepared:
        try:
            prepare(prepared, args.cpu_smoke)
        except ImportError as err:
            print(
                f"gpu_check: the launcher cannot be imported ({err}); run --prepare DIR where it can", file=sys.stderr
            )
            return 1
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report = {
        "device": f"{device_name}, torch {torch.__version__}",
        "training": {},
        "estimates": {},
        "cp_attention": {"skipped": "not reached"},
        "cp_speed": {"skipped": "not reached"},
        "moe_layer": {"skipped": "not reached"},
    }
    deadline = time.monotonic() + args.budget_s if args.budget_s else math.inf

    def save() -> None:  # after every part: a check stopped at its limit still brings back what ran
        report["fp8_speedup_8b_layers"] = fp8_speedup(report["training"])
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))

    for name, part in parts(device, args.cpu_smoke, prepared, out, report):
        if time.monotonic() > deadline:
            print(f"gpu_check: {name}: skipped, past the {args.budget_s:.0f} s budget", flush=True)
            continue
        began = time.monotonic()
        try:
            part()
        except Exception as err:  # reported with the rest; the exit status says it failed
            report[name] = {"error": f"{type(err).__name__}: {err}"}
        print(f"gpu_check: {name}: done in {time.monotonic() - began:.0f} s", flush=True)
        save()
    print(table(report))
    print(f"\ngpu_check: wrote {out / 'gpu_check.json'}")
    failed = [n for n, r in report["training"].items() if r["status"] == "failed"]
    failed += [part for part in ("cp_attention", "cp_speed", "moe_layer") if "error" in report[part]]
    if "layers" in report["moe_layer"]:
        failed += gpu_moe_check.failures(report["moe_layer"])
    if failed:
        print(f"gpu_check: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
