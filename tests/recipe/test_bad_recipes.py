"""Every way a recipe can be wrong gives exit code 2 and one readable line: where, what, what is valid.

Each case is a whole recipe file, so the line number in the message can be checked against the
line a user would edit.
"""

from __future__ import annotations

import json
import re
import textwrap

import pytest

BASE = """\
name: t
model: llama3-8b
training:
  seq_len: 8192
  global_batch_size: 16
  steps: 10
cluster:
  backend: sagemaker
  instance_type: ml.p5.48xlarge
"""


def case(id, text, message, line_of=None, *, options=()):
    return pytest.param(textwrap.dedent(text), message, line_of, options, id=id)


CASES = [
    case(
        "unknown-top-level-key",
        BASE + "trainin: {}\n",
        r"trainin: unknown key \(did you mean training\?\); valid keys here: name, extends, model",
        "trainin:",
    ),
    case(
        "unknown-nested-key",
        BASE.replace("  steps: 10", "  steps: 10\n  seqlen: 4"),
        r"training.seqlen: unknown key \(did you mean seq_len\?\)",
        "seqlen:",
    ),
    case(
        "integer-expected",
        BASE.replace("seq_len: 8192", "seq_len: long"),
        r"training.seq_len: expected an integer, got 'long'",
        "seq_len:",
    ),
    case(
        "float-for-integer",
        BASE.replace("steps: 10", "steps: 2.5"),
        r"training.steps: expected a whole number, got 2.5",
        "steps:",
    ),
    case(
        "bool-expected",
        BASE + "precision: {fp8: maybe}\n",
        r"precision.fp8: expected true or false, got 'maybe'",
        "precision:",
    ),
    case(
        "literal-choice",
        BASE + "parallel:\n  activation_checkpointing: partial\n",
        r"parallel.activation_checkpointing: expected 'none', 'selective' or 'full', got 'partial'",
        "activation_checkpointing:",
    ),
    case(
        "seq-len-above-limit",
        BASE.replace("seq_len: 8192", "seq_len: 4194305"),
        r"training.seq_len: expected at most 4194304, got 4194305",
        "seq_len:",
    ),
    case(
        "seq-len-zero",
        BASE.replace("seq_len: 8192", "seq_len: 0"),
        r"training.seq_len: expected a positive number, got 0",
        "seq_len:",
    ),
    case("missing-required-key", BASE.replace("  steps: 10\n", ""), r"training.steps: is required", "training:"),
    case("section-not-a-mapping", BASE + "parallel: 4\n", r"parallel: expected a mapping, got 4", "parallel:"),
    case(
        "unknown-model",
        BASE.replace("model: llama3-8b", "model: llama3-8bb"),
        r"model: 'llama3-8bb' is not in the model catalog \(did you mean llama3-8b\?\); use llama2-7b, ",
        "model:",
    ),
    case(
        "model-override-unknown-base",
        BASE.replace("model: llama3-8b", "model: {base: llama9-1b, num_layers: 2}"),
        r"model.base: 'llama9-1b' is not in the model catalog",
        "model:",
    ),
    case(
        "model-override-unknown-field",
        BASE.replace("model: llama3-8b", "model:\n  base: llama3-8b\n  layers: 2"),
        r"model.layers: unknown key \(did you mean num_layers\?\)",
        "layers:",
    ),
    case(
        "model-wrong-shape",
        BASE.replace("model: llama3-8b", "model: [llama3-8b]"),
        r"model: expected a catalog name, \{base: NAME, \.\.\.\}, \{hf_config: PATH\} or \{init_from: DIR\}, got a list",
        "model:",
    ),
    case(
        "hf-config-missing",
        BASE.replace("model: llama3-8b", "model: {hf_config: nowhere/config.json}"),
        r"model.hf_config: .*nowhere/config.json does not exist",
        "model:",
    ),
    case(
        "tensor-not-dividing-heads",
        BASE.replace("llama3-8b", "llama3.1-70b")
        .replace("seq_len: 8192", "seq_len: 12288")
        .replace("global_batch_size: 16", "global_batch_size: 24")
        + "  instance_count: 3\nparallel:\n  tensor: 3\n",
        r"parallel.tensor: 3 does not divide 64 attention heads; use 1, 2, 4 or 8$",
        "tensor: 3",
    ),
    case(
        "tensor-beyond-node",
        BASE.replace("llama3-8b", "llama2-13b")
        .replace("seq_len: 8192", "seq_len: 4000")
        .replace("global_batch_size: 16", "global_batch_size: 4")
        + "  instance_count: 5\nparallel:\n  tensor: 10\n",
        r"parallel.tensor: 10 exceeds the 8 GPUs of one node; tensor parallelism needs NVLink, use 1, 2, 4, 5 or 8$",
        "tensor: 10",
    ),
    case(
        "world-size-mismatch",
        BASE + "parallel:\n  tensor: 2\n  data_shard: 2\n",
        r"parallel.data_shard: tensor x context x pipeline x data_replicate x data_shard = 4 GPUs, but 1 x ml.p5.48xlarge has 8; use data_shard 4 or auto",
        "data_shard:",
    ),
    case(
        "degrees-exceed-gpus",
        BASE + "parallel:\n  tensor: 8\n  context: 2\n",
        r"parallel: tensor 8 x context 2 x pipeline 1 x data_replicate 1 = 16 does not divide the 8 GPUs of 1 x ml.p5.48xlarge",
        "parallel:",
    ),
    case(
        "seq-len-not-divisible-for-cp",
        BASE.replace("seq_len: 8192", "seq_len: 8190") + "parallel:\n  context: 2\n",
        r"training.seq_len: 8190 is not divisible by 2 x context 2 x tensor 1 = 4; use e.g. 8188 or 8192",
        "seq_len:",
    ),
    case(
        "global-batch-not-divisible",
        BASE.replace("global_batch_size: 16", "global_batch_size: 12"),
        r"training.global_batch_size: 12 is not a multiple of micro_batch_size 1 x data-parallel size 8 = 8; use a multiple of 8",
        "global_batch_size:",
    ),
    case(
        "too-few-microbatches-for-pipeline",
        BASE.replace("global_batch_size: 16", "global_batch_size: 4") + "parallel:\n  pipeline: 4\n  data_shard: 2\n",
        r"training.global_batch_size: 4 gives 2 micro-batches per step, fewer than the 4 pipeline stages; use at least 8",
        "global_batch_size:",
    ),
    case(
        "tied-embeddings-with-pipeline",
        BASE.replace("llama3-8b", "llama3.2-1b") + "parallel:\n  pipeline: 2\n",
        r"parallel.pipeline: 2 splits a model with tied embeddings over stages; use pipeline: 1$",
        "pipeline: 2",
    ),
    case(
        "virtual-stages-without-interleaving",
        BASE + "parallel:\n  pipeline: 2\n  virtual_stages: 2\n",
        r"parallel.virtual_stages: 2 stages per rank need pipeline_schedule: interleaved_1f1b, not 1f1b",
        "virtual_stages:",
    ),
    case(
        "fp8-on-a100",
        BASE.replace("ml.p5.48xlarge", "ml.p4d.24xlarge") + "precision:\n  fp8: true\n",
        r"precision.fp8: a100-40gb has no FP8 tensor cores; FP8 needs h100-80gb, h100-96gb-500w or h200-141gb \(or device: cpu for tests\)",
        "fp8:",
    ),
    case(
        "unknown-instance-type",
        BASE.replace("ml.p5.48xlarge", "ml.p5.24xlarge"),
        r"cluster.instance_type: 'ml.p5.24xlarge' is not a known instance type \(did you mean ml.p5.48xlarge\?\); use ml.p4d.24xlarge, ",
        "instance_type:",
    ),
    case(
        "malformed-role-arn",
        BASE + "sagemaker:\n  role_arn: SageMakerRole\n",
        r"sagemaker.role_arn: 'SageMakerRole' is not an IAM role ARN; use arn:aws:iam::<12-digit account>:role/<name>",
        "role_arn:",
    ),
    case(
        "malformed-s3-uri",
        BASE + "sagemaker:\n  output_uri: my-bucket/out\n",
        r"sagemaker.output_uri: 'my-bucket/out' is not an S3 URI; use s3://<bucket>/<prefix>",
        "output_uri:",
    ),
    case(
        "malformed-region",
        BASE + "sagemaker:\n  region: us-westish\n",
        r"sagemaker.region: 'us-westish' is not an AWS region; use e.g. us-east-1 or us-west-2",
        "region:",
    ),
    case(
        "max-run-beyond-28-days",
        BASE + "  max_run: 40d\n",
        r"cluster.max_run: 40d exceeds SageMaker's limit of 28 days; use 28d or less",
        "max_run:",
    ),
    case(
        "bad-duration",
        BASE + "  max_run: 5 days\n",
        r"cluster.max_run: '5 days' is not a duration; write e.g. 5d, 12h, 1d12h, 90m or seconds",
        "max_run:",
    ),
    case(
        "spot-wait-shorter-than-run",
        BASE + "  max_run: 2d\nsagemaker:\n  spot: true\n  max_wait: 1d\n",
        r"sagemaker.max_wait: 1d is shorter than cluster.max_run 2d",
        "max_wait:",
    ),
    case(
        "spot-on-a-training-plan",
        BASE
        + "sagemaker:\n  spot: true\n"
        + "  training_plan_arn: arn:aws:sagemaker:us-west-2:210987654321:training-plan/march\n",
        r"sagemaker.training_plan_arn: runs on the plan's reserved capacity, which is not spot: "
        r"remove sagemaker.spot: true \(or the training plan\)",
        "training_plan_arn:",
    ),
    case(
        "max-run-moved-to-cluster",
        BASE + "sagemaker:\n  max_run: 2d\n",
        r"sagemaker.max_run: moved to cluster.max_run: every backend reads it there",
        "max_run:",
    ),
    case(
        "image-uri-moved-to-cluster",
        BASE + "sagemaker:\n  image_uri: x.dkr.ecr.us-west-2.amazonaws.com/mine:1\n",
        r"sagemaker.image_uri: moved to cluster.image: every backend reads it there",
        "image_uri:",
    ),
    case(
        "slurm-shared-dir-relative",
        BASE + "slurm:\n  shared_dir: fsx/launcher\n",
        r"slurm.shared_dir: 'fsx/launcher' is not an absolute path; use e.g. /fsx/launcher",
        "shared_dir:",
    ),
    case(
        "vpc-needs-security-groups",
        BASE + "sagemaker:\n  subnets: [subnet-0abc]\n",
        r"sagemaker.security_group_ids: a VPC needs both subnets and security_group_ids",
        "sagemaker:",
    ),
    case(
        "uint16-with-large-vocab",
        BASE + "data:\n  source: s3://bucket/tokens/\n",
        r"data.dtype: uint16 cannot hold token ids of a 128256-token vocabulary; use uint32",
        "data:",
    ),
    case(
        "local-path-for-sagemaker",
        BASE + "data:\n  source: ./tokens\n  dtype: uint32\n",
        r"data.source: a local path \(.*tokens\) cannot reach a SageMaker job; upload it and use an s3:// URI",
        "source:",
    ),
    case(
        "local-backend-multi-node",
        "name: t\nmodel: llama-tiny\ntraining: {seq_len: 64, global_batch_size: 4, steps: 1}\ncluster:\n  backend: local\n  device: cpu\n  instance_count: 2\n",
        r"cluster.instance_count: the local backend runs on this one machine; use 1, not 2",
        "instance_count:",
    ),
    case(
        "local-cuda-needs-accelerator",
        "name: t\nmodel: llama-tiny\ntraining: {seq_len: 64, global_batch_size: 4, steps: 1}\ncluster:\n  backend: local\n  device: cuda\n",
        r"cluster.accelerator: required for a local cuda machine so memory can be checked; use a100-40gb, a100-80gb, h100-80gb, h100-96gb-500w or h200-141gb",
        "cluster:",
    ),
    case(
        "invalid-name",
        BASE.replace("name: t", "name: my_job!"),
        r"name: 'my_job!' must be letters, digits and single hyphens, starting and ending with a letter or digit",
        "name:",
    ),
    case(
        "yaml-syntax-error",
        "name: t\nmodel: llama3-8b\ntraining:\n  seq_len: [8192\n  steps: 3\n",
        r"YAML syntax error: .*",
        None,
    ),
    case("empty-file", "", r"is empty; a recipe needs at least name, model and training$", None),
    case("comment-only-file", "# nothing here\n", r"is empty; a recipe needs at least name, model and training$", None),
    case(
        "top-level-list",
        "- name: t\n- model: llama3-8b\n",
        r"expected a mapping of keys \(name, model, training, \.\.\.\), got a list$",
        "- name",
    ),
    case("duplicate-key", BASE + "name: again\n", r"name: duplicate key; each key may appear once", "name: again"),
    case("extends-missing-file", "extends: parent.yaml\n" + BASE, r"extends: parent.yaml does not exist", "extends:"),
    case(
        "set-wrong-type",
        BASE,
        r"--set parallel.tensor: expected an integer, got 'two'$",
        None,
        options=("--set", "parallel.tensor=two"),
    ),
    case(
        "set-not-key-value",
        BASE,
        r"--set '(parallel.tensor)' is not KEY=VALUE; write e.g. --set parallel.context=16",
        None,
        options=("--set", "parallel.tensor"),
    ),
    case(
        "set-unknown-key",
        BASE,
        r"--set parallel.tensr: unknown key \(did you mean tensor\?\)",
        None,
        options=("--set", "parallel.tensr=2"),
    ),
]


