"""Bad input to `launcher data prepare`: one line naming the option or input, exit code 2."""

from __future__ import annotations

import json

import pytest

from .conftest import write_jsonl


@pytest.fixture
def inputs(tmp_path, tokenizer_file):
    write_jsonl(tmp_path / "a.jsonl", ["one document", "another one"])
    return tmp_path, str(tokenizer_file)


def test_a_missing_field_names_the_line_and_the_fields_it_has(cli, inputs):
    tmp_path, tokenizer = inputs
    result = cli(
        "data", "prepare", tmp_path / "a.jsonl", "--tokenizer", tokenizer, "--out", tmp_path / "o", "--field", "body"
    )
    assert result.code == 2
    assert result.err_lines == [
        f"INPUT {tmp_path / 'a.jsonl'}:1: no text field 'body'; name it with --field (this line has: text, id)"
    ]


def test_a_line_that_is_not_json_is_named(cli, inputs):
    tmp_path, tokenizer = inputs
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    result = cli("data", "prepare", tmp_path / "a.jsonl", "--tokenizer", tokenizer, "--out", tmp_path / "o")
    assert result.code == 2 and len(result.err_lines) == 1
    assert result.err_lines[0].startswith(f"INPUT {tmp_path / 'a.jsonl'}:2: not a JSON object")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["{tmp}/missing.jsonl"],
            "INPUT {tmp}/missing.jsonl: does not exist; give files, a directory, a glob or an s3:// prefix",
        ),
        (
            ["{tmp}/*.parquet"],
            "INPUT {tmp}/*.parquet: no files found; give files, a directory, a glob or an s3:// prefix",
        ),
        (
            ["{tmp}/a.jsonl", "--format", "csv"],
            "--format: 'csv' is not a format; use auto, text, jsonl, parquet, arrow",
        ),
        (
            ["{tmp}/a.jsonl", "--eos-token", "<|eot|>"],
            "--eos-token '<|eot|>': not a token of {tok}; name one of its special tokens",
        ),
        (["{tmp}/a.jsonl", "--shard-tokens", "0"], "--shard-tokens: 0 is not a positive number of tokens"),
        (["{tmp}/a.jsonl", "--workers", "-1"], "--workers: -1 is not a positive number of processes"),
    ],
)
def test_bad_options_and_inputs_are_one_line_each(cli, inputs, args, line):
    tmp_path, tokenizer = inputs
    fill = {"tmp": tmp_path, "tok": tokenizer}
    result = cli(
        "data", "prepare", *[a.format(**fill) for a in args], "--tokenizer", tokenizer, "--out", tmp_path / "o"
    )
    assert (result.code, result.err_lines) == (2, [line.format(**fill)])


def test_a_tokenizer_that_is_not_one_and_a_directory_without_one_are_refused(cli, inputs):
    tmp_path, _ = inputs
    (tmp_path / "tokenizer.json").write_text("{}")
    result = cli("data", "prepare", tmp_path / "a.jsonl", "--tokenizer", tmp_path, "--out", tmp_path / "o")
    assert result.code == 2 and result.err_lines[0].startswith(
        f"--tokenizer {tmp_path / 'tokenizer.json'}: not a Hugging Face tokenizer.json"
    )
    result = cli("data", "prepare", tmp_path / "a.jsonl", "--tokenizer", tmp_path / "o", "--out", tmp_path / "o")
    assert result.err_lines == [
        f"--tokenizer {tmp_path / 'o'}: no tokenizer.json there; give the file or a directory holding one"
    ]


def test_an_output_directory_holding_another_dataset_is_not_overwritten(cli, inputs):
    tmp_path, tokenizer = inputs
    first = cli("data", "prepare", tmp_path / "a.jsonl", "--tokenizer", tokenizer, "--out", tmp_path / "o", "--json")
    assert first.code == 0 and json.loads(first.out)["documents"] == 2
    result = cli(
        "data",
        "prepare",
        tmp_path / "a.jsonl",
        "--tokenizer",
        tokenizer,
        "--out",
        tmp_path / "o",
        "--shard-tokens",
        "7",
    )
    assert result.code == 2
    assert result.err_lines == [
        f"--out {tmp_path / 'o'}: holds a dataset of other inputs, tokenizer or settings; use an empty directory"
    ]
