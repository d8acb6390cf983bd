"""Catalog numbers against the published parameter counts and the rules that use them."""

from __future__ import annotations

import pytest

from launcher import catalog
from launcher.contract.layout import tensor_choices

# Parameter counts as published on each model card (billions, rounded as published).
PUBLISHED_PARAMS_B = {
    "llama2-7b": 6.74,
    "llama2-13b": 13.02,
    "llama2-70b": 68.98,
    "llama3-8b": 8.03,
    "llama3-70b": 70.55,
    "llama3.1-8b": 8.03,
    "llama3.1-70b": 70.55,
    "llama3.1-405b": 405.85,
    "llama3.2-1b": 1.24,
    "llama3.2-3b": 3.21,
    "mistral-7b": 7.25,
    "qwen3-8b": 8.2,  # "Number of Parameters: 8.2B" (Qwen/Qwen3-8B): QK-norm and head_dim counted
    "mixtral-8x7b": 46.7,  # "46.7B total parameters" (Mixtral of Experts, arXiv 2401.04088)
}


@pytest.mark.parametrize("name, billions", PUBLISHED_PARAMS_B.items())
def test_parameter_count_matches_the_model_card(name, billions):
    assert catalog.models()[name].num_params() / 1e9 == pytest.approx(billions, abs=0.01)


def test_every_model_has_a_valid_shape_and_a_source():
    for name, arch in catalog.models().items():
        assert arch.shape_problems() == [], name
        assert arch.source, name


def test_llama31_models_carry_rope_scaling_and_128k_context():
    for name in ("llama3.1-8b", "llama3.1-70b", "llama3.1-405b"):
        arch = catalog.models()[name]
        assert arch.max_context == 131072
        assert arch.rope_scaling.factor == 8.0 and arch.rope_scaling.original_max_context == 8192


def test_tiny_models_train_on_a_cpu():
    for name in ("llama-tiny", "llama3.1-tiny"):
        assert catalog.models()[name].num_params() < 1_000_000


def test_instances_name_known_accelerators_and_carry_prices():
    accelerators = catalog.accelerators()
    for key, instance in catalog.instance_types().items():
        if key == "local":
            continue
        assert instance.accelerator in accelerators
        if instance.accelerator == "cpu":  # a CPU instance: processes come from cluster.nproc_per_node
            assert instance.gpus_per_node is None and instance.usd_per_hour > 0 and instance.price_source
            continue
        assert instance.gpus_per_node == 8
        assert instance.usd_per_hour > 0 and instance.price_date and instance.price_source


def test_efa_facts():
    instances = catalog.instance_types()
    assert instances["ml.p5.48xlarge"].efa_interfaces == 32
    assert instances["ml.p5e.48xlarge"].efa_interfaces == 32
    assert instances["ml.p5en.48xlarge"].efa_interfaces == 16
    assert all(instances[k].has_efa for k in ("ml.p5.48xlarge", "ml.p5e.48xlarge", "ml.p5en.48xlarge"))


def test_only_hopper_has_fp8():
    has_fp8 = {key for key, acc in catalog.accelerators().items() if acc.has_fp8}
    assert has_fp8 == {"h100-80gb", "h100-96gb-500w", "h200-141gb"}


def test_a_peak_outside_its_bounds_is_refused():
    entry = catalog.accelerators()["h100-96gb-500w"].model_dump()
    with pytest.raises(ValueError, match=r"peak_bf16_tflops 884.0 lies outside its bounds \[800.0, 850.0\]"):
        catalog.Accelerator(**{**entry, "peak_bf16_tflops": 884, "peak_bf16_tflops_bounds": (800, 850)})


def test_host_cpu_memory_is_read_from_this_machine():
    assert catalog.accelerators()["cpu"].memory_bytes > 1 << 30


def test_tensor_choices_divide_both_head_counts():
    assert tensor_choices(catalog.models()["llama3.1-70b"], 8) == [1, 2, 4, 8]
    assert tensor_choices(catalog.models()["llama2-13b"], 8) == [1, 2, 4, 5, 8]
    assert tensor_choices(catalog.models()["llama3.2-3b"], 8) == [1, 2, 4, 8]


def test_a_head_dim_of_its_own_counts_its_own_projection_widths():
    # qwen3-tiny: 8 heads of 32 (256 wide) on a 128 hidden size, QK-norm, tied embeddings.
    arch = catalog.models()["qwen3-tiny"]
    attention = 2 * 128 * 256 + 2 * 128 * 4 * 32 + 2 * 32
    block = attention + 3 * 128 * 352 + 2 * 128
    assert (arch.head_dim, arch.q_dim) == (32, 256)
    assert arch.num_params() == 512 * 128 + 4 * block + 128


def test_qwen3_moe_counts_every_expert_and_the_router():
    # The model card: "Number of Parameters: 30.5B in total" (one decimal: within 0.05B).
    arch = catalog.models()["qwen3-30b-a3b"]
    assert arch.num_params() / 1e9 == pytest.approx(30.5, abs=0.05)
    assert arch.moe.layer_params(2048) == 128 * 2048 + 128 * 3 * 2048 * 768


def test_qwen3_235b_counts_the_model_cards_235b_of_which_22b_are_active():
    # The model card: "235B in total and 22B activated" (whole billions: within 0.5B); active:
    # every parameter but the 120 of 128 experts a token skips in each of the 94 layers.
    arch = catalog.models()["qwen3-235b-a22b"]
    moe = arch.moe
    skipped = arch.num_layers * (moe.num_experts - moe.top_k) * moe.expert_params(arch.hidden_size)
    assert arch.num_params() / 1e9 == pytest.approx(235, abs=0.5)
    assert (arch.num_params() - skipped) / 1e9 == pytest.approx(22, abs=0.5)


@pytest.mark.parametrize(
    "package, filename",
    [
        ("launcher.catalog", name)
        for name in ("accelerators.yaml", "engines.yaml", "host_cpu.yaml", "instances.yaml", "models.yaml")
    ]
    + [("launcher.backends", "dlc_images.yaml")],
)
def test_packaged_yaml_reads_as_pure_python_safe_load_reads_it(package, filename):
    """libyaml's parser (catalog/packaged_yaml.py) gives every shipped file the values PyYAML's own
    SafeLoader gives it, and is the one in use where PyYAML was built with it."""
    from importlib.resources import files

    import yaml

    from launcher.catalog.packaged_yaml import SAFE_LOADER, load_packaged

    assert SAFE_LOADER is (yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader)
    text = files(package).joinpath(filename).read_text()
    assert load_packaged(package, filename) == yaml.load(text, Loader=yaml.SafeLoader)
