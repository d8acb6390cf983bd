"""The `launcher` command: a thin skin over the Python API. Each verb is a few lines.

Errors reach the user in one place, `main`: a LauncherError prints its lines (as JSON on stdout
with --json) and exits with its code, the same for every verb (launcher.errors: 0 ok, 1 job
failed, 2 bad input or won't fit, 3 cloud or engine error, 130 detached); set
LAUNCHER_TRACEBACK=1 to see the traceback of any error.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

try:  # typer >= 0.29 carries its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer, on click itself
    from click import exceptions as click_errors

from launcher.contract.text import terminal_safe
from launcher.errors import EXIT_DETACHED, EXIT_USAGE, Detached, LauncherError, RecipeError

if TYPE_CHECKING:  # the CLI imports the API inside each verb, so `launcher --help` stays fast
    from launcher.plan import SearchOptions
    from launcher.recipe import Recipe

app = typer.Typer(
    name="launcher",
    help="Validate, size and launch long-context LLM training jobs from YAML recipes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


class PipeClosed(Exception):
    """stdout's reader went away (`launcher plan ... | head`): not an error of the launcher's."""


class _Console(Console):
    def on_broken_pipe(self) -> None:
        raise PipeClosed  # rich would exit 1; main() exits 0, quietly


out = _Console(soft_wrap=True, highlight=False)
err = _Console(stderr=True, soft_wrap=True, highlight=False)
"""Progress, notes and warnings: silenced by --quiet."""
failures = Console(stderr=True, soft_wrap=True, highlight=False)
"""Errors: never silenced."""


def _version(value: bool) -> None:
    if value:
        import launcher

        print(f"launcher {launcher.__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only results (submit: the job name); no progress or notes.")
    ] = False,
) -> None:
    """Validate, size and launch long-context LLM training jobs from YAML recipes."""
    err.quiet = quiet


RecipeArg = Annotated[Path, typer.Argument(help="A YAML recipe file.", show_default=False)]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="KEY=VALUE",
        help="Override a recipe value: --set parallel.context=16 (repeatable).",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
NameArg = Annotated[
    str,
    typer.Argument(help="The job's name, as submit printed it (`launcher list` shows them).", show_default=False),
]
# None means launcher.estimate.DEFAULT_THRESHOLD, read when a verb runs: importing the estimator
# here would slow down `launcher --help`. A test keeps the help text equal to the constant.
PlotOpt = Annotated[
    Path | None,
    typer.Option(
        "--plot", help="Also draw it to this .png, .svg or .pdf file (needs the plot extra).", show_default=False
    ),
]
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


# Wider than any table: piped output is printed whole, at the table's own width.
UNLIMITED_WIDTH = 100_000


def _print_table(table_for: Callable[[int | None], Any]) -> None:
    """A table fitted to the terminal's width; piped, the whole table (no width to fit)."""
    if out.is_terminal:
        out.print(table_for(out.width))
    else:
        _Console(soft_wrap=True, highlight=False, width=UNLIMITED_WIDTH).print(table_for(None))


def _print_json(data) -> None:
    out.print_json(json.dumps(data)) if sys.stdout.isatty() else print(json.dumps(data, indent=2))


@app.command()
def validate(
    recipes: Annotated[list[Path], typer.Argument(help="Recipe files.", show_default=False)],
    set_: SetOpt = None,
    json_: Annotated[
        bool, typer.Option("--json", help="One JSON object per recipe: ok, summary, problems, warnings.")
    ] = False,
) -> None:
    """Check recipes against the schema, the catalogs and every layout rule."""
    reports = [_validate_one(path, set_, quiet=json_) for path in recipes]
    if json_:
        _print_json(reports)
    if not all(report["ok"] for report in reports):
        raise typer.Exit(2)


def _validate_one(path: Path, set_options: list[str] | None, *, quiet: bool) -> dict[str, Any]:
    """One recipe's report; printed (problems on stderr, `ok` on stdout) unless `quiet`."""
    from launcher import api

    try:
        recipe = api.load(path, set_options=set_options or [])
    except RecipeError as error:
        for line in [] if quiet else error.lines():
            err.print(terminal_safe(line, one_line=True), markup=False)  # a recipe's text, echoed
        problems = [{key: terminal_safe(str(value)) for key, value in p.__dict__.items()} for p in error.problems]
        return {"recipe": str(path), "ok": False, "summary": None, "problems": problems, "warnings": []}
    warnings = [*recipe.warnings, *recipe.placeholders]
    for note in [] if quiet else warnings:
        err.print(f"[yellow]warning:[/] {recipe.source}: {note}")
    if not quiet:
        out.print(f"[green]ok[/] {path}: {recipe.summary_line()}")
    return {"recipe": str(path), "ok": True, "summary": recipe.summary_line(), "problems": [], "warnings": warnings}


