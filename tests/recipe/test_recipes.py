"""Good recipes: the shipped ones, extends, overrides, the Python API and the JSON Schema."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import jsonschema
import pytest
import yaml

from launcher import api
from launcher.errors import RecipeError
from launcher.recipe import Recipe
from tests import REPO

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def test_recipes_directory_has_the_promised_recipes():
    names = {path.stem for path in RECIPES}
    assert {
        "llama70b-128k",
        "llama3-8b-8k",
        "llama3-8b-128k-cp",
        "llama405b-128k",
        "mistral7b-32k",
        "tiny-cpu",
    } <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(cli, path):
    result = cli("validate", path)
    assert result.code == 0, result.err
    assert result.out.startswith("ok ")
    # Not even a warning, but for the one thing each user must fill in: the SageMaker recipes'
    # execution role is AWS's documentation account, which submit refuses.
    sagemaker = Recipe.load(path).cluster.backend == "sagemaker"
    assert result.err_lines == (
        [
            f"warning: {path}: sagemaker.role_arn: 111122223333 is an example account of AWS's documentation, not "
            "yours; set your execution role, e.g. --set sagemaker.role_arn=arn:aws:iam::<your account>:role/<name>; "
            "submit refuses it"
        ]
        if sagemaker
        else []
    )


def test_a_recipe_with_its_own_role_validates_without_a_warning(cli):
    result = cli(
        "validate",
        REPO / "recipes" / "llama70b-128k.yaml",
        "--set",
        "sagemaker.role_arn=arn:aws:iam::314159265358:role/r",
    )
    assert (result.code, result.err) == (0, "")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_declares_the_schema_for_editors(path):
    assert path.read_text().startswith("# yaml-language-server: $schema=../docs/recipe.schema.json\n")


def test_llama70b_recipe_is_what_the_readme_promises():
    recipe = Recipe.load(REPO / "recipes" / "llama70b-128k.yaml")
    assert recipe.model_name == "llama3.1-70b"
    assert recipe.training.seq_len == 131072
    assert recipe.precision.fp8
    assert recipe.layout.context > 1
    assert recipe.cluster.instance_type == "ml.p5e.48xlarge"


@pytest.fixture(scope="module")
def schema():
    from launcher.recipe.schema_export import recipe_json_schema

    return recipe_json_schema()


def test_schema_command_prints_the_committed_schema(cli, schema):
    result = cli("schema")
    assert result.code == 0
    assert json.loads(result.out) == schema
    # The file editors load is the command's output; regenerate with `launcher schema > docs/recipe.schema.json`.
    assert json.loads((REPO / "docs" / "recipe.schema.json").read_text()) == schema


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_schema_accepts_every_shipped_recipe(schema, path):
    jsonschema.Draft202012Validator.check_schema(schema)
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(yaml.safe_load(path.read_text())))
    assert errors == []


def test_schema_rejects_what_validation_rejects(schema):
    validator = jsonschema.Draft202012Validator(schema)
    assert not validator.is_valid(
        {
            "name": "x",
            "model": "llama3-8b",
            "training": {"seq_len": 8, "global_batch_size": 1, "steps": 1},
            "trainin": {},
        }
    )
    assert not validator.is_valid(
        {"name": "x", "model": "llama3-8b", "training": {"seq_len": 8, "global_batch_size": 1}}
    )
    assert not validator.is_valid(
        {"name": "x", "model": 3, "training": {"seq_len": 8, "global_batch_size": 1, "steps": 1}}
    )
    assert validator.is_valid({"extends": "base.yaml", "parallel": {"context": 4}})


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_extends_deep_merges_and_child_wins(tmp_path):
    write(
        tmp_path,
        "base.yaml",
        """\
        name: base
        model: llama3.1-8b
        training: {seq_len: 8192, global_batch_size: 16, steps: 100, optimizer: {lr: 1.0e-4, warmup_steps: 10}}
        cluster: {backend: sagemaker, instance_type: ml.p5.48xlarge}
        sagemaker: {region: us-east-1, tags: {team: a}}
        """,
    )
    child = write(
        tmp_path,
        "child.yaml",
        """\
        extends: base.yaml
        name: child
        training: {seq_len: 32768, optimizer: {lr: 2.0e-4}}
        parallel: {context: 2}
        sagemaker: {tags: {run: b}}
        """,
    )
    recipe = Recipe.load(child)
    assert recipe.name == "child"
    assert recipe.training.seq_len == 32768
    assert recipe.training.steps == 100  # from the parent
    assert recipe.training.optimizer.lr == 2.0e-4
    assert recipe.training.optimizer.warmup_steps == 10  # merged, not replaced
    assert recipe.sagemaker.tags == {"team": "a", "run": "b"}
    assert recipe.layout.context == 2 and recipe.layout.data_shard == 4


def test_problems_in_a_parent_point_at_the_parent(tmp_path, cli):
    write(
        tmp_path,
        "base.yaml",
        "name: base\nmodel: llama3-8b\ntraining: {seq_len: 8192, global_batch_size: 16, steps: 1}\nparallel:\n  tensor: 3\n",
    )
    write(
        tmp_path,
        "child.yaml",
        "extends: base.yaml\nname: child\ncluster: {backend: sagemaker, instance_type: ml.p5.48xlarge, instance_count: 3}\n",
    )
    with pytest.raises(RecipeError) as error:
        Recipe.load(tmp_path / "child.yaml")
    tensor = [p for p in error.value.problems if p.path == "parallel.tensor"]
    assert tensor and tensor[0].source.endswith("base.yaml:5")


def test_overrides_are_typed_by_the_schema(tmp_path):
    path = REPO / "recipes" / "llama3-8b-128k-cp.yaml"
    recipe = api.load(path, set_options=["parallel.context=4", "training.seq_len=65536", "precision.fp8=true"])
    assert recipe.layout.context == 4 and recipe.layout.data_shard == 2
    assert recipe.training.seq_len == 65536
    assert recipe.precision.fp8 is True
    same = Recipe.load(path, {"parallel.context": 4, "training.seq_len": 65536, "precision.fp8": True})
    assert same == recipe


def test_override_replaces_a_whole_model_reference(tmp_path):
    recipe = api.load(
        REPO / "recipes" / "tiny-cpu.yaml", set_options=["model={base: llama3.1-8b, num_layers: 2, vocab_size: 1024}"]
    )
    assert recipe.arch.num_layers == 2 and recipe.arch.hidden_size == 4096 and recipe.arch.vocab_size == 1024


def test_override_into_a_scalar_says_how_to_set_it_whole(cli):
    result = cli("validate", REPO / "recipes" / "tiny-cpu.yaml", "--set", "model.num_layers=2")
    assert result.code == 2
    assert result.err_lines == [
        "--set model.num_layers: model is 'llama-tiny', not a mapping; set it whole, e.g. --set model='{...}'"
    ]


def test_show_json_has_the_resolved_layout_and_derived_values(cli):
    result = cli("show", REPO / "recipes" / "llama70b-128k.yaml", "--json")
    assert result.code == 0, result.err
    shown = json.loads(result.out)
    assert shown["parallel"]["data_shard"] == 4  # auto: 32 GPUs / cp 8
    assert shown["parallel"]["world_size"] == 32
    assert shown["model"]["num_layers"] == 80 and shown["model"]["rope_scaling"]["factor"] == 8.0
    assert shown["runtime"]["peak_flops"]["fp8"] == 1979e12
    assert shown["derived"]["instance"] == "4 x ml.p5e.48xlarge"
    assert shown["derived"]["grad_accum_steps"] == 8  # 32 sequences / 4 data-parallel ranks


def test_round_trip_through_dict_and_yaml(tmp_path):
    recipe = Recipe.load(REPO / "recipes" / "mistral7b-32k.yaml")
    assert Recipe.from_dict(recipe.to_dict()) == recipe
    again = tmp_path / "again.yaml"
    again.write_text(recipe.to_yaml())
    assert Recipe.load(again) == recipe
    assert recipe.cluster.max_run == 2 * 86400 and recipe.to_dict()["cluster"]["max_run"] == 172800


def test_with_changes_revalidates():
    recipe = Recipe.load(REPO / "recipes" / "llama3-8b-8k.yaml")
    assert recipe.with_changes({"parallel.tensor": 2}).layout.data_shard == 4
    with pytest.raises(RecipeError, match="parallel.tensor: 3 does not divide"):
        recipe.with_changes({"parallel.tensor": 3})
    assert recipe.layout.tensor == 1  # the original never changes


def test_recipe_is_immutable():
    recipe = Recipe.load(REPO / "recipes" / "tiny-cpu.yaml")
    with pytest.raises(Exception, match="frozen"):
        recipe.name = "other"


def test_bf16_moments_with_a_beta2_finer_than_bf16_is_a_warning_and_0_95_is_not(tmp_path, cli):
    head = "name: r\nmodel: llama3-8b\ncluster: {backend: sagemaker, instance_type: ml.p5.48xlarge}\n"
    training = (
        "training: {seq_len: 8192, global_batch_size: 8, steps: 10, optimizer: {state_dtype: bf16, betas: [0.9, %s]}}\n"
    )
    fine = cli("validate", write(tmp_path, "fine.yaml", head + training % "0.999"))
    assert fine.code == 0 and fine.err.startswith("warning: ")
    assert (
        "fine.yaml: training.optimizer.state_dtype: bf16 with betas[1] 0.999: the second moment's per-step change "
        "(0.10%) is below bf16's resolution (0.39%)"
    ) in fine.err
    coarse = cli("validate", write(tmp_path, "coarse.yaml", head + training % "0.95"))
    assert coarse.code == 0 and "state_dtype" not in coarse.err
    wrong = cli("validate", write(tmp_path, "wrong.yaml", head + training.replace("bf16", "fp16") % "0.95"))
    assert wrong.code != 0 and "training.optimizer.state_dtype" in wrong.err and "'fp32' or 'bf16'" in wrong.err
    assert len(wrong.err.strip().splitlines()) == 1


def test_seq_len_beyond_trained_context_is_a_warning_not_an_error(tmp_path, cli):
    path = write(
        tmp_path,
        "r.yaml",
        "name: r\nmodel: llama3-8b\ntraining: {seq_len: 16384, global_batch_size: 8, steps: 1}\ncluster: {backend: sagemaker, instance_type: ml.p5.48xlarge}\n",
    )
    result = cli("validate", path)
    assert result.code == 0
    assert "warning:" in result.err and "beyond llama3-8b's trained context of 8192 tokens" in result.err


def test_hf_config_builds_the_architecture(tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 688,
        "vocab_size": 1000,
        "max_position_embeddings": 2048,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    }
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    path = write(
        tmp_path,
        "r.yaml",
        "name: r\nmodel: {hf_config: model/config.json}\ntraining: {seq_len: 512, global_batch_size: 2, steps: 1}\ncluster: {device: cpu, nproc_per_node: 2}\n",
    )
    recipe = Recipe.load(path)
    arch = recipe.arch
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.ffn_hidden_size) == (
        256,
        3,
        8,
        2,
        688,
    )
    assert arch.tie_embeddings and arch.rope_scaling.original_max_context == 256 and arch.norm_eps == 1e-6
    assert recipe.model_name == "model"


def test_cli_help_and_validate_import_no_heavy_packages():
    code = textwrap.dedent(f"""\
        import sys
        from launcher.cli import app, main
        sys.argv = ["launcher", "validate", {str(REPO / "recipes" / "llama70b-128k.yaml")!r}]
        try:
            main()
        except SystemExit as e:
            assert e.code in (0, None), e.code
        sys.argv = ["launcher", "--help"]
        try:
            main()
        except SystemExit as e:
            assert e.code in (0, None), e.code
        heavy = sorted(m for m in ("torch", "boto3", "botocore", "sagemaker", "torchao", "tokenizers", "pyarrow") if m in sys.modules)
        print("HEAVY", heavy)
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in result.stdout, result.stdout + result.stderr


