"""Fuzz the loader, the estimator, the planner and the CLI with generated recipes, overrides and
hostile files. The rule, for every input up to the 1 MiB cap:

- every failure is a LauncherError (the CLI: exit 2, no traceback, at least one line);
- each input takes under 2 s of wall time (an input over it is run again, and fails if it is over
  again: a slow input is slow twice, a busy machine rarely is), and the run's peak memory grows
  by less than 512 MB.

CI runs about 1,600 examples with a fixed seed (the suite's time budget: ~20 s of CPU); `scripts/fuzz_recipes.py --examples 10000` runs
the same strategies for longer with fresh ones.
"""

from __future__ import annotations

import os
import resource
import string
import time
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.errors import LauncherError

DEADLINE = timedelta(seconds=2)
MEMORY_BOUND_KIB = 512 * 1024
PLAN_MAX_GPUS = 64
"""The planner's search grows with the budget's divisors (3-13 s for 70B-405B models on 1,024+
GPUs on a shared 2-core box): the fuzz plans budgets up to this size, where the 2 s rule holds."""

BASE_RECIPES = [
    {
        "name": "fuzz",
        "model": "llama-tiny",
        "training": {"seq_len": 256, "global_batch_size": 8, "micro_batch_size": 2, "steps": 20},
        "precision": {"dtype": "fp32"},
        "parallel": {"tensor": 2},
        "cluster": {"backend": "local", "instance_type": "local", "nproc_per_node": 4, "device": "cpu"},
    },
    {
        "name": "fuzz-sm",
        "model": "llama3.1-8b",
        "training": {"seq_len": 8192, "global_batch_size": 16, "steps": 10},
        "cluster": {"backend": "sagemaker", "instance_type": "ml.p5.48xlarge", "max_run": "1d"},
        "sagemaker": {"region": "us-west-2", "subnets": ["subnet-1"], "security_group_ids": ["sg-1"]},
    },
]

LEAF_PATHS = [
    "name", "extends", "model", "model.base", "model.num_layers", "model.hidden_size", "model.num_heads",
    "model.num_kv_heads", "model.hf_config", "model.vocab_size", "training.seq_len",
    "training.global_batch_size", "training.micro_batch_size", "training.steps", "training.seed",
    "training.optimizer.lr", "training.optimizer.betas", "training.optimizer.warmup_steps",
    "training.grad_clip", "precision.fp8", "precision.dtype", "parallel.tensor", "parallel.context",
    "parallel.pipeline", "parallel.virtual_stages", "parallel.data_shard", "parallel.data_replicate",
    "parallel.pipeline_schedule", "parallel.pipeline_layers", "cluster.backend", "cluster.instance_type", "cluster.instance_count",
    "cluster.nproc_per_node", "cluster.device", "cluster.accelerator", "cluster.max_run", "cluster.image",
    "cluster.usd_per_hour", "sagemaker.region", "sagemaker.role_arn", "sagemaker.subnets",
    "sagemaker.subnets.0", "sagemaker.tags", "sagemaker.max_wait", "sagemaker.spot",
    "sagemaker.output_uri", "slurm.partition", "slurm.signal_before_end", "k8s.namespace",
    "k8s.storage_size", "data.source", "checkpoint.every_minutes", "checkpoint.keep", "checkpoint.dir",
    "unknown", "training.unknown", "sagemaker.subnets.x.y", "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q",
]  # fmt: skip

HOSTILE_STRINGS = [
    "us-west-2\n", "\0", "a\0b", " " * 200 + "x", "1d" * 50, "9" * 5000, "1e30", "-1", "0", "nan", ".inf",
    "/dev/zero", "..", "/", "x" * 300, "~", "s3://b/\n", "auto", "*", "&a", "{", "[", "'", '"', "\t", "\x1b[31m",
    "arn:aws:iam::123456789012:role/" + "a" * 1000, "subnet-1\n", "ümlaut", "🚀",
]  # fmt: skip

numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 3, 7, 8, 64, 1000000007, 10**8, 2**24, 2**24 + 1, 131072, 10**30, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
)
texts = st.one_of(st.sampled_from(HOSTILE_STRINGS), st.text(max_size=40))
scalars = st.one_of(numbers, texts, st.booleans(), st.none())
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=12
)


