"""Imports point one way (docs/architecture.md): down the flow, never up, and never in a circle.

Every `import` and `from ... import` in launcher/ and entrypoints/ is read from the source (AST),
at module level, inside functions and under TYPE_CHECKING alike, so a function-level import
cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "launcher"

# Each room of the launcher and its rank: a module may import from its own room or from rooms of
# a lower rank, never a higher one. `launcher` itself is the lazy package __init__, which the
# bundle ships beside the contract and which must import nothing.
RANKS = {
    "launcher": 0,
    "contract": 0,
    "errors": 1,
    "display": 1.5,  # HTML, SVG and plots: knows no launcher type, only errors
    "catalog": 2,
    "data": 2,
    "recipe": 3,
    "estimate": 5,
    "plan": 6,
    "resolve": 6.5,  # settles every auto of a recipe with the estimator and the planner
    "spec": 7,
    "bundle": 8,
    "registry": 9,
    "backends": 10,
    "jobs": 11,
    "resume": 11.5,  # what a `submit --resume` continues: reads the registry, asks the backends and the jobs
    "api": 12,
    "cli": 13,
    "__main__": 14,
}
TRAINING_PACKAGES = {"torch", "torchao"}
# Beyond those, a package one entrypoint module may import because the training image ships it,
# with where the image says so. Nothing else may: the bundle installs no other package.
IMAGE_PACKAGES = {
    ("entrypoints/checkpoint_mirror.py", "boto3"): (
        "the PyTorch 2.13 DLC's base dependencies (aws/deep-learning-containers, "
        "docker/pytorch/2.13/cuda/pyproject.toml and cpu/pyproject.toml); imported only where "
        "LAUNCHER_CHECKPOINT_S3 is set"
    ),
    ("entrypoints/mlflow_sink.py", "botocore"): (
        "the same DLC base dependencies; imported only for a SageMaker MLflow tracking server's ARN, "
        "to sign its requests (SigV4) and put its artifacts in S3, as the sagemaker-mlflow plugin does"
    ),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(root: Path) -> list[Path]:
    # launcher/_entrypoints is the wheel's link to entrypoints/, not launcher code.
    return sorted(p for p in root.rglob("*.py") if "_entrypoints" not in p.parts and "__pycache__" not in p.parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; `from a import b` gives a.b when
    b is a module of this repository, else a."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                is_module = (REPO / Path(*candidate.split("."))).is_dir() or (
                    REPO / Path(*candidate.split(".")).with_suffix(".py")
                ).is_file()
                # `from launcher import Recipe`: a lazy export, resolved by launcher_imports.
                lazy = node.module == "launcher"
                found.append((node.lineno, candidate if is_module or lazy else node.module))
    return found


def lazy_export_target(name: str) -> str | None:
    """`from launcher import Recipe` reaches the module the lazy package __init__ names."""
    tree = ast.parse((LAUNCHER / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value).get(name)
    return None


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "launcher"


def launcher_imports() -> dict[str, list[tuple[int, str]]]:
    """launcher module -> the launcher modules it imports."""
    graph = {}
    for path in python_files(LAUNCHER):
        targets = []
        for line, target in imported_modules(path):
            if target.split(".")[0] != "launcher":
                continue
            if target.startswith("launcher.") and target.count(".") == 1 and room(target) not in RANKS:
                target = lazy_export_target(target.split(".")[1]) or target
            targets.append((line, target))
        graph[module_name(path)] = targets
    return graph


def test_every_room_of_the_launcher_has_a_rank():
    rooms = {room(module) for module in launcher_imports()}
    assert rooms <= set(RANKS), f"give these rooms a rank in RANKS and docs/architecture.md: {rooms - set(RANKS)}"


def test_no_module_imports_from_a_room_above_its_own():
    upward = [
        f"{module} (line {line}) imports {target}: {room(module)} ({RANKS[room(module)]}) "
        f"is below {room(target)} ({RANKS[room(target)]})"
        for module, targets in launcher_imports().items()
        for line, target in targets
        if room(target) != room(module) and RANKS[room(target)] >= RANKS[room(module)]
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycle_between_launcher_modules():
    graph = {m: {t for _, t in targets if t != m and t in _known()} for m, targets in launcher_imports().items()}
    cycles = [sorted(component) for component in strongly_connected(graph) if len(component) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _known() -> set[str]:
    return {module_name(p) for p in python_files(LAUNCHER)}


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [{"a", "b", "c"}]


@pytest.mark.parametrize("path", python_files(REPO / "entrypoints"), ids=lambda p: str(p.relative_to(REPO)))
def test_the_entrypoints_import_only_torch_the_standard_library_and_the_contract(path):
    shipped = {package for module, package in IMAGE_PACKAGES if module == str(path.relative_to(REPO))}
    wrong = [
        f"line {line}: {target}"
        for line, target in imported_modules(path)
        if not (
            target.split(".")[0] in sys.stdlib_module_names
            or target.split(".")[0] in TRAINING_PACKAGES | shipped | {"entrypoints", "__future__"}
            or target == "launcher.contract"
            or target.startswith("launcher.contract.")
        )
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", python_files(LAUNCHER / "contract"), ids=lambda p: p.name)
def test_the_contract_imports_only_the_standard_library(path):
    wrong = [
        f"line {line}: {target}"
        for line, target in imported_modules(path)
        if target.split(".")[0] not in sys.stdlib_module_names | {"__future__"}
        and not target.startswith("launcher.contract")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_package_init_the_bundle_ships_imports_only_the_standard_library():
    targets = [target for _, target in imported_modules(LAUNCHER / "__init__.py")]
    assert all(t.split(".")[0] in sys.stdlib_module_names | {"__future__"} for t in targets), targets


def test_no_function_is_over_80_lines():
    # One screen per function (DEVELOPERS.md): longer ones get split into named steps.
    long = []
    for root in (LAUNCHER, REPO / "entrypoints"):
        for path in python_files(root):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 80:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)


# --- capabilities, not names -----------------------------------------------------------------


def engine_names() -> set[str]:
    from launcher.backends import NAMES

    return set(NAMES)


def _names_an_engine(node: ast.expr, names: set[str]) -> bool:
    """A string literal that is a backend's name, or a tuple/list/set literal holding one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_an_engine(item, names) for item in node.elts)
    return False


