"""Write docs/planner.md: the throughput model, its constants, and each calibration point's error.

    python scripts/planner_calibration.py          # regenerate docs/planner.md
    python scripts/planner_calibration.py --check  # exit 1 if docs/planner.md is out of date

Every published measurement below is set beside `launcher.plan.throughput.predict` for the
same model, layout, batch and hardware, with the error (predicted / measured - 1). The GPU
measurements of our own code come from docs/planner_gpu.json (scripts/planner_gpu_kernels.py) and
from scripts/gpu_check.sh. The section that scripts/bench_plan.py writes is kept as it is.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import itertools
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launcher import catalog  # noqa: E402
from launcher.contract.config import OPTIMIZER_STATE_BYTES  # noqa: E402
from launcher.contract.layout import Layout  # noqa: E402
from launcher.estimate import DEFAULT_THRESHOLD, Workload, estimate_memory, format_bytes  # noqa: E402
from launcher.plan import LayoutPlan, SearchOptions, search, throughput  # noqa: E402
from launcher.plan.explain import against_recipe  # noqa: E402
from launcher.plan.modes import mode  # noqa: E402
from launcher.plan.rank import (  # noqa: E402
    Scored,
    candidate_workloads,
    first_that_fit,
    score,
    tp_saved_inputs_choices,
)
from launcher.plan.throughput import CONSTANTS, model_flops_per_token, predict  # noqa: E402
from launcher.plan.userbuffers import USERBUFFERS  # noqa: E402
from launcher.recipe import Recipe  # noqa: E402
from launcher.recipe.hardware import Hardware, hardware_for  # noqa: E402

DOC = ROOT / "docs" / "planner.md"
GPU_JSON = ROOT / "docs" / "planner_gpu.json"
MOE_LAYER_JSON = ROOT / "docs" / "gpu_check_h100.json"  # its "moe_layer": scripts/gpu_moe_check.py on one H100
BENCH_START, BENCH_END = "<!-- bench_plan:start -->", "<!-- bench_plan:end -->"

BENCHMARK = ROOT / "docs" / "published_benchmark.yaml"
OWN = "this repo on one H200"
OWN_URL = "docs/planner_gpu.json, scripts/gpu_check.sh"

# GPT-3 and Nemotron-4 use a two-matrix MLP (GeLU, squared ReLU) of width F; the model's SwiGLU of
# width 2F/3 has the same parameters and FLOPs. Architectures from NeMo's model configs.
GPT3 = {"num_kv_heads": None, "vocab_size": 51200, "max_context": 2048}
ARCH = {
    "gpt3-5b": ("llama2-7b", {**GPT3, "hidden_size": 4096, "num_layers": 24, "num_heads": 32, "ffn_hidden_size": 10923}),
    "gpt3-20b": ("llama2-7b", {**GPT3, "hidden_size": 6144, "num_layers": 44, "num_heads": 48, "ffn_hidden_size": 16384}),
    "gpt3-175b": ("llama2-7b", {**GPT3, "hidden_size": 12288, "num_layers": 96, "num_heads": 96, "ffn_hidden_size": 32768}),
    "nemotron-8b": ("llama2-7b", {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 32,
                                  "ffn_hidden_size": 10923, "vocab_size": 256000}),
    "nemotron-22b": ("llama2-7b", {"hidden_size": 6144, "num_layers": 40, "num_heads": 48, "num_kv_heads": 48,
                                   "ffn_hidden_size": 16384, "vocab_size": 256000}),
    "nemotron-340b": ("llama2-7b", {"hidden_size": 18432, "num_layers": 96, "num_heads": 96, "num_kv_heads": 8,
                                    "ffn_hidden_size": 49152, "vocab_size": 256000}),
}  # fmt: skip


@dataclass(frozen=True)
class Point:
    source: str  # a source's title: the table it is listed in
    model: str
    gpus: int
    layout: Layout
    seq_len: int
    global_batch: int
    micro_batch: int
    ac: str
    measured: float  # tokens/s/GPU (or model TFLOP/s/GPU with tflops=True)
    fp8: bool = False
    fp8_recipe: str = "tensorwise"  # torchao's scaling: rowwise for the published fp8-rowwise rows
    compile: bool = False
    schedule: str = "1f1b"
    accelerator: str = "h100-80gb"
    gpus_per_node: int = 8
    network_gbps: float = 3200  # 400 Gb/s per GPU: p5, DGX H100 and torchtitan's hosts alike
    tflops: bool = False  # measured is model TFLOP/s/GPU (published 12·L·h·s convention)
    attention_kernel: str = "cudnn"  # the attention kernel the run used (Constants.attention_kernel_factor)
    cp_kernel: str = "-"  # the source's own CP kernel, as it names it (shown, not priced: cp_ring prices TE's ring)
    tp_overlap: str = "none"  # TP collectives overlapped with GEMMs: async (torch) or userbuffers (TE) (Workload)
    userbuffers: str = "te_defaults"  # under userbuffers, the TE config the row's run named (Workload.userbuffers)
    p2p_overlap: bool = False  # Megatron's overlap_p2p_comm under the interleaved schedule (Workload)
    # Megatron's distributed optimizer (ZeRO-1, grads reduce-scattered and params all-gathered
    # once per step, overlapped): priced with FSDP's sync_last_gathered traffic (workload_of).
    distributed_optimizer: bool = False
    cp_ring: bool = False  # CP as Transformer Engine's p2p ring, transfers beside attention (Workload)
    ep_dispatch_per_node: bool = False  # MoE tokens cross nodes once per node, as Hybrid-EP sends them (Workload)
    moe_a2a_overlap: bool = False  # Megatron's overlap_moe_expert_parallel_comm: all-to-alls beside compute (Workload)
    moe_permute_fusion: bool = False  # Megatron's moe_permute_fusion: TE's fused permute kernels (Workload)
    mlp_activation: str = "swiglu"  # squared_relu_unfused: Megatron's eager squared ReLU (Workload)
    recompute_core_attention: bool = False  # Megatron's recompute_granularity selective (Workload)
    # Gradients reduced (and, under FSDP, accumulated unsharded) in bf16: Megatron's
    # grad_reduce_in_fp32 False, our parallel.reduce_dtype bf16 (Workload.reduce_dtype).
    grad_reduce_bf16: bool = False
    # Sequence parallel keeps the shard of its gathered inputs and gathers them again in backward,
    # async beside the input-gradient GEMM, as Megatron-Core and Transformer Engine do:
    # parallel.tp_saved_inputs shard with regather_overlap (Workload).
    tp_saves_shard: bool = False
    # FP8 weights cast once per step and reused by its micro-batches (Workload.fp8_weights_cached).
    fp8_weights_cached: bool = False
    # Whose float8 casts ran: torchao's, or Transformer Engine's with delayed or current scaling
    # (Workload.fp8_casts).
    fp8_casts: str = "torchao"
    # The experts' grouped GEMMs in FP8 too (precision.fp8_experts, Workload.fp8_experts).
    fp8_experts: bool = False
    # Round-robin routing, every expert the same rows (training.moe_force_load_balance, Workload):
    # Megatron-Core's moe_router_force_load_balancing in the benchmark configs that set it.
    moe_force_load_balance: bool = False
    optimizer_state_dtype: str = "fp32"  # AdamW's moments: training.optimizer.state_dtype (Workload)
    # Megatron-Core's recompute_method block: this many layers of each virtual stage recomputed
    # in full (Workload.recompute_layers, planner-only), where the source's configs set it.
    recompute_layers: int = 0
    # The whole micro-batch's logits computed and kept for the loss (Workload.logits_materialized).
    logits_materialized: bool = False
    use: str = "check"  # "fit": a constant was set from it; "check": ours, independent; "benchmark": published
    note: str = ""
    arch_changes: dict = field(default_factory=dict)

    def priced_as(self) -> tuple:
        """What the model can tell apart: rows that differ only in what it does not price (the
        container version, the FP8 recipe beyond tensorwise/rowwise) count as one layout of a sweep."""
        return (self.model, self.gpus, self.layout, self.seq_len, self.global_batch, self.micro_batch, self.ac,
                self.fp8, self.fp8_recipe, self.compile, self.schedule, self.accelerator, self.tp_overlap, self.userbuffers,
                self.p2p_overlap, self.ep_dispatch_per_node, self.moe_a2a_overlap, self.moe_permute_fusion, self.mlp_activation,
                self.recompute_core_attention,
                self.grad_reduce_bf16, self.tp_saves_shard, self.fp8_weights_cached, self.fp8_casts,
                self.fp8_experts, self.moe_force_load_balance, self.optimizer_state_dtype,
                self.recompute_layers, self.logits_materialized)  # fmt: skip

    @property
    def held_apart(self) -> bool:
        """A published measurement no constant was fitted to (docs/published_benchmark.yaml)."""
        return self.use == "benchmark"


# fmt: off
POINTS = [
    # The calibration points: our own code on one H200, which the model's constants were set from.
    Point(OWN, "llama3.2-1b", 1, Layout(), 8192, 4, 1, "none", 41437, accelerator="h200-141gb", gpus_per_node=1, network_gbps=0,
          note="entrypoints/train.py, scripts/gpu_check.sh, bf16 eager"),
    Point(OWN, "llama3.2-1b", 1, Layout(), 8192, 4, 1, "none", 22520, fp8=True, accelerator="h200-141gb", gpus_per_node=1,
          network_gbps=0, use="fit", note="FP8 tensorwise, eager: fp8_eager_cast_factor"),
]
# fmt: on


def own_model_points() -> list[Point]:
    """The entrypoints' model, 4 blocks of Llama 3.1 8B on one H200 (docs/planner_gpu.json)."""
    if not GPU_JSON.exists():
        return []
    rows = json.loads(GPU_JSON.read_text()).get("model_steps", [])
    return [
        Point(OWN, "llama3.1-8b", 1, Layout(), r["seq_len"], 1, 1, r["activation_checkpointing"], r["tokens_per_s"],
              accelerator="h200-141gb", gpus_per_node=1, network_gbps=0, arch_changes={"num_layers": r["num_layers"]},
              use="fit", note="4 blocks + loss + AdamW, bf16 eager: elementwise and loss bytes")
        for r in rows
    ]  # fmt: skip


ROW_REQUIRED = (
    "source",
    "table",
    "model",
    "gpus",
    "dp",
    "seq",
    "gbs",
    "mbs",
    "ac",
    "precision",
    "compile",
    "measured",
    "unit",
)
ROW_OPTIONAL = ("tp", "pp", "cp", "vp", "ep", "schedule", "async_tp", "tp_comm_overlap", "overlap_p2p_comm",
                "distributed_optimizer", "cp_ring", "grad_reduce_bf16", "fp8_weight_cache", "fp8_experts",
                "moe_force_load_balance", "ep_dispatch_per_node", "moe_a2a_overlap", "mlp_activation",
                "recompute_core_attention",
                "optimizer_state_dtype", "recompute_layers", "userbuffers", "note", "assumed", "fitted")  # fmt: skip
# A source's defaults for its rows (a row's own value wins): what its configs set, cited in the
# source under the evidence key beside each.
SOURCE_DEFAULTS = {
    "tp_comm_overlap": "overlap_evidence",
    "overlap_p2p_comm": "overlap_evidence",
    "distributed_optimizer": "optimizer_evidence",
    "cp_ring": "cp_evidence",
    "grad_reduce_bf16": "grad_reduce_evidence",
    "tp_saves_shard": "shard_evidence",
    "fp8_weight_cache": "fp8_cache_evidence",
    "fp8_experts": "fp8_experts_evidence",
    "moe_force_load_balance": "balance_evidence",
    "moe_permute_fusion": "permute_evidence",
    "logits_materialized": "loss_evidence",
}
PRECISIONS = ("bf16", "fp8", "fp8-cs", "fp8-rowwise")
MLP_ACTIVATIONS = ("swiglu", "squared_relu_unfused")  # Workload.mlp_activation
UNITS = {"tokens/s/GPU": False, "model TFLOP/s/GPU": True}


class BenchmarkError(ValueError):
    """docs/published_benchmark.yaml holds a row the model cannot price as written."""


def load_benchmark(path: Path = BENCHMARK) -> tuple[dict[str, dict], list[Point]]:
    """The published benchmark: {source key: its record} and one Point per row. Every row is
    checked by content (fields, layout product, batch split, known model) before it is priced."""
    import yaml  # noqa: PLC0415  (only this script reads YAML)

    data = yaml.safe_load(path.read_text())
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("sources"), dict)
        or not isinstance(data.get("points"), list)
    ):
        raise BenchmarkError(f"{path.name}: expected a mapping with 'sources' and a 'points' list")
    sources = data["sources"]
    for key, record in sources.items():
        if (
            not isinstance(record, dict)
            or not record.get("title")
            or not (record.get("url") or all(record.get(k) for k in ("repo", "path", "commit")))
        ):
            raise BenchmarkError(f"{path.name}: source {key!r} needs a title and a url, or repo, path and commit")
        for setting, evidence in SOURCE_DEFAULTS.items():
            if setting in record and (not isinstance(record[setting], bool) or not record.get(evidence)):
                raise BenchmarkError(
                    f"{path.name}: source {key!r} sets {setting}: it must be true or false, and {evidence} "
                    "must say where the source's configs set it"
                )
        casts = record.get("fp8_casts", "torchao")
        if casts not in ("torchao", "transformer_engine") or (
            casts != "torchao" and not record.get("fp8_casts_evidence")
        ):
            raise BenchmarkError(
                f"{path.name}: source {key!r} fp8_casts {casts!r}: torchao (the default) or transformer_engine, "
                "with fp8_casts_evidence saying where the source ran it"
            )
        kernel = record.get("attention_kernel", "cudnn")
        if kernel not in CONSTANTS.attention_kernel_factor:
            raise BenchmarkError(
                f"{path.name}: source {key!r} attention_kernel {kernel!r} is not one of "
                f"{', '.join(CONSTANTS.attention_kernel_factor)}"
            )
    return sources, [_benchmark_point(i, row, sources, path.name) for i, row in enumerate(data["points"], 1)]


