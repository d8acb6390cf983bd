"""`launcher plan` and the `predicted` block of `launcher estimate --json`, through the real CLI."""

from __future__ import annotations

import json
import re

import pytest

from launcher import catalog
from tests import REPO

RECIPES = REPO / "recipes"

JSON_KEYS = {
    "tensor",
    "context",
    "pipeline",
    "virtual_stages",
    "pipeline_schedule",
    "data_shard",
    "data_replicate",
    "micro_batch_size",
    "activation_checkpointing",
    "fp8",
    "instance_type",
    "instance_count",
    "memory_utilization",
    "per_gpu_peak_bytes",
    "tokens_per_s_per_gpu",
    "mfu",
    "step_time_s",
    "usd_per_million_tokens",
}


def test_plan_prints_the_ranked_table_and_why_the_best_wins(cli):
    result = cli("plan", RECIPES / "llama3-8b-8k.yaml", "--top", "4")
    assert result.code == 0, result.err
    header = result.out.splitlines()[0]
    assert header == "llama3-8b, 8192 tokens on 1 x ml.p5.48xlarge (8 x h100-80gb)"
    for column in (
        "tensor",
        "context",
        "pipeline",
        "shard",
        "replicate",
        "micro",
        "AC",
        "fp8",
        "peak",
        "MFU",
        "$ per 1M",
    ):
        assert column in result.out
    rows = [line for line in result.out.splitlines() if line.strip()[:2] in {"1 ", "2 ", "3 ", "4 "}]
    assert len(rows) == 4
    assert " is fastest at " in result.out and "tokens/s/GPU" in result.out
    assert "The recipe's own layout (data_shard 8, micro batch 1, selective AC)" in result.out


def test_plan_json_lists_layouts_named_like_the_recipe_fields(cli):
    result = cli("plan", RECIPES / "llama70b-128k.yaml", "--json", "--top", "3", "--gpus", "64")
    assert result.code == 0, result.err
    layouts = json.loads(result.out)
    assert len(layouts) == 3
    for layout in layouts:
        assert JSON_KEYS <= set(layout)
        assert layout["instance_count"] == 8
        assert (
            layout["tensor"] * layout["context"] * layout["pipeline"] * layout["data_shard"] * layout["data_replicate"]
            == 64
        )
    speeds = [layout["tokens_per_s_per_gpu"] for layout in layouts]
    assert speeds == sorted(speeds, reverse=True)


def test_plan_takes_set_overrides(cli):
    result = cli("plan", RECIPES / "llama3-8b-8k.yaml", "--json", "--top", "1", "--set", "training.seq_len=4096")
    assert result.code == 0, result.err
    assert json.loads(result.out)[0]["tokens_per_s_per_gpu"] > 0


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--instance-type", "ml.p9.huge"], "--instance-type: 'ml.p9.huge' is not a known instance type"),
        (["--gpus", "12"], "--gpus 12 is not a multiple of the 8 GPUs of one ml.p5.48xlarge; use e.g. 8 or 16"),
        (
            [
                "--instances",
                "1",
                "--set",
                "training.seq_len=131072",
                "--set",
                "parallel.context=8",
                "--set",
                "model=llama3.1-405b",
            ],
            "no layout of llama3.1-405b at 131072 tokens fits in 80% of h100-80gb memory",
        ),
    ],
)
def test_bad_plan_input_is_one_line_and_exit_2(cli, args, line):
    result = cli("plan", RECIPES / "llama3-8b-8k.yaml", *args)
    assert result.code == 2
    assert len(result.err_lines) == 1
    assert result.err_lines[0].startswith(line)
    assert "Traceback" not in result.err


def test_plan_on_the_host_cpu_ranks_layouts_on_the_measured_cpu_rates_per_cpu_rank_and_says_so(cli):
    result = cli("plan", RECIPES / "tiny-cpu.yaml", "--top", "3")
    assert (result.code, result.err) == (0, ""), result.err
    assert "/CPU rank" in result.out and "/GPU" not in result.out
    assert " tokens/s per CPU rank: " in result.out and "tokens/s/GPU" not in result.out and "nan" not in result.out
    measured_on = catalog.host_cpu_rates().measured_on
    assert (
        f"note: the host CPU has no datasheet peak: speeds are this layout's counted work at the seconds per unit "
        f"measured on {measured_on} (launcher/catalog/host_cpu.yaml), with {catalog.host_cores()} cores here; "
        "tokens/s are per CPU rank"
    ) in " ".join(result.out.split())
    plans = json.loads(cli("plan", RECIPES / "tiny-cpu.yaml", "--top", "3", "--json").out)
    assert len(plans) == 3 and all(plan["tokens_per_s_per_gpu"] > 0 and plan["mfu"] is None for plan in plans)