def _mentions_backend(node: ast.expr) -> bool:
    """`backend`, `x.backend`, `spec.cluster.backend`, `data["backend"]`: a value that holds a backend name."""
    if isinstance(node, ast.Name):
        return "backend" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "backend" in node.attr.lower()
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and isinstance(key.value, str) and "backend" in key.value.lower()
    return False


def engine_name_comparisons(source: str, names: set[str]) -> list[int]:
    """Lines of every comparison of a backend-valued expression with a backend's name literal."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for left, right in zip(operands, operands[1:], strict=False):
                if (_names_an_engine(left, names) and _mentions_backend(right)) or (
                    _names_an_engine(right, names) and _mentions_backend(left)
                ):
                    lines.append(node.lineno)
    return lines


@pytest.mark.parametrize(
    "source, found",
    [
        ('if spec.cluster.backend == "sagemaker": pass', True),
        ('ok = "local" != ref.backend', True),
        ('ok = ref.backend in ("local", "docker")', True),
        ('ok = data["backend"] == "k8s"', True),
        ('ok = 0 < 1 and backend_name not in ["slurm"]', True),
        # The torch distributed backend and the `local` instance type are not engines.
        ('ok = fp8 and backend == "nccl"', False),
        ('ok = hardware.instance_key == "local"', False),
        ("ok = ref.backend == self.name", False),
    ],
)
def test_the_engine_name_check_finds_comparisons_with_a_backend_name(source, found):
    assert bool(engine_name_comparisons(source, engine_names())) is found


def test_no_code_outside_the_backends_compares_a_backend_name():
    # Ask a capability (launcher/catalog/engines.yaml) or a backend hook (Backend.links) instead.
    names, found = engine_names(), []
    for path in python_files(LAUNCHER):
        if path.relative_to(LAUNCHER).parts[0] == "backends":
            continue
        found += [f"{path.relative_to(REPO)}:{line}" for line in engine_name_comparisons(path.read_text(), names)]
    assert not found, "\n".join(found)


# Built from the concrete recipe that RESOLVE hands on: none of them may estimate or plan again.
AFTER_RESOLVE = ("spec", "bundle", "registry", "backends", "jobs")


def test_nothing_built_after_resolve_imports_the_estimator_the_planner_or_the_resolve_stage():
    wrong = [
        f"{module} (line {line}) imports {target}"
        for module, targets in launcher_imports().items()
        if room(module) in AFTER_RESOLVE
        for line, target in targets
        if room(target) in ("estimate", "plan", "resolve")
    ]
    assert not wrong, "after RESOLVE nothing estimates or plans:\n" + "\n".join(wrong)


# The schema's other autos are choices made while the job runs, not by the launcher.
AUTO_AT_RUN_TIME = {
    "data.format": "`launcher data prepare` reads each raw file by its name",
    "checkpoint.resume": "the entrypoints resume from the newest complete checkpoint when the job starts",
}


def schema_autos() -> set[str]:
    """Every recipe key whose value may be "auto" (a Literal with it, or its default)."""
    import typing

    from pydantic import BaseModel

    from launcher.recipe.schema import RecipeSpec

    def literals(hint) -> set:
        if typing.get_origin(hint) is typing.Literal:
            return set(typing.get_args(hint))
        return set().union(*(literals(arg) for arg in typing.get_args(hint)))

    def walk(model: type[BaseModel], prefix: str) -> set[str]:
        found = set()
        for name, info in model.model_fields.items():
            hint, key = info.annotation, f"{prefix}{name}"
            nested = [a for a in (hint, *typing.get_args(hint)) if isinstance(a, type) and issubclass(a, BaseModel)]
            for section in nested:
                found |= walk(section, f"{key}.")
            if info.default == "auto" or "auto" in literals(hint):
                found.add(key)
        return found

    return walk(RecipeSpec, "")


def test_every_auto_of_the_schema_is_settled_by_resolve_or_chosen_at_run_time():
    from launcher.recipe.recipe import SETTLED_AT_RESOLVE

    assert schema_autos() == set(SETTLED_AT_RESOLVE) | set(AUTO_AT_RUN_TIME)


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_only_the_resolve_stage_settles_auto(path):
    from launcher.errors import UsageError
    from launcher.recipe import Recipe
    from launcher.recipe.recipe import SETTLED_AT_RESOLVE
    from launcher.resolve import resolve

    recipe = Recipe.load(path)
    resolved = resolve(recipe)
    concrete = resolved.concrete
    assert concrete.unsettled == () and resolve(concrete).concrete is concrete
    # Besides the autos, the launcher settles what nothing names (launcher/resolve.py).
    chosen = {"cluster.stop_grace", "checkpoint.every_minutes", "cluster.collective_timeout"}
    assert set(recipe.unsettled) <= set(resolved.settled) <= set(recipe.unsettled) | chosen
    assert "auto" not in {concrete.value_at(key) for key in SETTLED_AT_RESOLVE}
    # A recipe with any one of them left at auto has no job config: only RESOLVE settles it.
    for key in SETTLED_AT_RESOLVE:
        with pytest.raises(UsageError, match=f": {key} still says auto; "):
            concrete.with_changes({key: "auto"}).resolved()