def _benchmark_point(i: int, row, sources: dict, where: str) -> Point:
    at = f"{where} point {i}"
    layout = _checked_row(row, sources, at)
    recompute_layers = row.get("recompute_layers", 0)
    source = sources[row["source"]]
    return Point(
        source["title"],
        row["model"],
        row["gpus"],
        layout,
        row["seq"],
        row["gbs"],
        row["mbs"],
        row["ac"],
        float(row["measured"]),
        fp8=row["precision"] != "bf16",
        fp8_recipe="rowwise" if row["precision"] == "fp8-rowwise" else "tensorwise",
        compile=bool(row["compile"]),
        schedule=row.get("schedule", "1f1b"),
        accelerator=source["accelerator"],
        tflops=UNITS[row["unit"]],
        attention_kernel=source.get("attention_kernel", "cudnn"),
        cp_kernel=source.get("cp_kernel", "-"),
        tp_overlap=_tp_overlap(row, source, layout),
        userbuffers=row.get("userbuffers", "te_defaults"),
        p2p_overlap=layout.virtual_stages > 1 and _setting(row, source, "overlap_p2p_comm"),
        distributed_optimizer=_setting(row, source, "distributed_optimizer"),
        cp_ring=layout.context > 1 and _setting(row, source, "cp_ring"),
        ep_dispatch_per_node=layout.expert > 1 and bool(row.get("ep_dispatch_per_node")),
        moe_a2a_overlap=layout.expert > 1 and bool(row.get("moe_a2a_overlap")),
        mlp_activation=row.get("mlp_activation", "swiglu"),
        recompute_core_attention=bool(row.get("recompute_core_attention")),
        grad_reduce_bf16=_setting(row, source, "grad_reduce_bf16"),
        tp_saves_shard=layout.tensor > 1 and _setting(row, source, "tp_saves_shard"),
        fp8_weights_cached=row["precision"] != "bf16" and _setting(row, source, "fp8_weight_cache"),
        fp8_casts=_fp8_casts(row, source),
        fp8_experts=row["precision"] != "bf16" and _setting(row, source, "fp8_experts"),
        moe_force_load_balance=_setting(row, source, "moe_force_load_balance"),
        moe_permute_fusion=_setting(row, source, "moe_permute_fusion"),
        optimizer_state_dtype=row.get("optimizer_state_dtype", "fp32"),
        recompute_layers=recompute_layers,
        logits_materialized=_setting(row, source, "logits_materialized"),
        use="fit" if row.get("fitted") else "benchmark",
        note=_benchmark_note(row, source),
    )


def _checked_row(row, sources: dict, at: str) -> Layout:
    """The row's layout, once its fields, model, degrees and flags are checked by content
    (BenchmarkError, one line, where any is not)."""
    if not isinstance(row, dict):
        raise BenchmarkError(f"{at}: expected a mapping, got {row!r}")
    missing = [k for k in ROW_REQUIRED if k not in row]
    unknown = sorted(set(row) - set(ROW_REQUIRED) - set(ROW_OPTIONAL))
    if missing or unknown:
        raise BenchmarkError(
            f"{at}: missing {missing}, unknown {unknown}; fields are {', '.join(ROW_REQUIRED + ROW_OPTIONAL)}"
        )
    if row["source"] not in sources:
        raise BenchmarkError(f"{at}: source {row['source']!r} is not one of {', '.join(sources)}")
    if row["precision"] not in PRECISIONS or row["unit"] not in UNITS:
        raise BenchmarkError(f"{at}: precision must be one of {PRECISIONS} and unit one of {tuple(UNITS)}")
    if row["model"] not in ARCH and row["model"] not in catalog.models():
        raise BenchmarkError(f"{at}: model {row['model']!r} is neither in the catalog nor in ARCH")
    degrees = {k: row.get(k, 1) for k in ("tp", "pp", "cp", "vp", "dp", "ep")}
    if not all(
        isinstance(v, int) and v >= 1 for v in (*degrees.values(), row["gpus"], row["seq"], row["gbs"], row["mbs"])
    ):
        raise BenchmarkError(f"{at}: gpus, seq, gbs, mbs and the degrees must be positive integers")
    recompute_layers = row.get("recompute_layers", 0)
    if not isinstance(recompute_layers, int) or isinstance(recompute_layers, bool) or recompute_layers < 0:
        raise BenchmarkError(f"{at}: recompute_layers must be a whole number of layers, 0 or more")
    if recompute_layers and row["ac"] != "none":
        raise BenchmarkError(f"{at}: recompute_layers prices Megatron's block recomputation on its own: set ac none")
    layout = Layout(tensor=degrees["tp"], pipeline=degrees["pp"], context=degrees["cp"],
                    virtual_stages=degrees["vp"], data_shard=degrees["dp"], expert=degrees["ep"])  # fmt: skip
    if layout.world_size != row["gpus"] or row["gbs"] % (row["mbs"] * degrees["dp"]):
        raise BenchmarkError(
            f"{at}: tp x pp x cp x dp = {layout.world_size} must equal gpus {row['gpus']}, and gbs {row['gbs']} "
            f"must be a multiple of mbs x dp = {row['mbs'] * degrees['dp']}"
        )
    if layout.moe_ranks % degrees["ep"]:
        raise BenchmarkError(
            f"{at}: ep {degrees['ep']} must divide dp x cp x tp = {layout.moe_ranks}: expert parallelism "
            "borrows ranks of dp_shard x cp x tp (launcher/contract/layout.py)"
        )
    if row.get("optimizer_state_dtype", "fp32") not in OPTIMIZER_STATE_BYTES:
        raise BenchmarkError(f"{at}: optimizer_state_dtype must be one of {', '.join(OPTIMIZER_STATE_BYTES)}")
    if row.get("mlp_activation", "swiglu") not in MLP_ACTIVATIONS:
        raise BenchmarkError(f"{at}: mlp_activation must be one of {', '.join(MLP_ACTIVATIONS)}")
    _check_userbuffers(row, sources[row["source"]], at)
    flags = {
        k: row[k]
        for k in ("async_tp", "ep_dispatch_per_node", "moe_a2a_overlap", "recompute_core_attention", *SOURCE_DEFAULTS)
        if k in row
    }
    if not all(isinstance(v, bool) for v in flags.values()):
        raise BenchmarkError(f"{at}: {', '.join(flags)} must be true or false")
    return layout


def _check_userbuffers(row: dict, source: dict, at: str) -> None:
    """A row's `userbuffers` names a known TE config, under tp_comm_overlap, with the source's
    userbuffers_evidence saying which config files its runs named."""
    name = row.get("userbuffers")
    if name is None:
        return
    if name not in USERBUFFERS:
        raise BenchmarkError(f"{at}: userbuffers {name!r} is not one of {', '.join(USERBUFFERS)}")
    if not _setting(row, source, "tp_comm_overlap") or not source.get("userbuffers_evidence"):
        raise BenchmarkError(
            f"{at}: userbuffers {name!r} needs tp_comm_overlap and the source's userbuffers_evidence citing the config"
        )


def _fp8_casts(row: dict, source: dict) -> str:
    """Workload.fp8_casts of a row: torchao's, or Transformer Engine's where the source ran it
    (its `fp8_casts`), with current scaling where the row says fp8-cs."""
    if source.get("fp8_casts") != "transformer_engine":
        return "torchao"
    return "te_current" if row["precision"] == "fp8-cs" else "te_delayed"


def _tp_overlap(row: dict, source: dict, layout: Layout) -> str:
    """torchtitan's async TP, Megatron's userbuffers (tp_comm_overlap), or none; only under TP."""
    if layout.tensor == 1:
        return "none"
    if row.get("async_tp"):
        return "async"
    return "userbuffers" if _setting(row, source, "tp_comm_overlap") else "none"


def _setting(row: dict, source: dict, key: str) -> bool:
    """A row's own `key`, else its source's default (SOURCE_DEFAULTS)."""
    return bool(row.get(key, source.get(key, False)))


def _benchmark_note(row: dict, source: dict) -> str:
    parts = [row["table"], row.get("note", "")]
    if row.get("tp", 1) > 1 and _setting(row, source, "tp_comm_overlap"):
        parts.append(f"TE TP overlap (tp_overlap; userbuffers {row.get('userbuffers', 'te_defaults')})")
    if row.get("vp", 1) > 1 and _setting(row, source, "overlap_p2p_comm"):
        parts.append("p2p overlap")
    if row.get("dp", 1) > 1 and row.get("pp", 1) == 1 and _setting(row, source, "distributed_optimizer"):
        parts.append("distributed optimizer (priced as sync_last_gathered)")
    if row.get("cp", 1) > 1 and _setting(row, source, "cp_ring"):
        parts.append("TE p2p ring CP (cp_ring)")
    if _setting(row, source, "grad_reduce_bf16"):
        parts.append("bf16 gradient reduce (reduce_dtype bf16)")
    if row.get("tp", 1) > 1 and _setting(row, source, "tp_saves_shard"):
        parts.append("SP saves the shard (tp_saved_inputs shard)")
    if row["precision"] != "bf16" and _setting(row, source, "fp8_weight_cache"):
        parts.append("FP8 weights cached per step (fp8_weights_cached)")
    if row["precision"] != "bf16" and _fp8_casts(row, source) != "torchao":
        parts.append(f"TE's fused float8 casts (fp8_casts {_fp8_casts(row, source)})")
    if row["precision"] != "bf16" and _setting(row, source, "fp8_experts"):
        parts.append("FP8 experts (precision.fp8_experts)")
    if _setting(row, source, "moe_force_load_balance"):
        parts.append("force-balanced routing (training.moe_force_load_balance)")
    if _setting(row, source, "moe_permute_fusion"):
        parts.append("TE's fused permutes (moe_permute_fusion)")
    if row.get("ep", 1) > 1 and row.get("ep_dispatch_per_node"):
        parts.append("Hybrid-EP dispatch, once per node (ep_dispatch_per_node)")
    if row.get("ep", 1) > 1 and row.get("moe_a2a_overlap"):
        parts.append("all-to-alls beside another micro-batch's compute (moe_a2a_overlap)")
    if row.get("mlp_activation") == "squared_relu_unfused":
        parts.append("unfused squared ReLU (mlp_activation)")
    if row.get("recompute_core_attention"):
        parts.append("core attention recomputed (recompute_core_attention)")
    if row.get("optimizer_state_dtype") == "bf16":
        parts.append("bf16 optimizer states (training.optimizer.state_dtype bf16)")
    if _setting(row, source, "logits_materialized"):
        parts.append("loss on kept logits (logits_materialized)")
    if row.get("recompute_layers"):
        parts.append(f"{row['recompute_layers']} layers per stage recomputed in full (recompute_layers)")
    if row["precision"] == "fp8-cs":  # Transformer Engine's current scaling: per tensor, as torchao's tensorwise
        parts.append("fp8-cs GEMMs priced as tensorwise")
    if row["precision"] == "fp8-rowwise":
        parts.append("priced as rowwise (fp8_rowwise_factor, not fitted to these rows)")
    if row.get("async_tp"):
        parts.append("async TP (tp_overlap)")
    if row.get("assumed"):
        parts.append("assumed: " + ", ".join(row["assumed"]))
    if row.get("fitted"):
        parts.append(f"fitted: {row['fitted']}")
    return "; ".join(p for p in parts if p)


def source_urls() -> dict[str, str]:
    """{source title: where its numbers were read}: repo, path and commit, or the page."""
    sources, _ = load_benchmark()
    urls = {OWN: OWN_URL}
    for record in sources.values():
        where = record.get("url") or f"https://github.com/{record['repo']}/blob/{record['commit']}/{record['path']}"
        extra = "; ".join(f"{k}: {record[k]}" for k in ("ran_with", "hardware", "context_url") if record.get(k))
        urls[record["title"]] = where + (f" ({extra})" if extra else "")
    return urls


# The published sweeps ran their own context-parallel kernels (torchtitan's ring attention over
# SDPA, Transformer Engine's P2P ring in NeMo/Megatron), not ours. They are priced at the masked
# two-SDPA kernel's 0.58 of plain attention (the zigzag_sdpa factor, measured on an H200). Our
# LSE-merged allgather kernel measured 0.88-0.95 on an H100 at 32K (its cp_attention_factor), but
# priced at that the published CP rows at 32K and beyond come out 24-64% too fast (NeMo's Llama 2
# 7B at 32K-1M, torchtitan's 8B and 405B at 64K-256K), torchtitan's 8B at 64K excepted (+3%), and
# the Llama 3 paper's 405B at 128K 12%; at 8K they spread from -15% to +13%. Long sequences over
# CP ran at about 0.58 of what the model takes for plain attention: why is not taken apart.
PUBLISHED_CP = dataclasses.replace(
    CONSTANTS,
    cp_attention_factor={**CONSTANTS.cp_attention_factor, "allgather": CONSTANTS.cp_attention_factor["zigzag_sdpa"]},
)


