"""The host-CPU step model (launcher/plan/host_cpu.py): a CPU step is the work its layout counts at
the seconds per unit measured on a host (launcher/catalog/host_cpu.yaml), with the ranks beyond
the cores taking turns. How well it predicts is measured, not asserted here:
scripts/bench_cpu_step.py's held-out layouts, in docs/monitoring.md."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import catalog
from launcher.contract.layout import Layout
from launcher.estimate import Workload
from launcher.plan.forecast import forecast
from launcher.plan.host_cpu import cpu_work
from launcher.plan.throughput import predict
from launcher.recipe import Recipe
from launcher.recipe.hardware import hardware_for
from tests import REPO, load_script

TINY = catalog.models()["llama-tiny"]
RATES = catalog.host_cpu_rates().seconds_per_unit


def cpu(procs: int):
    return hardware_for("local", accelerator_key="cpu", procs_per_node=procs)


def tiny(layout: Layout, *, micro_batch_size=2, grad_accum_steps=1) -> Workload:
    return Workload(
        arch=TINY,
        layout=layout,
        seq_len=256,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        dtype="fp32",
    )


def test_one_rank_costs_its_layers_micro_batches_and_flops_at_the_measured_rates(monkeypatch):
    monkeypatch.setattr(catalog, "host_cores", lambda: 2)
    speed = predict(tiny(Layout(), grad_accum_steps=4), cpu(1))
    # llama-tiny's blocks: q, k, v, o and the SwiGLU MLP; 2 x 256 tokens x 4 micro-batches
    h, kv, f, vocab, layers, tokens = 128, 64, 352, 512, 4, 2048
    block = 2 * h * h + 2 * h * kv + 3 * h * f
    expected = (
        RATES["per_step"]
        + layers * RATES["per_layer"]
        + layers * 4 * RATES["per_layer_micro_batch"]
        + 6 * tokens * (layers * block + h * vocab) / 1e9 * RATES["matmul_gflop"]
        + 6 * tokens * layers * h * 256 / 1e9 * RATES["attention_gflop"]
    )
    assert speed.step_time_s == pytest.approx(expected, rel=1e-12)
    assert speed.tokens_per_s_per_gpu == pytest.approx(tokens / expected)
    assert math.isnan(speed.mfu) and speed.mfu_text() == "-" and speed.to_dict()["mfu"] is None


def test_ranks_beyond_the_cores_take_turns_on_them(monkeypatch):
    workload = tiny(Layout(tensor=2, data_shard=2), grad_accum_steps=2)
    steps = {}
    for cores in (1, 2, 4, 16):
        monkeypatch.setattr(catalog, "host_cores", lambda cores=cores: cores)
        steps[cores] = predict(workload, cpu(4)).step_time_s
    assert steps[1] == pytest.approx(4 * steps[4]) and steps[2] == pytest.approx(2 * steps[4])
    assert steps[16] == steps[4]  # one thread per rank: spare cores do not help


def test_a_cpu_instance_type_shares_its_vcpus_and_slurm_gives_a_core_per_rank(monkeypatch):
    monkeypatch.setattr(catalog, "host_cores", lambda: 1)
    c5 = hardware_for("ml.c5.2xlarge", accelerator_key="cpu", procs_per_node=8)  # 8 vCPUs
    assert c5.cpu_cores == 8 and cpu(8).cpu_cores is None  # local: this machine's, here 1
    workload = tiny(Layout(data_shard=8))
    assert predict(workload, cpu(8)).step_time_s == pytest.approx(8 * predict(workload, c5).step_time_s)
    # Slurm's --cpus-per-task=<ranks> (launcher/backends/slurm.py)
    slurm = hardware_for("local", accelerator_key="cpu", procs_per_node=8, backend="slurm")
    assert slurm.cpu_cores == 8 and predict(workload, slurm).step_time_s == predict(workload, c5).step_time_s


def test_a_pipeline_stretches_its_micro_batches_over_the_bubble_and_idles_its_cores_in_it(monkeypatch):
    monkeypatch.setattr(catalog, "host_cores", lambda: 8)  # no turns taken
    workload = tiny(Layout(pipeline=2), grad_accum_steps=4)
    speed = predict(workload, cpu(2))
    # 2 of 4 layers on the slowest rank, 4 micro-batches in 4 + 1 slots
    per_micro_batch = 2 * 4 * RATES["per_layer_micro_batch"]
    assert speed.breakdown["host_overhead"] == pytest.approx(
        RATES["per_step"] + 2 * RATES["per_layer"] + 5 / 4 * per_micro_batch
    )
    assert speed.breakdown["pipeline_p2p"] == pytest.approx(RATES["pp_step"])
    monkeypatch.setattr(catalog, "host_cores", lambda: 1)
    # busy 4/5 of the step: the two ranks share one core 1.6 times over
    assert predict(workload, cpu(2)).step_time_s == pytest.approx(1.6 * speed.step_time_s)


def test_expert_parallelism_divides_the_expert_loop_and_sends_each_routed_token_to_its_experts_and_back():
    moe = catalog.models()["qwen3-moe-tiny"]  # 8 experts, top-2, hidden 128
    whole, split = (
        cpu_work(dataclasses.replace(tiny(Layout(data_shard=4), grad_accum_steps=2), arch=moe, layout=layout))
        for layout in (Layout(data_shard=4), Layout(data_shard=4, expert=4))
    )
    assert whole["expert_layer_micro_batch"] == 4 * 2 * 8 and split["expert_layer_micro_batch"] == 4 * 2 * 2
    assert "ep_mb" not in whole
    # 4 layers x 2 micro-batches x 4 all-to-alls of 2 x 256 tokens x top-2 x 128 fp32 values, 3/4 leaving the rank
    assert split["ep_mb"] == pytest.approx(4 * 2 * 4 * (2 * 256 * 2 * 128 * 4) * 3 / 4 / 1e6)
    # each rank gathers its 2 local experts over dp_shard 4 / ep 4 = 1 rank: no expert traffic left for FSDP
    assert split["fsdp_mb"] < whole["fsdp_mb"]


def test_tensor_parallel_all_reduces_the_gradient_of_each_weight_it_replicates_every_layer_and_micro_batch():
    """entrypoints/parallel/tensor.py keeps Qwen3's q_norm and k_norm and an MoE's router and
    shared experts replicated over tp (SequenceParallel): each one's gradient is all-reduced over
    tp in every backward. Without TP, or for a Llama block, there are none."""
    models = catalog.models()
    moe = models["qwen3-moe-tiny"]  # q_norm, k_norm and a router; no shared experts
    shared = moe.model_copy(update={"moe": moe.moe.model_copy(update={"shared_experts": 1})})
    counts = {}
    for name, arch in (("llama", TINY), ("qwen3", models["qwen3-8b"]), ("moe", moe), ("shared", shared)):
        work = cpu_work(dataclasses.replace(tiny(Layout(tensor=2), grad_accum_steps=2), arch=arch))
        counts[name] = work["tp_replicated_layer_micro_batch"] / (arch.num_layers * 2)
        untensored = cpu_work(dataclasses.replace(tiny(Layout(data_shard=2), grad_accum_steps=2), arch=arch))
        assert "tp_replicated_layer_micro_batch" not in untensored
    assert counts == {"llama": 0, "qwen3": 2, "moe": 3, "shared": 6}


def test_an_moe_model_on_cpus_is_predicted_and_forecast():
    recipe = Recipe.load(REPO / "recipes" / "tiny-cpu.yaml", {"model": "qwen3-moe-tiny", "parallel.tensor": 1})
    speed = predict(Workload.from_recipe(recipe), recipe.hardware)
    assert speed.step_time_s > 0 and speed.breakdown["host_overhead"] > 0
    assert forecast(recipe, time_limit_s=None).speed == speed


def test_the_shipped_rates_are_the_fit_of_the_stored_measurements():
    """scripts/bench_cpu_step.py --check: the catalog and docs/monitoring.md's table are what
    docs/cpu_step_measured.json gives (no timing runs here)."""
    done = subprocess.run(
        [sys.executable, "scripts/bench_cpu_step.py", "--check"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"held-out: \d+ layouts, median \|error\| \d+%, largest \d+%", done.stdout), done.stdout


def test_measuring_only_new_layouts_is_refused_on_another_cpu(tmp_path, monkeypatch):
    """`bench_cpu_step.py --measure --new` adds to one host's measurements: on a CPU whose model,
    family, model number or stepping differs it stops before it runs anything or writes."""
    bench = load_script("bench_cpu_step")
    stored = json.loads(bench.MEASURED.read_text())
    stored["host"]["cpu"] = "Some CPU (cpu family 0, model 0, stepping 0)"
    measured = tmp_path / "cpu_step_measured.json"
    measured.write_text(json.dumps(stored))
    monkeypatch.setattr(bench, "MEASURED", measured)
    monkeypatch.setattr(bench, "measure_one", lambda changes: pytest.fail(f"measured {changes}"))
    with pytest.raises(SystemExit) as refused:
        bench.measure(new_only=True)
    here = bench._cpu_model()
    if "cpu family" in Path("/proc/cpuinfo").read_text():  # x86's fields; other CPUs name themselves otherwise
        assert re.fullmatch(r".+ \(cpu family \d+, model \d+, stepping \d+\)", here), here
    assert str(refused.value) == (
        "error: --new: cpu_step_measured.json was measured on 'Some CPU (cpu family 0, model 0, stepping 0)' "
        f"and this host is {here!r}; measure every layout here (--measure without --new)"
    )
    assert json.loads(measured.read_text()) == stored
