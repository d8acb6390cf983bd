"""The `launcher` command: a thin skin over the Python API. Each verb is a few lines.

Errors reach the user in one place, `main`: a LauncherError prints its lines and exits with
its code (2 for bad input); set LAUNCHER_TRACEBACK=1 to see the traceback of any error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from launcher.errors import LauncherError

app = typer.Typer(
    name="launcher",
    help="Validate, size and launch long-context LLM training jobs from YAML recipes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)

RecipeArg = Annotated[Path, typer.Argument(help="A YAML recipe file.", show_default=False)]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", "-s", help="Override a recipe value: --set parallel.context=16 (repeatable).", show_default=False
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _load(path: Path, set_options: list[str] | None):
    from launcher.recipe import Recipe

    recipe = Recipe.load_with_options(path, set_options or [])
    for note in recipe.warnings:
        err.print(f"[yellow]warning:[/] {recipe.source}: {note}")
    return recipe


def _print_json(data) -> None:
    out.print_json(json.dumps(data)) if sys.stdout.isatty() else print(json.dumps(data, indent=2))


@app.command()
def validate(
    recipes: Annotated[list[Path], typer.Argument(help="Recipe files.", show_default=False)],
    set_: SetOpt = None,
) -> None:
    """Check recipes against the schema, the catalogs and every layout rule."""
    from launcher.errors import RecipeError

    failed = False
    for path in recipes:
        try:
            recipe = _load(path, set_)
        except RecipeError as error:
            failed = True
            for line in error.lines():
                err.print(line, markup=False)
            continue
        out.print(f"[green]ok[/] {path}: {recipe.summary_line()}")
    if failed:
        raise typer.Exit(2)


@app.command()
def show(recipe: RecipeArg, set_: SetOpt = None, json_: JsonOpt = False) -> None:
    """Print the fully resolved recipe, with derived values such as data_shard and world size."""
    loaded = _load(recipe, set_)
    resolved = {**loaded.resolved(), "derived": loaded.summary()}
    if json_:
        _print_json(resolved)
    else:
        import yaml

        out.print(yaml.safe_dump(resolved, sort_keys=False), markup=False)


@app.command()
def schema() -> None:
    """Print the JSON Schema of recipes, for editor completion (yaml-language-server)."""
    from launcher.recipe.schema_export import recipe_json_schema

    print(json.dumps(recipe_json_schema(), indent=2))


def main() -> None:
    # click handles usage errors (exit 2) and --help; everything the launcher itself refuses
    # arrives here as a LauncherError.
    try:
        app()
    except LauncherError as error:
        if os.environ.get("LAUNCHER_TRACEBACK"):
            raise
        for line in error.lines():
            err.print(line, markup=False)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
