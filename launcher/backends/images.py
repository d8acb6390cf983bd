"""The default training image: the region's PyTorch Deep Learning Container (dlc_images.yaml).

The same file pins the wheels that image lacks (launcher/backends/wheelhouse.py reads them)."""

from __future__ import annotations

from functools import cache
from importlib.resources import files

import yaml

from launcher.errors import UsageError


@cache
def image_catalog() -> dict:
    return yaml.safe_load(files(__package__).joinpath("dlc_images.yaml").read_text())


def default_image(region: str) -> str:
    images = image_catalog()
    account = images["accounts"].get(region)
    if account is None:
        raise UsageError(f"cluster.image: no PyTorch training image is known for {region}; set cluster.image to one")
    suffix = images["dns_suffix"]["cn" if region.startswith("cn-") else "default"]
    return f"{account}.dkr.ecr.{region}.{suffix}/{images['repository']}:{images['tag']}"


def training_image(recipe) -> str:
    """The recipe's own image (cluster.image), or the default for its region."""
    return recipe.cluster.image or default_image(recipe.sagemaker.region)
