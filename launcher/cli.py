"""The `launcher` command: a thin skin over the Python API. Each verb is a few lines.

Errors reach the user in one place, `main`: a LauncherError prints its lines and exits with
its code (2 for bad input); set LAUNCHER_TRACEBACK=1 to see the traceback of any error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from launcher.errors import LauncherError, RecipeError

if TYPE_CHECKING:  # the CLI imports the API inside each verb, so `launcher --help` stays fast
    from launcher.recipe import Recipe

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
# None means launcher.estimate.DEFAULT_THRESHOLD, read when a verb runs: importing the estimator
# here would slow down `launcher --help`. A test keeps the help text equal to the constant.
ThresholdOpt = Annotated[
    float | None,
    typer.Option(help="Fraction of GPU memory a job may use and still fit (default 0.8).", show_default=False),
]


def _load(path: Path, set_options: list[str] | None) -> Recipe:
    from launcher import api

    recipe = api.load(path, set_options=set_options or [])
    for note in recipe.warnings:
        err.print(f"[yellow]warning:[/] {recipe.source}: {note}")
    return recipe


def _threshold(value: float | None) -> float:
    from launcher.estimate import DEFAULT_THRESHOLD

    return DEFAULT_THRESHOLD if value is None else value


def _print_json(data) -> None:
    out.print_json(json.dumps(data)) if sys.stdout.isatty() else print(json.dumps(data, indent=2))


@app.command()
def validate(
    recipes: Annotated[list[Path], typer.Argument(help="Recipe files.", show_default=False)],
    set_: SetOpt = None,
) -> None:
    """Check recipes against the schema, the catalogs and every layout rule."""
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
    from launcher.estimate import resolved_config

    resolved = {**resolved_config(loaded), "derived": loaded.summary()}
    if json_:
        _print_json(resolved)
    else:
        import yaml

        out.print(yaml.safe_dump(resolved, sort_keys=False), markup=False)


@app.command()
def estimate(
    recipe: RecipeArg,
    set_: SetOpt = None,
    mode: Annotated[
        str, typer.Option(help="fsdp: what the entrypoints allocate; megatron: Fujii et al. 2024's accounting.")
    ] = "fsdp",
    threshold: ThresholdOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Per-GPU peak memory per pipeline stage, whether it fits, and a change that does."""
    from launcher import api
    from launcher.estimate.memory import check_options

    threshold = _threshold(threshold)
    check_options(mode, threshold)
    loaded = _load(recipe, set_)
    result = api.estimate(loaded, mode=mode, threshold=threshold)
    if json_:
        _print_json({**result.to_json(), "predicted": api.predicted_summary(loaded)})
    else:
        from launcher.estimate.table import estimate_table

        out.print(estimate_table(result, title=f"{loaded.summary_line()} [{mode}]"))


