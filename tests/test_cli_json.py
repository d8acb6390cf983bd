"""Every reading command takes --json, and prints JSON on stdout with it: results, or the error."""

from __future__ import annotations

import json

from launcher.cli import command
from tests.backends.helpers import recipe_path

NOT_READING = {"export", "schema"}  # export writes a checkpoint; schema prints JSON always


def verbs() -> dict[str, object]:
    found, stack = {}, [("", command())]
    while stack:
        prefix, group = stack.pop()
        for name, sub in getattr(group, "commands", {}).items():
            path = f"{prefix}{name}"
            if getattr(sub, "commands", None):
                stack.append((f"{path} ", sub))
            else:
                found[path] = sub
    return found


def test_every_reading_verb_has_json():
    without = {name for name, verb in verbs().items() if not any("--json" in p.opts for p in verb.params)}
    assert without == NOT_READING


def test_each_verb_prints_json_with_json(cli, home):
    tiny = recipe_path("tiny-cpu")
    results = {
        "validate": cli("validate", tiny, "--json"),
        "show": cli("show", tiny, "--json"),
        "estimate": cli("estimate", tiny, "--json"),
        "plan": cli("plan", tiny, "--top", "2", "--json"),
        "submit": cli("submit", tiny, "--dry-run", "--json"),
        "list": cli("list", "--json"),
    }
    for verb in ("status", "logs", "stop", "metrics"):  # no such job: the error, as JSON
        results[verb] = cli(verb, "no-such-job", "--json")
    results["data prepare"] = cli("data", "prepare", home / "missing", "--tokenizer", home, "--out", home, "--json")
    assert set(results) == set(verbs()) - NOT_READING
    for verb, result in results.items():
        data = json.loads(result.out)  # whatever else, stdout is one JSON document
        if verb in ("status", "logs", "stop", "metrics", "data prepare"):
            assert result.code == 2 and data["exit_code"] == 2 and data["error"], (verb, data)
        else:
            assert result.code == 0, (verb, result.err)
    assert json.loads(results["list"].out) == []
    assert [report["ok"] for report in json.loads(results["validate"].out)] == [True]


def test_validate_json_reports_each_recipe_with_its_problems(cli):
    result = cli(
        "validate", recipe_path("tiny-cpu"), recipe_path("llama3-8b-8k"), "--set", "parallel.tensor=3", "--json"
    )
    reports = json.loads(result.out)
    assert result.code == 2 and result.err == ""
    assert [report["recipe"] for report in reports] == [str(recipe_path("tiny-cpu")), str(recipe_path("llama3-8b-8k"))]
    assert not any(report["ok"] for report in reports)
    problem = next(p for p in reports[1]["problems"] if p["path"] == "parallel.tensor")
    assert problem == {
        "path": "parallel.tensor",
        "message": "3 does not divide 32 attention heads; use 1, 2, 4 or 8",
        "source": "--set",
    }
    good = json.loads(cli("validate", recipe_path("tiny-cpu"), "--json").out)[0]
    assert good["ok"] and good["summary"].startswith("llama-tiny, 256 tokens") and good["problems"] == []
