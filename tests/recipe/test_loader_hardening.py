"""No input crashes or hangs the loader: each crash and hang the fuzz found is a test.

Every case runs the real CLI in-process and expects what any bad input gets: exit 2, nothing on
stdout, one line on stderr naming where the problem is and what would be valid, and no traceback,
within 2 seconds. The static inputs live in `crashers/`; the ones that cannot be a committed file
(a 10 MB recipe, a 1,200-file chain, a FIFO) are built here.
"""

from __future__ import annotations

import os
import re
import resource
import time
from pathlib import Path

import pytest

from launcher.errors import RecipeError, UsageError
from tests import REPO

CRASHERS = Path(__file__).parent / "crashers"
TINY = REPO / "recipes" / "tiny-cpu.yaml"
BASE = """\
name: t
model: llama-tiny
training: {seq_len: 256, global_batch_size: 8, steps: 10}
cluster: {backend: local, instance_type: local, nproc_per_node: 4, device: cpu}
"""
SECONDS = 10.0
"""CPU seconds of this process a hostile recipe may cost. The bound catches a hang or a reader
that is quadratic in the file (one over 1 MiB takes minutes), not speed; it counts CPU time, not
wall time, so a busy machine does not break it (a 1 MiB recipe takes well under 2 s here)."""
MIB = 1 << 20


def refused(cli, *args, pattern: str, seconds: float = SECONDS) -> str:
    """Run `launcher ARGS`; assert exit 2 with one matching line and no traceback, in time."""
    start = time.process_time()
    result = cli(*args)
    elapsed = time.process_time() - start
    assert result.code == 2, result
    assert result.out == ""
    assert "Traceback" not in result.err
    [line] = result.err_lines
    assert re.search(pattern, line), line
    assert elapsed < seconds, f"{elapsed:.1f} s"
    return line


def crasher(name: str) -> Path:
    path = CRASHERS / name
    assert path.is_file(), path
    return path


# --- the 264 crashes: 8 kinds that showed a traceback with exit 1 -----------------------------


def test_extends_with_a_nul_byte(cli):
    refused(cli, "validate", crasher("extends-nul-byte.yaml"), pattern=r":5 extends: contains a NUL byte")


def test_nul_byte_in_a_path_given_to_the_api():
    from launcher.recipe import Recipe

    with pytest.raises(RecipeError, match="path contains a NUL byte"):
        Recipe.load("recipe\0.yaml")


def test_500_nested_brackets(cli):
    refused(
        cli,
        "validate",
        crasher("nested-brackets-500.yaml"),
        pattern=r"nested-brackets-500.yaml:1 nested deeper than 32 levels",
    )


def test_500_unclosed_brackets(tmp_path, cli):
    (tmp_path / "r.yaml").write_text("[" * 500)
    refused(cli, "validate", tmp_path / "r.yaml", pattern=r"r.yaml:1 nested deeper than 32 levels")


def test_extends_chain_of_1200_files(tmp_path, cli):
    for i in range(1200):
        (tmp_path / f"r{i}.yaml").write_text(f"extends: r{i + 1}.yaml\n")
    (tmp_path / "r1200.yaml").write_text(BASE)
    line = refused(cli, "validate", tmp_path / "r0.yaml", pattern=r"extends: r16.yaml would make an extends chain")
    assert "longer than 16 files" in line and "merge some of them" in line


def test_extends_chain_of_16_files_loads(tmp_path, cli):
    for i in range(15):
        (tmp_path / f"r{i}.yaml").write_text(f"extends: r{i + 1}.yaml\n")
    (tmp_path / "r15.yaml").write_text(BASE)
    assert cli("validate", tmp_path / "r0.yaml").code == 0


