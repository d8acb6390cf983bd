"""Expert parallelism (issue 24 part 3): one layout rule on both sides, and EP layouts on several
gloo processes that train as one process does (fixture `expert_runs`, expert_jobs.py)."""

from __future__ import annotations

import json

import pytest

from launcher.contract.config import ConfigError, JobConfig
from launcher.contract.layout import Layout, expert_choices, expert_problems

from .entrypoint_jobs import REPO
from .expert_jobs import LAYOUTS, MOE, RESUMED
from .tiny_models import tiny

# fp32 on gloo: the same sums in another order (micro-batches over ranks, experts over ranks).
PARITY = 1e-6


def moe_model(**moe):
    from launcher.contract.config import MoeConfig

    return tiny(moe=MoeConfig(**{**MOE, "expert_ffn_hidden_size": 16, **moe}))


# --- the rule: EP divides the experts and dp_shard x cp x tp ----------------------------------


@pytest.mark.parametrize(
    "layout",
    [
        Layout(data_shard=4, expert=2),
        Layout(data_shard=4, expert=4),
        Layout(data_shard=2, context=2, expert=2),
        Layout(context=4, expert=2),  # smaller than cp: a group is 2 consecutive ranks of dp_shard x cp
        Layout(data_shard=2, tensor=2, expert=2),
        Layout(data_shard=2, tensor=2, expert=4),  # tp ranks route their own tokens: EP spans them
        Layout(tensor=4, expert=2),  # smaller than tp
        Layout(data_replicate=2, data_shard=4, expert=4),
        Layout(data_shard=8, expert=8),
    ],
    ids=str,
)
def test_allows_an_expert_degree_that_divides_the_experts_and_dp_shard_x_cp_x_tp(layout):
    assert expert_problems(layout, moe_model()) == []


def test_rejects_an_expert_degree_that_does_not_divide_the_experts_naming_the_valid_ones():
    (problem,) = expert_problems(Layout(data_shard=6, expert=3), moe_model())
    assert problem == ("parallel.expert", "3 does not divide the model's 8 experts; use 1 or 2")


def test_rejects_an_expert_degree_that_does_not_divide_dp_shard_x_cp_x_tp_naming_the_valid_ones():
    # data_replicate ranks are not borrowed: 8 experts on dp_shard 2 x cp 1 x tp 2.
    (problem,) = expert_problems(Layout(data_shard=2, tensor=2, data_replicate=2, expert=8), moe_model())
    assert problem == (
        "parallel.expert",
        "8 does not divide data_shard 2 x context 1 x tensor 2 = 4, the ranks expert parallelism borrows; "
        "use 1, 2 or 4",
    )
    assert expert_choices(moe_model(), Layout(data_shard=4, context=2)) == [1, 2, 4, 8]
    assert expert_choices(moe_model(), Layout(context=2, tensor=2)) == [1, 2, 4]


@pytest.mark.parametrize("expert", [0, -2])
def test_the_entrypoints_refuse_a_hostile_expert_degree_in_one_line(expert):
    with pytest.raises(ConfigError) as raised:
        JobConfig.from_dict(resolved_moe_config(expert=expert))
    assert str(raised.value) == f"parallel.expert: {expert} is not a degree; use 1, 2 or 4"


def test_rejects_expert_parallelism_of_a_dense_model():
    (problem,) = expert_problems(Layout(data_shard=2, expert=2), tiny())
    assert problem == ("parallel.expert", "2 splits experts, but the model is dense (no moe block); use 1")


def resolved_moe_config(**parallel) -> dict:
    """A 4-rank resolved config of the tiny MoE model (dp_shard 4), with `parallel` changed."""
    from launcher.recipe import Recipe
    from launcher.resolve import resolve

    recipe = resolve(Recipe.load(REPO / "recipes" / "tiny-cpu.yaml", {"parallel.tensor": 1})).concrete
    config = recipe.resolved().to_dict()
    config["model"]["moe"] = MOE
    config["parallel"].update(parallel)
    return config


def test_the_entrypoints_refuse_an_expert_degree_by_the_same_rule_in_one_line():
    with pytest.raises(ConfigError) as raised:
        JobConfig.from_dict(resolved_moe_config(expert=3))
    assert str(raised.value) == "parallel.expert: 3 does not divide the model's 8 experts; use 1, 2 or 4"
    # The degree travels in the resolved config, and a dense config still reads without it.
    assert JobConfig.from_dict(resolved_moe_config(expert=4)).parallel.expert == 4
    dense = JobConfig.from_dict({**resolved_moe_config(), "model": resolved_moe_config()["model"] | {"moe": None}})
    assert "expert" not in dense.to_dict()["parallel"] and dense.parallel.expert == 1


def test_pipelined_moe_layers_with_auxiliary_losses_are_refused_naming_the_pipeline():
    config = resolved_moe_config(pipeline=2, data_shard=2, world_size=4, grad_accum_steps=2)
    with pytest.raises(ConfigError, match=r"^parallel.pipeline: 2 splits the MoE layers whose auxiliary losses"):
        JobConfig.from_dict(config)