def workload_of(point: Point) -> Workload:
    """The point's run as the model prices it: its model, layout, batch, precision and schedule."""
    arch = model_arch(point.model)
    if point.arch_changes:
        arch = arch.model_copy(update=point.arch_changes)
    layout = point.layout
    assert layout.world_size == point.gpus, (point, layout.world_size)
    return Workload(
        arch=arch,
        layout=layout,
        seq_len=point.seq_len,
        micro_batch_size=point.micro_batch,
        grad_accum_steps=point.global_batch // (point.micro_batch * layout.data_parallel),
        fp8=point.fp8,
        fp8_recipe=point.fp8_recipe,
        activation_checkpointing=point.ac,
        pipeline_schedule=point.schedule,
        # torch.distributed.pipelining (torchtitan) and Megatron's distributed optimizer reduce
        # the gradients once per step under PP (the estimate asks auto: what our program picks).
        grad_accumulation="sync_last_gathered" if layout.pipeline > 1 else "sync_each",
        compile=point.compile,
        cp_attention="allgather",  # K/V of the whole sequence per layer, as a ring moves them (cp_ring: overlapped)
        tp_overlap=point.tp_overlap,
        userbuffers=point.userbuffers,
        p2p_overlap=point.p2p_overlap,
        cp_ring=point.cp_ring,
        ep_dispatch_per_node=point.ep_dispatch_per_node,
        moe_a2a_overlap=point.moe_a2a_overlap,
        moe_permute_fusion=point.moe_permute_fusion,
        mlp_activation=point.mlp_activation,
        recompute_core_attention=point.recompute_core_attention,
        reduce_dtype="bf16" if point.grad_reduce_bf16 else "fp32",
        tp_saved_inputs="shard" if point.tp_saves_shard else "gathered",
        regather_overlap=point.tp_saves_shard,  # both regather async beside the dgrad GEMM (Workload)
        fp8_weights_cached=point.fp8_weights_cached,
        fp8_casts=point.fp8_casts,
        fp8_experts=point.fp8_experts,
        moe_force_load_balance=point.moe_force_load_balance,
        optimizer_state_dtype=point.optimizer_state_dtype,
        recompute_layers=point.recompute_layers,
        logits_materialized=point.logits_materialized,
    )


def run(point: Point, machine: Hardware | None = None) -> tuple[float, float, object, object]:
    """(measured and predicted tokens/s/GPU, the Throughput, our program's MemoryEstimate) of a
    point, on its catalog hardware unless `machine` is given."""
    machine = machine or hardware(point)
    workload = workload_of(point)
    speed = priced_speed(point, machine)
    return measured_tokens(point), speed.tokens_per_s_per_gpu, speed, our_memory(workload, machine)


def measured_tokens(point: Point) -> float:
    """The point's measurement in tokens/s/GPU (published model TFLOP/s converted)."""
    if point.tflops:
        arch = workload_of(point).arch
        return point.measured * 1e12 / model_flops_per_token(arch, point.seq_len, causal=False)
    return point.measured


def priced_speed(point: Point, machine: Hardware, cp_rate: float | None = None):
    """The model's Throughput of the point's run on `machine`; `cp_rate` replaces the fraction of
    plain attention its CP kernel runs at (PUBLISHED_CP's)."""
    workload = workload_of(point)
    constants = PUBLISHED_CP
    if cp_rate is not None:
        constants = dataclasses.replace(
            constants, cp_attention_factor={**constants.cp_attention_factor, "allgather": cp_rate}
        )
    if point.attention_kernel != constants.attention_kernel:
        constants = dataclasses.replace(constants, attention_kernel=point.attention_kernel)
    # Megatron's distributed optimizer moves what FSDP's sync_last_gathered moves: the gradients
    # reduce-scattered once per step, overlapped with the last micro-batch's backward
    # (overlap_grad_sync / overlap_grad_reduce), and the parameters all-gathered once, overlapped
    # with the next step's first forward (overlap_param_sync / overlap_param_gather). The memory
    # verdict is our program's (our_memory).
    priced = (
        dataclasses.replace(workload, grad_accumulation="sync_last_gathered")
        if point.distributed_optimizer
        else workload
    )
    return predict(priced, machine, constants=constants)


VERDICT_ORDER = ("fits", "risky", "oom")


def our_memory(workload, hw: Hardware):
    """Our program's memory estimate on the point's layout, as the planner judges a layout: the
    accumulation mode `auto` picks (the fastest whose estimate fits; sync_each, the least memory,
    where none does), and the point's own `parallel.tp_saved_inputs` unless another choice the
    planner tries (launcher.plan.rank.tp_saved_inputs_choices) has a better verdict (or, where
    none fits, less memory). The point's own settings price its speed; this is what our program
    would run it with."""
    base = dataclasses.replace(workload, grad_accumulation="auto")
    own = workload.tp_saved_inputs
    tries = dict.fromkeys((own, *tp_saved_inputs_choices(workload.layout, workload.activation_checkpointing)))
    estimates = [(saved, estimate_memory(dataclasses.replace(base, tp_saved_inputs=saved), hw)) for saved in tries]

    def rank(entry) -> tuple:
        saved, estimate = entry
        oom = estimate.verdict == "oom"
        return VERDICT_ORDER.index(estimate.verdict), estimate.per_gpu_peak_bytes if oom else 0, saved != own

    return min(estimates, key=rank)[1]


def model_arch(name: str):
    """The catalog's model, or one of ARCH's published architectures built on a catalog entry."""
    if name not in ARCH:
        return catalog.models()[name]
    base, changes = ARCH[name]
    changes = {**changes, "num_kv_heads": changes.get("num_kv_heads") or changes["num_heads"]}
    return catalog.models()[base].model_copy(update=changes)


def hardware(point: Point) -> Hardware:
    """The point's GPU model, node size and network bandwidth on a p5's record (the price is unused)."""
    p5 = hardware_for("ml.p5.48xlarge")
    return dataclasses.replace(
        p5,
        accelerator_key=point.accelerator,
        accelerator=catalog.accelerators()[point.accelerator],
        procs_per_node=point.gpus_per_node,
        instance=p5.instance.model_copy(update={"efa_gbps": point.network_gbps}),
    )


def layout_text(layout: Layout) -> str:
    parts = [
        f"{n[:2].upper() if n != 'data_shard' else 'FSDP'} {getattr(layout, n)}"
        for n in ("tensor", "context", "pipeline", "data_shard", "expert")
    ]
    text = " ".join(p for p in parts if not p.endswith(" 1")) or "1 GPU"
    return text.replace("TE", "TP").replace("CO", "CP").replace("PI", "PP").replace("EX", "EP") + (
        f" v{layout.virtual_stages}" if layout.virtual_stages > 1 else ""
    )


