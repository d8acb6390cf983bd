"""Every shipped recipe renders on every backend that can hold its cluster, s3:// data included."""

from __future__ import annotations

import pytest

from launcher import api
from launcher.backends import NAMES, backend_class
from launcher.backends.sagemaker.settings import SageMakerSettings
from launcher.errors import LauncherError
from launcher.recipe import Recipe

from .helpers import REPO

RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


def fits(recipe: Recipe, backend: str) -> bool:
    """Whether the engine can hold the recipe's cluster at all: the local backend is this machine,
    SageMaker rents ml.* instances, docker runs one node."""
    local = recipe.cluster.instance_type == "local"
    if backend == "local":
        return local
    if backend == "sagemaker":
        return not local
    return recipe.cluster.instance_count == 1 or backend_class(backend).capabilities.multi_node


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_renders_on_every_backend_that_can_hold_it(home, recipe, backend):
    path = REPO / "recipes" / f"{recipe}.yaml"
    if not fits(Recipe.load(path), backend):
        with pytest.raises(LauncherError, match=r"runs one node|runs on this machine|needs an ml\.\* instance type"):
            api.submit(path, backend=backend, dry_run=True, force=True)
        return
    sets = []
    if backend == "accelerate" and Recipe.load(path).cluster.instance_count > 1:
        # accelerate leaves storage to the user: several nodes need a checkpoint.dir they share.
        with pytest.raises(
            LauncherError, match=r"^checkpoint\.dir: 'checkpoints' is relative, on each node's own disk"
        ):
            api.submit(path, backend=backend, dry_run=True, force=True)
        sets = [f"checkpoint.dir=/fsx/checkpoints/{recipe}"]
    # --force: a 14-day run outlasts a time limit on some engines; that is the forecast's test
    # (tests/plan/test_forecast.py). This one is the render's.
    submission = api.submit(path, backend=backend, set_options=sets, dry_run=True, force=True)
    spec = submission.spec
    assert submission.rendering.text.strip()
    if backend != "sagemaker":  # the sagemaker: section is inert elsewhere
        assert (
            not isinstance(spec.engine, SageMakerSettings) and not spec.spot and spec.tags == () and spec.retries == 0
        )
    for data in spec.inputs:
        if data.source.startswith("s3://"):
            # The job reads the data through SM_CHANNEL_TRAIN wherever the backend puts it.
            assert spec.env["SM_CHANNEL_TRAIN"] == data.container_path
            assert not data.container_path.startswith("s3://")
