"""The MoE layer on one GPU: grouped-GEMM experts against a dense SwiGLU of equal active FLOPs, bf16 and FP8.

    python scripts/gpu_moe_check.py [--cpu-smoke]     # also part of scripts/gpu_check.sh

The layer is Qwen3-30B-A3B's (launcher/catalog/models.yaml: hidden 2048, 128 experts, top-8,
each expert 768 wide) on 8,192 tokens, one 8K sequence. The dense layer is a SwiGLU of width
top_k x 768 = 6,144: per token both do the same GEMM FLOPs, 3 x 2 x 2048 x 6144 forward (the
router's 2048 x 128 adds 2% to the MoE layer and is not counted). Each run is a forward and a
backward, timed after a warm-up:

- dense bf16 / dense fp8: entrypoints/model/llama.py's FeedForward, and the same converted by
  entrypoints/fp8.py (torchao Float8Linear, tensorwise), as a dense block trains;
- moe bf16 / moe fp8: entrypoints/model/moe.py's MoE (router, dropless dispatch, experts on
  `F.grouped_mm`, combine), and the same after entrypoints/fp8.py, which converts the router's
  nn.Linear and runs the experts on torchao's FP8 rowwise grouped GEMM, their rows padded to
  16 per expert (entrypoints/model/fp8_experts.py): what an MoE job runs under `precision.fp8`
  with `precision.fp8_experts: true`; moe_fp8_bf16_experts keeps the experts in bf16, as
  `precision.fp8` alone does (and any GPU without the kernel, compute capability 8.9);
- experts grouped_mm / experts fp8 rowwise: the experts' three grouped GEMMs alone on 512 rows per
  expert (the balanced share), in bf16 on `F.grouped_mm` and in FP8 on torchao 0.18's
  `_to_fp8_rowwise_then_scaled_grouped_mm` (torchao/prototype/moe_training/fp8_grouped_mm.py:
  rowwise scales, Triton casts, `torch._scaled_grouped_mm`; row groups must be multiples of 16,
  torchtitan's FP8_GROUP_ALIGNMENT_SIZE in torchtitan/components/quantization/__init__.py);
- fp8 kernel vs emulation: one grouped GEMM on uneven routing (the padded groups of
  fp8_experts.pad_groups), forward and backward, by the entrypoints' FP8 path on torchao's CUDA
  kernels, by torchao's own `_to_fp8_rowwise_then_scaled_grouped_mm` (0 difference expected: the
  same kernels, only the rows' backward copy made in forward), and by the entrypoints' CPU
  emulation (the same casts, products in fp32), each also against the exact fp32 product:
  relative errors of the output, the input's and the weight's gradients. The CPU tests rest on
  the emulation; this is where it meets the kernel.

`--cpu-smoke` runs every path that runs on a CPU (fp32, a tiny layer); the FP8 grouped GEMM is
CUDA-only and is reported as skipped there. Prints a table; `run()` returns the report that
gpu_check.py writes into gpu_check.json under "moe_layer".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GPU_SHAPE = {"hidden": 2048, "experts": 128, "top_k": 8, "expert_width": 768, "tokens": 8192}
SMOKE_SHAPE = {"hidden": 64, "experts": 8, "top_k": 2, "expert_width": 32, "tokens": 256}
FP8_GROUP_ALIGNMENT = 16  # torchtitan/components/quantization/__init__.py
REPEATS = 10


def layer_config(shape: dict, *, moe: bool):
    """A one-layer ModelConfig whose MLP is the MoE, or the dense SwiGLU of equal active width."""
    from launcher.contract.config import ModelConfig, MoeConfig

    experts = MoeConfig(
        num_experts=shape["experts"], top_k=shape["top_k"], expert_ffn_hidden_size=shape["expert_width"]
    )
    return ModelConfig(
        name="moe-layer-check", family="qwen3_moe" if moe else "qwen3", hidden_size=shape["hidden"], num_layers=1,
        num_heads=16, num_kv_heads=4, ffn_hidden_size=shape["top_k"] * shape["expert_width"], vocab_size=1024,
        max_context=shape["tokens"], rope_theta=1e6, rope_scaling=None, tie_embeddings=False, norm_eps=1e-6,
        moe=experts if moe else None,
    )  # fmt: skip


def active_flops(shape: dict) -> float:
    """GEMM FLOPs of one forward + backward (3x the forward), per layer, the router aside."""
    return 3 * 2 * 3 * shape["hidden"] * shape["top_k"] * shape["expert_width"] * shape["tokens"]


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _seconds(fn, device: str, repeats: int) -> float:
    fn()  # warm-up: kernels chosen, Triton compiled, allocator warm
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def _module_run(module, x, grad):
    def run():
        leaf = x.detach().requires_grad_()
        module(leaf).backward(grad)

    return run


def _layer(shape: dict, *, moe: bool, fp8: bool, device: str, dtype, fp8_experts: bool = True):
    import torch

    from entrypoints.model.llama import FeedForward
    from entrypoints.model.moe import MoE

    torch.manual_seed(0)
    cfg = layer_config(shape, moe=moe)
    module = MoE(cfg) if moe else FeedForward(cfg)
    for param in module.parameters():
        torch.nn.init.normal_(param, std=0.02)
    if fp8:
        from entrypoints.fp8 import Fp8Settings, convert_to_float8

        settings = Fp8Settings(
            recipe="tensorwise", float8_all_gather=False, emulate=device != "cuda", experts=fp8_experts
        )
        convert_to_float8(module, settings)
    return module.to(device=device, dtype=dtype)


def _float8_linears(module) -> int:
    """Linears entrypoints/fp8.py converted (its shard-scaled subclass included); 0 without torchao."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return 0
    return sum(isinstance(m, Float8Linear) for m in module.modules())