@app.command()
def plan(
    recipe: RecipeArg,
    gpus: Annotated[int | None, typer.Option(help="GPUs to plan for (a multiple of the node size).")] = None,
    instances: Annotated[int | None, typer.Option(help="Instances (nodes) to plan for.")] = None,
    instance_type: Annotated[
        str | None, typer.Option(help="Plan on this instance type instead of the recipe's.", show_default=False)
    ] = None,
    top: Annotated[int, typer.Option(help="How many layouts to show.")] = 10,
    vary_fp8: Annotated[bool, typer.Option("--vary-fp8", help="Also try the other precision.fp8 setting.")] = False,
    threshold: ThresholdOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Rank every valid parallel layout that fits by predicted throughput and cost."""
    from launcher import api

    loaded = _load(recipe, set_)
    found = api.plan_search(
        loaded,
        gpus=gpus,
        instances=instances,
        instance_type=instance_type,
        top=top,
        vary_fp8=vary_fp8,
        threshold=_threshold(threshold),
    )
    if json_:
        _print_json([layout.to_json() for layout in found.ranked])
    else:
        from launcher.plan.table import plan_table

        table = plan_table(found, title=f"{loaded.model_name}, {loaded.training.seq_len} tokens on {found.budget}")
        # Piped output has no terminal width to fit; do not squeeze the table to rich's 80 columns.
        wide = out if out.is_terminal else Console(soft_wrap=True, highlight=False, width=120)
        wide.print(table)


BackendOpt = Annotated[
    str | None,
    typer.Option("--backend", "-b", help="sagemaker, local, docker, slurm, k8s or accelerate.", show_default=False),
]
RegionOpt = Annotated[
    str | None, typer.Option(help="AWS region of a SageMaker job not submitted from here.", show_default=False)
]


def _ask(question: str) -> bool:
    return typer.confirm(question, default=False, err=True)


def _line(line: str, stream=None) -> None:
    print(line, file=stream or sys.stdout, flush=True)


@app.command()
def submit(
    recipe: RecipeArg,
    set_: SetOpt = None,
    backend: BackendOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be created; create nothing.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Submit even when memory is risky or the run would outlast max_run.")
    ] = False,
    resume: Annotated[
        str | None,
        typer.Option(help="Continue the checkpoints of an earlier job of this recipe (its name).", show_default=False),
    ] = None,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Do not ask before submitting a job predicted to cost over $1,000.")
    ] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the logs; exit with the job's exit code.")] = False,
    auto_plan: Annotated[
        bool, typer.Option("--auto-plan", help="First switch to the planner's best layout; prints what changed.")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Check memory, then start the job on its backend (--backend overrides cluster.backend)."""
    from launcher import api
    from launcher.jobs import result_text

    result = api.submit(
        recipe, backend=backend, set_options=set_ or [], dry_run=dry_run, force=force, wait=wait, auto_plan=auto_plan,
        yes=yes, resume=resume, confirm=_ask if sys.stdin.isatty() else None,
        report=lambda stage, message: err.print(message, markup=False),
        on_line=lambda line: _line(line, sys.stderr if json_ else sys.stdout),
    )  # fmt: skip
    if json_:
        _print_json(result.rendering.data if dry_run else result.to_dict())
    elif dry_run:
        out.print(result.rendering.text, markup=False, end="")
    elif result.final is None:
        out.print(f"{result.spec.name}: follow with `launcher logs {result.spec.name} --follow`", markup=False)
    else:
        out.print(f"{result.spec.name}: {result.final.state}. {result_text(result.final)}", markup=False)
    raise typer.Exit(result.exit_code)


@app.command()
def status(name: str, backend: BackendOpt = None, region: RegionOpt = None, json_: JsonOpt = False) -> None:
    """A job's state, its status transitions, failure reason and latest metrics."""
    from launcher import api
    from launcher.jobs import status_text

    found = api.status(name, backend=backend, region=region)
    _print_json(found.to_dict()) if json_ else out.print(status_text(found), markup=False)


@app.command()
def logs(
    name: str,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    backend: BackendOpt = None,
    region: RegionOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """A job's log lines (all hosts), optionally following them until the job ends.

    With --follow the exit code is the job's, as with `submit --wait`."""
    from launcher import api
    from launcher.jobs import shell_exit_code

    for line in api.logs(name, follow=follow, backend=backend, region=region):
        _line(json.dumps({"line": line}) if json_ else line)
    if follow:
        raise typer.Exit(shell_exit_code(api.status(name, backend=backend, region=region)))


@app.command()
def stop(
    name: str,
    grace: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL (local jobs).")] = 30.0,
    backend: BackendOpt = None,
    region: RegionOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Stop a job: SIGTERM (so it can checkpoint), then SIGKILL after the grace period."""
    from launcher import api
    from launcher.jobs import status_text

    stopped = api.stop(name, backend=backend, region=region, grace_s=grace)
    _print_json(stopped.to_dict()) if json_ else out.print(status_text(stopped), markup=False)


@app.command("list")
def list_(
    backend: BackendOpt = None,
    region: RegionOpt = None,
    limit: Annotated[int, typer.Option(help="At most this many jobs.")] = 50,
    json_: JsonOpt = False,
) -> None:
    """Jobs submitted from here (newest first), or those a backend knows with --backend."""
    from launcher import api
    from launcher.jobs import list_text

    found = api.list_jobs(backend=backend, region=region, limit=limit)
    _print_json([s.to_dict() for s in found]) if json_ else out.print(list_text(found), markup=False)


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