def test_console_script_is_installed_and_exits_2_on_bad_input(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [")
    launcher = REPO / ".venv" / "bin" / "launcher"
    command = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "launcher"]
    result = subprocess.run([*command, "validate", str(bad)], capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "YAML syntax error" in result.stderr


def test_a_mixture_of_experts_model_is_estimated_with_its_experts_and_told_how_to_fit(cli):
    # Mixtral 8x7B's 46.7B parameters at 16 bytes each over 8 GPUs: 93 GB of weights and states alone.
    too_big = cli("estimate", REPO / "recipes" / "llama3-8b-8k.yaml", "--set", "model=mixtral-8x7b")
    assert "oom: " in too_big.out and "largest: optimizer_states" in too_big.out, too_big.out + too_big.err
    assert "suggestion: " in too_big.out and "raise cluster.instance_count to 2" in too_big.out
    split = cli(
        "estimate",
        REPO / "recipes" / "llama3-8b-8k.yaml",
        "--set",
        "model=qwen3-30b-a3b",
        "--set",
        "parallel.expert=8",
    )
    assert "dp_shard8xep8" in split.out, split.out + split.err
    assert "note: experts: each EP rank's routed rows are priced at 1.25x the balanced share" in split.out


def test_submit_says_in_one_line_how_the_experts_run_under_fp8(cli):
    recipe = REPO / "recipes" / "qwen3-30b-a3b-64k.yaml"
    bf16 = cli("submit", recipe, "--dry-run")
    assert bf16.code == 0, bf16.err
    assert (
        "fp8: the experts run in the compute dtype; precision.fp8_experts: true runs them as FP8 grouped GEMMs"
        in bf16.err.splitlines()
    )
    fp8 = cli("submit", recipe, "--dry-run", "--set", "precision.fp8_experts=true")
    assert fp8.code == 0, fp8.err
    assert (
        "fp8: the experts run torchao's rowwise FP8 grouped GEMMs whatever fp8_recipe says, on rows padded "
        "to 16 per expert (on Hopper and Blackwell; elsewhere in the compute dtype)"
    ) in fp8.err.splitlines()
    # Priced: the padded rows and the casts (the recipe's comment says by how much).
    times = [re.search(r"^time: ([\d.]+) s/step", r.err, re.M) for r in (bf16, fp8)]
    assert float(times[1][1]) > float(times[0][1]), bf16.err + fp8.err


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        (
            ["precision.fp8=false"],
            "precision.fp8_experts: it adds the experts to FP8 training; set precision.fp8: true too, or drop it",
        ),
        (
            ["model=llama3.1-8b", "parallel.expert=1"],
            "precision.fp8_experts: this model has no experts (no moe: block in its architecture); drop it",
        ),
        (
            ['model={"base": "qwen3-30b-a3b", "hidden_size": 2056}'],
            "precision.fp8_experts: FP8 grouped GEMMs need the hidden size and the experts' FFN width to be multiples "
            "of 16 (this model: 2056 and 768); drop it",
        ),
    ],
)
def test_fp8_experts_are_refused_where_they_cannot_run(cli, changes, error):
    args = [item for change in ["precision.fp8_experts=true", *changes] for item in ("--set", change)]
    result = cli("validate", REPO / "recipes" / "qwen3-30b-a3b-64k.yaml", *args)
    assert result.code == 2, result.out + result.err
    assert result.err.splitlines() == [f"--set {error}"], result.err