@app.command()
def show(recipe: RecipeArg, set_: SetOpt = None, json_: JsonOpt = False) -> None:
    """Print the fully resolved recipe, with derived values such as data_shard and world size."""
    loaded = _load(recipe, set_)
    from launcher.resolve import resolve

    config = resolve(loaded).concrete.resolved().to_dict()
    resolved = {**config, **loaded.run_sections(), "derived": loaded.summary()}
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
    plot: PlotOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Per-GPU peak memory per pipeline stage, whether it fits, and a change that does."""
    from launcher import api
    from launcher.estimate.memory import check_options

    threshold = _threshold(threshold)
    check_options(mode, threshold)
    loaded = _load(recipe, set_)
    result = api.estimate(loaded, mode=mode, threshold=threshold)
    if plot is not None:
        err.print(f"plot: {result.plot(plot, title=f'{loaded.summary_line()} [{mode}]')}", markup=False)
    if json_:
        _print_json({**result.to_dict(), "predicted": api.predicted_summary(loaded)})
    else:
        from launcher.estimate.table import estimate_table

        title = f"{loaded.summary_line()} [{mode}]"
        _print_table(lambda width: estimate_table(result, title=title, width=width))
    if result.verdict == "oom":
        raise typer.Exit(EXIT_USAGE)


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
    plot: PlotOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Rank every valid parallel layout that fits by predicted throughput and cost."""
    from launcher import api

    loaded = _load(recipe, set_)
    options = api.SearchOptions(
        gpus=gpus, instances=instances, instance_type=instance_type, top=top, vary_fp8=vary_fp8,
        threshold=_threshold(threshold),
    )  # fmt: skip
    found = api.plan_search(loaded, options)
    if plot is not None:
        _plot_plans(loaded, plot, options)
    if json_:
        _print_json([layout.to_dict() for layout in found.ranked])
    else:
        from launcher.plan.table import plan_table

        title = f"{loaded.model_name}, {loaded.training.seq_len} tokens on {found.budget}"
        _print_table(lambda width: plan_table(found, title=title, width=width))


# The plot shows every layout that fits, not only the --top rows of the table.
ALL_LAYOUTS = 100_000


def _plot_plans(loaded: Recipe, path: Path, options: SearchOptions) -> None:
    from launcher import api

    every = api.plan(loaded, options, top=ALL_LAYOUTS)
    err.print(f"plot: {every.plot(path, title=f'{loaded.name}: {len(every)} layouts that fit')}", markup=False)


