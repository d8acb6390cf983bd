"""Count the HBM traffic torchao's float8 casts add to a compiled block, as inductor counts it.

    python scripts/fp8_cast_bytes.py            # measure and print the fits (about 8 minutes on 2 cores)
    python scripts/fp8_cast_bytes.py --write    # and record them in docs/fp8_cast_bytes.json

One entrypoints Llama block (entrypoints/model/llama.py), compiled as parallel/activation.py
compiles it, runs forward and backward in bf16, then again with its linears converted as
entrypoints/fp8.py converts them (torchao float8, tensorwise and rowwise). Inductor's scheduler gives every
kernel it generates the bytes it reads and writes (`get_read_write_buffers_sizes`: each buffer at
most once per kernel); the GEMMs and attention, extern kernels, are left out. The difference
between the two runs, per token, is what the casts cost: their amax reductions, the casts, the
casts again for the backward's weight gradient (AOTAutograd's partitioner moves them into the
forward graph and saves the float8 copies), the grad outputs' casts and the layouts `_scaled_mm`
needs (torchao/float8/float8_ops.py `preprocess_addmm`).

Counted on the CPU build of inductor: the graphs are the ones a GPU compiles (AOTAutograd's
partition does not depend on the device), the kernels' fusion follows the CPU backend's rules.
The block widths vary (hidden, KV and FFN) so that a least-squares fit of

    bytes per token = input * I + grad_output * G + weight * W

tells the three prices apart, for each recipe, where per token I = 3h + f counts the linears' inputs (the
attention and MLP inputs once each, wo's and w2's), G = 3h + 2kv + 2f their outputs'
gradients, and W = (2h^2 + 2h kv + 3h f) / rows the weights. launcher/plan/throughput.py
prices torch.compile'd torchao FP8 with the result (`torchao_cast_bytes`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch._functorch.config as functorch_config  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402
import torch._inductor.scheduler as inductor_scheduler  # noqa: E402

from entrypoints.fp8 import Fp8Settings, convert_to_float8  # noqa: E402
from entrypoints.model.llama import TransformerBlock, rope_inv_freq, rope_table  # noqa: E402
from entrypoints.parallel.activation import keep_product  # noqa: E402
from launcher.contract.config import ModelConfig  # noqa: E402

OUT = ROOT / "docs" / "fp8_cast_bytes.json"
HEAD_DIM, BATCH, SEQ = 64, 2, 2048
# (hidden, KV heads, FFN): each width moved on its own from the first, then together.
RECIPES = ("tensorwise", "rowwise")  # precision.fp8_recipe
SHAPES = [(256, 1, 768), (512, 1, 768), (256, 2, 768), (256, 1, 1536), (512, 2, 1536), (1024, 2, 3072)]


class KernelBytes:
    """Sums what every generated (non-extern) kernel reads and writes, as inductor schedules it."""

    def __init__(self):
        self.total = 0
        self._codegen = inductor_scheduler.Scheduler.codegen
        counter = self

        def codegen(scheduler):
            for node in scheduler.nodes:
                if not isinstance(node, inductor_scheduler.ExternKernelSchedulerNode):
                    counter.total += node.get_read_write_buffers_sizes()
            return counter._codegen(scheduler)

        inductor_scheduler.Scheduler.codegen = codegen


def block_bytes_per_token(counter: KernelBytes, hidden: int, kv_heads: int, ffn: int, recipe: str | None) -> float:
    """Inductor's bytes for one compiled block's forward and backward, per token: bf16 where
    `recipe` is None, else float8 with that torchao recipe."""
    torch._dynamo.reset()
    counter.total = 0
    torch.manual_seed(0)
    cfg = ModelConfig(
        name="probe", family="llama", hidden_size=hidden, num_layers=1, num_heads=hidden // HEAD_DIM,
        num_kv_heads=kv_heads, ffn_hidden_size=ffn, vocab_size=256, max_context=SEQ, rope_theta=5e5,
    )  # fmt: skip
    block = TransformerBlock(0, cfg).to(torch.bfloat16)
    if recipe is not None:
        convert_to_float8(block, Fp8Settings(recipe=recipe, float8_all_gather=False))
    keep_product(block)
    block.compile()
    rope = rope_table(torch.arange(SEQ), rope_inv_freq(HEAD_DIM, 5e5, None)).to(torch.bfloat16)
    x = torch.randn(BATCH, SEQ, hidden, dtype=torch.bfloat16, requires_grad=True)
    block(x, rope).float().pow(2).sum().backward()
    if counter.total == 0:
        raise SystemExit("fp8_cast_bytes: inductor generated no kernels (a cached graph?); nothing was counted")
    return counter.total / (BATCH * SEQ)


def widths(hidden: int, kv_heads: int, ffn: int) -> tuple[float, float, float]:
    """(I, G, W) per token of one block: linear inputs, output gradients, weights / rows."""
    kv = kv_heads * HEAD_DIM
    rows = BATCH * SEQ
    return 3 * hidden + ffn, 3 * hidden + 2 * kv + 2 * ffn, (2 * hidden**2 + 2 * hidden * kv + 3 * hidden * ffn) / rows


def fit(measured: list[dict]) -> dict[str, float]:
    """Least squares of the extra bytes per token on (I, G, W)."""
    a = torch.tensor([widths(m["hidden"], m["kv_heads"], m["ffn"]) for m in measured], dtype=torch.float64)
    b = torch.tensor([[m["fp8"] - m["bf16"]] for m in measured], dtype=torch.float64)
    solution = torch.linalg.lstsq(a, b).solution.flatten().tolist()
    return dict(zip(("input", "grad_output", "weight"), solution, strict=True))


def measure_recipe(counter: KernelBytes, recipe: str, bf16: dict[tuple, float]) -> dict:
    """One recipe's blocks at every shape against the bf16 ones, and the fit of their difference."""
    measured = []
    for shape in SHAPES:
        fp8 = block_bytes_per_token(counter, *shape, recipe)
        hidden, kv_heads, ffn = shape
        measured.append(dict(hidden=hidden, kv_heads=kv_heads, ffn=ffn, bf16=round(bf16[shape], 1), fp8=round(fp8, 1)))
        print(f"{recipe}: h {hidden}, kv {kv_heads * HEAD_DIM}, f {ffn}: bf16 {bf16[shape]:,.0f}, float8 {fp8:,.0f} bytes/token", flush=True)  # fmt: skip
    prices = fit(measured)
    for m in measured:
        i, g, w = widths(m["hidden"], m["kv_heads"], m["ffn"])
        predicted = prices["input"] * i + prices["grad_output"] * g + prices["weight"] * w
        m["fit_error"] = round(predicted / (m["fp8"] - m["bf16"]) - 1, 4)
    print(f"{recipe} bytes per element: " + ", ".join(f"{k} {v:.2f}" for k, v in prices.items()))
    print(f"{recipe} fit errors: " + ", ".join(f"{m['fit_error']:+.1%}" for m in measured))
    return dict(shapes=measured, bytes_per_element={k: round(v, 2) for k, v in prices.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"record the result in {OUT.relative_to(ROOT)}")
    args = parser.parse_args()
    # Every graph compiled afresh, so the scheduler runs (a cache hit would count nothing).
    inductor_config.fx_graph_cache = False
    inductor_config.fx_graph_remote_cache = False
    functorch_config.enable_autograd_cache = False
    counter = KernelBytes()
    bf16 = {shape: block_bytes_per_token(counter, *shape, None) for shape in SHAPES}
    record = {recipe: measure_recipe(counter, recipe, bf16) for recipe in RECIPES}
    if args.write:
        import torchao

        versions = dict(torch=torch.__version__, torchao=torchao.__version__, date=datetime.date.today().isoformat())
        OUT.write_text(
            json.dumps(dict(**versions, tokens=BATCH * SEQ, head_dim=HEAD_DIM, recipes=record), indent=1) + "\n"
        )
        print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
