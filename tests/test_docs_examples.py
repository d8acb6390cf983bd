"""Docs that cannot go stale: every command output quoted in README.md and docs/*.md is what the
command prints now (scripts/docs_examples.py rewrites them), and recipe comments quote no
predictions (`launcher plan`, `estimate` and `submit --dry-run` print those)."""

from __future__ import annotations

import re

from tests import REPO, load_script


def docs_examples():
    return load_script("docs_examples")


def test_every_quoted_command_output_is_what_the_command_prints_now():
    script = docs_examples()
    quoted = [example.command for path in script.documents() for example in script.examples(path)]
    assert len(quoted) >= 3, quoted  # the README's validate, out-of-memory and dry-run examples
    stale = [f"{e.path.name}: $ {e.command}\n--- quoted\n{e.quoted}--- now\n{now}" for e, now in script.stale()]
    assert stale == [], "run `python scripts/docs_examples.py`:\n" + "\n".join(stale)


PREDICTION = re.compile(
    r"\d[\d.,]*\s*(%|x (faster|slower)|s/step|days?\b|h\b|GiB|tokens/s)|predicted \d|ranks (it|this) (first|second|third)"
)


def test_recipe_comments_quote_no_predictions():
    quoted = []
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        for number, line in enumerate(recipe.read_text().splitlines(), 1):
            comment = line.partition("#")[2]
            if PREDICTION.search(comment) and "measured" not in comment:
                quoted.append(f"{recipe.name}:{number}: {comment.strip()}")
    assert quoted == []


def test_the_seq_len_hint_never_passes_the_longest_sequence_a_recipe_may_ask_for(cli):
    from launcher.contract.layout import MAX_SEQ_LEN

    # 4194304 is not a multiple of 48 (cp 8 x tp 3 x 2): of 4194288 and 4194336 only the first is a
    # length the schema takes.
    longest = ("--set", f"training.seq_len={MAX_SEQ_LEN}")
    result = cli("validate", REPO / "recipes" / "llama70b-128k.yaml", "--set", "parallel.tensor=3", *longest)
    hint = next(line for line in result.err_lines if "training.seq_len" in line)
    assert hint.endswith("= 48; use e.g. 4194288"), hint