@dataclass(frozen=True)
class Result:
    """One point run through the model."""

    point: Point
    measured: float  # tokens/s/GPU
    predicted: float  # tokens/s/GPU
    speed: object  # the model's Throughput
    memory: object  # the estimator's MemoryEstimate of our program running the point's layout

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per token as published sweeps count them (attention with a full mask)."""
        return model_flops_per_token(model_arch(self.point.model), self.point.seq_len, causal=False)


def results() -> list[Result]:
    """The calibration points (ours) and then the published benchmark, each run through the model."""
    _, published = load_benchmark()
    return [Result(p, *run(p)) for p in POINTS + own_model_points() + published]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's over the ranks (ties share their mean rank)."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


CEILING_MAX_GROUPS = 7
"""Above this many distinct configurations the ceiling is not searched (47,293 orderings at 7)."""


def spearman_ceiling(measured: list[float], configurations: list[tuple]) -> float | None:
    """The highest Spearman any model that reads only the configuration can reach on these points.

    Such a model gives rows of one configuration (the container version, which no model prices,
    is not part of it: `Point.priced_as`) one prediction, so repeated runs that measured
    differently tie in its ranking. The best it can do is the best weak ordering of the distinct
    configurations, searched whole. 1.0 where every configuration appears once; None past
    CEILING_MAX_GROUPS configurations."""
    groups = list(dict.fromkeys(configurations))
    if len(groups) == len(configurations):
        return 1.0
    if len(groups) > CEILING_MAX_GROUPS:
        return None
    of = [groups.index(c) for c in configurations]
    found = (spearman(measured, [rank[g] for g in of]) for rank in _weak_orderings(len(groups)))
    return max((rho for rho in found if rho == rho), default=None)  # all tied: no ranking (NaN)


def _weak_orderings(n: int):
    """Every ranking of n items that allows ties (ordered set partitions), as a rank per item."""
    if n == 0:
        yield ()
        return
    for size in range(1, n + 1):
        for first in itertools.combinations(range(n), size):
            rest = [i for i in range(n) if i not in first]
            for tail in _weak_orderings(len(rest)):
                rank = [0] * n
                for position, item in enumerate(rest):
                    rank[item] = 1 + tail[position]
                yield tuple(rank)


def sweep_correlations(found: list[Result], held_apart: bool = True) -> dict[str, tuple[int, float]]:
    """{source: (distinct layouts, Spearman)} over each source's held-apart (or fitted) points, ranking model
    FLOP/s per GPU (tokens/s x the model's FLOPs per token): where a table mixes models, tokens/s
    alone would rank by model size whatever the layout; within one model and sequence both agree."""
    by_source: dict[str, list[Result]] = {}
    for r in found:
        if r.point.held_apart == held_apart:
            by_source.setdefault(r.point.source, []).append(r)
    return {
        source: (
            len({r.point.priced_as() for r in rs}),
            spearman([r.measured * r.flops_per_token for r in rs], [r.predicted * r.flops_per_token for r in rs]),
        )
        for source, rs in by_source.items()
    }


MIN_SWEEP = 10
"""The calibration goal: Spearman >= 0.7 on every sweep of at least this many layouts."""

MIN_RANKED = 3
"""Fewer points than this say nothing about ranking (two points rank +1 or -1)."""

GOAL = {"median": 0.15, "within_15": 0.70, "spearman": 0.8, "spearman_points": 5}
"""Issue 23's goal on the held-apart points: median absolute error <= 15%, at least 70% of points
within +-15%, Spearman >= 0.8 on every source with 5 or more points."""


@dataclass(frozen=True)
class ErrorSummary:
    """Absolute error and ranking over one group of points."""

    points: int
    median_abs: float
    within_15: float
    within_30: float
    median: float
    spearman: float | None  # None below MIN_RANKED points
    ceiling: float | None  # spearman_ceiling: the best a configuration-only model can rank them

    @classmethod
    def of(cls, rs: list[Result]) -> ErrorSummary:
        errors = [r.error for r in rs]
        absolute = [abs(e) for e in errors]
        rho = ceiling = None
        if len(rs) >= MIN_RANKED:
            measured = [r.measured * r.flops_per_token for r in rs]
            rho = spearman(measured, [r.predicted * r.flops_per_token for r in rs])
            ceiling = spearman_ceiling(measured, [r.point.priced_as() for r in rs])
        return cls(
            len(rs),
            statistics.median(absolute),
            sum(a <= 0.15 for a in absolute) / len(rs),
            sum(a <= 0.30 for a in absolute) / len(rs),
            statistics.median(errors),
            rho,
            ceiling,
        )


def error_summaries(found: list[Result], held_apart: bool) -> dict[str, ErrorSummary]:
    """{source: summary} over the held-apart (or the fitted) points, then "all" of them together."""
    chosen = [r for r in found if r.point.held_apart == held_apart]
    by_source: dict[str, list[Result]] = {}
    for r in chosen:
        by_source.setdefault(r.point.source, []).append(r)
    summaries = {source: ErrorSummary.of(rs) for source, rs in by_source.items()}
    if chosen:
        summaries["all"] = ErrorSummary.of(chosen)
    return summaries


def summary_table(summaries: dict[str, ErrorSummary]) -> str:
    lines = [
        "| source | points | median abs. error | within ±15% | within ±30% | median error | Spearman | best possible |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for source, s in summaries.items():
        rho, ceiling = (f"{v:.2f}" if v is not None and v == v else "-" for v in (s.spearman, s.ceiling))
        name = f"**{source}**" if source == "all" else source
        lines.append(
            f"| {name} | {s.points} | {s.median_abs:.0%} | {s.within_15:.0%} | {s.within_30:.0%} | {s.median:+.0%} "
            f"| {rho} | {ceiling} |"
        )
    return "\n".join(lines)


def goal_lines(summaries: dict[str, ErrorSummary]) -> list[str]:
    """Issue 23's goal on the held-apart points, each part met or missed."""
    total = summaries["all"]
    ranked = {k: s for k, s in summaries.items() if k != "all" and s.points >= GOAL["spearman_points"]}
    low = [_missed_rank(k, s) for k, s in ranked.items() if not (s.spearman or 0) >= GOAL["spearman"]]
    return [
        f"- median absolute error {total.median_abs:.0%} (goal <= {GOAL['median']:.0%}): "
        + ("met" if total.median_abs <= GOAL["median"] else "missed"),
        f"- within ±15%: {round(total.within_15 * total.points)} of {total.points} points, "
        f"{total.within_15:.1%} (goal >= {GOAL['within_15']:.0%}): "
        + ("met" if total.within_15 >= GOAL["within_15"] else "missed"),
        f"- Spearman >= {GOAL['spearman']} on every source with {GOAL['spearman_points']} or more points: "
        + ("met" if not low else "missed on " + ", ".join(low)),
    ]


def _missed_rank(source: str, s: ErrorSummary) -> str:
    """A source short of the Spearman goal, and whether any configuration-only model could meet it."""
    text = f"{source} ({s.spearman:.3f}"  # three places: 0.797 is short of 0.8, though it prints as 0.80
    if s.ceiling is not None and s.ceiling < GOAL["spearman"]:
        text += f"; no model that reads the configuration can exceed {s.ceiling:.2f} here: runs of one"
        text += " configuration in different containers measured apart"
    return text + ")"


def oom_goal_line(found: list[Result]) -> str:
    """Issue 23's memory goal: no published layout that ran is called `oom` for our program."""
    numbered = [(i, r) for i, r in enumerate(found, 1) if r.point.held_apart]
    oom = [i for i, r in numbered if r.memory.verdict == "oom"]
    return "- no `oom` verdict for our program on a published layout that ran: " + (
        "met" if not oom else f"missed on {len(oom)} of {len(numbered)} (# {', '.join(map(str, oom))})"
    )


def calibration_section() -> tuple[str, list[Result]]:
    found = results()
    urls = source_urls()
    header = [
        "| # | model | GPUs | layout | seq | batch/micro | AC | precision | measured tok/s/GPU | predicted | error | largest term | memory | use | notes |",
        "|---:|---|---|---|---:|---|---|---|---:|---:|---:|---|---|---|---|",
    ]
    held = error_summaries(found, held_apart=True)
    lines = [
        "### Error per source",
        "",
        "On the fitted points (the calibration set in scripts/planner_calibration.py: our own code, from",
        "which the constants were set):",
        "",
        summary_table(error_summaries(found, held_apart=False)),
        "",
        "On the held-apart points (docs/published_benchmark.yaml: published runs, no constant fitted to them):",
        "",
        summary_table(held),
        "",
        "Issue 23's goal on the held-apart points:",
        "",
        *goal_lines(held),
        oom_goal_line(found),
        "",
        "Error = predicted / measured - 1; Spearman ranks measured against predicted model FLOP/s per GPU.",
        "`best possible`: the highest Spearman any model that reads only a row's configuration can reach",
        "(`spearman_ceiling`): it predicts one value for rows that differ only in what no model prices,",
        "such as the container version, so where such repeats measured apart the ranking cannot be perfect.",
        "`memory`: the estimator's verdict and peak per GPU for our program (the entrypoints) on the point's",
        "layout and GPU, not for the published system's; an `oom` there is a gap to find in our estimate or",
        "our program, term by term (docs/estimator.md).",
        "",
        "### Every point",
        "",
    ]
    number = 0
    for source in dict.fromkeys(r.point.source for r in found):
        rows = [r for r in found if r.point.source == source]
        lines += [f"#### {source}", "", f"Source: {urls[source]}", "", *header]
        for r in rows:
            number += 1
            lines.append(_row(number, r))
        lines.append("")
    lines += [
        "`use`: `fit`, a constant was set from this point (so its error says little); `check`, our own",
        "measurement, independent; `benchmark`, a published measurement held apart from the fit.",
        "",
        "Rank correlation per published sweep (the goal of issue 11: 0.7 or more on every sweep of at least",
        f"{MIN_SWEEP} layouts, checked by tests/plan/test_calibration.py):",
        "",
        "| sweep | layouts | Spearman | goal |",
        "|---|---:|---:|---|",
    ]
    for source, (layouts, rho) in sweep_correlations(found).items():
        if layouts < MIN_RANKED:
            continue
        goal = ("met" if rho >= 0.7 else "MISSED") if layouts >= MIN_SWEEP else f"fewer than {MIN_SWEEP} layouts"
        lines.append(f"| {source} | {layouts} | {rho:.2f} | {goal} |")
    return "\n".join(lines), found


def _row(i: int, r: Result) -> str:
    p, speed = r.point, r.speed
    precision = ("FP8" if p.fp8 else "bf16") + (" compile" if p.compile else "")
    top = max(speed.breakdown, key=speed.breakdown.__getitem__)
    return (
        f"| {i} | {p.model} | {p.gpus} x {p.accelerator} | {layout_text(p.layout)} | {p.seq_len:,} | "
        f"{p.global_batch}/{p.micro_batch} | {p.ac} | {precision} | {r.measured:,.0f} | {r.predicted:,.0f} | "
        f"{r.error:+.0%} | {top} {speed.breakdown[top] / speed.step_time_s:.0%} | "
        f"{r.memory.verdict} {format_bytes(r.memory.per_gpu_peak_bytes)} | {p.use} | {p.note} |"
    )


def kernel_section() -> str:
    if not GPU_JSON.exists():
        return "No GPU measurements recorded (run scripts/planner_gpu_kernels.py on a GPU)."
    data = json.loads(GPU_JSON.read_text())
    k = CONSTANTS
    peak = 989e12
    lines = [
        f"Measured with scripts/planner_gpu_kernels.py on an {data['device']}, torch {data['torch']}, {data['date']}; "
        "short bursts at the boost clock (see the sustained row).",
        "",
        "| kernel | shape | measured TFLOP/s | model's rate | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for r in data.get("gemm_bf16", []):
        half = k.gemm_half_dim["bf16"]
        rate = peak * k.matmul_efficiency["hopper:bf16"]
        for d in (r["m"], r["k"], r["n"]):
            rate *= d / (d + half)
        lines.append(
            f"| bf16 GEMM | {r['m']} x {r['k']} x {r['n']} | {r['tflops']:.0f} | {rate / 1e12:.0f} | {rate / 1e12 / r['tflops']:.2f} |"
        )
    for r in data.get("gemm_fp8", []) if isinstance(data.get("gemm_fp8"), list) else []:
        half = k.gemm_half_dim["fp8"]
        rate = 2 * peak * k.matmul_efficiency["hopper:fp8"]
        for d in (r["m"], r["k"], r["n"]):
            rate *= d / (d + half)
        lines.append(
            f"| FP8 `_scaled_mm` | {r['m']} x {r['k']} x {r['n']} | {r['tflops']:.0f} | {rate / 1e12:.0f} | {rate / 1e12 / r['tflops']:.2f} |"
        )
    for r in data.get("attention", []):
        rate = peak * k.attention_efficiency["hopper"] * r["seq"] / (r["seq"] + k.attention_half_seq)
        lines.append(
            f"| causal SDPA fwd+bwd, GQA 32/8 | {r['seq']:,} tokens | {r['tflops']:.0f} | {rate / 1e12:.0f} | {rate / 1e12 / r['tflops']:.2f} |"
        )
    for r in data.get("cp_attention", []):
        rate = (
            peak
            * k.attention_efficiency["hopper"]
            * k.cp_attention_factor["zigzag_sdpa"]
            * r["seq"]
            / (r["seq"] + k.attention_half_seq)
        )
        lines.append(
            f"| zigzag CP attention (entrypoints) | cp {r['cp']} rank {r['rank']}, {r['seq']:,} tokens | {r['tflops']:.0f} | "
            f"{rate / 1e12:.0f} | {rate / 1e12 / r['tflops']:.2f} |"
        )
    sustained = data.get("sustained_gemm")
    if sustained:
        windows = sustained["windows"]
        late = [w["tflops"] for w in windows if w["t"] > 10]
        lines.append(
            f"| bf16 GEMM held for {windows[-1]['t']:.0f} s | {sustained['m']} x {sustained['k']} x {sustained['n']} | "
            f"{statistics.median(late):.0f} (median after 10 s; clock {windows[-1]['sm_mhz,watts'].split(',')[0]} MHz) | "
            f"{_gemm_rate(sustained) / 1e12:.0f} | {_gemm_rate(sustained) / 1e12 / statistics.median(late):.2f} |"
        )
    bw = data.get("elementwise")
    if bw:
        lines.append(
            f"| elementwise add | {bw['bytes'] / 1e9:.1f} GB moved | {bw['gbps']:,.0f} GB/s | "
            f"{4800 * k.hbm_efficiency:,.0f} GB/s | {4800 * k.hbm_efficiency / bw['gbps']:.2f} |"
        )
    parts = {(r["part"], r.get("seq_len")): r["seconds"] for r in data.get("model_parts", [])}
    if parts:
        lines += ["", "The entrypoints' model in parts (one H200): " + ", ".join(
            f"{name}{f' at {seq:,}' if seq else ''}: {seconds * 1000:.1f} ms" for (name, seq), seconds in parts.items()
        ) + "."]  # fmt: skip
    return "\n".join(lines)


@functools.cache
def moe_layer_measured() -> dict:
    """docs/gpu_check_h100.json's "moe_layer": scripts/gpu_moe_check.py's timings of our MoE layer."""
    return json.loads(MOE_LAYER_JSON.read_text())["moe_layer"]


def moe_layer_seconds(permute_bytes: float | None = None) -> tuple[float, float]:
    """(measured, the model's) seconds of our bf16 MoE layer, forward and backward, at the shape
    scripts/gpu_moe_check.py timed on one H100; the model's at `permute_bytes` per permuted
    element in place of `moe_permute_bytes` where given."""
    measured = moe_layer_measured()
    shape = measured["shape"]
    point = Point(OWN, "qwen3-30b-a3b", 1, Layout(), shape["tokens"], 1, 1, "none", 0.0, gpus_per_node=1)
    arch = model_arch(point.model)
    moe = arch.moe
    assert (arch.hidden_size, moe.num_experts, moe.top_k, moe.expert_ffn_hidden_size) == (
        shape["hidden"],
        shape["experts"],
        shape["top_k"],
        shape["expert_width"],
    ), shape
    constants = CONSTANTS if permute_bytes is None else dataclasses.replace(CONSTANTS, moe_permute_bytes=permute_bytes)
    model = throughput.moe_layer_seconds(workload_of(point), hardware(point), constants)
    return measured["layers"]["moe"]["ms"] / 1e3, model


def moe_layer_section() -> str:
    """The fit of `moe_permute_bytes`: our MoE layer measured against the model's terms."""
    measured, model = moe_layer_seconds()
    without = moe_layer_seconds(0.0)[1]
    counted = moe_layer_seconds(4.0)[1]
    experts_only = moe_layer_measured()["experts_only"]["grouped_mm"]["ms"]
    return (
        'Our bf16 MoE layer on one H100 (scripts/gpu_moe_check.py, docs/gpu_check_h100.json "moe_layer": '
        "Qwen3-30B-A3B's layer on 8,192 tokens, router, dispatch, grouped-GEMM experts and combine, forward "
        f"and backward): measured {measured * 1e3:.2f} ms, the model {model * 1e3:.2f} ms. Of that, the "
        f"router's and the experts' GEMMs and the experts' SwiGLU are {without * 1e3:.2f} ms (the experts' "
        f"grouped GEMMs alone measured {experts_only:.2f} ms); the permutes take the rest at "
        f"`moe_permute_bytes` = {CONSTANTS.moe_permute_bytes:g} bytes per element, fitted here. At one read "
        f"and one write of bf16 (4 bytes, as fused permute kernels move: `moe_permute_fusion`) the layer "
        f"would take {counted * 1e3:.2f} ms."
    )


def _gemm_rate(shape: dict) -> float:
    k = CONSTANTS
    rate = 989e12 * k.matmul_efficiency["hopper:bf16"]
    for d in (shape["m"], shape["k"], shape["n"]):
        rate *= d / (d + k.gemm_half_dim["bf16"])
    return rate


def constants_section() -> str:
    """Each field of `Constants` with its value and the docstring written under it."""
    source = Path(throughput.__file__).read_text()
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Constants")
    rows, pending = [], []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign):
            pending.append(node.target.id)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and pending:
            doc = " ".join(node.value.value.split())
            values = "; ".join(f"`{name}` = {_value(getattr(CONSTANTS, name))}" for name in pending)
            rows.append(f"| {values} | {doc} |")
            pending = []
    return "\n".join(["| constant | what it is, and where its value comes from |", "|---|---|", *rows])


def _value(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items())
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclasses.dataclass(frozen=True)
class OverlapPair:
    """One layout measured with vanilla TP and with async TP (torchtitan's async-TP table)."""

    vanilla: Point
    overlapped: Point
    ideal_gain: float  # predicted speed-up if hidden pieces cost nothing
    interference: float  # tp_overlap_interference that makes the predicted speed-up the measured one

    @property
    def measured_gain(self) -> float:
        return self.overlapped.measured / self.vanilla.measured - 1


def overlap_pairs() -> list[OverlapPair]:
    """Every vanilla/async TP pair of the benchmark, with the interference that fits it: the
    step time is linear in it, so two predictions pin it."""
    _, points = load_benchmark()
    by_layout: dict[tuple, dict[bool, Point]] = {}
    for point in points:
        if point.layout.tensor > 1 and "async TP" in point.source:
            key = dataclasses.replace(point, tp_overlap="none").priced_as()
            by_layout.setdefault(key, {})[point.tp_overlap == "async"] = point
    pairs = []
    for found in by_layout.values():
        if set(found) != {False, True}:
            continue
        vanilla, overlapped = found[False], found[True]
        constants = dataclasses.replace(PUBLISHED_CP, attention_kernel=vanilla.attention_kernel)
        workload, machine = workload_of(vanilla), hardware(vanilla)
        base = predict(workload, machine, constants=constants).step_time_s
        hidden_free, hidden_whole = (
            predict(
                dataclasses.replace(workload, tp_overlap="async"),
                machine,
                constants=dataclasses.replace(constants, tp_overlap_interference=value),
            ).step_time_s
            for value in (0.0, 1.0)
        )
        target = base * vanilla.measured / overlapped.measured
        pairs.append(
            OverlapPair(
                vanilla, overlapped, base / hidden_free - 1, (target - hidden_free) / (hidden_whole - hidden_free)
            )
        )
    return pairs


def fitted_interference(pairs: list[OverlapPair]) -> float:
    """The median fit over the pairs whose rows are marked `fitted` (the 8B ones)."""
    fits = sorted(p.interference for p in pairs if p.vanilla.use == "fit")
    if not fits:
        raise BenchmarkError("published_benchmark.yaml: no fitted vanilla/async TP pair for tp_overlap_interference")
    return fits[len(fits) // 2]


def overlap_section() -> str:
    pairs = overlap_pairs()
    fit = fitted_interference(pairs)
    if abs(fit - CONSTANTS.tp_overlap_interference) > 0.005:
        raise BenchmarkError(
            f"published_benchmark.yaml: the async TP pairs fit tp_overlap_interference = {fit:.2f}, "
            f"but Constants has {CONSTANTS.tp_overlap_interference}: set it to the fit"
        )
    lines = [
        "| model | precision | vanilla TP tok/s/GPU | async TP | measured speed-up | predicted | if hidden pieces cost nothing | interference that fits | use |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in pairs:
        v = p.vanilla
        precision = "bf16" if not v.fp8 else f"FP8 {v.fp8_recipe}"
        predicted = run(p.overlapped)[1] / run(v)[1] - 1
        lines.append(
            f"| {v.model} | {precision} | {v.measured:,.0f} | {p.overlapped.measured:,.0f} | {p.measured_gain:+.1%} | "
            f"{predicted:+.1%} | {p.ideal_gain:+.1%} | {p.interference:.2f} | {'fit' if v.use == 'fit' else 'check'} |"
        )
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class PeakFit:
    """The peak of a part no datasheet gives (catalog `peak_bf16_tflops_bounds`), fitted to the
    calibration points that ran on it: each point's own fitting peak, their median, and that
    median held inside the source's bounds."""

    accelerator: str
    bounds: tuple[float, float]
    wanted: dict[int, float]  # point index (the doc's #) -> the peak that makes it exact
    fit: float


PEAK_SEARCH_TFLOPS = (100.0, 4000.0)


def peak_that_fits(point: Point) -> float:
    """The BF16 peak (FP8 at twice it, as on Hopper) at which the model predicts the point's
    measured speed exactly. Faster hardware is never predicted slower, so bisection finds it."""
    machine = hardware(point)
    return solve_rising(lambda peak: run(point, with_peak(machine, peak))[1], point.measured, PEAK_SEARCH_TFLOPS, 0.5)


def solve_rising(predicted, target: float, bounds: tuple[float, float], tolerance: float) -> float:
    """The x within `bounds` (to `tolerance`) at which `predicted(x)`, never falling as x rises,
    reaches `target`: bisection."""
    low, high = bounds
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (low, middle) if predicted(middle) > target else (middle, high)
    return (low + high) / 2


def with_peak(machine: Hardware, peak: float) -> Hardware:
    """`machine` with its GPU's BF16 peak at `peak` TFLOP/s and FP8 at twice it, unbounded."""
    accelerator = machine.accelerator.model_copy(
        update={"peak_bf16_tflops": peak, "peak_fp8_tflops": 2 * peak, "peak_bf16_tflops_bounds": None}
    )
    return dataclasses.replace(machine, accelerator=accelerator)


def peak_fits() -> list[PeakFit]:
    """One PeakFit per bounded accelerator with fitted points on it."""
    _, points = load_benchmark()
    start = len(POINTS) + len(own_model_points()) + 1  # the doc numbers every point in results()'s order
    found = []
    for key, accelerator in catalog.accelerators().items():
        if accelerator.peak_bf16_tflops_bounds is None:
            continue
        wanted = {start + i: peak_that_fits(p) for i, p in enumerate(points) if p.accelerator == key and p.use == "fit"}
        if not wanted:
            raise BenchmarkError(f"published_benchmark.yaml: no fitted point on {key} to fit its peak")
        low, high = accelerator.peak_bf16_tflops_bounds
        median = sorted(wanted.values())[len(wanted) // 2]
        found.append(PeakFit(key, (low, high), wanted, min(max(median, low), high)))
    return found


def peak_section() -> str:
    lines = []
    for found in peak_fits():
        accelerator = catalog.accelerators()[found.accelerator]
        if abs(found.fit - accelerator.peak_bf16_tflops) > 1.0:
            raise BenchmarkError(
                f"launcher/catalog/accelerators.yaml: the fitted points put {found.accelerator}'s peak at "
                f"{found.fit:.0f} TFLOP/s, but the catalog has {accelerator.peak_bf16_tflops:g}: set it to the fit"
            )
        low, high = found.bounds
        wanted = ", ".join(f"#{i} {v:.0f}" for i, v in found.wanted.items())
        where = "inside them" if low < found.fit < high else "at the nearer bound"
        lines.append(
            f"- `{found.accelerator}`: bounds {low:g}-{high:g}; the fitted points want {wanted} (median "
            f"{sorted(found.wanted.values())[len(found.wanted) // 2]:.0f}); the catalog holds {found.fit:.0f}, {where}."
        )
    return "\n".join(lines)


def cp_speedup_section() -> str:
    """NeMo's context-parallel speed-up (Llama 2 7B, FP8, H100), asked of the planner."""
    published = {8192: 1.00, 16384: 1.00, 32768: 1.03, 65536: 1.07, 131072: 1.31}
    base = Recipe.load(ROOT / "recipes" / "llama3-8b-8k.yaml")
    fast_cp = dataclasses.replace(CONSTANTS, cp_attention_factor=dict.fromkeys(CONSTANTS.cp_attention_factor, 1.0))
    lines = [
        "| seq | GPUs | published | best without CP | best overall, measured CP kernel | speed-up | best overall, CP kernel as fast as plain attention | speed-up |",
        "|---:|---:|---:|---|---|---:|---|---:|",
    ]
    for seq, ratio in published.items():
        gpus = seq // 1024
        recipe = base.with_changes(
            {
                "model": "llama2-7b",
                "training.seq_len": seq,
                "training.global_batch_size": 4 * 2**20 // seq,
                "precision.fp8": True,
                "training.compile": True,
                "cluster.instance_count": max(1, gpus // 8),
                "parallel.tensor": 8,  # any valid starting layout; the planner replaces it
            }
        )
        cells = [f"{seq:,}", str(gpus), f"{ratio:.2f}"]
        budget = recipe.hardware
        candidates = candidate_workloads(recipe, budget)  # the planner's, enumerated once for both constants
        for constants in (CONSTANTS, fast_cp):
            ranked = sorted(score(candidates, budget, constants=constants), key=Scored.sort_key)
            best, without = (
                _fastest_that_fits([item for item in ranked if keep(item.workload.layout)], budget)
                for keep in (lambda _: True, lambda layout: layout.context == 1)
            )
            if len(cells) == 3:
                cells.append(without.describe())
            cells += [best.describe(), f"{best.tokens_per_s_per_gpu / without.tokens_per_s_per_gpu:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fastest_that_fits(ranked: list[Scored], budget: Hardware) -> LayoutPlan:
    """What `search(..., top=1)` returns first, of candidates already scored and sorted."""
    (item, memory), *_ = first_that_fit(ranked, budget, top=1, threshold=DEFAULT_THRESHOLD).fitting
    return LayoutPlan(workload=item.workload, hardware=budget, memory=memory, throughput=item.throughput)


CP_RATE_SEARCH = (0.05, 3.0)
"""The fractions of plain attention `cp_rate_that_fits` searches between."""


def cp_rate_that_fits(point: Point) -> float | None:
    """The fraction of plain attention at which the point's CP kernel would have to run for the
    model to predict its measured speed; None where no rate in CP_RATE_SEARCH does (the rest of
    the step alone is already too slow or too fast). Faster attention never predicts slower."""
    machine, measured = hardware(point), measured_tokens(point)

    def predicted(rate: float) -> float:
        return priced_speed(point, machine, cp_rate=rate).tokens_per_s_per_gpu

    low, high = CP_RATE_SEARCH
    if not predicted(low) <= measured <= predicted(high):
        return None
    return solve_rising(predicted, measured, CP_RATE_SEARCH, 0.005)


def implied_cp_section(found: list[Result]) -> str:
    """Each published CP row's implied kernel rate, beside the rate its row is priced at."""
    priced = PUBLISHED_CP.cp_attention_factor["allgather"]
    lines = [
        "| # | source | model | seq | layout | queries per CP rank | CP kernel | implied rate | error at "
        f"{priced:.2f} |",
        "|---:|---|---|---:|---|---:|---|---:|---:|",
    ]
    for number, r in enumerate(found, 1):
        point = r.point
        if not point.held_apart or point.layout.context == 1:
            continue
        rate = cp_rate_that_fits(point)
        kernel = "TE p2p ring" if point.cp_ring else point.cp_kernel
        cells = [
            str(number), point.source.split(",")[0], point.model, f"{point.seq_len:,}", layout_text(point.layout),
            f"{point.seq_len // point.layout.context:,}", kernel, "-" if rate is None else f"{rate:.2f}",
            f"{r.error:+.0%}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def recipes_section() -> str:
    lines = [
        "| recipe | its layout | predicted tok/s/GPU | best layout the planner finds | predicted | recipe vs best |",
        "|---|---|---:|---|---:|---:|",
    ]
    notes = []
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        recipe = Recipe.load(path)
        per = "" if recipe.hardware.accelerator.peak_bf16_tflops else " per CPU rank"  # launcher.plan.host_cpu
        found = search(recipe, SearchOptions(top=100_000))
        current = found.current
        # the recipe's grad_accumulation "auto" is priced as sync_each (launcher.plan.modes), as the search ranks it
        own = {**current.settings(), "parallel.grad_accumulation": mode(current.workload, "grad_accumulation")}
        rank = next((i for i, p in enumerate(found.ranked, 1) if p.settings() == own), None)
        where = f"#{rank} of {len(found.ranked)} that fit" if rank else "does not fit"
        lines.append(
            f"| {path.name} | {current.describe()} ({where}) | {current.tokens_per_s_per_gpu:,.0f}{per} | "
            f"{found.best.describe()} | {found.best.tokens_per_s_per_gpu:,.0f}{per} | "
            f"{current.tokens_per_s_per_gpu / found.best.tokens_per_s_per_gpu - 1:+.0%} |"
        )
        note = against_recipe(found)
        if note:
            notes.append(f"- {path.name}: {note}")
    return "\n".join(lines + [""] + notes)


def render(bench: str) -> str:
    calibration, found = calibration_section()
    return TEMPLATE.format(
        calibration=calibration,
        implied_cp=implied_cp_section(found),
        published_cp=PUBLISHED_CP.cp_attention_factor["allgather"],
        kernels=kernel_section() + "\n\n" + moe_layer_section(),
        constants=constants_section(),
        overlap=overlap_section(),
        peaks=peak_section(),
        cp_speedup=cp_speedup_section(),
        recipes=recipes_section(),
        bench=bench,
        bench_start=BENCH_START,
        bench_end=BENCH_END,
    )


def existing_bench() -> str:
    if DOC.exists():
        text = DOC.read_text()
        if BENCH_START in text and BENCH_END in text:
            return text.split(BENCH_START, 1)[1].split(BENCH_END, 1)[0].strip("\n")
    return "Not measured yet: run `python scripts/bench_plan.py --write`."


TEMPLATE = """# The planner and its throughput model

<!-- Generated by scripts/planner_calibration.py; edit that script, not this file. -->

`launcher plan RECIPE [--gpus N | --instances N] [--instance-type T] [--top K] [--json]` lists
every parallel layout of the recipe's model that the recipe rules accept on that GPU budget,
keeps those the memory estimator says fit (80% of GPU memory by default), and ranks them by
predicted tokens/s/GPU, with MFU and dollars per million tokens; then it says why the best wins.
`launcher estimate --json` adds `predicted` for the recipe's own layout, `launcher submit
--auto-plan` switches to the best layout first, and `launcher.api.plan(recipe, gpus=..., top=...)`
is the API.

## The search

- Candidates (`launcher/plan/candidates.py`): tensor over the divisors of the KV-head count that
  fit in a node; context, pipeline (and virtual stages up to 8) and the data-parallel split over
  the divisors of the GPUs still unassigned; micro batch over the divisors of each data-parallel
  rank's sequences; activation checkpointing none/selective/full; FP8 both ways with `--vary-fp8`.
  Each branch is cut where a recipe rule first rejects it, and every survivor passes
  `launcher.recipe.rules.layout_problems`, the function that validates recipes. A test compares
  the enumeration with the rule-filtered full product.
- Ranking (`launcher/plan/rank.py`): every candidate is scored by the throughput model (about
  20 us each), sorted, and the memory estimator runs in that order only until `--top` layouts fit.
  Memory grows with the micro batch, from sync_each to sync_last to sync_last_gathered, and where
  sequence parallel keeps its gathered inputs rather than their shard, and falls with
  recomputation and with the FSDP shard, so a failure also rules out the same degrees (the expert
  degree included: memory is not monotone in it) that hold at least as much on every one of those
  axes. A test checks the result equals estimating every candidate. Scoring shares what candidates have in common: the cluster's rates and links, each
  distinct layer's compute, and, within a family of candidates that differ only in checkpointing
  and accumulation mode, the terms that read neither, and each recomputed share's micro-batch
  terms (a test checks every prediction equals predicting the candidate alone).

## How a layout is scored

`launcher/plan/throughput.py`, one function per term. For one micro-batch on one GPU of the last
pipeline rank (its blocks plus the output layer and the loss):

| term | model | overlap assumption |
|---|---|---|
| matmuls | 6 FLOPs per weight and token (8 for the output layer: the fused loss recomputes each chunk's logits, on chunks of the contract's `chunk_tokens`, launcher/contract/loss.py), at peak x efficiency(GPU, precision) x d/(d+half) for each GEMM dimension M, K, N | `logits_materialized` (planner-only: Megatron-Core and torchtitan run the output layer once over the micro-batch and keep the logits): 6 FLOPs per output weight, M all the rows |
| attention | causal: 6·s·h FLOPs per token and layer, heads split over TP, queries over CP; at the rate of the fused kernel that runs it (`attention_kernel`: cuDNN, which torch's SDPA prefers on Hopper from torch 2.11 and Transformer Engine runs, or FlashAttention-2 at 0.62 of it); efficiency falls for short sequences, and under CP runs at the kernel's fraction of plain attention (`parallel.cp_attention`: allgather (LSE-merged fused pieces) 0.95, 0.92 and 0.88 with 16K, 8K and 4K queries per rank, measured on an H100; ulysses 1.0, a target; 0.58 the masked two-SDPA kernel document masking runs) | - |
| elementwise | norms, RoPE, SwiGLU, residuals, FP8 casts and the loss's logits, in bytes over HBM bandwidth; torch.compile removes about 2/3. FP8 casts the linears' inputs (under float8 all-gather the sequence-parallel ones on this rank's s/t rows, before the gather, as torchao's PrepareFloat8ModuleInput does), their output gradients and the weights every micro-batch (the FSDP shard under float8 all-gather), at the bytes per element inductor counts for the compiled block (`torchao_cast_bytes`, scripts/fp8_cast_bytes.py) | `fp8_weights_cached` (planner-only: Transformer Engine's is_first_microbatch cache, which Megatron-Core sets) casts the weights once per step; `fp8_casts` (planner-only) prices Transformer Engine's fused cast-transposes instead, counted from its source (`te_cast_bytes`) |
| recomputation | the forward again for checkpointed blocks: all (full) or every other one (selective) | `recompute_layers` (planner-only: Megatron-Core's recompute_method block): the first k layers of each virtual stage |
| TP | sequence-parallel all-gather + reduce-scatter around attention and MLP, forward, backward and recomputed forward, over NVLink; under `parallel.tp_saved_inputs: shard` a kept block all-gathers both inputs once more in backward (an MoE block the attention's) | none for the entrypoints (DTensor's collectives sit between dependent matmuls, and the regathers wait); `tp_overlap` (planner-only) async, torch's async TP, cuts each into t pieces beside its GEMM, run as t GEMMs of M/t rows: one piece exposed, the rest hidden while the GEMM lasts, at `tp_overlap_interference` of their time; userbuffers, Transformer Engine's, prices each GEMM's collective by the method and SMs of the run's config (launcher/plan/userbuffers.py: ring exchange on the copy engines, pipelined and bulk on SMs); `regather_overlap` (planner-only: Megatron-Core's and TE's async all-gather before the input-gradient GEMM) hides each regather behind that GEMM at the same interference |
| CP | allgather: all-gather of K and V in forward, again in backward (a kept layer regathers them, parallel/context.py) or in the recomputed forward, and reduce-scatter of their gradients: three per layer (two under document masking, which keeps the gathered K/V); ulysses: all-to-alls of q, k, v in and the output back, forward, recomputed forward and backward | none for the entrypoints; `cp_ring` (planner-only: Transformer Engine's p2p ring) moves each K/V chunk (with dK/dV in backward) beside one of the c attention steps, exposed only by what outlasts the step |
| FSDP | by `parallel.grad_accumulation`: sync_each gathers each block before forward and backward and reduce-scatters gradients (in `parallel.reduce_dtype`) every micro-batch; sync_last reduce-scatters on the last micro-batch only; sync_last_gathered also gathers once per step, as under PP, where torch.distributed.pipelining keeps blocks gathered; under PP, sync_each gathers each block once and reduce-scatters every micro-batch (pipeline.py's _GradientSyncEachMicroBatch) | hidden behind 85% of the micro-batch's compute (the step's under PP and sync_last_gathered); the first block's gather always exposed |
| HSDP | all-reduce of the gradient shards between replicas, once per step | half hidden |
| PP | send/recv of activations and gradients per micro-batch and virtual stage, at one GPU's NIC share across nodes | none for the entrypoints; `p2p_overlap` (planner-only: Megatron's overlap_p2p_comm, interleaved only) hides each behind a chunk's compute |
| bubble | step = (compute + exposed) x (m + (p - 1)/v): the idle fraction is (p - 1)/(m·v + p - 1) | - |
| optimizer | AdamW over the fp32 shard, HBM-bound | - |
| experts (MoE) | the router (N x h x E) and each of the N x k token copies through one expert's three h x f GEMMs, in bf16, at a rate that falls with the rows per expert (N x k x ep / E, balanced routing), on the rank's own N = b x s / (c x t) tokens (tensor.py: each tp rank routes its own slice of the sequence); elementwise: the SwiGLU on every copy and the permutations by expert and back, at `moe_permute_bytes` per element (fitted to our layer on an H100). With `precision.fp8_experts` the experts' GEMMs run at the FP8 rowwise rate on their padded rows (R rounded up to 16, plus 16 x E/ep: groups of 16-row multiples, none empty) and add torchao's fused casts (the rows, the gradients and the local experts' weights every micro-batch; once per step under `fp8_weights_cached`) and the padding's copies | `fp8_experts` (Megatron-Bridge's MoE rows: TE's grouped linears run FP8); `moe_permute_fusion` (planner-only: Megatron-Core's moe_permute_fusion, TE's fused permute kernels) at one read and one write per element |
| EP | token all-to-alls there and back in forward, backward and a recomputed forward, (ep - 1)/ep of the copies each, over ep consecutive ranks of dp_shard x cp x tp (tp innermost; each tp rank routes its own tokens): across nodes the copies for other nodes leave through one GPU's share of the NICs while those for its own node cross NVLink, and the slower sets the time (an all-to-all is not a ring); `ep_dispatch_per_node` (planner-only: DeepEP's and Hybrid-EP's dispatch) sends a token once to each other node that holds one of its experts; FSDP gathers and reduces E / ep experts per rank | none in the entrypoints (the router and the experts wait for them); `moe_a2a_overlap` (planner-only: Megatron-Core's overlap_moe_expert_parallel_comm, whose combined 1F1B runs each layer's forward of one micro-batch beside its backward of another) hides them behind that layer's compute at `tp_overlap_interference`, on all chunks but the warmup forwards |

### Links

A collective over a group of n ranks, s apart in the mesh (TP innermost, then CP, dp_shard,
dp_replicate, PP), runs:

- inside a node (s x n divides the GPUs per node): over NVLink, 80% of one direction;
- across nodes: every group of that mesh dimension runs its collective at the same time, so the
  groups with ranks on a node share its NICs. A group with r ranks per node (r = min(n, g/s) for
  g GPUs per node) drives r of the node's g NICs: node bandwidth x 80% x r/g, capped by NVLink for
  the intra-node hops. FSDP over all 128 GPUs of 16 p5s (r = 8) gets all 3,200 Gb/s of a node,
  320 GB/s after efficiency, where the earlier per-GPU model gave every node-spanning collective
  one GPU's share (40 GB/s); with TP 8 inside each node (r = 1) it is one GPU's share again.
- Point-to-point sends (pipeline stages) get one GPU's NIC share across nodes: every GPU of the
  node sends its own message at once.

Node bandwidth is the catalog's `efa_gbps` (instances.yaml, from the EC2 instance
specifications), NVLink the catalog's `nvlink_gbps` (accelerators.yaml, NVIDIA datasheets).

### Run modes

`parallel.grad_accumulation`, `parallel.reduce_dtype` and `parallel.cp_attention` are workload
fields (launcher/plan/modes.py): `auto` accumulation (decided by memory at submit) is priced as
sync_each; CP attention is the layout's path (allgather or ulysses), and the masked two-SDPA
kernel (zigzag_sdpa) where document masking needs it. The search tries all three accumulation
modes for FSDP layouts without PP and with more than one micro-batch per step, and sync_each
against sync_last_gathered under PP; the memory estimator counts each mode's unsharded gradients
and gathered parameters. It also tries both
`parallel.tp_saved_inputs` under TP where blocks keep their activations: `shard`
(entrypoints/parallel/regather.py) costs one all-gather per input in backward and holds (t - 1)/t
less of each, so it ranks below `gathered` unless it lets a faster layout fit (the table's layout
then says "TP saves shard"). The published sweeps below ran
their own CP kernels (ring attention), so they are priced at the masked kernel's measured 0.58,
not at what our LSE-merged kernel measured on an H100 (0.88-0.95 of plain attention at 32K,
`cp_attention_factor`): at that rate the published CP rows at 32K and beyond would be up to 64%
too fast (PUBLISHED_CP in this script).

Outputs: tokens/s/GPU, MFU (model FLOPs 6·N + 6·L·h·s per token over the BF16 peak, as the
entrypoints log it), step time, time to the recipe's steps, and $ per 1M tokens and per run from
the instance price (`cluster.usd_per_hour` overrides the catalog for the recipe's own type).

### Mixture of experts

For a model with a `moe:` block the search also walks `parallel.expert` over the divisors of the
expert count that divide dp_shard x cp x tp (`expert_choices` in launcher/contract/layout.py, the
rule recipes are validated by), and the table gains an `expert` column. Model FLOPs count the
parameters a token goes through (router, top-k and shared experts), as the entrypoints' MFU
does. The model prices two things against each other: gathering every expert per layer (FSDP,
hidden behind compute as for dense blocks) against the all-to-alls EP adds. Under EP a rank's
experts are an FSDP unit of their own over the expert_fsdp ranks that hold the same ones, ep x
tp apart and often one per node, so their gathers get one GPU's NIC share where a block's get
the node's; every micro-batch of a step gathers them again (`grad_accumulation: sync_each`). At
long sequences attention dominates and hides the gathers, so for Qwen3-30B-A3B's small experts
(768 wide) at 64K the planner prefers no EP, and for Mixtral's (14,336 wide) at 32K on four p5
no EP, by 2-3% over EP 2 to 8 with one micro-batch per step: within the model's noise.

No published MoE *sweep* exists to rank against: Megatron-Bridge publishes one layout per MoE
model and container, and NeMo and torchtitan none on H100. Its six DGX-H100 rows of Qwen3-30B-A3B
(16 GPUs, token-dropless with force-balanced routing, as we price) are held apart below: three
layouts on six containers, PP 2 x EP 8 with 24 or 12 virtual stages and PP 1 x EP 16. One layout
(PP 2, 12 virtual stages) measured 5,113 tokens/s/GPU in the 26.02 container and 9,058 in
26.02.01; the 25.11 row (24 virtual stages, micro-batch 2) measured 5,275. The source's
maintainers filed 25.11's rate as a regression of the dropless path, "2X slower" than 25.09
(NVIDIA-NeMo/Megatron-Bridge issue 1998, to be fixed in 26.02), so those two rows measure a
defect; they stay in the statistics. The model, which
prices a layout and not a container, is 15-17% above the 26.02.01 to 26.06 rows and about twice
the 25.11 and 26.02 ones (12-16% before our FP8 experts stopped casting their rows four times a
micro-batch: the model prices our program's casts, not TE's). The EP 16 rows span two nodes and
dispatch with Hybrid-EP (`ep_dispatch_per_node`, the config cited in the YAML), which sends a token
over the network once per other node its experts sit on (1.0 of 8 copies here) where an
all_to_all_single, as ours, sends the 4 copies bound there: priced as ours, with the node's
copies through one GPU's NIC share, those rows would be 28% too slow instead of 17% too fast. One
measurement of our own MoE layer (scripts/gpu_moe_check.py, bf16 on one H100) sets what our
permutations cost (`moe_permute_bytes`, under "Kernels of our own code" below): 3.5 times the
bytes they move, which the published rows, run with Transformer Engine's fused permutes
(`moe_permute_fusion`), do not pay. No GPU run of ours has timed the all-to-alls. Megatron-Bridge's
five Qwen3-235B-A22B rows (EP 32 over TP 2 x DP 16, as our EP now spans tp) are held apart beside
them; GPT-OSS 120B (not in the catalog) is left out.

## Constants

{constants}

### Overlapped TP: what the async TP pairs say

torchtitan measured the same layouts with vanilla and async TP. Priced with no cost for the
hidden pieces, the model would promise about twice the speed-up they measured; the step time is
linear in `tp_overlap_interference`, so each pair pins the value that reproduces its measured
speed-up. The constant is the median over the Llama 3.1 8B pairs (their rows are `fitted`); the
70B pairs stay held apart and check it. Transformer Engine's userbuffers overlap (the NeMo and
Megatron-Bridge rows with tp_comm_overlap) does not use this value: it is priced from the config
each run named (launcher/plan/userbuffers.py, the configs cited in docs/published_benchmark.yaml),
GEMM by GEMM as TE runs it. Its ring exchanges move their bytes on the copy engines
(`userbuffers_send` issues cudaMemcpyAsync where `use_ce`, TE's default), so the GEMM beside them
keeps its SMs and a step hides whole behind the chunk before it; a pipelined reduce-scatter holds
`num_sm` SMs from its GEMM (`set_sm_margin`: the GEMM runs `132 / (132 - num_sm)` times as long)
and leaves its last chunk exposed; a bulk pair shares `num_sm` of the GEMM's 132 SMs while its
collective runs. Where torch's async TP pays 53% of each hidden piece, a bulk reduce-scatter on 24
SMs pays 18% and a ring exchange nothing: no measurement of TE's overlap was fitted.

{overlap}

### The peak of a part no datasheet gives

torchtitan's Grand Teton H100s run at 500 W, and their source bounds the peak only by the H100
NVL's and the SXM's (launcher/catalog/accelerators.yaml). The catalog's peak for such a part is
fitted inside those bounds: each calibration point on it (`fitted` rows) pins the peak at which
the model predicts it exactly (`peak_that_fits`), and the catalog holds their median, held inside
the bounds. `--check` fails when the two differ. Where the fit sits at a bound, the fitted points'
remaining error lies in something else the model prices, not in the peak.

{peaks}

## Calibration and the published benchmark

Two sets of points, kept apart. The calibration points (`POINTS` and docs/planner_gpu.json in
scripts/planner_calibration.py) are measurements of our own code on one H200, from which the
model's constants were set. The published benchmark (docs/published_benchmark.yaml) holds every
published H100/H200 measurement read so far from torchtitan's benchmarks/, NeMo's performance
docs, Megatron-Bridge's performance summaries and the Llama 3 paper: each row with its model,
sequence, GPUs, TP/PP/CP/VP/DP, micro and global batch, precision and the table it was read
from, and each source with its repo, path and commit (or page). A configuration field the source
does not state is marked `assumed` in the row. No constant is fitted to a benchmark row; one that
is later fitted names its constant in the row's `fitted` and moves to the fitted table.

Each point runs through the same model with its own layout, batch and precision on the catalog's
hardware for its source (`h100-80gb`: 989 dense BF16 TFLOP/s, 3.35 TB/s, 900 GB/s NVLink; for
torchtitan's Grand Teton hosts `h100-96gb-500w`: 835, 2.4 TB/s; 400 Gb/s of network per GPU).
Rows that ran torchtitan's async TP, or Megatron's TP communication overlap or p2p overlap where
the source's configs set them (cited in docs/published_benchmark.yaml), are priced with the
planner-only `tp_overlap` and `p2p_overlap` (below); Megatron's distributed optimizer and Transformer
Engine's p2p ring CP likewise (`distributed_optimizer`, `cp_ring`, under "Where the errors come
from"), and so are a loss over kept logits (`logits_materialized`: Megatron-Core and torchtitan) and
Megatron's block recomputation where a config sets it (`recompute_layers`); Transformer Engine's FP8 current scaling is priced as tensorwise (one scale per
tensor), torchao's rowwise as rowwise (its GEMMs at `fp8_rowwise_factor`, an assumption not
fitted to these rows, and weights gathered in bf16). Searched and not used: Fujii et al. 2024
(arXiv 2411.06465) ran 454 layouts on A100s and H100s, but its throughput tables were not
available here; MLPerf Training's Llama 2 70B LoRA and GPT-3 results publish time to train, not
layouts with throughput; NeMo's long-sequence rows without CP publish no layout;
Megatron-Bridge's 25.09 H100 table gives no precision.

{calibration}

Where the errors come from (read the tables above for their size):
- torchtitan's H100s are 96 GB HBM2e parts at 2.4 TB/s and 500 W (their footnote: the true peak
  lies between SXM and NVL), priced as the catalog's `h100-96gb-500w`. Priced as 700 W HBM3
  H100s they were predicted 30-42% too fast at 8K (8B, FSDP). The SXM peak scaled by the cube
  root of the power ratio (884 TFLOP/s, an upper bound) left the 8K rows 13-25% too fast; the
  peak fitted to the async TP table's 8B rows (above: they want 492-673, below the source's range,
  so it sits at the NVL bound, 835) leaves them 7-19% too fast, and the held-apart rows on the
  part without CP still want 622-852 TFLOP/s each, 750 at the median (`peak_that_fits`). Their 64K-256K rows used torch's early
  ring-attention context parallelism. Their
  attention ran FlashAttention-2 (torch SDPA's flash backend), priced at its own rate: before
  that term (every kernel priced as cuDNN) the error grew with the sequence, +42% at 8K to +76%
  at 32K for the same 8B FP8 layout; with it, +26% and +35%.
- NeMo and Megatron-Bridge (Megatron-Core, Transformer Engine, 700 W DGX H100) run kernels
  (TE's fused attention and context parallelism) that beat the entrypoints' torch ones that the
  constants describe, and their TP overlap is priced GEMM by GEMM from the userbuffers config
  each run named (below, "TE's userbuffers, from its configs").
  Their data parallelism is Megatron's distributed optimizer (`distributed_optimizer` in the
  benchmark's sources, with the configs that set it): gradients reduce-scattered and parameters
  all-gathered once per step, overlapped, which is FSDP's `sync_last_gathered` traffic and is
  priced so; FSDP's per-micro-batch gathers had priced NeMo's GPT-3 20B (TP 2, 32-way data
  parallel over InfiniBand) 21% too slow, now +3%. Their context parallelism is Transformer
  Engine's p2p ring (`cp_ring`): each K/V chunk (and dK/dV in backward) moves beside one of the
  c attention steps and is exposed only by what outlasts that step. Priced as our exposed
  all-gathers instead, NeMo's Llama 2 7B rows at 512K and 1M (CP 16 and 32) were 28% and 27%
  too slow; now within 2%. Megatron-Bridge's performance configs reduce gradients in bf16
  (`grad_reduce_bf16`: grad_reduce_in_fp32 False), priced as `parallel.reduce_dtype: bf16` for
  speed and for our program's memory: the accumulated unsharded gradients halve (its 70B TP 4
  PP 8 rows went from 90.8 to 84.5 GiB, its 405B rows from 95.7 to 79.8). With the entrypoints'
  vocabulary-parallel embedding, whose gradient holds V/t rows where DTensor's held a dense
  V x h tensor (docs/estimator.md), they were at 82.9 and 78.0 GiB. Megatron-Core and Transformer
  Engine keep the shard of sequence parallel's gathered inputs and all-gather it again beside the
  input-gradient GEMM (`tp_saves_shard`, evidence in the YAML): priced as
  `parallel.tp_saved_inputs: shard` with `regather_overlap`, these rows are at 73.6 and 62.0 GiB
  (risky and fits), NeMo's GPT-3 175B at 512 GPUs went from 85.4 (oom) to 77.2 GiB (then 56.5 with
  `parallel.grad_accumulation: sync_each` under PP, below), and the
  regathers cost these rows about 1% of predicted speed: Megatron-Bridge's 70B rows moved from
  -14% to -15% or -16%, which took the share within ±15% from 71% to 68%. Nemotron-4 340B's
  config reduces gradients in bf16 (optim.grad_sync_dtype, cited on its row): 107.9 GiB before,
  83.2 after, still `oom`; it also keeps Apex's optimizer state in bf16 (optim.dtype, the only
  24.07 config that does), which our program now runs as `training.optimizer.state_dtype: bf16`
  (entrypoints/optim.py, AdamWBf16Moments: bf16 moments beside the fp32 masters): 71.8 GiB, risky. NeMo 24.07's table mixes GPT-3 and Nemotron-4 (two-matrix MLPs,
  modelled as a SwiGLU of equal size) with Llama.
- NeMo 24.07's configs, read whole (cited in the YAML): none recomputes but Nemotron-4 340B's,
  whose granularity selective recomputes each layer's core attention (`recompute_core_attention`),
  so `ac: none` is no longer an assumption there; and the three Nemotron configs run their squared
  ReLU unfused (bias_activation_fusion false: torch.pow(F.relu(x), 2), two eager kernels forward
  and four backward, 28 bytes per FFN element counted: `mlp_activation`) where GPT-3's GeLU and
  Llama's SwiGLU are fused. Nemotron's 8B went from +13% to +8%, its 22B from +9% to +6%, its 340B
  from -9% to -12%, and that source's Spearman from 0.78 to 0.797.
- FP8 casts. Transformer Engine casts each FP8 weight on a step's first micro-batch and reuses it
  for the rest (`fp8_weight_cache`, evidence in the YAML; Megatron FSDP's 8B row excepted), priced
  as `fp8_weights_cached` (about +2% on Megatron-Bridge's 70B rows). And the model had cast
  sequence parallel's two gathered block inputs at their full s rows, where under float8
  all-gather (torchao 0.18's PrepareFloat8ModuleInput, as our entrypoints run it, and TE's
  norm-fused cast) each rank casts its s/t rows before the gather. Together: Megatron-Bridge's
  70B rows went from -15% to -16% to -12% to -14%, the share within ±15% from 68% to 79%, NeMo
  24.07's Spearman from 0.80 to 0.82; torchtitan's FP8 TP 8 rows rose by 3-7% (70B at 256 GPUs:
  +1% to +7%, +4% to +10%).
- FP8 casts, measured. A compiled torchao float8 block moves far more than one amax and one cast
  per linear input: scripts/fp8_cast_bytes.py sums inductor's own per-kernel byte counts over the
  entrypoints' compiled Llama block, forward and backward, float8 against bf16, at six widths
  (docs/fp8_cast_bytes.json, torch 2.13 and torchao 0.18 on the CPU build of inductor: the
  graphs a GPU compiles, the CPU backend's fusion). The fits, within 1.5% at every width:
  tensorwise 13.0 bytes per linear input element (the backward's casts for the weight gradient
  move into the forward graph with an amax of their own), 5.2 per output gradient, 7.6 per
  weight; rowwise 16.1, 2.2 and 11.4; against 5 per input, doubled for backward, before
  (`torchao_cast_bytes`). Under the Float8 TP styles wo's and w2's output gradients are cast on
  the rank's s/t rows, before backward gathers them (Float8RowwiseParallel). The same script's bf16 block moves 29.5 KB per token at h 256, f 768,
  where the model's fitted elementwise bytes give 26.9. The eager factor, refitted to the 1B
  point, went from 28 to 17. Transformer Engine's casts (NeMo's and Megatron-Bridge's rows) are
  now counted from its source rather than priced as torchao's (`fp8_casts` te_delayed /
  te_current, `te_cast_bytes`, evidence in the YAML): 0-2% slower there. torchtitan's FP8 rows'
  errors fell by 2-14 points (the December 2024 8B at 8K from +7% to +1%, the June 2025 8B TP 8 rows from
  +20-44% to +15-30%); torchtitan's December 2024 runs used torchao eab345c, which saved the
  float8 inputs for backward instead of casting them again
  (manual_float8_matmul_with_args_in_float8), so their casts moved somewhat less than priced.
  Over the held-apart points: within ±15% 50 to 51 of 66, median absolute error 8.9% to 9.2%;
  Spearman of torchtitan's June 2025 rows 0.83 to 0.94, of Megatron-Bridge's dense rows 0.02 to
  0.27, of NeMo 24.07's 0.797 to 0.769 (its GPT-3 20B and 175B rows, now 0.7% apart in predicted
  model FLOP/s, changed places).
- TE's userbuffers, from its configs. The NeMo and Megatron-Bridge rows with tp_comm_overlap had
  their TP collectives priced as torch's async TP: t pieces, one exposed, the rest paying 53% of
  their time (`tp_overlap_interference`, fitted to torchtitan's pairs). Transformer Engine runs
  them otherwise (launcher/plan/userbuffers.py, from TE v1.8's comm_gemm_overlap.h and
  userbuffers.cu): its ring exchanges copy on the copy engines beside GEMM chunks that keep their
  SMs, and its pipelined and bulk overlaps take a config's few SMs (2 to 24 of 132). Each row now
  names the config its run used (`userbuffers`, evidence in the YAML: NeMo-Framework-Launcher's
  tp_overlap files, Megatron-Bridge's comm_overlap.py, TE's defaults where a config named none).
  Megatron-Bridge's dense rows went from -6% to -19% (median -10%) to -0% to -10% (median -2%),
  and that source's Spearman from 0.27 to 0.89: the 405B rows, TP 8 with 24 SMs on qkv's bulk
  reduce-scatter, had paid most. NeMo 24.07's TP rows rose by 4-7% (GPT-3 20B +3% to +8%, Llama 2
  70B -2% to +6%, Nemotron-4 340B -12% to -5%), its Spearman from 0.769 to 0.755: the rows it
  misranks have no TP (GPT-3 5B, Llama 2 7B and 13B, +8% to +10%, against GPT-3 175B on 512 GPUs,
  -9%). Over the held-apart points: median absolute error 9.2% to 7.6%, within ±15% 51 to 53 of 66.
  Not measured: no run of TE's overlap has been timed here, and a bulk kernel on 2 SMs is priced
  at the link's full rate.
- Under pipeline parallelism our program used to keep every gradient unsharded in the reduce
  dtype until the step's end (torch.distributed.pipelining turns FSDP's gradient sync off).
  `parallel.grad_accumulation: sync_each` now reduce-scatters each micro-batch's gradients into
  their fp32 shards instead (entrypoints/parallel/pipeline.py, _GradientSyncEachMicroBatch), as the
  Llama 3 paper's FSDP keeps gradients sharded; `auto` takes it where sync_last_gathered does not
  fit, and the memory column is `auto`'s pick. NeMo's GPT-3 175B rows went from risky 69.4 and 77.2
  GiB to fits 52.8 and 56.5, its Llama 3 70B row from risky 64.3 to fits 50.9. Megatron-Bridge's
  70B rows stay at 73.6: over a shard of 2 under bf16 reduce, fp32 shards hold as much as unsharded
  bf16 gradients, and `auto` keeps the faster mode on the tie. Without pipelining `auto` shows its faster mode's
  larger peak where that fits (sync_last_gathered: NeMo's GPT-3 5B 31.6 -> 56.6 GiB, still fits).
- The output layer. Our fused loss recomputes each chunk's logits in backward (8 FLOPs per output
  weight and token); Megatron-Core's GPTModel and torchtitan run the output layer once over the
  micro-batch and keep the logits (6, in one GEMM of all the rows: `logits_materialized`, evidence
  in the YAML). The model had priced every published row with our loss, and sized its chunks
  without the contract's 1024-token floor, which put small-M GEMMs in the price (54 rows for
  Qwen3's 152K words at h 2048); `loss_bytes_per_logit` was refitted to the same measured loss
  (86 ms) with the chunks the entrypoints run. The published systems' heads are cheaper now: their
  rows rose by 0-3% for Llama-size vocabularies and 10-20% for Qwen3-30B-A3B and Nemotron's 256K
  words. Megatron-Bridge's 70B rows went from -12% to -14% to -8% to -10%, its 405B rows, whose
  slowest pipeline rank is a middle one (16 layers; the last holds 15 and the head), did not move,
  and that source's Spearman fell from 0.72 to 0.02; NeMo 24.07's from 0.82 to 0.78. Within each
  of these sources the measured model FLOP/s spread over about ±9% (Megatron-Bridge: 719 to 856
  TFLOP/s/GPU), so their ranking turns on errors of a few percent that the model does not resolve:
  it under-predicts large TP x PP layouts against small FSDP ones across NeMo and Megatron-Bridge
  alike (Megatron-Bridge's 405B -9% to -18%, its 8B -4%; NeMo's 340B and 175B -8% to -12%, its 5B
  and 7B +8% to +10%), and no sourced mechanism found here closes that.
- Megatron-Bridge's Llama 3 8B H100 FP8 config recomputes 5 layers in full (recompute_num_layers
  5, recompute_method block, cited on its row; `recompute_layers`): 5 of 32 layers' forwards again,
  about -4% of predicted speed. The 70B and 405B configs recompute nothing (Megatron-Core's
  default), and the Qwen3 configs set recompute_granularity None: those rows' `ac: none` is no
  longer an assumption.
- NeMo's long-sequence sweep leaves micro batch and recomputation unstated (marked `assumed`). The
  Llama 3 paper (section 3.3.2) states that its 8K pre-training ran without activation
  checkpointing and with an interleaved schedule of V stages per pipeline rank; V = 8 follows from
  its layer split (the rows' note), the micro batch is unstated (assumed 1).
- Our own runs on one H200 are close, but most of them set constants.

### Kernels of our own code on a GPU

{kernels}

## The context-parallel speed-up at long sequences

NeMo measured Llama 2 7B (FP8, H100), one GPU per 1K tokens of sequence (8K on 8 GPUs up to 128K
on 128), with its best layout with CP against its best without: 1.00x up to 16K, 1.31x at 128K.
Here the planner ranks every layout for the same model, sequence and GPU count (global batch 4M
tokens, FP8 with compile, p5) and compares its best overall with its best without CP:

{cp_speedup}

Llama 2 7B's 32 KV heads let `parallel.cp_attention: auto` take Ulysses at every degree here
(launcher/contract/layout.py's rule), whose kernel is plain attention on a subset of heads, so
both columns agree: the model has CP win from 16K on, by more than NeMo measured up to 64K
(1.04-1.24 against 1.00-1.07) and by less at 128K (1.24 against 1.31), where its best layout
without CP, TP 8 with selective recomputation, is faster than what NeMo reports for its own.
NeMo's CP ran Transformer Engine's ring, at about {published_cp:.2f} of plain attention (next
section); ours runs Ulysses at a rate that is a target, not a measurement (`cp_attention_factor`),
and the all-gather path at 0.88-0.95 where the heads do not divide.

### What the published CP rows imply

Every published row with CP is priced with its kernel at {published_cp:.2f} of plain attention
(PUBLISHED_CP). Solving each row for the rate at which the model would predict its measured speed
(`cp_rate_that_fits`, bisection; the rest of the model as it stands, so the rate also absorbs
that part's error) shows where that one number holds:

{implied_cp}

Transformer Engine's ring in NeMo's long-sequence sweep implies {published_cp:.2f} within 0.03 from
32K to 1M, over CP 2 to 32, with 16K to 32K queries per rank: there one number holds. torch's ring
attention in torchtitan's tables (torch 1963fc8, December 2024, FlashAttention-2 under it) implies
0.62-0.70 with 32K queries per rank, for the 8B and the 405B alike, except the 8B at 64K with CP 2
(0.91), whose 405B twin implies 0.65; the Llama 3 paper's K/V all-gather at 128K, 0.72. At 8K, with 4K queries per rank, attention is a small part
of the step and the rate carries the rest of a row's error: NeMo's 8B and 70B imply 0.57 and
0.96, and no rate up to 3 times plain attention's reaches Megatron-Bridge's 405B rows, whose
steps the rest of the model already prices slower than measured. Nothing here is fitted: these
are held-apart rows. Our own kernel measured 0.88-0.95 (`cp_attention_factor`), above every
published long-sequence row but one.

## Findings the tests check

tests/plan/test_findings.py, each with a model and budget where several layouts fit:
- a smaller TP degree ranks higher (Llama 3 8B at 8K and Mistral 7B at 32K on one p5, without
  PP). With PP, at a fixed global batch, smaller TP means more data-parallel ranks and fewer
  micro-batches each, so a larger bubble; across nodes a larger TP also divides the FSDP traffic
  FSDP2 repeats every micro-batch, and can win there;
- a larger micro batch ranks higher (same scenarios, without PP, where it also shrinks the number
  of micro-batches that fill the pipeline);
- at 128K the best layouts use CP (Llama 3.1 70B on 4 p5e with a CP kernel as fast as plain
  attention; with the measured kernel, on 4 p5, where TP alone cannot shard enough);
- 405B at 128K on 1024 H100s needs PP or TP x CP >= 16: every layout that fits has one;
- at 8K on 128 H100s (Llama 3 8B, 8M tokens per step), plain FSDP beats adding PP 2 (-14% to -19%:
  the bubble with 8 micro-batches per stage), CP 2 (-12% with the current kernel, -4% to -6% with
  allgather or ulysses) or TP 2 (-7%), as published sweeps found. The earlier per-GPU model,
  which gave every node-spanning collective one GPU's NIC share, had PP 2 1.3-1.4x faster and CP 2
  about 1.9x slower than plain FSDP at micro batch 1.

## The shipped recipes

{recipes}

## Search speed

{bench_start}
{bench}
{bench_end}

## What is weak

- Absolute numbers: the held-apart points miss part of issue 23's goal (the list under the
  table says which). Megatron-Bridge's dense rows repeat two layouts on four containers whose
  speed rose by up to 12% (70B 1,602 to 1,664, 405B 292 to 328 tokens/s/GPU), and its MoE rows
  one Qwen3-30B-A3B layout at 5,113 and 9,058: the model prices a layout, not a container. The
  MoE source's ranking is between its two models: Qwen3-235B-A22B ran at a higher model FLOP/s
  per GPU (233-253 TFLOP/s) than Qwen3-30B-A3B (118-208), and the model puts them the other way
  round, the 30B rows 15-18% over (elementwise work 37-40% of their predicted step) and the 235B
  rows 9-15% under (the all-to-alls 44%, after what moe_a2a_overlap hides). Which term is wrong
  needs a GPU measurement of one MoE layer's step on H100s, not a constant fitted
  to these rows. torchtitan's 8B rows at 8K stay over-predicted (7-19%: the
  500 W part's peak sits at the bottom of its source's range, where its fitted rows push it, and
  is not a measurement; early CP, async TP), NeMo 24.07's small layouts without TP
  over-predicted (GPT-3 5B, Llama 2 7B and 13B, +8% to +10%) and its GPT-3 175B on 512 GPUs
  under-predicted (-9%), which is what keeps that source's Spearman under 0.8. A 10% predicted gap between
  two layouts is within the noise.
- No layout that ran says `oom` for our program now; three did, and each closed by holding less
  in the entrypoints, not by pricing less:
  - Qwen3-30B-A3B at PP 2, micro-batch 2: torchao's `_Float8GroupedMM` keeps the experts' rows
    and w2's input in bf16 for backward where TE keeps 1-byte FP8 copies, 0.17 GiB per layer and
    micro-batch with rank 0 holding 49 of them (48 warmup forwards of one-layer chunks). The
    entrypoints now keep the per-group column-wise float8 copies the weights' gradients read,
    made in forward (entrypoints/model/fp8_experts.py): `oom` 83.1 GiB to `risky` 74.1 (with
    the force-balanced routing its config sets, priced as training.moe_force_load_balance; our
    static state matches Megatron's: fp32 masters and moments of the local experts, bf16
    weights and gradients). The traced grid's FP8-experts config checks it (14.35 to 13.29 GiB
    traced); the kernels' path against torchao's own function needs a GPU
    (scripts/gpu_moe_check.py).
  - The Llama 3 paper's 405B at 8K on 8,192 and 16,384 GPUs (TP 8, PP 16 x 8, 32 and 16
    micro-batches), which the paper says ran without activation checkpointing. The paper's
    split gives V = 8 (its row's note), which our program runs (`stage_layer_counts`), letting
    a sent chunk output go (_release_sent_outputs in entrypoints/parallel/pipeline.py, as
    Megatron-Core's deallocate_output_tensor). Rank 1 on 8,192 GPUs holds 141 one-layer
    forwards ((v - 1) x p + 2(p - 1 - r) + 1 chunks, the count Megatron-Core's interleaved
    schedule keeps with N = p). Each kept the set Megatron-Core keeps per layer (norm inputs
    and outputs, q/k/v, the attention output, w1 x, w3 x and their product, w2's input): 0.50
    GiB, 87.5 GiB in all (80.1 on 16,384 GPUs). Our dense blocks now keep no copy of the
    product: backward makes it again from w1 x and w3 x, an elementwise pass
    (entrypoints/model/swiglu.py `product_recomputed`, bitwise the same gradients; priced in
    `product_recompute_time`), which leaves 0.40 GiB per layer-forward: `risky` 72.4 and 66.5
    GiB. Fujii et al.'s accounting of Megatron-LM (the estimator's `--mode megatron`, 454 runs)
    puts the 8,192-GPU layout at 102.6 GiB, its activations alone at 84.3; what the paper's own
    program did to fit is not published.

- Kernel rates come from one H200 with torch 2.11 and short runs; the sustained-clock correction
  comes from one GEMM held for a minute. H100 rates are taken to equal H200 ones except for memory
  bandwidth. No multi-GPU measurement of our own code exists: every communication constant is from
  datasheets and NCCL's tests (about 80% of link bandwidth). The node-aggregate ring ignores
  NCCL's tree and NVLS algorithms and the contention between mesh dimensions whose collectives
  overlap in time (FSDP prefetch during TP's). All-to-alls across nodes (EP, Ulysses) are priced
  at one GPU's NIC share for what leaves the node, NCCL's PXN routing and its own overheads aside.
- The allgather CP kernel's speed was measured at one sequence length (32K) on one H100 and
  is keyed by the queries each rank holds; below 4K per rank it is extrapolated. The ulysses
  kernel's (1.0 of plain attention) is a target, not a measurement; the accumulation modes'
  overlap is the same fixed fraction as before. Published CP runs at 32K and beyond imply 0.57-0.72
  of plain attention ("What the published CP rows imply"), under what ours measured; all are
  priced at one 0.58 (PUBLISHED_CP), which fits Transformer Engine's ring and not torchtitan's
  8B at 64K.
- No published sweep varies layouts on one model at a fixed GPU count in enough points: the two
  sweeps of 10 or more mix models and sequence lengths, so their Spearman (over model FLOP/s)
  tests the model's sense of efficiency across shapes more than its choice among layouts.
- FP8 without torch.compile rests on one measurement of a 1B model; how the eager cast overhead
  scales to 70B/405B shapes is extrapolated.
- FP8 casts under torch.compile are inductor's byte counts on its CPU backend
  (scripts/fp8_cast_bytes.py), one block without TP or FSDP: the graphs are the GPU's, Triton's
  fusion may differ, and a GPU run has not timed them. Transformer Engine's casts are counted
  from its source, not measured.
- Transformer Engine's userbuffers overlap is priced from its source and the runs' configs, not
  from a timing: a copy-engine ring step is taken to cost its GEMM nothing, a kernel on `num_sm`
  SMs to take that share of the GEMM's 132 and to move bytes at the link's full rate however few
  SMs it has, and the final sum of a ring reduce-scatter's chunks is left out. NeMo's pipelined
  reduce-scatters are split in 4 chunks, priced with the GEMM efficiency of t chunks.
- Overlap is a fixed fraction per collective, not a schedule; the pipeline's stages are taken as
  equal but for the last one's output layer and the ranks with the most layers; PP send/recv is
  hidden only under Megatron's overlap_p2p_comm with an interleaved schedule (`p2p_overlap`,
  behind one chunk's compute), which the entrypoints do not run.
- Only one instance type is searched per call; mixed fleets and spot interruptions are not costed.
- Mixture of experts: routing is priced balanced (the memory estimate prices a bound above it),
  the grouped GEMM at the dense GEMM efficiency with a rows-per-expert factor. One measurement of
  our MoE layer sets a constant: its bf16 layer on one H100 (docs/gpu_check_h100.md) fits
  `moe_permute_bytes` (14.1 bytes per permuted element where one read and one write would be 4),
  so our eager permutes cost the layer more than its experts' SwiGLU and about as much as its
  GEMMs. One shape was measured (8,192 tokens, no EP): the per-element cost is taken to hold at
  other widths and under EP's extra regrouping, and under torch.compile, which the measurement
  did not run. The published MoE rows ran Transformer Engine's fused permutes and are priced at
  4 bytes (`moe_permute_fusion`); no GPU run of ours has timed those kernels. The FP8 layer is not
  fitted: it ran the single-tensor column-scale kernel that the dual-kernel fix
  (entrypoints/model/fp8_experts.py) replaced, and its experts-only FP8 time is torchao's own
  function, which casts the rows twice as often as ours; neither is the program that runs now.
  There torchao's FP8 grouped GEMMs with their casts ran at half the bf16 grouped GEMM's rate
  (8.30 against 4.11 ms at 512 rows per expert, where the model's terms give 7.46 and 3.93), and
  the whole layer with FP8 experts took 14.5 ms against 8.5 ms with bf16 ones (1.7 x); the model
  prices a step of the 26.06 Qwen3-30B-A3B row's layout 1.16 x slower with FP8 experts (10,416
  against 12,050 tokens/s/GPU; our program, with its eager permutes, 7,723 against 8,586).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/planner.md is out of date")
    args = parser.parse_args()
    try:
        text = render(existing_bench())
    except BenchmarkError as err:  # one line: which row, what is wrong, what is valid
        sys.exit(f"docs/{err}")
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            sys.exit(f"{DOC.relative_to(ROOT)} is out of date: run python scripts/planner_calibration.py")
        return
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