def layer_runs(shape: dict, device: str, dtype, repeats: int) -> dict:
    """dense/moe x bf16/fp8: ms per forward + backward and active TFLOP/s."""
    import torch

    x = torch.randn(1, shape["tokens"], shape["hidden"], device=device, dtype=dtype)
    grad = torch.randn_like(x)
    flops = active_flops(shape)
    runs = {}
    for name, moe, fp8, experts in (("dense", False, False, False), ("dense_fp8", False, True, False),
                                    ("moe", True, False, False), ("moe_fp8", True, True, True),
                                    ("moe_fp8_bf16_experts", True, True, False)):  # fmt: skip
        try:
            module = _layer(shape, moe=moe, fp8=fp8, device=device, dtype=dtype, fp8_experts=experts)
            seconds = _seconds(_module_run(module, x, grad), device, repeats)
        except Exception as err:  # reported with the rest; the exit status says it failed
            runs[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            continue
        converted = _float8_linears(module)
        runs[name] = {"ms": seconds * 1e3, "active_tflops": flops / seconds / 1e12, "float8_linears": converted}
        if moe:
            counts = module.routing.tokens_per_expert
            runs[name]["max_over_mean_rows"] = (counts.max() / counts.mean()).item()
            runs[name]["fp8_experts"] = module.experts.fp8_emulate is not None
    return runs


def expert_gemm_runs(shape: dict, device: str, dtype, repeats: int) -> dict:
    """The experts' three grouped GEMMs (gate, up, down) alone on balanced rows, bf16 vs FP8 rowwise."""
    import torch
    import torch.nn.functional as F

    from entrypoints.model.moe import grouped_linear

    experts, hidden, width = shape["experts"], shape["hidden"], shape["expert_width"]
    rows = shape["tokens"] * shape["top_k"] // experts
    rows -= rows % FP8_GROUP_ALIGNMENT
    counts = torch.full((experts,), rows, dtype=torch.int64, device=device)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    x = torch.randn(rows * experts, hidden, device=device, dtype=dtype)
    w1, w3 = (0.02 * torch.randn(experts, width, hidden, device=device, dtype=dtype) for _ in range(2))
    w2 = 0.02 * torch.randn(experts, hidden, width, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    flops = 3 * 2 * 3 * hidden * width * rows * experts

    def swiglu(matmul):
        def run():
            leaves = [t.detach().requires_grad_() for t in (x, w1, w3, w2)]
            a, g, u, d = leaves
            matmul(F.silu(matmul(a, g)) * matmul(a, u), d).backward(grad)

        return run

    def unquantized(a, w):  # F.grouped_mm on CUDA in bf16, the exact per-expert loop elsewhere
        return grouped_linear(a, w, counts)

    report = {"rows_per_expert": rows}
    seconds = _seconds(swiglu(unquantized), device, repeats)
    report["grouped_mm"] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
    if device != "cuda":
        report["fp8_rowwise"] = {"skipped": "torchao's FP8 grouped GEMM runs on CUDA only (Triton casts)"}
        return report
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

        def fp8(a, w):  # w [E, N, K] -> B_t [E, K, N], column-major per group, as the kernel asks
            return _to_fp8_rowwise_then_scaled_grouped_mm(
                a, w.transpose(-2, -1), offsets, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
            )

        seconds = _seconds(swiglu(fp8), device, repeats)
        report["fp8_rowwise"] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
        report["fp8_speedup"] = report["grouped_mm"]["ms"] / report["fp8_rowwise"]["ms"]
    except Exception as err:
        report["fp8_rowwise"] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    return report


def _relative(ours, reference) -> float:
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()


def kernel_vs_emulation(shape: dict, device: str) -> dict:
    """torchao's FP8 grouped GEMM against the entrypoints' emulation of it and the exact product."""
    import torch

    from entrypoints.model.fp8_experts import fp8_grouped_linear, pad_groups
    from entrypoints.model.moe import expert_counts, grouped_linear

    # On a CPU only the emulation runs, against the exact product (the smoke test's path).
    kinds = ("kernel", "torchao", "emulated", "exact") if device == "cuda" else ("emulated", "exact")
    torch.manual_seed(0)
    experts, hidden, width = shape["experts"], shape["hidden"], shape["expert_width"]
    copies = shape["tokens"] * shape["top_k"]
    # Uneven routing: a skewed draw, so groups of every size (and some empty) need padding.
    chosen = torch.multinomial(torch.linspace(0.2, 1.8, experts), copies, replacement=True).to(device)
    counts = expert_counts(torch.sort(chosen).values, experts)
    x = torch.randn(copies, hidden, device=device, dtype=torch.bfloat16)
    weight = 0.02 * torch.randn(experts, width, hidden, device=device, dtype=torch.bfloat16)
    grad = torch.randn(copies, width, device=device, dtype=torch.bfloat16)

    def product(kind: str):
        leaf_x = (x.float() if kind == "exact" else x).detach().requires_grad_()
        leaf_w = (weight.float() if kind == "exact" else weight).detach().requires_grad_()
        if kind == "exact":
            out = grouped_linear(leaf_x, leaf_w, counts)  # the per-expert loop in fp32
        elif kind == "torchao":  # torchao's own autograd function, which keeps the bf16 rows
            from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

            groups = pad_groups(leaf_x, counts)
            out = groups.unpad(
                _to_fp8_rowwise_then_scaled_grouped_mm(
                    groups.rows, leaf_w.transpose(-2, -1), groups.offsets, pad_token_groups_for_grouped_mm=False
                )
            )
        else:
            groups = pad_groups(leaf_x, counts)
            out = groups.unpad(fp8_grouped_linear(groups.rows, leaf_w, groups.offsets, emulate=kind == "emulated"))
        out.backward(grad.to(out.dtype))
        return out.detach(), leaf_x.grad, leaf_w.grad

    results = {kind: product(kind) for kind in kinds}
    report = {"rows": copies, "max_over_mean_rows": (counts.max() / counts.float().mean()).item(),
              "empty_groups": int((counts == 0).sum())}  # fmt: skip
    # kernel vs torchao: 0 expected, the same kernels in the same order (entrypoints/model/
    # fp8_experts.py `_Float8GroupedLinears`), the rows' backward copy made in forward.
    for pair in (("kernel", "torchao"), ("kernel", "emulated"), ("kernel", "exact"), ("emulated", "exact")):
        if pair[0] not in results:
            continue
        ours, reference = results[pair[0]], results[pair[1]]
        report[" vs ".join(pair)] = {
            name: _relative(a, b) for name, a, b in zip(("out", "grad_x", "grad_w"), ours, reference, strict=True)
        }
    return report


def run(device: str, smoke: bool) -> dict:
    import torch

    shape = SMOKE_SHAPE if smoke else GPU_SHAPE
    dtype = torch.float32 if smoke else torch.bfloat16
    repeats = 2 if smoke else REPEATS
    report = {
        "shape": shape,
        "dtype": str(dtype).removeprefix("torch."),
        "layers": layer_runs(shape, device, dtype, repeats),
    }
    report["experts_only"] = expert_gemm_runs(shape, device, dtype, repeats)
    try:
        report["fp8_kernel_vs_emulation"] = kernel_vs_emulation(shape, device)
    except Exception as err:  # reported with the rest; the exit status says it failed
        report["fp8_kernel_vs_emulation"] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    layers = report["layers"]
    if "ms" in layers["moe"] and "ms" in layers["dense"]:
        report["moe_over_dense_time"] = layers["moe"]["ms"] / layers["dense"]["ms"]
    return report


def failures(report: dict) -> list[str]:
    """The parts that raised (a skipped part is not a failure), and the entrypoints' FP8 experts
    where they differ at all from torchao's own function: the same kernels on the same values."""
    parts = {f"moe_layer.{name}": entry for name, entry in report["layers"].items()}
    parts["moe_layer.experts_fp8_rowwise"] = report["experts_only"]["fp8_rowwise"]
    parts["moe_layer.fp8_kernel_vs_emulation"] = report["fp8_kernel_vs_emulation"]
    failed = [name for name, entry in parts.items() if "error" in entry]
    against_torchao = report["fp8_kernel_vs_emulation"].get("kernel vs torchao", {})
    failed += [f"moe_layer.fp8 {name} differs from torchao's" for name, error in against_torchao.items() if error != 0]
    return failed


def table(report: dict) -> list[str]:
    shape = report["shape"]
    lines = [
        "",
        f"moe layer: {shape['tokens']} tokens, hidden {shape['hidden']}, {shape['experts']} experts top-{shape['top_k']} "
        f"x {shape['expert_width']} vs dense SwiGLU {shape['top_k'] * shape['expert_width']} ({report['dtype']}), fwd+bwd",
    ]
    for name, entry in report["layers"].items():
        if "error" in entry:
            lines.append(f"  {name:20} failed: {entry['error']}")
            continue
        balance = f"  rows max/mean {entry['max_over_mean_rows']:.2f}" if "max_over_mean_rows" in entry else ""
        lines.append(f"  {name:20} {entry['ms']:8.2f} ms {entry['active_tflops']:7.1f} active TFLOP/s{balance}")
    if "moe_over_dense_time" in report:
        lines.append(f"  moe / dense time: {report['moe_over_dense_time']:.2f}")
    experts = report["experts_only"]
    lines.append(f"  experts' grouped GEMMs alone, {experts['rows_per_expert']} rows per expert:")
    for name in ("grouped_mm", "fp8_rowwise"):
        entry = experts[name]
        if "ms" in entry:
            lines.append(f"    {name:11} {entry['ms']:8.2f} ms {entry['tflops']:7.1f} TFLOP/s")
        else:
            lines.append(f"    {name:11} {entry.get('skipped') or 'failed: ' + entry['error']}")
    if "fp8_speedup" in experts:
        lines.append(f"    fp8 rowwise speed-up over grouped_mm: {experts['fp8_speedup']:.2f}x")
    check = report["fp8_kernel_vs_emulation"]
    if "skipped" in check or "error" in check:
        lines.append(f"  fp8 kernel vs emulation: {check.get('skipped') or 'failed: ' + check['error']}")
    else:
        lines.append(
            f"  fp8 grouped GEMM, {check['rows']} uneven rows (max/mean {check['max_over_mean_rows']:.2f}), relative errors:"
        )
        for pair, errors in check.items():
            if " vs " in pair:
                lines.append(f"    {pair:20} " + "  ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny fp32 layer on the CPU")
    args = parser.parse_args(argv)
    report = run("cpu" if args.cpu_smoke else "cuda", args.cpu_smoke)
    print("\n".join(table(report)))
    print(json.dumps(report, indent=2))
    return 1 if failures(report) else 0


if __name__ == "__main__":
    sys.exit(main())
