"""Why FP8 on the CPU runs torchao's emulated matmul: one forward and backward of two Float8Linears.

    .venv/bin/python scripts/bench_fp8_cpu.py [--tokens 1024] [--repeats 3]

Times the same two-layer float8 MLP (256 -> 512 -> 256, tensorwise) with torchao's default
matmul, `torch._scaled_mm`, and with `Float8LinearConfig.emulate` (entrypoints/fp8.py's choice
for device: cpu), next to the plain fp32 MLP, and prints the largest difference of the outputs.
The numbers are written in docs/sagemaker.md ("FP8 on the CPU").
"""

from __future__ import annotations

import argparse
import copy
import time


def _mlp(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))


def _seconds(module, x, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        module(x).sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    x = torch.randn(args.tokens, 256, requires_grad=True)
    plain = _mlp(torch)
    runs = {"fp32": plain}
    for name, emulate in (("fp8_scaled_mm", False), ("fp8_emulated", True)):
        module = copy.deepcopy(plain)
        convert_to_float8_training(module, config=Float8LinearConfig(emulate=emulate))
        runs[name] = module
    outputs = {name: module(x).detach() for name, module in runs.items()}
    for name, module in runs.items():
        print(f"{name:14s} {_seconds(module, x, args.repeats) * 1e3:10.1f} ms per forward + backward")
    difference = (outputs["fp8_scaled_mm"] - outputs["fp8_emulated"]).abs().max().item()
    print(f"largest |scaled_mm - emulated| output difference: {difference:.3g}")
    print(f"torch {torch.__version__}, {args.tokens} tokens, {torch.get_num_threads()} threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