def test_forced_load_balance_prices_the_balanced_share_and_is_refused_without_experts(cli):
    """training.moe_force_load_balance: the estimate drops the routing bound (each EP rank gets the
    balanced share) and says so; a dense model has nothing to balance."""
    recipe = REPO / "recipes" / "qwen3-30b-a3b-64k.yaml"
    dropless = cli("estimate", recipe, "--json")
    forced = cli("estimate", recipe, "--json", "--set", "training.moe_force_load_balance=true")
    assert dropless.code == forced.code == 0, dropless.err + forced.err
    peaks = [json.loads(r.out)["per_gpu_peak_bytes"] for r in (dropless, forced)]
    assert peaks[1] < peaks[0], peaks
    assert (
        "experts: routing is round-robin (training.moe_force_load_balance): every EP rank gets the balanced share"
        in (json.loads(forced.out)["notes"])
    )
    dense = cli(
        "validate",
        recipe,
        "--set",
        "model=llama3.1-8b",
        "--set",
        "parallel.expert=1",
        "--set",
        "training.moe_force_load_balance=true",
    )
    assert dense.code == 2, dense.out + dense.err
    assert dense.err.splitlines() == [
        "--set training.moe_force_load_balance: this model has no experts (no moe: block in its architecture) to "
        "balance; drop it"
    ], dense.err


@pytest.mark.parametrize("recipe", ["qwen3-8b-128k.yaml", "qwen3-30b-a3b-64k.yaml", "mixtral-8x7b-32k.yaml"])
def test_qwen3_and_moe_recipes_may_export_hugging_face_checkpoints(cli, recipe):
    result = cli("validate", REPO / "recipes" / recipe, "--set", "checkpoint.export_hf=true")
    assert result.code == 0, result.err
