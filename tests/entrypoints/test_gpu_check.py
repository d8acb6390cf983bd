"""scripts/gpu_check.sh: refuses a machine without a GPU, and runs end to end on the CPU (--cpu-smoke),
the CP attention speed section (at 256 tokens, kernel names by the profiler) and the MoE layer included."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def test_without_nvidia_smi_it_fails_fast_with_the_reason(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    proc = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "nvidia-smi not found: this check needs an NVIDIA GPU" in proc.stderr
    assert not any(tmp_path.iterdir())


CPU_SMOKE = "scripts/gpu_check.sh --cpu-smoke"


def wants_cpu_smoke(item) -> bool:
    return getattr(item, "originalname", "") == "test_cpu_smoke_trains_and_checks_cp_attention"


def cpu_smoke_work(items, tmp_path_factory, background) -> dict:
    """The smoke run, if its test is selected, beside the serial tests (tests/background.py)."""
    if not any(wants_cpu_smoke(item) for item in items):
        return {}
    out = tmp_path_factory.mktemp("gpu-check")

    def run() -> tuple[subprocess.CompletedProcess, Path]:
        argv = ["bash", str(SCRIPT), "--cpu-smoke", "--out", str(out)]
        return background.run(
            argv, cwd=REPO, env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}, timeout=400
        ), out

    return {CPU_SMOKE: run}


@pytest.mark.torchrun
def test_cpu_smoke_trains_and_checks_cp_attention(_background):
    proc, out = _background.result(CPU_SMOKE)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert set(report["training"]) == {"bf16", "fp8"}
    for name in ("bf16", "fp8"):
        run = report["training"][name]
        assert run["status"] == "ok" and run["steps"] == 3 and run["checkpoint_complete"]
        assert report["estimates"][name]["per_gpu_peak_bytes"] > 0
    for degree in ("cp2", "cp4"):
        assert max(report["cp_attention"][degree]["max_abs_error"].values()) < 1e-5
    assert "cp attention at 512 tokens" in proc.stdout
    speed = report["cp_speed"]
    run = speed["runs"]["256/cpu"]
    cpu_kernel = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert {cpu_kernel, cpu_kernel + "_backward"} <= set(run["cp_kernels"]["ops"])
    assert cpu_kernel in run["full_kernels"]["ops"]
    for degree in (2, 4, 8):
        assert len(run[f"cp{degree}"]["rank_ms"]) == 2 and run[f"cp{degree}"]["tflops_per_rank"] > 0
    assert speed["hypothesis"]["verdict"] == "not applicable: the CPU has one fused kernel"
    assert cpu_kernel in speed["hypothesis"]["masked_cp4_rank1"]["ops"]
    assert "cp attention speed (4/2 heads x 16" in proc.stdout
    # The MoE layer against the dense layer of equal active FLOPs, every path a CPU runs.
    moe = report["moe_layer"]
    assert set(moe["layers"]) == {"dense", "dense_fp8", "moe", "moe_fp8", "moe_fp8_bf16_experts"}
    assert all(entry["ms"] > 0 for entry in moe["layers"].values())
    # precision.fp8_experts's layer runs its experts in FP8 (emulated here), the other does not.
    assert moe["layers"]["moe_fp8"]["fp8_experts"] and not moe["layers"]["moe_fp8_bf16_experts"]["fp8_experts"]
    emulated = moe["fp8_kernel_vs_emulation"]["emulated vs exact"]
    assert all(0.005 < emulated[key] < 0.1 for key in ("out", "grad_x", "grad_w")), emulated
    # The report counts what entrypoints/fp8.py converted: the dense layer's three linears.
    assert moe["layers"]["dense"]["float8_linears"] == 0 and moe["layers"]["dense_fp8"]["float8_linears"] == 3
    assert 1.0 <= moe["layers"]["moe"]["max_over_mean_rows"] < 2.0
    assert moe["experts_only"]["grouped_mm"]["ms"] > 0
    assert moe["experts_only"]["fp8_rowwise"] == {
        "skipped": "torchao's FP8 grouped GEMM runs on CUDA only (Triton casts)"
    }
    assert "moe layer: 256 tokens, hidden 64, 8 experts top-2 x 32 vs dense SwiGLU 64" in proc.stdout