BackendOpt = Annotated[
    str | None,
    typer.Option("--backend", "-b", help="sagemaker, local, docker, slurm, k8s or accelerate.", show_default=False),
]
RegionOpt = Annotated[
    str | None,
    typer.Option(
        help="AWS region of a SageMaker job not submitted from here; default: AWS_REGION, "
        "AWS_DEFAULT_REGION, then the profile's region, as the AWS CLI does.",
        show_default=False,
    ),
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
    from launcher.display.live import LiveProgress
    from launcher.display.text import wait_text

    loaded = api.load(recipe, backend=backend, set_options=set_ or [])
    follow = LiveProgress(total_steps=loaded.training.steps, console=err, lines_to=sys.stderr if json_ else sys.stdout)
    with follow:
        result = api.submit(
            loaded, backend=backend, dry_run=dry_run, force=force, wait=wait, auto_plan=auto_plan,
            yes=yes, resume=resume, confirm=_ask if sys.stdin.isatty() else None,
            report=lambda stage, message: err.print(message, markup=False),
            on_line=follow.line, on_status=follow.status,
        )  # fmt: skip
    if json_:
        _print_json(result.rendering.data if dry_run else result.to_dict())
    elif dry_run:
        out.print(result.rendering.text, markup=False, end="")
    elif err.quiet:
        print(result.spec.name)
    elif result.final is None:
        out.print(f"{result.spec.name}: follow with `launcher logs {result.spec.name} --follow`", markup=False)
    else:
        out.print(wait_text(result.final), markup=False)
    raise typer.Exit(result.exit_code)


@app.command()
def status(name: NameArg, backend: BackendOpt = None, region: RegionOpt = None, json_: JsonOpt = False) -> None:
    """A job's state, its status transitions, failure reason and latest metrics."""
    from launcher import api
    from launcher.display.text import status_text

    found = api.status(name, backend=backend, region=region)
    _print_json(found.to_dict()) if json_ else out.print(status_text(found), markup=False)


@app.command()
def logs(
    name: NameArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    backend: BackendOpt = None,
    region: RegionOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """A job's log lines (all hosts), optionally following them until the job ends.

    With --follow the exit code is the job's, as with `submit --wait`."""
    from launcher import api
    from launcher.jobs import outcome_exit_code

    try:
        for line in api.logs(name, follow=follow, backend=backend, region=region):
            _line(json.dumps({"line": line}) if json_ else line)
    except KeyboardInterrupt:
        raise Detached(name) from None
    if follow:
        raise typer.Exit(outcome_exit_code(api.status(name, backend=backend, region=region)))


@app.command()
def stop(
    name: NameArg,
    grace: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL (local jobs).")] = 30.0,
    backend: BackendOpt = None,
    region: RegionOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Stop a job: SIGTERM (so it can checkpoint), then SIGKILL after the grace period."""
    from launcher import api
    from launcher.display.text import status_text

    stopped = api.stop(name, backend=backend, region=region, grace_s=grace)
    _print_json(stopped.to_dict()) if json_ else out.print(status_text(stopped), markup=False)


@app.command()
def metrics(
    name: NameArg,
    plot: PlotOpt = None,
    backend: BackendOpt = None,
    region: RegionOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="Every step as JSON.")] = False,
) -> None:
    """Every step a job has logged: loss, tokens/s/GPU, MFU and memory, as a table, JSON or a plot."""
    from launcher import api

    history = api.metrics(name, backend=backend, region=region)
    if plot is not None:
        err.print(f"plot: {history.plot(plot)}", markup=False)
    if json_:
        _print_json(history.to_dict())
    else:
        from launcher.display.text import metrics_text

        out.print(metrics_text(history), markup=False)


@app.command("list")
def list_(
    backend: BackendOpt = None,
    region: RegionOpt = None,
    limit: Annotated[int, typer.Option(help="At most this many jobs.")] = 50,
    clean: Annotated[
        bool,
        typer.Option("--clean", help="First remove the records of submits that died before the backend took the job."),
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Jobs submitted from here (newest first), or those a backend knows with --backend.

    A record that cannot be read is one line on stderr (and exit code 2); the others are listed."""
    from launcher import api
    from launcher.display.text import list_text
    from launcher.jobs import clean_records

    for line in clean_records() if clean else ():
        err.print(line, markup=False)
    damaged: list[str] = []
    found = api.list_jobs(backend=backend, region=region, limit=limit, on_damaged=damaged.append)
    _print_json([s.to_dict() for s in found]) if json_ else out.print(list_text(found), markup=False)
    for line in damaged:
        failures.print(line, markup=False)
    if damaged:
        raise typer.Exit(EXIT_USAGE)


@app.command()
def export(
    name: NameArg,
    out_dir: Annotated[Path, typer.Option("--out", help="The directory to write.", show_default=False)],
    step: Annotated[int | None, typer.Option(help="The checkpoint's step (default: the newest).")] = None,
) -> None:
    """Write a local job's checkpoint as a Hugging Face checkpoint that transformers loads."""
    from launcher import api

    written = api.export(name, out=out_dir, step=step)
    out.print(f"{name}: Hugging Face checkpoint written to {written}", markup=False)


@app.command()
def schema() -> None:
    """Print the JSON Schema of recipes, for editor completion (yaml-language-server)."""
    from launcher.recipe.schema_export import recipe_json_schema

    print(json.dumps(recipe_json_schema(), indent=2))


data_app = typer.Typer(help="Prepare training data: tokenize text into shards a recipe's data.source reads.")
app.add_typer(data_app, name="data", no_args_is_help=True)


@data_app.command("prepare")
def data_prepare(
    inputs: Annotated[
        list[str],
        typer.Argument(help="Files, directories, globs or s3:// prefixes.", show_default=False),
    ],
    tokenizer: Annotated[str, typer.Option(help="A tokenizer.json or a directory holding one.", show_default=False)],
    destination: Annotated[str, typer.Option("--out", help="Output directory or s3:// prefix.", show_default=False)],
    format: Annotated[str, typer.Option(help="auto (by file name), text, jsonl, parquet or arrow.")] = "auto",
    field: Annotated[str, typer.Option(help="The JSONL field or column holding the text.")] = "text",
    delimiter: Annotated[
        str | None, typer.Option(help="Split text files into documents at this string.", show_default=False)
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="Tokenizing processes (default: all cores).", show_default=False)
    ] = None,
    shard_tokens: Annotated[int, typer.Option(help="Start a new shard past this many tokens.")] = 100_000_000,
    eos_token: Annotated[
        str | None, typer.Option(help="The token after every document (default: the tokenizer's).", show_default=False)
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Tokenize documents into uint16/uint32 shards, a document index and manifest.json; resumable."""
    from launcher import api

    done = api.prepare_data(
        inputs, tokenizer=tokenizer, out=destination, format=format, field=field, delimiter=delimiter,
        shard_tokens=shard_tokens, eos_token=eos_token, workers=workers,
    )  # fmt: skip
    m = done.manifest
    if json_:
        _print_json({"out": done.out, "reused_shards": done.reused_shards, "tokens_per_s": done.tokens_per_s, **m})
        return
    rate = f"{done.tokens_per_s:,.0f} tokens/s on {done.workers} workers" if done.written_shards else "nothing to do"
    out.print(
        f"{done.out}: {m['documents']:,} documents, {m['tokens']:,} {m['dtype']} tokens in {len(m['shards'])} shards "
        f"({done.reused_shards} kept from an earlier run; {rate})",
        markup=False,
    )


def command():
    """The click command behind `launcher`: on/off flags shown without a `<bool>` type, and a
    closed stdout (`launcher schema | head`) turned into PipeClosed, which click would otherwise
    report as exit 1."""
    root = typer.main.get_command(app)
    commands = [root]
    while commands:
        command_ = commands.pop()
        commands += getattr(command_, "commands", {}).values()
        for param in command_.params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
            if hasattr(param, "display_type"):
                param.display_type = _repeated_type(param.display_type)
        if command_.callback is not None:
            command_.callback = _closed_pipe_guard(command_.callback)
        command_.get_help_option = _untyped_help(command_.get_help_option)
    return root


def _repeated_type(display_type):
    """`<path>...` for a value given many times, where typer would show Python's `<list[Path]>`."""

    def shown(ctx):
        label = display_type(ctx)
        repeated = re.fullmatch(r"<list\[(\w+)\]>", label)
        return f"<{repeated.group(1).lower()}>..." if repeated else label

    return shown


def _untyped_help(get_help_option):
    """click makes --help when a command runs, not with the command's params."""

    def untyped(ctx):
        option = get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    return untyped


def _closed_pipe_guard(callback):
    @functools.wraps(callback)
    def run(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except BrokenPipeError:
            raise PipeClosed from None

    return run


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every failure is one message (JSON on stdout under --json) and an exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in args
    try:
        code = command().main(args=args, prog_name="launcher", standalone_mode=False)
        if code == EXIT_DETACHED:  # typer's answer to Ctrl-C outside a follow, silent otherwise
            failures.print("interrupted")
        sys.stdout.flush()
    except (PipeClosed, BrokenPipeError):
        # Python would complain again when it flushes stdout at exit: point it at /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    except click_errors.NoArgsIsHelpError as error:
        print(error.ctx.get_help())
        code = EXIT_USAGE
    except click_errors.ClickException as error:  # click's own: an unknown option, a missing argument
        where = error.ctx.command_path if getattr(error, "ctx", None) else "launcher"
        code = _fail([f"{where}: {error.format_message()} (see `{where} --help`)"], [], EXIT_USAGE, as_json)
    except typer.Abort:  # Ctrl-C or end of input at a question
        code = _fail(["aborted; nothing was submitted"], [], EXIT_DETACHED, as_json)
    except LauncherError as error:
        if os.environ.get("LAUNCHER_TRACEBACK"):
            raise
        problems = [p.__dict__ for p in getattr(error, "problems", [])]
        code = _fail(error.lines(), problems, error.exit_code, as_json)
    sys.exit(code or 0)


def _fail(lines: list[str], problems: list[dict], exit_code: int, as_json: bool) -> int:
    # Errors carry text from services, files and processes: none of it may drive the terminal.
    # A recipe's problems are one line each, so a newline inside a value cannot forge another.
    lines = [terminal_safe(line, one_line=bool(problems)) for line in lines]
    problems = [{key: terminal_safe(value) for key, value in problem.items()} for problem in problems]
    if as_json:
        print(json.dumps({"error": "\n".join(lines), "problems": problems, "exit_code": exit_code}, indent=2))
    else:
        for line in lines:
            failures.print(line, markup=False)
    return exit_code


if __name__ == "__main__":
    main()
