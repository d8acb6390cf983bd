"""Measure, on one NVIDIA GPU, the rates the planner's throughput model assumes.

    python scripts/planner_gpu_kernels.py --out docs/planner_gpu.json

What it times (CUDA events, after warm-up):
- bf16 GEMMs at the shapes of Llama 3 8B/70B linears, whole and under tensor parallelism (the
  model's matmul efficiency and its shape term);
- FP8 tensorwise scaled GEMMs (`torch._scaled_mm`), if the GPU has FP8 tensor cores;
- causal SDPA forward + backward with GQA at several sequence lengths (attention efficiency);
- an elementwise add over a large tensor (HBM efficiency);
- the entrypoints' own model (entrypoints/model/llama.py): 4 blocks of Llama 3.1 8B shape with its
  fused loss and AdamW, one GPU, at 8K and 32K tokens, without and with full activation
  checkpointing: end-to-end tokens/s to set beside the model's prediction; then its parts alone
  (the blocks, the fused loss, AdamW) and the zigzag context-parallel attention of one rank.

scripts/planner_calibration.py reads the JSON this writes and puts each measurement beside the
model's number in docs/planner.md. Needs torch with CUDA; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BF16_GEMMS = [
    # (M tokens, K in, N out): Llama 3 8B linears at 8192 tokens, then under TP 8, then short M.
    (8192, 4096, 4096),
    (8192, 4096, 1024),
    (8192, 4096, 14336),
    (8192, 14336, 4096),
    (8192, 4096, 512),
    (8192, 512, 4096),
    (8192, 4096, 128),
    (8192, 4096, 1792),
    (8192, 1792, 4096),
    (2048, 4096, 14336),
    (1024, 4096, 14336),
    (8192, 8192, 28672),
    (8192, 8192, 8192),
]
FP8_GEMMS = [(8192, 4096, 14336), (8192, 14336, 4096), (8192, 8192, 28672), (8192, 4096, 512)]
SDPA_SEQS = [2048, 8192, 32768]


def timed(fn, *, warmup: int = 3, iters: int = 10) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def gemms_bf16(results: dict) -> None:
    import torch

    rows = []
    for m, k, n in BF16_GEMMS:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        seconds = timed(lambda a=a, b=b: a @ b)
        rows.append({"m": m, "k": k, "n": n, "seconds": seconds, "tflops": 2 * m * k * n / seconds / 1e12})
    results["gemm_bf16"] = rows


def gemms_fp8(results: dict) -> None:
    import torch

    if torch.cuda.get_device_capability() < (8, 9):
        results["gemm_fp8"] = "no FP8 tensor cores"
        return
    rows = []
    one = torch.tensor(1.0, device="cuda")
    for m, k, n in FP8_GEMMS:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()  # column-major [k, n]
        seconds = timed(lambda a=a, b=b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        rows.append({"m": m, "k": k, "n": n, "seconds": seconds, "tflops": 2 * m * k * n / seconds / 1e12})
    results["gemm_fp8"] = rows


def attention(results: dict) -> None:
    import torch
    import torch.nn.functional as F

    rows = []
    heads, kv_heads, dim = 32, 8, 128
    for seq in SDPA_SEQS:
        q = torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16)

        def step(q=q, k=k, v=v, grad=grad):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(grad)

        seconds = timed(step)
        # The model's count: causal forward + backward = 6 * s * h FLOPs per token (h = heads * dim).
        flops = 6 * seq * heads * dim * seq
        rows.append({"seq": seq, "seconds": seconds, "tflops": flops / seconds / 1e12})
    results["attention"] = rows


def bandwidth(results: dict) -> None:
    import torch

    n = 1 << 28
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    seconds = timed(lambda: torch.add(a, b, out=c))
    results["elementwise"] = {"bytes": 3 * n * 2, "seconds": seconds, "gbps": 3 * n * 2 / seconds / 1e9}


def llama8b_blocks(num_layers: int):
    """The entrypoints' config of Llama 3.1 8B's shapes with `num_layers` blocks (no RoPE scaling)."""
    from launcher.contract.config import ModelConfig

    return ModelConfig(
        name=f"llama3.1-8b-{num_layers}-layers",
        family="llama",
        hidden_size=4096,
        num_layers=num_layers,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=14336,
        vocab_size=128256,
        max_context=131072,
        rope_theta=500000.0,
    )


def model_steps(results: dict) -> None:
    """The entrypoints' model, 4 blocks of Llama 3.1 8B, one GPU: forward, backward, AdamW."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from entrypoints.model.llama import build_model

    cfg = llama8b_blocks(4)
    rows = []
    for seq, ac in [(8192, "none"), (8192, "full"), (32768, "none")]:
        model = build_model(cfg, seq_len=seq, device="cuda").to(torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        model.init_rope()
        if ac == "full":
            for layer in model.layers.values():
                layer.forward = _checkpointed(layer.forward, checkpoint)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tokens = torch.randint(0, cfg.vocab_size, (1, seq), device="cuda")

        def step(model=model, optimizer=optimizer, tokens=tokens):
            loss = model(tokens, targets=tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        seconds = timed(step, warmup=2, iters=5)
        rows.append(
            {
                "num_layers": cfg.num_layers,
                "seq_len": seq,
                "activation_checkpointing": ac,
                "seconds": seconds,
                "tokens_per_s": seq / seconds,
                "max_memory_allocated": torch.cuda.max_memory_allocated(),
            }
        )
        del model, optimizer
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    results["model_steps"] = rows


def model_parts(results: dict) -> None:
    """Where the model step's time goes: 4 blocks alone, the fused loss alone, AdamW alone."""
    import torch

    from entrypoints.model.llama import TransformerBlock, rope_inv_freq, rope_table
    from entrypoints.model.loss import linear_cross_entropy

    cfg = llama8b_blocks(4)
    rows = []
    for seq in (8192, 32768):
        with torch.device("cuda"):
            blocks = torch.nn.ModuleList(TransformerBlock(i, cfg) for i in range(cfg.num_layers)).to(torch.bfloat16)
        rope = rope_table(torch.arange(seq, device="cuda"), rope_inv_freq(cfg.head_dim, cfg.rope_theta, None))
        rope = rope.to(torch.bfloat16)
        x = torch.randn(1, seq, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def blocks_step(blocks=blocks, x=x, rope=rope):
            h = x
            for block in blocks:
                h = block(h, rope)
            h.backward(torch.ones_like(h))

        rows.append({"part": "4 blocks", "seq_len": seq, "seconds": timed(blocks_step, warmup=2, iters=5)})
        del blocks
    for seq in (8192,):
        h = torch.randn(seq, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, cfg.vocab_size, (seq,), device="cuda")

        def loss_step(h=h, w=w, targets=targets):
            linear_cross_entropy(h, w, targets).backward()

        rows.append({"part": "loss", "seq_len": seq, "seconds": timed(loss_step, warmup=2, iters=5)})
        del h, w
    params = [torch.randn(1 << 26, device="cuda", requires_grad=True) for _ in range(8)]  # 537M fp32
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    seconds = timed(optimizer.step, warmup=2, iters=5)
    rows.append({"part": "adamw fp32", "parameters": sum(p.numel() for p in params), "seconds": seconds})
    results["model_parts"] = rows


def cp_attention(results: dict) -> None:
    """The entrypoints' zigzag context-parallel attention kernel on one rank's chunks."""
    import torch

    from entrypoints.parallel.context import zigzag_attention_masked

    heads, kv_heads, dim, seq = 32, 8, 128, 32768
    rows = []
    for size in (2, 4, 8):
        local = seq // size
        for rank in (0, size - 1):
            q = torch.randn(1, heads, local, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

            def step(q=q, k=k, v=v, rank=rank, size=size):
                zigzag_attention_masked(q, k, v, rank, size, enable_gqa=True).backward(torch.ones_like(q))

            seconds = timed(step)
            flops = 6 * seq * heads * dim * local  # this rank's share of the causal work
            rows.append({"seq": seq, "cp": size, "rank": rank, "seconds": seconds, "tflops": flops / seconds / 1e12})
    results["cp_attention"] = rows


def sustained(results: dict, seconds: float) -> None:
    """The same GEMM for `seconds`: the rate in the first second against the last windows.

    Short benchmarks run at the boost clock; a training job runs for hours at whatever clock the
    power limit allows under dense matmuls.
    """
    import subprocess

    import torch

    m, k, n = 8192, 4096, 14336
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    windows, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds:
        window = timed(lambda: a @ b, warmup=0, iters=200)
        clock = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        windows.append(
            {
                "t": round(time.perf_counter() - started, 2),
                "tflops": 2 * m * k * n / window / 1e12,
                "sm_mhz,watts": clock,
            }
        )
    results["sustained_gemm"] = {"m": m, "k": k, "n": n, "windows": windows}


def _checkpointed(forward, checkpoint):
    def run(x, rope):
        return checkpoint(forward, x, rope, use_reentrant=False)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sustained", type=float, default=0.0, help="also run one GEMM for this many seconds")
    parser.add_argument("--only-sustained", action="store_true", help="skip everything else")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this script measures GPU kernels")
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    sections = [gemms_bf16, gemms_fp8, attention, bandwidth, model_steps, model_parts, cp_attention]
    if args.only_sustained:
        sections = []
    if args.sustained:
        sections.append(lambda results: sustained(results, args.sustained))
    for section in sections:
        started = time.perf_counter()
        try:
            section(results)
        except Exception:
            results[getattr(section, "__name__", "sustained") + "_error"] = traceback.format_exc(limit=3)
        print(f"{getattr(section, '__name__', 'sustained')}: {time.perf_counter() - started:.1f} s", flush=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