@pytest.mark.parametrize("text, message, line_of, options", CASES)
def test_bad_recipe_exits_2_with_one_line(tmp_path, monkeypatch, cli, text, message, line_of, options):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.yaml").write_text(text)
    result = cli("validate", "recipe.yaml", *options)

    assert result.code == 2
    assert result.out == ""
    assert "Traceback" not in result.err
    [line] = result.err_lines  # exactly one problem, on one line
    if message is not None:
        assert re.search(message, line), line
    if line_of is not None:
        number = next(i for i, text_line in enumerate(text.splitlines(), 1) if line_of in text_line)
        assert line.startswith(f"recipe.yaml:{number} "), line
    elif not options:
        assert line.startswith("recipe.yaml"), line


def test_pipeline_not_dividing_the_layers_is_valid_with_uneven_stages(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text(
        BASE.replace("global_batch_size: 16", "global_batch_size: 24")
        + "  instance_count: 3\nparallel:\n  pipeline: 3\n  data_shard: 4\n  tensor: 2\n"
    )
    result = cli("validate", "r.yaml")
    assert result.code == 0, result.err


def test_more_stages_than_layers_says_every_stage_but_the_ends_needs_a_layer(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    text = BASE + "parallel:\n  pipeline: 2\n  virtual_stages: 18\n  pipeline_schedule: interleaved_1f1b\n"
    (tmp_path / "r.yaml").write_text(text)
    result = cli("validate", "r.yaml")
    assert result.code == 2
    assert result.err_lines == [
        "r.yaml:12 parallel.virtual_stages: pipeline 2 x virtual_stages 18 = 36 stages need at least 34 layers "
        "(one on every stage but the first and last), the model has 32; use at most 34 stages"
    ]
    # 34 stages are the most: the first holds only the embedding, the last only the output layer.
    (tmp_path / "r.yaml").write_text(text.replace("virtual_stages: 18", "virtual_stages: 17"))
    result = cli("validate", "r.yaml")
    assert result.code == 0, result.err


@pytest.mark.parametrize(
    "layers, message",
    [
        ("[16, 16, -1, 1]", r"parallel.pipeline_layers.2: expected at least 0, got -1"),
        (
            "[16, 0, 15, 1]",
            r"parallel.pipeline_layers: \[16, 0, 15, 1\] has a middle stage without layers; "
            r"only the first and last stages may hold none",
        ),
        ("[16, 16, 1]", r"parallel.pipeline_layers: 3 entries for pipeline 2 x virtual_stages 2 = 4 stages; give 4"),
        ("[15, 16, 0, 0]", r"parallel.pipeline_layers: \[15, 16, 0, 0\] has a middle stage without layers"),
        ("[0, 15, 16, 0]", r"parallel.pipeline_layers: \[0, 15, 16, 0\] sums to 31, but the model has 32 layers"),
    ],
    ids=["negative", "middle-zero", "length", "middle-zero-before-end", "sum"],
)
def test_bad_pipeline_layers_names_the_key(tmp_path, monkeypatch, cli, layers, message):
    monkeypatch.chdir(tmp_path)
    interleaved = "parallel:\n  pipeline: 2\n  virtual_stages: 2\n  pipeline_schedule: interleaved_1f1b\n"
    (tmp_path / "r.yaml").write_text(BASE + interleaved + f"  pipeline_layers: {layers}\n")
    result = cli("validate", "r.yaml")
    assert result.code == 2
    [line] = result.err_lines
    assert re.search(message, line), line


def test_missing_file(tmp_path, cli):
    result = cli("validate", tmp_path / "nope.yaml")
    assert result.code == 2
    assert result.err_lines == [f"{tmp_path / 'nope.yaml'} no such file"]


def test_directory_instead_of_file(tmp_path, cli):
    result = cli("validate", tmp_path)
    assert result.code == 2
    assert result.err_lines[0].endswith("is a directory, not a recipe file")


def test_extends_cycle(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yaml").write_text("extends: b.yaml\nname: a\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\nname: b\n")
    result = cli("validate", "a.yaml")
    assert result.code == 2
    assert result.err_lines == [
        "b.yaml:1 extends: a.yaml extends back to a file of this chain (a.yaml -> b.yaml -> a.yaml); remove the cycle"
    ]


def test_hf_config_that_is_not_json(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "r.yaml").write_text(BASE.replace("model: llama3-8b", "model: {hf_config: config.json}"))
    result = cli("validate", "r.yaml")
    assert result.code == 2
    [line] = result.err_lines
    assert re.fullmatch(r"r.yaml:2 model.hf_config: .*config.json is not valid JSON \(line 1: .*\)", line)


def test_several_problems_give_one_line_each(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    text = BASE + "  max_run: 30d\nparallel:\n  tensor: 3\nsagemaker:\n  region: nowhere\n"
    (tmp_path / "r.yaml").write_text(text)
    result = cli("validate", "r.yaml")
    assert result.code == 2
    assert sorted(line.split(" ", 2)[1] for line in result.err_lines) == [
        "cluster.max_run:",
        "parallel.tensor:",
        "parallel:",
        "sagemaker.region:",
        "training.seq_len:",
    ]


def test_one_bad_file_among_good_ones_fails_the_run(tmp_path, monkeypatch, cli):
    from tests import REPO

    (tmp_path / "bad.yaml").write_text("name: t\n")
    result = cli("validate", REPO / "recipes" / "tiny-cpu.yaml", tmp_path / "bad.yaml")
    assert result.code == 2
    assert "ok" in result.out and "tiny-cpu.yaml" in result.out
    assert any("model: is required" in line for line in result.err_lines)


def test_show_json_on_a_bad_recipe_prints_the_error_as_json(tmp_path, cli):
    # `show --json` on a bad recipe prints the error as one JSON object, never partial output.
    (tmp_path / "r.yaml").write_text("name: t\nmodel: nope\n")
    result = cli("show", tmp_path / "r.yaml", "--json")
    assert result.code == 2 and result.err == ""
    report = json.loads(result.out)
    assert report["exit_code"] == 2 and "training" in {p["path"] for p in report["problems"]}