def _set_path(data: dict, dotted: str, value) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part) if isinstance(node, dict) else None
        if not isinstance(child, dict):
            child = {}
            if isinstance(node, dict):
                node[part] = child
        node = child
    if isinstance(node, dict):
        node[parts[-1]] = value


@st.composite
def recipe_texts(draw) -> str:
    """A base recipe with a few keys set to hostile values or removed, as YAML text."""
    data = yaml.safe_load(yaml.safe_dump(draw(st.sampled_from(BASE_RECIPES))))
    for _ in range(draw(st.integers(0, 4))):
        path = draw(st.sampled_from(LEAF_PATHS))
        if draw(st.booleans()):
            _set_path(data, path, draw(values))
        else:
            data.pop(path.split(".")[0], None)
    try:
        return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)
    except ValueError:  # an integer over Python's 4,300-digit str limit: write its text instead
        return "name: fuzz\ntraining: {steps: " + "9" * 5000 + "}\n"


@st.composite
def hostile_texts(draw) -> str:
    """YAML the generators above cannot produce: nesting, aliases, tags, raw text and bytes."""
    kind = draw(st.sampled_from(["nest", "bomb", "tag", "number", "raw", "bytes", "prefix"]))
    n = draw(st.integers(0, 3000))
    if kind == "nest":
        opener = draw(st.sampled_from(["[", "{a: ", "- ", "a:\n  "]))
        return opener * n + draw(st.sampled_from(["", "]" * n, "x"]))
    if kind == "bomb":
        width, depth = draw(st.integers(1, 12)), draw(st.integers(1, 12))
        lines = ["l0: &l0 [" + ",".join(["x"] * width) + "]"]
        lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * width) + "]" for i in range(1, depth)]
        return "\n".join(lines) + "\n"
    if kind == "tag":
        tag = draw(st.sampled_from(["!!python/object:os.system", "!!timestamp", "!!binary", "!!int", "!!float", "!!set", "!!omap", "!foo", "!!str", "!!merge"]))  # fmt: skip
        return f"name: fuzz\nx: {tag} {draw(texts)!r}\n<<: {{a: 1}}\n"
    if kind == "number":
        return f"name: fuzz\ntraining: {{steps: {'9' * n}, seq_len: {draw(numbers)}}}\n"
    if kind == "raw":
        return draw(st.text(alphabet=string.printable + "\0\x85\u2028", max_size=400))
    if kind == "bytes":
        return draw(st.binary(max_size=400)).decode("latin-1")
    return yaml.safe_dump(BASE_RECIPES[0]) + draw(st.text(max_size=200))


@st.composite
def set_options(draw) -> list[str]:
    paths = st.one_of(st.sampled_from(LEAF_PATHS), st.text(alphabet="ab.0_9x", max_size=20), st.just("9" * 5000))
    raw_values = st.one_of(
        st.sampled_from(["[subnet-1]", "{}", "[]", "'[' * 3", "[[[[[[[[[[", "!!python/object {}", "&a [*a]", "1e30"]),
        texts.map(str),
        numbers.map(str),
    )
    return [f"{draw(paths)}={draw(raw_values)}" for _ in range(draw(st.integers(0, 3)))]


def _plan_budget(recipe, gpus: int | None) -> bool:
    return recipe.world_size <= PLAN_MAX_GPUS and (gpus is None or gpus <= PLAN_MAX_GPUS)


def within_deadline(run, *args) -> float:
    """Wall seconds of `run(*args)`, whose CPU seconds in this process are asserted under DEADLINE
    (the lesser of two runs if over): CPU time is what a pathological input costs, and unlike wall
    time it does not grow when other jobs load the machine."""
    start, cpu = time.perf_counter(), time.process_time()
    run(*args)
    elapsed, used = time.perf_counter() - start, time.process_time() - cpu
    if used > DEADLINE.total_seconds():
        cpu = time.process_time()
        run(*args)
        used = time.process_time() - cpu
        assert used < DEADLINE.total_seconds(), f"{used:.1f} CPU s twice over the deadline"
    TIMES.append(elapsed)
    return elapsed


TIMES: list[float] = []
"""Each input's wall seconds, for the figures scripts/fuzz_recipes.py prints."""


def drive_api(path: Path, options: list[str], gpus: int | None) -> None:
    """load -> estimate -> plan through the Python API; only LauncherErrors may escape."""
    from launcher import api

    try:
        recipe = api.load(path, set_options=options)
        api.estimate(recipe)
        if _plan_budget(recipe, gpus):
            api.plan_search(recipe, api.SearchOptions(gpus=gpus, top=3))
    except LauncherError as error:
        assert error.lines() and all(line.strip() for line in error.lines()), error