def test_extends_cycle_names_the_chain(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: c.yaml\n")
    (tmp_path / "c.yaml").write_text("extends: b.yaml\n")
    refused(
        cli, "validate", "a.yaml", pattern=r"^c.yaml:1 extends: b.yaml extends back .*\(b.yaml -> c.yaml -> b.yaml\)"
    )


def test_set_into_a_list_with_key_names(cli):
    refused(
        cli, "validate", TINY, "--set", "sagemaker.subnets=[subnet-1]", "--set", "sagemaker.subnets.x.y=1",
        pattern=r"^--set sagemaker.subnets.x.y: sagemaker.subnets is a list of 1; x is not an index of it \(0 to 0\)",
    )  # fmt: skip


def test_set_into_a_list_past_its_end(cli):
    refused(
        cli, "validate", TINY, "--set", "sagemaker.subnets=[subnet-1]", "--set", "sagemaker.subnets.3=subnet-2",
        pattern=r"^--set sagemaker.subnets.3: sagemaker.subnets is a list of 1; 3 is not an index",
    )  # fmt: skip


def test_set_into_an_empty_list(cli):
    refused(
        cli, "validate", TINY, "--set", "sagemaker.subnets=[]", "--set", "sagemaker.subnets.0=subnet-2",
        pattern=r"is a list of 0; 0 is not an index of it \(none, it is empty\)",
    )  # fmt: skip


def test_set_an_item_of_a_list(tmp_path, cli):
    text = BASE + "sagemaker: {subnets: [subnet-1], security_group_ids: [sg-1]}\n"
    (tmp_path / "r.yaml").write_text(text)
    assert cli("validate", tmp_path / "r.yaml", "--set", "sagemaker.subnets.0=subnet-2").code == 0
    refused(
        cli,
        "validate",
        tmp_path / "r.yaml",
        "--set",
        "sagemaker.subnets.0=net-2",
        pattern=r"subnets.0: 'net-2' is not a subnet ID",
    )


def test_set_key_path_with_a_5000_digit_part(cli):
    refused(
        cli,
        "validate",
        TINY,
        "--set",
        "sagemaker.subnets." + "9" * 5000 + "=x",
        pattern=r"sagemaker.subnets: expected a list, got a mapping$",
    )


def test_set_key_path_too_deep(cli):
    refused(
        cli, "validate", TINY, "--set", "a." * 40 + "b=1", pattern=r"has 41 parts; a recipe key path has at most 16"
    )


@pytest.mark.parametrize("verb", ["validate", "estimate", "plan"])
def test_dev_zero_as_the_recipe(cli, verb):
    refused(cli, verb, "/dev/zero", pattern=r"^/dev/zero is a device, not a recipe file$")


def test_dev_zero_as_extends(cli):
    refused(
        cli,
        "validate",
        crasher("extends-dev-zero.yaml"),
        pattern=r":5 extends: /dev/zero: is a device, not a recipe file$",
    )


def test_dev_zero_as_hf_config(cli):
    refused(
        cli, "validate", crasher("hf-config-dev-zero.yaml"),
        pattern=r":2 model.hf_config: /dev/zero is a device, not a Hugging Face config.json$",
    )  # fmt: skip


def test_300_character_extends_name(cli):
    refused(
        cli, "validate", crasher("extends-300-character-name.yaml"),
        pattern=r":5 extends: a{60}…: name is too long for the file system",
    )  # fmt: skip


def test_300_character_recipe_name(tmp_path, cli):
    refused(cli, "validate", tmp_path / ("a" * 300 + ".yaml"), pattern=r"name is too long for the file system")


@pytest.mark.parametrize("where", ["file", "set", "hf_config"])
def test_integer_of_5000_digits(tmp_path, cli, where):
    digits = "9" * 5000
    if where == "file":
        refused(
            cli,
            "validate",
            crasher("integer-5000-digits.yaml"),
            pattern=r":3 training.steps: a number of 5,000 characters",
        )
    elif where == "set":
        refused(
            cli,
            "validate",
            TINY,
            "--set",
            f"training.steps={digits}",
            pattern=r"^--set training.steps: a number of 5,000",
        )
    else:
        (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": ' + digits + "}")
        (tmp_path / "r.yaml").write_text(BASE.replace("model: llama-tiny", "model: {hf_config: config.json}"))
        refused(cli, "validate", tmp_path / "r.yaml", pattern=r"model.hf_config: .* holds a number too long")


# --- the 90 hangs over 10 s ------------------------------------------------------------------------


def test_alias_bomb(cli):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused(
        cli,
        "validate",
        crasher("alias-bomb.yaml"),
        pattern=r":5 e: more than 10,000 values \(counting aliases expanded\)",
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # KiB


def test_a_few_aliases_are_fine(tmp_path, cli):
    text = BASE + "sagemaker: {subnets: &nets [subnet-1], security_group_ids: [sg-1], tags: {a: &v x, b: *v}}\n"
    (tmp_path / "r.yaml").write_text(text)
    assert cli("validate", tmp_path / "r.yaml").code == 0


def test_10_mb_recipe_is_refused_by_the_size_cap(tmp_path, cli):
    (tmp_path / "big.yaml").write_text(BASE + "# padding\n" * (MIB))
    refused(
        cli,
        "validate",
        tmp_path / "big.yaml",
        pattern=r"big.yaml is 10,485,9\d\d bytes; a recipe file may be at most 1,048,576 bytes \(1 MiB\)$",
        seconds=1.0,
    )


def test_recipe_near_the_cap_parses_quickly(tmp_path, cli):
    """The largest recipe the cap lets through: a long comment and the biggest legal lists."""
    comment = "# " + "x" * 98 + "\n"
    text = BASE + comment * ((MIB - len(BASE) - 200) // len(comment))
    (tmp_path / "big.yaml").write_text(text)
    assert len(text) > MIB - 400
    start = time.process_time()
    assert cli("validate", tmp_path / "big.yaml").code == 0
    assert time.process_time() - start < SECONDS


def test_recipe_near_the_cap_of_values_is_refused_quickly(tmp_path, cli):
    (tmp_path / "big.yaml").write_text(BASE + "sagemaker: {subnets: [" + "a," * (MIB // 2 - 200) + "]}\n")
    refused(
        cli,
        "validate",
        tmp_path / "big.yaml",
        pattern=r"big.yaml:5 more than 10,000 values; a recipe has a few hundred$",
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_fifo_as_the_recipe_does_not_block(tmp_path, cli):
    os.mkfifo(tmp_path / "pipe.yaml")
    refused(cli, "validate", tmp_path / "pipe.yaml", pattern=r"pipe.yaml is a named pipe \(FIFO\), not a recipe file$")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_fifo_as_extends_does_not_block(tmp_path, cli):
    os.mkfifo(tmp_path / "pipe.yaml")
    (tmp_path / "r.yaml").write_text(BASE + "extends: pipe.yaml\n")
    refused(cli, "validate", tmp_path / "r.yaml", pattern=r"extends: pipe.yaml: is a named pipe")


def test_divisors_of_a_large_prime_are_fast():
    from launcher.contract.layout import divisors

    start = time.process_time()
    assert divisors(1_000_000_007) == [1, 1_000_000_007]
    assert divisors(2**24) == [2**k for k in range(25)]
    assert divisors(360) == [d for d in range(1, 361) if 360 % d == 0]
    assert time.process_time() - start < 0.5


def test_plan_gpus_1e30(cli):
    refused(
        cli,
        "plan",
        TINY,
        "--gpus",
        str(10**30),
        pattern=r"^--gpus 1000000000000000000000000000000: use a whole number from 1 to 131,072$",
    )


def test_plan_gpus_1e30_written_as_a_float(cli):
    result = cli("plan", TINY, "--gpus", "1e30")
    assert result.code == 2 and "Traceback" not in result.err  # click's own usage error


def test_num_layers_1000000007(cli):
    refused(
        cli,
        "validate",
        crasher("num-layers-1000000007.yaml"),
        pattern=r":2 model.num_layers: expected at most 10000, got 1000000007$",
    )


def test_global_batch_size_1e8(cli):
    refused(
        cli,
        "plan",
        crasher("global-batch-size-1e8.yaml"),
        pattern=r":3 training.global_batch_size: expected at most 16777216",
    )


def test_max_run_of_200_spaces_then_x(cli):
    refused(
        cli,
        "validate",
        crasher("max-run-200-spaces-then-x.yaml"),
        pattern=r":4 cluster.max_run: '\s+\.\.\.' is not a duration",
    )


@pytest.mark.parametrize("text", ["1d 12h", " 90m ", "5d", "12h30m15s"])
def test_durations_with_spaces_still_parse(text):
    from launcher.recipe.schema import parse_duration

    assert parse_duration(text) > 0


def test_durations_over_a_year(cli):
    refused(
        cli,
        "validate",
        TINY,
        "--set",
        "cluster.max_run=400d",
        pattern=r"cluster.max_run: 34,560,000 seconds is over a year; use at most 365d",
    )


# --- patterns that accepted a trailing newline -------------------------------------------------


def test_region_with_a_trailing_newline(cli):
    refused(
        cli,
        "validate",
        crasher("region-trailing-newline.yaml"),
        pattern=r":5 sagemaker.region: 'us-west-2\\n' is not an AWS region",
    )


@pytest.mark.parametrize(
    "key, value",
    [
        ("sagemaker.role_arn", "arn:aws:iam::123456789012:role/x"),
        ("sagemaker.output_uri", "s3://bucket/prefix"),
        ("sagemaker.kms_key_id", "alias/key"),
        ("cluster.image", "repo/image:tag"),
        ("name", "job"),
        ("slurm.partition", "gpu"),
        ("k8s.namespace", "team"),
        ("k8s.storage_size", "1Ti"),
    ],
)
def test_patterns_refuse_a_trailing_newline(tmp_path, cli, key, value):
    (tmp_path / "r.yaml").write_text(BASE)
    assert cli("validate", tmp_path / "r.yaml", "--set", f"{key}={value}").code == 0
    refused(
        cli, "validate", tmp_path / "r.yaml", "--set", f'{key}="{value}\\n"', pattern=rf"^--set {re.escape(key)}: .*\\n"
    )


# --- files that are not recipes --------------------------------------------------------------------


def test_directory_as_extends(tmp_path, cli):
    (tmp_path / "sub").mkdir()
    (tmp_path / "r.yaml").write_text(BASE + "extends: sub\n")
    refused(cli, "validate", tmp_path / "r.yaml", pattern=r"extends: sub: is a directory, not a recipe file$")


def test_binary_file(tmp_path, cli):
    (tmp_path / "r.yaml").write_bytes(b"name: t\n\xff\xfe")
    refused(cli, "validate", tmp_path / "r.yaml", pattern=r"r.yaml is not UTF-8 text \(byte 8\)")


def test_nul_byte_in_the_content(tmp_path, cli):
    (tmp_path / "r.yaml").write_bytes(BASE.encode() + b"x\0")
    refused(cli, "validate", tmp_path / "r.yaml", pattern=r"r.yaml contains a NUL byte on line 5")


def test_hf_config_over_the_cap(tmp_path, cli):
    (tmp_path / "config.json").write_text("{" + " " * (MIB + 1) + "}")
    (tmp_path / "r.yaml").write_text(BASE.replace("model: llama-tiny", "model: {hf_config: config.json}"))
    refused(cli, "validate", tmp_path / "r.yaml", pattern=r"model.hf_config: .*config.json is 1,048,579 bytes")


@pytest.mark.parametrize(
    "config, message",
    [
        ("[" * 100_000, "nesting too deep"),
        (
            '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256, "rope_scaling": 5}',
            "rope_scaling in .* is not an object",
        ),
        (
            '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256, "head_dim": [1]}',
            r"head_dim \[1\] in .* is not a whole number from 1 to",
        ),
        (
            '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1000000007, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256}',
            "num_hidden_layers 1000000007 in .* is not a whole number from 1 to 10,000",
        ),
        (
            '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256, "rope_theta": Infinity}',
            "rope_theta inf in .* is not a positive number",
        ),
        (
            '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256, "rope_scaling": {"rope_type": "llama3"}}',
            "rope_scaling in .* needs positive numbers",
        ),
    ],
    ids=["nested", "scaling-not-object", "head-dim-list", "layers-prime", "theta-inf", "scaling-missing"],
)
def test_hostile_hf_configs(tmp_path, cli, config, message):
    (tmp_path / "config.json").write_text(config)
    (tmp_path / "r.yaml").write_text(BASE.replace("model: llama-tiny", "model: {hf_config: config.json}"))
    refused(cli, "validate", tmp_path / "r.yaml", pattern=rf"model.hf_config: .*{message}")


@pytest.mark.parametrize(
    "text, message",
    [
        ("? [a, b]\n: 1\n", r"a key is a list or mapping"),
        (
            "name: t\nx: !!timestamp soon\n",
            r"^\S+r\.yaml:2 x: !!timestamp 'soon' cannot be read: !!timestamp takes a date such as 2026-12-01, "
            r"or a date and time such as 2026-12-01T10:00:00Z; or drop the tag$",
        ),
        ("x: [1, !!int 0x2z]\n", r"^\S+r\.yaml:1 x\.1: !!int '0x2z' cannot be read: !!int takes an integer such as 42"),
        ("x:\n  y: !!bool maybe\n", r"^\S+r\.yaml:2 x\.y: !!bool 'maybe' cannot be read: !!bool takes true or false"),
        (
            "x: !local thing\n",
            r"^\S+r\.yaml:1 x: !local 'thing' cannot be read: !local is unknown; the tags are !!int, ",
        ),
        ("x: !!python/object:os.system {}\n", r"YAML syntax error: .*could not determine a constructor"),
        ("a: &a [*a]\n", r"nested deeper than 32 levels"),
        ("name: t\nname: u\n", r"name: duplicate key"),
    ],
    ids=[
        "complex-key",
        "bad-timestamp",
        "bad-int-in-a-list",
        "bad-bool",
        "unknown-local-tag",
        "python-tag",
        "recursive-alias",
        "duplicate-key",
    ],
)
def test_hostile_yaml(tmp_path, cli, text, message):
    (tmp_path / "r.yaml").write_text(text)
    refused(cli, "validate", tmp_path / "r.yaml", pattern=message)


def test_api_errors_are_launcher_errors():
    """The same refusals reach Python callers as LauncherErrors (UsageError), never OSError."""
    from launcher import api

    for path in ["/dev/zero", "/", "x" * 300, crasher("alias-bomb.yaml")]:
        with pytest.raises(UsageError):
            api.load(path)