def test_plan_of_an_moe_model_on_the_host_cpu_searches_expert_parallelism(cli):
    result = cli("plan", RECIPES / "tiny-cpu.yaml", "--set", "model=qwen3-moe-tiny", "--top", "300", "--json")
    assert (result.code, result.err) == (0, ""), result.err
    experts = {plan["expert"] for plan in json.loads(result.out)}
    assert experts >= {1, 2, 4}, experts


def test_the_count_of_faster_layouts_that_do_not_fit_is_of_those_faster_than_the_best_whatever_top_is():
    from launcher import api

    recipe = api.load(RECIPES / "llama70b-128k.yaml")
    counts = {api.plan_search(recipe, api.SearchOptions(top=top)).faster_but_too_big for top in (1, 3, 10)}
    assert len(counts) == 1 and counts.pop() > 0


def test_estimate_json_carries_the_predicted_throughput(cli):
    result = cli("estimate", RECIPES / "llama3-8b-8k.yaml", "--json")
    assert result.code == 0, result.err
    predicted = json.loads(result.out)["predicted"]
    assert set(predicted) == {"tokens_per_s_per_gpu", "mfu", "step_time_s"}
    assert predicted["tokens_per_s_per_gpu"] > 0 and 0 < predicted["mfu"] < 1


def test_estimate_json_predicts_a_cpu_step_with_no_mfu(cli):
    result = cli("estimate", RECIPES / "tiny-cpu.yaml", "--json")
    assert result.code == 0, result.err
    predicted = json.loads(result.out)["predicted"]
    assert predicted["mfu"] is None and predicted["tokens_per_s_per_gpu"] > 0 and predicted["step_time_s"] > 0


def test_submit_auto_plan_applies_the_best_layout_and_shows_what_changed(cli):
    result = cli("submit", RECIPES / "llama3-8b-8k.yaml", "--auto-plan", "--dry-run", "--json")
    assert result.code == 0, result.err
    lines = result.err_lines
    assert lines[0].startswith("auto-plan: ") and lines[0].endswith("% faster than the recipe's layout); changed:")
    changes = [line.strip() for line in lines[1:] if line.startswith("  ")]
    assert "parallel.activation_checkpointing: selective -> none" in changes
    assert any(line.startswith("memory: fits") for line in lines)
    assert json.loads(result.out)  # the rendering of the changed recipe


def test_auto_plan_says_a_faster_recipe_layout_does_not_fit_rather_than_a_negative_gain(cli):
    oom = ("--set", "training.micro_batch_size=4", "--set", "parallel.activation_checkpointing=none")
    result = cli("submit", RECIPES / "llama3-8b-8k.yaml", *oom, "--auto-plan", "--dry-run", "--json")
    assert result.code == 0, result.err
    head = result.err_lines[0]
    assert "-" not in head.split("predicted")[1] and head.endswith(
        "% slower than the recipe's layout, which needs 176% of GPU memory); changed:"
    ), head


def test_auto_plan_keeps_a_recipe_that_already_has_the_best_layout():
    from launcher.plan.apply import auto_plan
    from launcher.recipe import Recipe

    first = auto_plan(Recipe.load(RECIPES / "llama3-8b-8k.yaml"))
    assert first.recipe.layout == first.best.layout
    second = auto_plan(first.recipe)
    assert second.changes == {}
    assert second.recipe is first.recipe
    assert second.lines()[0].startswith("auto-plan: the recipe's layout is already the best")


def test_the_reasons_line_names_the_expert_degree_that_sets_two_layouts_apart(cli):
    """Two layouts that differ only in expert parallelism (Mixtral at 64K on 16 H100s: EP 2 and
    4): the line says which has expert 4."""
    result = cli("plan", REPO / "recipes" / "qwen3-30b-a3b-64k.yaml", "--set", "model=mixtral-8x7b", "--top", "2")
    assert result.code == 0, result.err
    assert re.search(r"the runner-up \([^)]*expert 4[^)]*\)", result.out), result.out