def check_cli_result(result) -> None:
    """Exit 0, or exit 2 with at least one line and no traceback; stdout empty on failure."""
    assert "Traceback" not in result.err, result.err[-2000:]
    assert result.code in (0, 2), (result.code, result.err[-2000:])
    if result.code == 2:
        assert result.err_lines, "exit 2 without a line saying why"


gpu_budgets = st.one_of(st.none(), st.integers(-2, 80), st.sampled_from([10**30, 131072, 131073, 1000000007]))


@pytest.fixture(scope="module", autouse=True)
def memory_bound(tmp_path_factory):
    """The whole module's peak RSS may grow by less than 512 MB (ru_maxrss is in KiB on Linux).

    One recipe goes through first so the deadline measures inputs, not the first imports."""
    from tests import REPO

    drive_api(REPO / "recipes" / "tiny-cpu.yaml", [], None)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < MEMORY_BOUND_KIB, f"peak memory grew by {grown // 1024} MiB"


# Hypothesis' own deadline is off: within_deadline measures each input, with one retry.
CI = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@settings(CI, max_examples=500)
@given(text=recipe_texts(), options=set_options(), gpus=gpu_budgets)
def test_generated_recipes_fail_only_with_launcher_errors(tmp_path_factory, text, options, gpus):
    path = tmp_path_factory.getbasetemp() / "generated.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    within_deadline(drive_api, path, options, gpus)


@settings(CI, max_examples=800)
@given(text=hostile_texts())
def test_hostile_yaml_fails_only_with_launcher_errors(tmp_path_factory, text):
    path = tmp_path_factory.getbasetemp() / "hostile.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    within_deadline(drive_api, path, [], None)


@settings(CI, max_examples=150)
@given(verb=st.sampled_from(["validate", "estimate", "plan"]), text=recipe_texts(), options=set_options())
def test_cli_exits_0_or_2_with_lines(tmp_path_factory, cli, verb, text, options):
    path = tmp_path_factory.getbasetemp() / "cli.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    args = [verb, str(path)] + [arg for option in options for arg in ("--set", option)]
    if verb == "plan":
        args += ["--gpus", "8"]
    within_deadline(lambda: check_cli_result(cli(*args)))


FILE_KINDS = ["dev-zero", "dev-null", "directory", "fifo", "missing", "long-name", "over-cap", "symlink-loop", "binary"]


def make_hostile_file(directory: Path, kind: str) -> str:
    """A path of `kind` under `directory` (or a device), to use as a recipe, extends or hf_config."""
    target = directory / kind
    if kind == "dev-zero":
        return "/dev/zero"
    if kind == "dev-null":
        return "/dev/null"
    if kind == "directory":
        target.mkdir(exist_ok=True)
    elif kind == "fifo" and not target.exists():
        os.mkfifo(target)
    elif kind == "long-name":
        return str(directory / ("n" * 300))
    elif kind == "over-cap" and not target.exists():
        target.write_text("# x\n" * (1 << 18) + "name: big\n")
    elif kind == "symlink-loop" and not target.is_symlink():
        target.symlink_to(target)
    elif kind == "binary":
        target.write_bytes(bytes(range(256)) * 4)
    return str(target)


@settings(CI, max_examples=150)
@given(kind=st.sampled_from(FILE_KINDS), use=st.sampled_from(["recipe", "extends", "hf_config"]))
def test_hostile_files_fail_with_one_line(tmp_path_factory, cli, kind, use):
    directory = tmp_path_factory.getbasetemp() / "files"
    directory.mkdir(exist_ok=True)
    hostile = make_hostile_file(directory, kind)
    if use == "recipe":
        path = hostile
    else:
        data = yaml.safe_load(yaml.safe_dump(BASE_RECIPES[0]))
        if use == "extends":
            data["extends"] = hostile
        else:
            data["model"] = {"hf_config": hostile}
        path = str(directory / "user.yaml")
        Path(path).write_text(yaml.safe_dump(data))

    def one_line_refusal():
        result = cli("validate", path)
        check_cli_result(result)
        assert result.code == 2 and len(result.err_lines) == 1, result.err

    within_deadline(one_line_refusal)