@pytest.mark.parametrize(
    "model, expert, message",
    [
        ("mixtral-8x7b", 3, "parallel.expert: 3 does not divide the model's 8 experts; use 1, 2, 4 or 8"),
        (
            "qwen3-30b-a3b",
            16,
            "parallel.expert: 16 does not divide data_shard 8 x context 1 x tensor 1 = 8, the ranks expert "
            "parallelism borrows; use 1, 2, 4 or 8",
        ),
        ("llama3-8b", 2, "parallel.expert: 2 splits experts, but the model is dense (no moe block); use 1"),
    ],
)
def test_validate_reports_the_expert_rule_beside_the_moe_refusal(cli, model, expert, message):
    result = cli(
        "validate",
        REPO / "recipes" / "llama3-8b-8k.yaml",
        "--set",
        f"model={model}",
        "--set",
        f"parallel.expert={expert}",
    )
    assert result.code == 2 and "Traceback" not in result.err
    assert message in result.err


# --- parity with one process -------------------------------------------------------------------


def metrics(job) -> list[dict]:
    return [json.loads(line) for line in (job.output_dir / "metrics.jsonl").read_text().splitlines()]


PARITY_LAYOUTS = [name for name in LAYOUTS if name != "no_ep_dp_shard4"]
# Against one process, gradient norms take the data-parallel layout's own order of sums: with
# expert parallelism off, dp_shard 4 alone is 4e-6 (relative) from one process (measured), so
# EP's own exactness is checked against that same layout without EP, to 1e-6, below.
LAYOUT_GRAD_NORM = 1e-5


@pytest.mark.torchrun
@pytest.mark.parametrize("layout", PARITY_LAYOUTS)
def test_expert_parallel_layout_matches_one_process_loss_and_gradient_norm(expert_runs, layout):
    got = metrics(expert_runs["layouts"][layout])
    want = metrics(expert_runs["references"][LAYOUTS[layout][2]])
    steps = LAYOUTS[layout][0].get("training.steps", 2)
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, steps + 1))
    for mine, theirs in zip(got, want, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=PARITY), (layout, mine["step"])
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=LAYOUT_GRAD_NORM), (layout, mine["step"])


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "layout, without_ep",
    [
        ("ep2_dp_shard4", "no_ep_dp_shard4"),
        ("ep4_dp_shard4", "no_ep_dp_shard4"),
        # 3 experts a rank over expert_fsdp 2, and 6 over dp_shard 4: sharded on dim 1
        ("ep2_dp_shard4_6_experts", "no_ep_dp_shard4_6_experts"),
    ],
)
def test_expert_parallelism_changes_loss_and_gradient_norm_by_float_rounding_only(expert_runs, layout, without_ep):
    got, want = (metrics(expert_runs["layouts"][name]) for name in (layout, without_ep))
    for mine, theirs in zip(got, want, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=PARITY), (layout, mine["step"])
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=PARITY), (layout, mine["step"])


@pytest.mark.torchrun
def test_experts_sharded_on_dim_1_checkpoint_as_the_same_full_tensors(expert_runs):
    """DCP writes the experts FSDP shards on dim 1 (3 a rank over 2 shards under EP 2; 6 over 4
    without EP; under TP 2 with EP 2 over the tp pair, 3 a rank over dp_shard 2) at their global
    offsets: gathered back, the layouts' step-2 weights agree."""
    import torch

    names = ("ep2_dp_shard4_6_experts", "no_ep_dp_shard4_6_experts", "ep2_tp2_dp_shard2_6_experts")
    with_ep, without, under_tp = (expert_runs["layouts"][name].final_model(2) for name in names)
    experts = [name for name in with_ep if ".experts." in name]
    assert len(experts) == 6  # w1, w2, w3 of both layers
    for name in experts:
        assert with_ep[name].shape[0] == 6, name
        torch.testing.assert_close(with_ep[name], without[name], rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(under_tp[name], without[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.torchrun
@pytest.mark.parametrize("name", RESUMED)
def test_experts_sharded_on_dim_1_resume_on_2_ranks_like_the_uninterrupted_run(expert_runs, name):
    """The 4-rank EP 2 checkpoint (experts FSDP-sharded on dim 1) resumed on 2 ranks, with EP 2
    and without: step 3's loss is the loaded model's, and its update the loaded moments'."""
    import torch

    source = expert_runs["layouts"][RESUMED[name][0]]
    resumed = expert_runs["resumed"][name]
    assert [m["step"] for m in metrics(resumed)] == [3]
    uninterrupted = metrics(source)[2]
    assert metrics(resumed)[0]["loss"] == pytest.approx(uninterrupted["loss"], rel=PARITY)
    # 2 data-parallel ranks sum the gradients in another order than 4 (LAYOUT_GRAD_NORM).
    assert metrics(resumed)[0]["grad_norm"] == pytest.approx(uninterrupted["grad_norm"], rel=LAYOUT_GRAD_NORM)
    assert metrics(resumed)[0]["lr"] == uninterrupted["lr"]
    got, want = resumed.final_model(3), source.final_model(3)
    assert got.keys() == want.keys() and sum(".experts." in key for key in got) == 6
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.torchrun
def test_expert_parallel_jobs_announce_the_expert_degree_and_train_with_the_auxiliary_losses(expert_runs):
    for layout in ("dp_shard4xep2", "dp_shard4xep4", "dp_shard2xcp2xep2", "dp_shard2xtp2xep4", "pp2xdp_shard2xep2"):
        assert f"layout={layout} " in expert_runs["stdout"], layout
    # The reference without auxiliary losses is the same model and data: the losses are in the loss.
    with_aux, without = (metrics(expert_runs["references"][name])[0]["loss"] for name in ("moe", "moe-no-aux"))
    assert with_aux - without > 1e-3
